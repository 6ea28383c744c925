"""process_grpo.py: the process-supervised advantage and the loss against numbers worked out by hand, the step rule,
the steps found in the completion's own token ids, and a short run of each supervision as a user runs it."""

import math
import os
import random
import re

import pytest
import torch
from conftest import ROOT, read_metrics, run_script

from process_grpo import grpo_loss, process_advantages, reward_steps, scored_steps, step_rewards_fn
from scale import process_grpo

SENTINEL = 1e6  # where no step ends, and in the padding: it must reach neither the advantage nor the loss


def test_process_advantages_by_hand():
    # G = 2, T = 4: row 0's steps end at t = 1 (reward 1) and t = 3 (reward 0), row 1's at t = 2 (reward 1).
    # R = (1, 0, 1): mean 2/3, deviations (1/3, -2/3, 1/3), unbiased variance (1/9 + 4/9 + 1/9) / 2 = 1/3,
    # std 0.57735 (+ eps 1e-4): r~ = (0.57725, -1.15450, 0.57725). A token sums the steps that end at or after it:
    # row 0: t 0, 1 -> 0.57725 - 1.15450 = -0.57725; t 2, 3 -> -1.15450. Row 1: t 0..2 -> 0.57725; t 3 -> 0.
    rewards = torch.tensor([[SENTINEL, 1.0, SENTINEL, 0.0], [SENTINEL, SENTINEL, 1.0, SENTINEL]])
    ends = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]]).bool()
    r = 1 / 3 / (math.sqrt(1 / 3) + 1e-4)
    expected = torch.tensor([[-r, -r, -2 * r, -2 * r], [r, r, r, 0.0]])
    torch.testing.assert_close(process_advantages(rewards, ends, group_size=2), expected)
    # not scaled (Dr. GRPO's): r - mean(R) alone, (1/3, -2/3, 1/3)
    expected = torch.tensor([[-1 / 3, -1 / 3, -2 / 3, -2 / 3], [1 / 3, 1 / 3, 1 / 3, 0.0]])
    torch.testing.assert_close(process_advantages(rewards, ends, 2, scale=False), expected)


def test_equal_steps_a_single_step_and_no_steps_give_zeros():
    ends = torch.tensor([[0, 1, 1], [1, 0, 1], [0, 0, 1], [0, 0, 0]]).bool()
    same = torch.where(ends, 0.5, SENTINEL)  # every step of the first group scores 0.5
    rewards = torch.cat([same[:2], torch.tensor([[SENTINEL, SENTINEL, 1.0], [SENTINEL] * 3])])
    # group 2: one step in all (row 2), and a completion with none (row 3): fewer than two steps, zeros
    assert torch.equal(process_advantages(rewards, ends, group_size=2), torch.zeros(4, 3))


def test_one_step_a_completion_at_its_end_is_grpo():
    """Outcome supervision: each completion one step, ending at its last token; the advantage is GRPO's z-score
    of the group, on every token up to the end, and 0 after it."""
    from scale.grpo import group_advantages

    outcome = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    lengths = [3, 1, 2, 3, 2, 1]
    ends = torch.zeros(6, 3, dtype=torch.bool)
    ends[torch.arange(6), torch.tensor(lengths) - 1] = True
    rewards = torch.where(ends, outcome[:, None], SENTINEL)
    mask = torch.arange(3)[None, :] < torch.tensor(lengths)[:, None]
    expected = torch.where(mask, group_advantages(outcome, 3)[:, None], 0.0)
    torch.testing.assert_close(process_advantages(rewards, ends, group_size=3), expected)


def test_the_loss_with_an_advantage_a_token_by_hand():
    """One completion of three tokens and a pad: A = (2, 2, -1), ratios (1.5, 1.0, 0.5), eps 0.2, no KL.
    t0: r 1.5, A 2 -> min(3.0, 2.4) = 2.4 (clipped); t1: r 1, A 2 -> 2; t2: r 0.5, A -1 -> min(-0.5, -0.8) = -0.8
    (clipped). loss = -(2.4 + 2 - 0.8) / 3 = -1.2; the gradient reaches t1 alone: d/dlogp (-r A / 3) = -2/3."""
    old = torch.tensor([[-1.0, -1.0, -1.0, SENTINEL]])
    logprobs = (old + torch.tensor([[1.5, 1.0, 0.5, 1.0]]).log()).clone()
    logprobs[0, 3] = SENTINEL
    logprobs.requires_grad_(True)
    advantages = torch.tensor([[2.0, 2.0, -1.0, SENTINEL]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = grpo_loss(logprobs, old, None, advantages, mask, beta=0.0)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -2 / 3, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("47+8=55 55-3=52 52+5=57", [(7, 1.0), (15, 1.0), (23, 1.0)]),
        ("47+8=55 55-3=52 52+5=58", [(7, 1.0), (15, 1.0), (23, 0.0)]),  # the last sum wrong
        ("47+8=56 56-3=53 53+5=58", [(7, 0.0), (15, 1.0), (23, 1.0)]),  # a wrong step carried on rightly
        ("47+8=55 54-3=51 51+5=56", [(7, 1.0), (15, 0.0), (23, 1.0)]),  # not the previous result
        ("47+8=55 55+3=58 58+5=63", [(7, 1.0), (15, 0.0), (23, 1.0)]),  # not the operator asked
        ("47+8=55 55-3=52 52+5=57 57+0=57", [(7, 1.0), (15, 1.0), (23, 1.0), (31, 0.0)]),  # a step too many
        ("47+8=55 5", [(7, 1.0), (9, 0.0)]),  # not an equation
        ("", []),
    ],
)
def test_the_chain_tasks_step_rule(completion, expected):
    assert step_rewards_fn(completion, {"prompt": "47+8-3+5=", "answer": "57"}) == expected


def test_steps_are_found_in_the_completions_own_ids(chat_model_dir):
    """A tokenizer whose tokens hold several characters: the step ends at the token whose decoded prefix first
    reaches the step's end, and the last step at the completion's last token, its stop token included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    record = {"prompt": "47+8-3+5=", "answer": "57"}
    text = "47+8=55 55-3=52 52+5=56"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    mask = torch.tensor([[1] * (len(ids) - 1) + [0]]).bool()
    rewards, ends = reward_steps(tokenizer, torch.tensor([ids]), mask, [text], [record], "process")
    positions = ends[0].nonzero().flatten().tolist()
    decoded = [tokenizer.decode(ids[: t + 1], skip_special_tokens=True) for t in positions]
    assert len(positions) == 3 and decoded[0].endswith("55") and decoded[1].endswith("52")
    assert positions[-1] == len(ids) - 2  # the stop token, not the pad after it
    assert rewards[0, positions].tolist() == [1.0, 1.0, 0.0]
    for t in positions[:2]:  # the token before does not reach the step's end yet
        assert len(tokenizer.decode(ids[:t], skip_special_tokens=True)) < len(decoded[positions.index(t)])
    outcome, outcome_ends = reward_steps(tokenizer, torch.tensor([ids]), mask, [text], [record], "outcome")
    assert outcome_ends[0].nonzero().flatten().tolist() == [len(ids) - 2] and outcome.sum().item() == 0.0


def test_a_chain_that_stops_early_ends_on_a_wrong_step_by_hand():
    """G = 2 of 47+8-3+5= (answer 57): A stops after one right step, '47+8=55'; B writes three, the last sum wrong,
    '47+8=55 55-3=52 52+5=58'. The last step gives the answer, so its reward is at most the answer's: A's one step
    scores 0, B's [1, 1, 0]. R = (0, 1, 1, 0): mean 1/2, unbiased std sqrt(1/3) = 0.57735, r~ = (-0.86603, 0.86603,
    0.86603, -0.86603) (eps aside). A: every token, its stop token included, -0.86603 (it scored +0.5 when only the
    steps present counted: R = (1, 1, 1, 0)). B: step 1's tokens 0.86603 + 0.86603 - 0.86603 = 0.86603 (they were
    pushed down, -0.5), step 2's 0, step 3's -0.86603."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-chainer"))  # a character a token
    record = {"prompt": "47+8-3+5=", "answer": "57"}
    texts = ["47+8=55", "47+8=55 55-3=52 52+5=58"]
    assert [scored_steps(t, record) for t in texts] == [[(7, 0.0)], [(7, 1.0), (15, 1.0), (23, 0.0)]]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, ids))
    completion_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids]).bool()
    rewards, ends = reward_steps(tokenizer, completion_ids, mask, texts, [record] * 2, "process")
    advantages = process_advantages(rewards, ends, group_size=2)
    r = 0.5 / math.sqrt(1 / 3)
    expected_a = [-r] * 8 + [0.0] * 16  # 7 characters and the stop token
    expected_b = [r] * 7 + [0.0] * 8 + [-r] * 9  # '47+8=55', ' 55-3=52', ' 52+5=58' and the stop token
    torch.testing.assert_close(advantages, torch.tensor([expected_a, expected_b]), atol=1e-3, rtol=0)


def test_the_default_step_rule_on_a_prompt_without_numbers_stops_with_one_line():
    with pytest.raises(
        SystemExit, match=r"^error: step_rewards_fn: the prompt 'What is two plus two\?' has no numbers"
    ):
        step_rewards_fn("4", {"prompt": "What is two plus two?", "answer": "4"})


def prefix_lengths(tokenizer, ids):  # the definition: the length of every prefix's text, each decoded whole
    return [len(tokenizer.decode(ids[: t + 1], skip_special_tokens=True)) for t in range(len(ids))]


def test_the_text_lengths_of_one_pass_are_those_of_every_prefix_decoded(real_model_dir):
    """On the bundled tokenizer (a character a token) and SmolLM2's (byte-level BPE, whose characters can span up to
    4 tokens and whose prefixes can end inside one): random ids, whatever text they decode to, and texts with
    spaces, newlines and characters of 2 to 4 bytes. So the steps end where decoding every prefix put them."""
    from transformers import AutoTokenizer

    rng = random.Random(0)
    texts = ["47+8=55 55-3=52 52+5=57", " 47 + 8 = 55.\n\n55 − 3 = 52 → 52×5 ≠ 261 ✓ 日本 😀 done .", "a  b\tc"]
    for path in (os.path.join(ROOT, "tiny-chainer"), real_model_dir):
        tokenizer = AutoTokenizer.from_pretrained(path)
        cases = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        cases += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
        for ids in cases:
            assert process_grpo.text_lengths(tokenizer, ids) == prefix_lengths(tokenizer, ids), (path, ids)


@pytest.mark.long
def test_the_benchmark_runs_both_supervisions_and_writes_their_table(tmp_path):
    """benchmarks/process_benchmark.py (results.md's comparison), with small runs: process and outcome supervision
    each log the trace error with its denominator at every evaluation, and the table and figure are written."""
    import json

    small = "--prompts-per-step 4 --group-size 4 --num-eval 16 --eval-every 2 --log-every 1"
    run_script(
        "benchmarks/process_benchmark.py",
        "--seeds",
        "1",
        "--num-steps",
        "2",
        f"--flags={small}",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--out-dir",
        str(tmp_path),
    )
    for supervision in ("process", "outcome"):
        metrics = read_metrics(str(tmp_path / "runs" / f"{supervision}__1"))
        evals = [m for m in metrics if "eval/trace_error" in m]
        assert len(evals) == 2 and all(0 <= m["eval/trace_error"] <= 1 for m in evals)
        assert all(m["eval/right_answers"] == round(m["eval/accuracy"] * 16) for m in evals)
        steps = [m for m in metrics if m["step"] > 0]
        assert len(steps) == 2 and all(0 < m["charts/steps"] for m in steps)
        with open(tmp_path / "runs" / f"{supervision}__1.json") as f:
            assert "--supervision" in json.load(f)["command"] or supervision == "process"
    page = (tmp_path / "results.md").read_text()
    assert "\n| process | " in page and "\n| outcome | " in page
    scale = re.search(r"process supervision ([\d.]+) / ([\d.]+) / ([\d.]+); outcome supervision ([\d.]+) / ", page)
    assert scale and float(scale[1]) > float(scale[3]) > 0  # the first step's tokens sum the most steps
    assert (tmp_path / "process_grpo.png").stat().st_size > 0
