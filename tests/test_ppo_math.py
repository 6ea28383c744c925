"""scale/ppo.py's rewards, GAE, whitening and both clipped losses against numbers worked out by hand."""

import math

import pytest
import torch

from ppo import adaptive_kl_coef, gae, kl_penalized_rewards, ppo_policy_loss, ppo_value_loss, whiten

SENTINEL = 1e6  # a padded position holds this; it must not reach any result


def test_kl_penalized_rewards_put_the_score_on_the_last_real_token():
    # completions of 3 and 2 tokens; log pi_old - log pi_ref = (0.1, 0.2, 0.3) and (0.5, -0.5); beta = 0.5
    ref = torch.zeros(2, 4)
    logprobs = torch.tensor([[0.1, 0.2, 0.3, SENTINEL], [0.5, -0.5, SENTINEL, SENTINEL]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    rewards = kl_penalized_rewards(torch.tensor([1.0, -2.0]), logprobs, ref, mask, beta=0.5)
    # row 0: -0.05, -0.1, -0.15 + 1 = 0.85, then padding 0;  row 1: -0.25, 0.25 - 2 = -1.75, 0, 0
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85, 0.0], [-0.25, -1.75, 0.0, 0.0]]))


def test_gae_by_hand_without_bootstrapping_from_padding():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[1.0, 0.0, 2.0, SENTINEL], [3.0, SENTINEL, SENTINEL, SENTINEL]])
    values = torch.tensor([[0.5, 1.0, 1.5, SENTINEL], [1.0, SENTINEL, SENTINEL, SENTINEL]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    # row 0, from the end (V = 0 after the last real token, whatever the padding holds):
    #   t2: delta = 2 + 0.9 * 0 - 1.5 = 0.5;            A = 0.5
    #   t1: delta = 0 + 0.9 * 1.5 - 1.0 = 0.35;         A = 0.35 + 0.72 * 0.5 = 0.71
    #   t0: delta = 1 + 0.9 * 1.0 - 0.5 = 1.4;          A = 1.4 + 0.72 * 0.71 = 1.9112
    # row 1: t0: delta = 3 + 0 - 1 = 2;  A = 2
    torch.testing.assert_close(advantages, torch.tensor([[1.9112, 0.71, 0.5, 0.0], [2.0, 0.0, 0.0, 0.0]]))
    # returns = A + V, on real tokens only
    torch.testing.assert_close(returns, torch.tensor([[2.4112, 1.71, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0]]))


def test_whiten_over_the_mask():
    x = torch.tensor([[1.0, 2.0, 3.0, SENTINEL], [4.0, 5.0, SENTINEL, SENTINEL]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # real values 1..5: mean 3, unbiased variance (4 + 1 + 0 + 1 + 4) / 4 = 2.5
    s = math.sqrt(2.5)
    expected = torch.tensor([[-2 / s, -1 / s, 0.0, 0.0], [1 / s, 2 / s, 0.0, 0.0]])
    torch.testing.assert_close(whiten(x, mask), expected)


def policy_batch():
    """Ratios (1.5, 0.5, pad) with A = +1 and (0.5, 1.5, 1.0) with A = -2, per token."""
    old = torch.tensor([[-1.0, -2.0, -SENTINEL], [-0.5, -1.5, -3.0]])
    logprobs = old + torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]]).log()
    logprobs[0, 2] = SENTINEL
    advantages = torch.tensor([[1.0, 1.0, SENTINEL], [-2.0, -2.0, -2.0]])
    return logprobs.requires_grad_(True), old, advantages, torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_ppo_policy_loss_by_hand():
    logprobs, old, advantages, mask = policy_batch()
    loss, stats = ppo_policy_loss(logprobs, old, advantages, mask, clip_eps=0.2)
    # max(-A r, -A clip(r, 0.8, 1.2)) per token:
    #   A = +1: r 1.5 -> max(-1.5, -1.2) = -1.2 (clipped);  r 0.5 -> max(-0.5, -0.8) = -0.5
    #   A = -2: r 0.5 -> max(1.0, 1.6) = 1.6 (clipped);  r 1.5 -> max(3.0, 2.4) = 3.0;  r 1 -> 2.0
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.6 + 3.0 + 2.0) / 5, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    # approx KL (r - 1) - log r: 2 * (0.5 - ln 1.5) + 2 * (-0.5 - ln 0.5) + 0, over 5 tokens
    assert stats["approx_kl"].item() == pytest.approx(
        (2 * (0.5 - math.log(1.5)) + 2 * (-0.5 - math.log(0.5))) / 5, abs=1e-6
    )
    loss.backward()
    # unclipped tokens: d(-A r)/d logp = -A r, over 5 tokens; clipped and padded tokens: 0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5 / 5, 0.0], [0.0, 3.0 / 5, 2.0 / 5]]))


def test_ppo_value_loss_by_hand():
    values = torch.tensor([[1.5, 1.5, -0.5, 0.1, SENTINEL]], requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, -1.0, 0.3, SENTINEL]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = ppo_value_loss(values, old_values, returns, mask, clip_value=0.2)
    # clipped values (1.2, 1.2, -0.2, 0.1); squared errors unclipped / clipped:
    #   (0.25, 0.64) -> 0.64 (clipped wins);  (0.25, 0.04) -> 0.25;  (0.25, 0.64) -> 0.64 (clipped, below);
    #   (0.04, 0.04) -> 0.04
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.25 + 0.64 + 0.04) / 4, abs=1e-6)
    assert stats["value_clip_frac"].item() == pytest.approx(2 / 4)
    loss.backward()
    # where the clipped error wins, the value gets no gradient; else 0.5 * 2 (V - R) / 4
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5 / 4, 0.0, -0.2 / 4, 0.0]]))


def test_adaptive_kl_coef_by_hand():
    # e = clip(kl / target - 1, -0.2, 0.2); beta <- beta (1 + e n / horizon); n = 100, horizon = 1000: n / h = 0.1
    def coef(kl, horizon=1000):
        return adaptive_kl_coef(0.1, kl=kl, target=6.0, num_completions=100, horizon=horizon)

    assert coef(6.6) == pytest.approx(0.101)  # e = 0.1
    assert coef(12.0) == pytest.approx(0.102)  # e = 1, clipped to 0.2
    assert coef(0.0) == pytest.approx(0.098)  # e = -1, clipped to -0.2
    assert coef(6.0) == pytest.approx(0.1)  # on target
    # a longer horizon moves beta more slowly: e = 0.2, n / h = 0.01
    assert coef(12.0, horizon=10000) == pytest.approx(0.1002)
