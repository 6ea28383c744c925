"""scale/gspo.py's loss against numbers worked out by hand."""

import math

import pytest
import torch

from gspo import gspo_loss

SENTINEL = 1e6  # a padded position holds this; it must not reach the loss or the gradient


def make_batch():
    """Four sequences with per-token log-ratios d = log pi - log pi_old and advantages A:

    seq 0: d (0.3, 0.1),        A = +1   -> s = e^0.2  = 1.221403
    seq 1: d (-0.4, 0.0, -0.2), A = -2   -> s = e^-0.2 = 0.818731
    seq 2: d (0.05, -0.05),     A = 0.5  -> s = e^0    = 1
    seq 3: d (0.2),             A = -1   -> s = e^0.2  = 1.221403
    """
    d = torch.tensor([[0.3, 0.1, 0.0], [-0.4, 0.0, -0.2], [0.05, -0.05, 0.0], [0.2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    old = torch.full((4, 3), -1.0)
    logprobs = old + d
    logprobs[mask == 0] = SENTINEL
    return logprobs.requires_grad_(True), old, torch.tensor([1.0, -2.0, 0.5, -1.0]), mask


def test_gspo_loss_by_hand():
    logprobs, old, adv, mask = make_batch()
    loss, stats = gspo_loss(logprobs, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.15)
    # clip range (0.9, 1.15):
    #   seq 0: min(1.2214 * 1, 1.15 * 1) = 1.15            -> -1.15   (clipped)
    #   seq 1: min(0.8187 * -2, 0.9 * -2) = -1.8           -> 1.8     (clipped)
    #   seq 2: s = 1                                       -> -0.5
    #   seq 3: min(1.2214 * -1, 1.15 * -1) = -1.2214       -> 1.2214  (the pessimistic side, not clipped)
    expected = (-1.15 + 1.8 - 0.5 + math.exp(0.2)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(0.5)
    assert stats["ratio"].item() == pytest.approx((2 * math.exp(0.2) + math.exp(-0.2) + 1) / 4, abs=1e-6)


def test_gspo_gradient_is_shared_by_the_tokens_of_a_sequence():
    logprobs, old, adv, mask = make_batch()
    loss, _ = gspo_loss(logprobs, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.15)
    loss.backward()
    # d s_i / d logp_it = s_i / |o_i|, so an unclipped sequence gives -A_i s_i / (|o_i| B) to each token:
    #   seq 2: -0.5 * 1 / (2 * 4) = -0.0625 on both tokens;  seq 3: 1 * e^0.2 / (1 * 4) = 0.305351
    # the clipped sequences 0 and 1 get nothing, and neither does padding
    expected = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-0.0625, -0.0625, 0.0], [math.exp(0.2) / 4, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_gspo_paper_clip_range_clips_small_moves():
    # with the paper's (3e-4, 4e-4) a mean log-ratio of 1e-3 is already outside the range
    logprobs = torch.tensor([[-1.0 + 1e-3, -2.0 + 1e-3]], requires_grad=True)
    loss, stats = gspo_loss(logprobs, torch.tensor([[-1.0, -2.0]]), torch.tensor([1.0]), torch.ones(1, 2))
    assert stats["clip_frac"].item() == 1.0
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    loss.backward()
    assert torch.count_nonzero(logprobs.grad) == 0
