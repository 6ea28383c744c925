"""--vllm's default correction (token-tis) against numbers worked out by hand: the truncated importance weights
(scale/'s rollout_correction), and each sampling file's loss with them, applied as its scale main applies them: token
t's advantage times w_t (GSPO: sequence i's times the mean of its w_t; RLOO: its log-probs times w_t), the loss
functions being the plain tier's, which take no weights (tests/test_mismatch.py: the other corrections). Needs no
vLLM: the weights and the losses are plain torch."""

import math

import pytest
import torch

from cispo import cispo_loss
from grpo import grpo_loss, masked_mean
from gspo import gspo_loss
from ppo import ppo_policy_loss
from rloo import rloo_loss
from scale.grpo import rollout_correction

SENTINEL = 1e6  # a padded position holds this; it must not reach the weights, the loss or the gradient
WEIGHTS = torch.tensor([[2.0, 0.5, 0.0]])  # two real tokens, then padding
MASK = torch.tensor([[1, 1, 0]])


def test_token_tis_weights_by_hand():
    # pi_old / pi_engine per token: 0.5/0.5 = 1, 0.3/0.6 = 0.5, 0.1/0.01 = 10 -> truncated at 2; padding 0
    old = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.2]]))
    engine = torch.log(torch.tensor([[0.5, 0.6, 0.01, 1.0]]))
    old[0, 3], engine[0, 3] = SENTINEL, -SENTINEL  # exp(2e6) would be inf
    weights, stats = rollout_correction(old, engine, torch.tensor([[1, 1, 1, 0]]), "token-tis", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.5, 2.0, 0.0]]))
    # |log ratio|: 0, log 2, log 10 over three tokens; the weights' mean 3.5 / 3; one token of three truncated
    assert stats["logprob_diff"].item() == pytest.approx((math.log(2) + math.log(10)) / 3, rel=1e-6)
    assert stats["is_weight"].item() == pytest.approx(3.5 / 3, rel=1e-6)
    assert stats["is_capped"].item() == pytest.approx(1 / 3)
    # a higher cap keeps the 10
    weights, _ = rollout_correction(old, engine, torch.tensor([[1, 1, 1, 0]]), "token-tis", cap=20.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.5, 10.0, 0.0]]))


def test_the_weights_are_constants():
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weights, _ = rollout_correction(old, torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2), "token-tis", cap=2.0)
    assert not weights.requires_grad


def test_grpo_loss_weighs_each_tokens_clipped_term():
    # ratio 1 at both tokens (logprobs = old), A = 1, no KL: l_t = -w_t; the paper's mean: -(2 + 0.5) / 2
    logprobs = torch.tensor([[-1.0, -2.0, SENTINEL]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    loss, _ = grpo_loss(logprobs, old, None, torch.tensor([1.0])[:, None] * WEIGHTS, MASK, beta=0.0)
    assert loss.item() == pytest.approx(-1.25)
    loss.backward()  # d l_t / d logprobs_t = -w_t r_t A / |o| = [-1, -0.25]
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -0.25, 0.0]]))
    # a clipped token (ratio e^0.5 > 1.2, A > 0) keeps no gradient, whatever its weight: -w clip(r) A = -2 * 1.2
    logprobs = torch.tensor([[-0.5, -2.0, SENTINEL]], requires_grad=True)
    loss, _ = grpo_loss(logprobs, old, None, torch.tensor([1.0])[:, None] * WEIGHTS, MASK, beta=0.0)
    assert loss.item() == pytest.approx((-2 * 1.2 - 0.5) / 2)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.25, 0.0]]))


def test_grpo_loss_leaves_the_kl_term_unweighed():
    # beta 0.5, ref = logprobs - log 2 at token 1 (d = -log 2: k3 = 1/2 + log 2 - 1), 0 at token 2; A = 0
    logprobs = torch.tensor([[-1.0, -2.0, SENTINEL]])
    ref = torch.tensor([[-1.0 - math.log(2), -2.0, 0.0]])
    loss, _ = grpo_loss(logprobs, logprobs, ref, torch.tensor([0.0])[:, None] * WEIGHTS, MASK, beta=0.5)
    assert loss.item() == pytest.approx(0.5 * (0.5 + math.log(2) - 1) / 2, rel=1e-6)


def test_gspo_loss_weighs_each_sequence_by_its_tokens_mean_weight():
    # s = 1, A = 2: -2, times the mean weight (2 + 0.5) / 2 = 1.25 -> -2.5; gradient -A w s / |o| = -1.25 per token
    logprobs = torch.tensor([[-1.0, -2.0, SENTINEL]], requires_grad=True)
    advantages = torch.tensor([2.0]) * masked_mean(WEIGHTS, MASK, dim=1)
    loss, _ = gspo_loss(logprobs, torch.tensor([[-1.0, -2.0, 0.0]]), advantages, MASK)
    assert loss.item() == pytest.approx(-2.5)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.25, -1.25, 0.0]]))


def test_cispo_loss_multiplies_its_weight_by_the_importance_weight():
    # ratio 1 (inside the clip), A = 1: loss = -(2 log .5 + 0.5 log .25) / 2 = -(-2 log 2 - log 2) / 2 = 1.5 log 2
    lp = torch.log(torch.tensor([0.5, 0.25]))
    logprobs = torch.tensor([[lp[0], lp[1], SENTINEL]], requires_grad=True)
    old = torch.tensor([[lp[0], lp[1], 0.0]])
    loss, _ = cispo_loss(logprobs, old, torch.tensor([1.0])[:, None] * WEIGHTS, MASK, 0.2, 0.2)
    assert loss.item() == pytest.approx(1.5 * math.log(2), rel=1e-6)
    loss.backward()  # -w A / |o|
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -0.25, 0.0]]))


def test_rloo_loss_weighs_each_tokens_log_prob():
    # -(2 (-1) + 0.5 (-2)) A / B with A = 1, B = 1: 3; gradient -w A / B; the statistic stays the plain sum
    logprobs = torch.tensor([[-1.0, -2.0, SENTINEL]], requires_grad=True)
    loss, _ = rloo_loss(logprobs * WEIGHTS, torch.tensor([1.0]), MASK)
    assert loss.item() == pytest.approx(3.0)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, -0.5, 0.0]]))


def test_ppo_policy_loss_weighs_each_tokens_term():
    # ratio 1, A = (1, -1): l = (-1, 1), weighed (-2, 0.5), mean -0.75; gradient -A r w / 2 = (-1, 0.25)
    logprobs = torch.tensor([[-1.0, -2.0, SENTINEL]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    loss, _ = ppo_policy_loss(logprobs, old, torch.tensor([[1.0, -1.0, 0.0]]) * WEIGHTS, MASK, 0.2)
    assert loss.item() == pytest.approx(-0.75)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, 0.25, 0.0]]))


@pytest.mark.parametrize("loss", ["grpo", "gspo", "cispo", "rloo", "ppo"])
def test_weights_of_one_change_nothing(loss):
    """All weights 1 (the engine samples as the trainer scores): the loss and its gradient are those without."""
    torch.manual_seed(0)
    logprobs = (-torch.rand(3, 4)).requires_grad_()
    old, mask, adv = -torch.rand(3, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]), torch.randn(3)
    call = {
        "grpo": lambda w: grpo_loss(logprobs, old, None, adv if w is None else adv[:, None] * w, mask, beta=0.0),
        "gspo": lambda w: gspo_loss(logprobs, old, adv if w is None else adv * masked_mean(w, mask, 1), mask, 0.2, 0.2),
        "cispo": lambda w: cispo_loss(logprobs, old, adv if w is None else adv[:, None] * w, mask, 0.2, 0.2),
        "rloo": lambda w: rloo_loss(logprobs if w is None else logprobs * w, adv, mask),
        "ppo": lambda w: ppo_policy_loss(logprobs, old, adv[:, None].expand(3, 4) * (1 if w is None else w), mask, 0.2),
    }[loss]
    without = call(None)[0]
    (grad_without,) = torch.autograd.grad(without, logprobs)
    weighed = call(mask.float())[0]
    (grad_weighed,) = torch.autograd.grad(weighed, logprobs)
    torch.testing.assert_close(weighed, without)
    torch.testing.assert_close(grad_weighed, grad_without)
