"""scale/rloo.py's advantage and loss against numbers worked out by hand."""

import pytest
import torch

from rloo import rloo_advantages, rloo_loss

SENTINEL = 1e6  # a padded position holds this; it must not reach the loss or the gradient


def test_rloo_advantages_by_hand():
    # group 1: each of the zeros has the others' mean 1/3 as baseline, the one has 0; group 2 all equal
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, 0.0]))
    # K = 3, rewards (0.5, 2, -1): 0.5 - (2 - 1)/2 = 0; 2 - (0.5 - 1)/2 = 2.25; -1 - (0.5 + 2)/2 = -2.25
    adv = rloo_advantages(torch.tensor([0.5, 2.0, -1.0]), group_size=3)
    torch.testing.assert_close(adv, torch.tensor([0.0, 2.25, -2.25]))


def test_rloo_advantages_sum_to_zero_in_every_group():
    rewards = torch.tensor([0.3, -1.2, 2.5, 0.0, 7.0, 1.0, 1.0, -4.0, 0.5])
    sums = rloo_advantages(rewards, group_size=3).view(-1, 3).sum(dim=1)
    torch.testing.assert_close(sums, torch.zeros(3))


def test_rloo_loss_and_gradient_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, SENTINEL], [-0.5, -0.5, -1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([2.0, -1.0])
    loss, stats = rloo_loss(logprobs, advantages, mask)
    # summed log-probs -3 and -2; loss = -((-3)(2) + (-2)(-1)) / 2 = -(-6 + 2) / 2 = 2
    assert loss.item() == pytest.approx(2.0)
    assert stats["seq_logprob"].item() == pytest.approx(-2.5)
    loss.backward()
    # every real token of sequence i gets -A_i / B; the padded one nothing
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0, 0.0], [0.5, 0.5, 0.5]]))
