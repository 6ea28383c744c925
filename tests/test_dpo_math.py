"""scale/dpo.py's loss and sequence log-probs against numbers worked out by hand."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM, LlamaConfig

from dpo import addition_task, completion_logps, dpo_loss, rounding_tolerance
from scale.dpo import load_model, load_tokenizer, pair_batch

# one pair with log-probs: policy chosen -10, rejected -12; reference chosen -11, rejected -11
# log-ratios: chosen +1, rejected -1, so h = 2
PAIR = [torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0])]


def log_sigmoid(x):
    return -math.log(1 + math.exp(-x))


@pytest.mark.parametrize(
    "loss_type, beta, smoothing, expected",
    [
        ("sigmoid", 0.1, 0.0, -log_sigmoid(0.2)),  # -log sigmoid(0.1 * 2) = 0.598139
        ("sigmoid", 0.5, 0.0, -log_sigmoid(1.0)),  # 0.313262
        ("sigmoid", 0.5, 0.2, -0.8 * log_sigmoid(1.0) - 0.2 * log_sigmoid(-1.0)),  # 0.250610 + 0.262652 = 0.513262
        ("ipo", 0.1, 0.0, (2 - 1 / 0.2) ** 2),  # (2 - 5)^2 = 9
        ("ipo", 0.5, 0.0, (2 - 1) ** 2),  # 1
        ("hinge", 0.1, 0.0, 1 - 0.2),  # max(0, 1 - 0.1 * 2) = 0.8
        ("hinge", 1.0, 0.0, 0.0),  # max(0, 1 - 2) = 0
    ],
)
def test_dpo_loss_by_hand(loss_type, beta, smoothing, expected):
    loss, stats = dpo_loss(*PAIR, beta=beta, loss_type=loss_type, label_smoothing=smoothing)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # implicit rewards beta (log pi - log pi_ref): chosen +beta, rejected -beta
    assert stats["chosen_reward"].item() == pytest.approx(beta)
    assert stats["rejected_reward"].item() == pytest.approx(-beta)
    assert stats["margin"].item() == pytest.approx(2 * beta)
    assert stats["accuracy"].item() == 1.0


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 7.0])
def test_dpo_loss_is_log_2_when_the_policy_is_the_reference(beta):
    logps = torch.tensor([-3.0, -20.0, -0.5])
    rejected = torch.tensor([-4.0, -1.0, -9.0])
    loss, stats = dpo_loss(logps, rejected, logps.clone(), rejected.clone(), beta=beta)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert stats["accuracy"].item() == pytest.approx(0.5, abs=1e-6)  # every margin is 0: a tie counts half


def test_dpo_gradient_with_respect_to_the_chosen_logp():
    chosen = torch.tensor([-10.0, -5.0], requires_grad=True)
    rejected = torch.tensor([-12.0, -5.0])
    loss, stats = dpo_loss(chosen, rejected, torch.tensor([-11.0, -5.0]), torch.tensor([-11.0, -5.0]), beta=0.5)
    loss.backward()
    # d/d c of -log sigmoid(beta h) / B = -beta sigmoid(-beta h) / B:
    #   pair 1: h = 2, -0.5 * sigmoid(-1) / 2 = -0.0672146;  pair 2: h = 0, -0.5 * 0.5 / 2 = -0.125
    sig = 1 / (1 + math.exp(1.0))
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.5 * sig / 2, -0.125]))
    assert stats["accuracy"].item() == 0.75  # one right, one tie


def test_rounding_tolerance_by_hand():
    # two pairs: chosen completions of 2 and 3 tokens, rejected of 4 and 1 -> N = 6 and 4 tokens
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    # float32: eps = 2^-23 = 1.1920929e-7, sqrt(6 eps) = 8.45728e-4, sqrt(4 eps) = 6.90534e-4
    torch.testing.assert_close(rounding_tolerance(mask), torch.tensor([8.45728e-4, 6.90534e-4]), atol=1e-9, rtol=0)


def test_a_margin_within_the_tolerance_is_a_tie():
    # h = log-ratio of chosen - log-ratio of rejected: 3e-6 and -3e-6 (rounding), 0.5, -0.5
    chosen, rejected = torch.tensor([-5.0, -5.0, -5.0, -5.0]), torch.tensor([-7.0, -7.0, -7.0, -7.0])
    ref_chosen = chosen - torch.tensor([3e-6, -3e-6, 0.5, -0.5])
    _, stats = dpo_loss(chosen, rejected, ref_chosen, rejected, beta=0.1, tie_tolerance=1e-4)
    assert stats["accuracy"].item() == pytest.approx((0.5 + 0.5 + 1 + 0) / 4)  # two ties, one right, one wrong
    _, stats = dpo_loss(chosen, rejected, ref_chosen, rejected, beta=0.1)  # no tolerance: the signs count
    assert stats["accuracy"].item() == pytest.approx((1 + 0 + 1 + 0) / 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_copies_of_the_bundled_model_tie_within_rounding_and_a_changed_one_does_not(dtype):
    """scale/dpo.py's step 0: the policy and a frozen reference loaded from one folder. Their margins may
    differ from 0 in the last bits (they do on some CPUs), but stay inside rounding_tolerance; a
    reference whose weights really differ (by about one per cent) is ranked outside it, in bfloat16
    compute too (a tolerance from bfloat16's eps, 0.2 nats here, counted nearly all of them as ties)."""
    args = SimpleNamespace(
        trust_remote_code=False,
        dtype=dtype,
        gradient_checkpointing=False,
        fsdp=False,
        system_prompt=None,
        max_prompt_length=None,
        max_length=None,
    )
    path, device = os.path.join(ROOT, "tiny-adder"), torch.device("cpu")
    tokenizer = load_tokenizer(path, False)
    policy = load_model(path, args, device).eval()
    reference = load_model(path, args, device, frozen=True).eval()
    changed = load_model(path, args, device, frozen=True).eval()
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1 + 1e-2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    held_out = addition_task(num_eval=64)[1]
    pairs = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": str(int(r["answer"]) + 10)} for r in held_out]
    tokens = pair_batch(tokenizer, pairs, device, args)
    with torch.no_grad():
        (pc, pr), (rc, rr), (cc, cr) = (completion_logps(m, *tokens).chunk(2) for m in (policy, reference, changed))
    tolerance = rounding_tolerance(tokens[-1])  # (64,)
    assert ((pc - rc) - (pr - rr)).abs().le(tolerance).all()
    assert ((pc - cc) - (pr - cr)).abs().gt(tolerance).float().mean() > 0.9


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def reference_completion_logp(model, prompt, completion):
    """Computed alone, with no padding: the log-softmax of every logit, summed over the completion only."""
    ids = torch.tensor([prompt + completion])
    logprobs = model(input_ids=ids).logits[0].log_softmax(-1)  # (L, vocab)
    return sum(logprobs[len(prompt) - 1 + t, token].item() for t, token in enumerate(completion))


def test_completion_logps_sum_only_completion_tokens_with_prompts_of_different_lengths():
    model = tiny_llama()
    # a chosen/rejected-like pair whose prompts differ in length (3 and 6 tokens) and whose completions
    # differ in length (2 and 4 tokens), laid out as completion_batch does: prompts left-padded, completions
    # right-padded
    prompts, completions = [[11, 12, 13], [21, 22, 23, 24, 25, 26]], [[31, 2], [41, 42, 43, 2]]
    input_ids = torch.tensor([[0, 0, 0, 11, 12, 13, 31, 2, 0, 0], [21, 22, 23, 24, 25, 26, 41, 42, 43, 2]])
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0], [1] * 10])
    mask = attention_mask[:, 6:]
    with torch.no_grad():
        got = completion_logps(model, input_ids, attention_mask, 6, mask)
        expected = torch.tensor([reference_completion_logp(model, p, c) for p, c in zip(prompts, completions)])
        # what a wrong sum over the prompt tokens too would add: not zero, and not the same for both
        prompt_terms = torch.tensor([reference_completion_logp(model, p[:1], p[1:]) for p in prompts])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert (prompt_terms.abs() > 1).all() and abs(prompt_terms[0] - prompt_terms[1]) > 1
