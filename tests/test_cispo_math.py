"""scale/cispo.py's loss against numbers worked out by hand."""

import pytest
import torch

from cispo import cispo_loss

SENTINEL = 1e6  # a padded position holds this; it must not reach the loss or the gradient


def make_batch():
    """Seq 0: A = +1, ratios (1.5, 0.5), log pi (-1, -2), one pad.  Seq 1: A = -2, ratios (0.5, 1.5, 1.0),
    log pi (-0.5, -1.5, -3)."""
    logprobs = torch.tensor([[-1.0, -2.0, SENTINEL], [-0.5, -1.5, -3.0]])
    ratio = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]])
    old = logprobs - ratio.log()
    old[0, 2] = -SENTINEL
    return logprobs.clone().requires_grad_(True), old, torch.tensor([1.0, -2.0]), torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_cispo_loss_by_hand_without_lower_bound():
    logprobs, old, adv, mask = make_batch()
    loss, stats = cispo_loss(logprobs, old, adv, mask, clip_eps_low=1.0, clip_eps_high=0.2)
    # w = clip(r, 0, 1.2): seq 0 (1.2, 0.5), seq 1 (0.5, 1.2, 1.0); terms w A log pi:
    #   seq 0: 1.2 * 1 * -1 = -1.2;  0.5 * 1 * -2 = -1.0
    #   seq 1: 0.5 * -2 * -0.5 = 0.5;  1.2 * -2 * -1.5 = 3.6;  1.0 * -2 * -3 = 6.0
    # loss = -(-2.2 + 10.1) / 5 = -1.58
    assert loss.item() == pytest.approx(-1.58, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)  # the two ratios of 1.5
    assert stats["ratio"].item() == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 1.0) / 5, abs=1e-6)


def test_cispo_loss_with_a_lower_bound():
    logprobs, old, adv, mask = make_batch()
    loss, stats = cispo_loss(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    # now the ratios of 0.5 become 0.8: seq 0: -1.2 + 0.8 * -2 = -2.8;  seq 1: 0.8 + 3.6 + 6.0 = 10.4
    assert loss.item() == pytest.approx(-(10.4 - 2.8) / 5, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(4 / 5)


def test_cispo_clipped_tokens_keep_their_gradient():
    logprobs, old, adv, mask = make_batch()
    loss, _ = cispo_loss(logprobs, old, adv, mask, clip_eps_low=1.0, clip_eps_high=0.2)
    loss.backward()
    # d loss / d log pi = -w A / 5 at every real token, clipped or not (w is a constant):
    #   seq 0: -1.2/5 = -0.24 (ratio 1.5, clipped: GRPO would give 0 here), -0.5/5 = -0.1
    #   seq 1: 1.0/5 = 0.2, 2.4/5 = 0.48 (clipped), 2.0/5 = 0.4
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.24, -0.1, 0.0], [0.2, 0.48, 0.4]]))
