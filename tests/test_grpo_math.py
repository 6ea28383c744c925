"""scale/grpo.py's advantage and loss against numbers worked out by hand."""

import math

import pytest
import torch

from grpo import group_advantages, grpo_loss

SENTINEL = 1e6  # a padded position holds this; it must not reach the loss, the stats or the gradient


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.25, deviations (0.75, -0.25, -0.25, -0.25),
    # unbiased variance (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5; group 2: all equal -> zeros
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / torch.tensor([0.5001] * 4 + [1.0] * 4)
    torch.testing.assert_close(group_advantages(rewards, group_size=4), expected)
    # Dr. GRPO: no division by the std
    torch.testing.assert_close(
        group_advantages(rewards, 4, scale=False), torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    )


def test_group_advantages_pairs_and_no_nan():
    # G = 2, rewards (0, 2): mean 1, unbiased std sqrt((1 + 1) / 1) = sqrt(2)
    adv = group_advantages(torch.tensor([0.0, 2.0, 3.0, 3.0]), group_size=2)
    a = 1 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([-a, a, 0.0, 0.0]))
    assert not torch.isnan(group_advantages(torch.zeros(8), 4)).any()


def make_batch():
    """Two sequences: seq 0 has A = +1 and 2 real tokens, seq 1 has A = -2 and 3 real tokens.

    ratios r = pi / pi_old:  seq 0: (1.5, 0.5, pad)   seq 1: (0.5, 1.5, 1.0)
    """
    old = torch.tensor([[-1.0, -2.0, -SENTINEL], [-0.5, -1.5, -3.0]])
    ratio = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]])
    logprobs = (old + ratio.log()).clone()
    logprobs[0, 2] = SENTINEL
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logprobs.requires_grad_(True), old, torch.tensor([1.0, -2.0]), mask


# per-token losses -min(r A, clip(r, 0.8, 1.3) A), with eps_low = 0.2 and eps_high = 0.3:
#   seq 0 (A = +1): r 1.5 -> min(1.5, 1.3) = 1.3 -> -1.3 (clipped, no gradient)
#                   r 0.5 -> min(0.5, 0.8) = 0.5 -> -0.5
#   seq 1 (A = -2): r 0.5 -> min(-1.0, -1.6) = -1.6 -> 1.6 (clipped, no gradient)
#                   r 1.5 -> min(-3.0, -2.6) = -3.0 -> 3.0 (the pessimistic side: not clipped)
#                   r 1.0 -> -2.0 -> 2.0
@pytest.mark.parametrize(
    "loss_agg, expected",
    [
        ("seq-mean-token-mean", ((-1.3 - 0.5) / 2 + (1.6 + 3.0 + 2.0) / 3) / 2),  # (-0.9 + 2.2) / 2 = 0.65
        ("token-mean", (-1.3 - 0.5 + 1.6 + 3.0 + 2.0) / 5),  # 4.8 / 5 = 0.96
        ("seq-mean-token-sum-norm", ((-1.3 - 0.5) / 4 + (1.6 + 3.0 + 2.0) / 4) / 2),  # (-0.45 + 1.65) / 2 = 0.6
    ],
)
def test_grpo_loss_by_hand(loss_agg, expected):
    logprobs, old, adv, mask = make_batch()
    loss, stats = grpo_loss(
        logprobs,
        old,
        None,
        adv,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.3,
        beta=0.0,
        loss_agg=loss_agg,
        max_completion_length=4,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)  # two of five real tokens are clipped
    assert stats["ratio"].item() == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 1.0) / 5, abs=1e-6)
    assert "kl" not in stats  # beta = 0: no reference model


def test_grpo_loss_gradient_by_hand():
    logprobs, old, adv, mask = make_batch()
    loss, _ = grpo_loss(logprobs, old, None, adv, mask, 0.2, 0.3, beta=0.0, loss_agg="seq-mean-token-mean")
    loss.backward()
    # an unclipped token contributes -r A / (|o_i| B), since dr/dlogp = r; a clipped one nothing:
    #   seq 0: clipped, -0.5 * 1 / (2 * 2) = -0.125, pad 0
    #   seq 1: clipped, -1.5 * -2 / (3 * 2) = 0.5, -1.0 * -2 / (3 * 2) = 1/3
    expected = torch.tensor([[0.0, -0.125, 0.0], [0.0, 0.5, 1 / 3]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_grpo_kl_value_and_direction():
    # ratio 1 and A = 0, so only the KL term is left; d = ref - logp = (ln 2, -ln 2)
    logprobs = torch.tensor([[-1.0, -1.0, SENTINEL]], requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2), -1.0 - math.log(2), -SENTINEL]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = grpo_loss(logprobs, logprobs.detach(), ref, torch.zeros(1), mask, beta=0.1)
    # k3 = e^d - d - 1: 2 - ln 2 - 1 = 0.306853 and 0.5 + ln 2 - 1 = 0.193147; mean 0.25
    assert stats["kl"].item() == pytest.approx(0.25, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * 0.25, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - e^d: -1 where the reference is more likely (descent raises logp toward it),
    # +0.5 where it is less likely; times beta / |o| = 0.1 / 2
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.05, 0.025, 0.0]]))


def test_grpo_loss_at_ratio_one_is_minus_the_advantage():
    # r = 1: the loss is -mean A, and the gradient -A / |o| per token, sign and all
    logprobs = torch.tensor([[-0.3, -0.7], [-1.2, -0.1]], requires_grad=True)
    loss, stats = grpo_loss(logprobs, logprobs.detach(), None, torch.tensor([2.0, -1.0]), torch.ones(2, 2), beta=0.0)
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))
    assert stats["clip_frac"].item() == 0.0


def test_weighted_means_by_hand():
    """Micro-batch token means 1.0 over 1 token and 0.0 over 3 tokens: the step's token mean is 1/4, not 1/2; a
    statistic that only some records hold is averaged over those; a tensor weight counts as its value."""
    from scale.grpo import weighted_means

    records = [({"kl": torch.tensor(1.0), "loss": 2.0}, 1), ({"kl": 0.0}, torch.tensor(3)), ({"loss": 5.0}, 2.0)]
    assert weighted_means(records) == pytest.approx({"kl": 0.25, "loss": (2.0 * 1 + 5.0 * 2) / 3})
