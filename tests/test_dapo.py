"""dapo.py: the overlong penalty against numbers worked out by hand, dynamic sampling with a stand-in sampler
(which groups are kept, dropped and filled in, and the batch they make), grpo.py's run when DAPO's changes are
off, and short runs as a user runs them."""

import json
import os
import random

import pytest
import torch
from conftest import ROOT, read_metrics, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo import overlong_penalty
from scale import dapo, grpo


def test_overlong_penalty_by_hand():
    # max 8, cache 4: the zone is lengths 5 to 8; (4 - length) / 4 there, 0 before, -1 beyond
    lengths = torch.tensor([1, 4, 5, 6, 7, 8, 9])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 8, 4), expected)
    # the zone the whole length: max 4, cache 4 -> -length / 4
    torch.testing.assert_close(overlong_penalty(torch.tensor([0, 2, 4]), 4, 4), torch.tensor([0.0, -0.5, -1.0]))
    # cache 1: only the full length is punished, by the whole of it
    torch.testing.assert_close(overlong_penalty(torch.tensor([15, 16]), 16, 1), torch.tensor([0.0, -1.0]))


class StandIn:
    """Stands in for sample(): batch k answers each prompt right or wrong as RIGHT[k] says, a right answer its sum,
    a wrong one 9999999 (8 ids with its EOS: in the overlong zone of 8 tokens, and the batches differ in width)."""

    def __init__(self, tokenizer, right):
        self.tokenizer, self.right, self.calls = tokenizer, right, 0

    def __call__(self, policy, engine, tokenizer, prompt_ids, prompt_mask, args, stop_ids):
        pattern, self.calls = self.right[self.calls], self.calls + 1
        prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        texts = [str(sum(map(int, p.rstrip("=").split("+")))) if ok else "9999999" for p, ok in zip(prompts, pattern)]
        rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        return ids, torch.zeros(ids.shape)  # the sampler's log-probs (these rows were not sampled)


def sample_once(monkeypatch, right, **flags):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    monkeypatch.setattr(dapo, "sample", StandIn(tokenizer, right))
    args = dapo.Args(prompts_per_step=2, group_size=2, max_new_tokens=8, **flags)
    records = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(10, 90)]
    rng = random.Random(0)
    drawn = [rng.choices(records, k=2) for _ in right]  # the prompts each batch draws
    policy = torch.nn.Linear(1, 1)  # dynamic_sample reads only its device
    batch, counts = dapo.dynamic_sample(policy, None, tokenizer, records, random.Random(0), args, [2])
    return tokenizer, batch, counts, drawn


def test_dynamic_sampling_keeps_the_groups_whose_rewards_differ(monkeypatch):
    """Two prompts a batch, G = 2. Batch 1: prompt a's two answers agree (right, right), b's differ; batch 2: c's
    differ, d's agree (wrong, wrong). The step keeps b and c, in that order, after 2 batches, and drops a and d. A
    wrong answer, 8 tokens of 8 (the zone is the last 2, a quarter), loses the whole penalty: its reward is -1."""
    right = [[True, True, True, False], [False, True, False, False]]
    tokenizer, batch, counts, drawn = sample_once(monkeypatch, right)
    b, c = drawn[0][1], drawn[1][0]
    assert [r["prompt"] for r in batch["group"]] == [b["prompt"]] * 2 + [c["prompt"]] * 2
    assert batch["rewards"].tolist() == [1.0, -1.0, -1.0, 1.0]  # 0 for the wrong answer, -1 for its length
    overlong = counts.pop("charts/overlong_share")  # 4 of the 8 sampled completions were wrong, in the zone
    assert counts == {"charts/sample_batches": 2, "charts/dropped_groups": 2, "charts/filled_groups": 0}
    assert overlong.item() == pytest.approx(0.5, abs=1e-6)
    # the batches' widths differ (a wrong answer is 8 ids, a right one 3 or 4): completions padded on the right,
    # their mask 0 there; the texts as sampled
    assert batch["texts"] == [str(int(b["answer"])), "9999999", "9999999", c["answer"]]
    assert batch["mask"].sum(dim=1).tolist() == [len(t) + 1 for t in batch["texts"]]
    assert batch["completion_ids"].shape[1] == 8 and batch["prompt_ids"].shape == batch["prompt_mask"].shape
    for row, text in zip(batch["completion_ids"], batch["texts"]):
        assert tokenizer.decode(row, skip_special_tokens=True) == text


def test_a_step_still_short_is_filled_with_dropped_groups(monkeypatch):
    """--max-sample-batches 1 and one group of two with a signal: the other place goes to the dropped group, whose
    rewards agree (advantage 0); without --dynamic-sampling every group is kept, as grpo.py keeps them."""
    right = [[True, True, True, False]]
    _, batch, counts, drawn = sample_once(monkeypatch, right, max_sample_batches=1)
    assert [r["prompt"] for r in batch["group"]] == [drawn[0][1]["prompt"]] * 2 + [drawn[0][0]["prompt"]] * 2
    assert counts["charts/sample_batches"] == 1 and counts["charts/dropped_groups"] == 0
    assert counts["charts/filled_groups"] == 1
    assert dapo.group_advantages(batch["rewards"], 2)[2:].tolist() == [0.0, 0.0]
    _, batch, counts, drawn = sample_once(monkeypatch, right, dynamic_sampling=False)
    assert [r["prompt"] for r in batch["group"]] == [drawn[0][0]["prompt"]] * 2 + [drawn[0][1]["prompt"]] * 2
    counts.pop("charts/overlong_share")
    assert counts == {"charts/sample_batches": 1, "charts/dropped_groups": 0, "charts/filled_groups": 0}


def test_with_dapos_changes_off_it_logs_what_grpo_py_logs(tmp_path):
    """dapo.py without dynamic sampling and overlong shaping, with grpo.py's clip, loss and KL, is grpo.py: the same
    seed gives the same metrics (timings aside) and samples."""
    small = ["--num-steps", "3", "--prompts-per-step", "8", "--group-size", "4", "--micro-batch-size", "16"]
    small += ["--num-eval", "40", "--eval-every", "3", "--log-every", "1", "--num-minibatches", "2"]
    grpo_flags = ["--no-dynamic-sampling", "--no-overlong-shaping", "--clip-eps-high", "0.2", "--beta", "0.04"]
    grpo_flags += ["--loss-agg", "seq-mean-token-mean"]
    run_script("scale/grpo.py", *small, "--output-dir", str(tmp_path / "grpo"))
    run_script("scale/dapo.py", *small, *grpo_flags, "--output-dir", str(tmp_path / "dapo"))
    timed = ("_time", "tokens_per_sec")
    for x, y in zip(read_metrics(tmp_path / "grpo"), read_metrics(tmp_path / "dapo"), strict=True):
        assert x["step"] == y["step"]
        for key in x:
            if not key.endswith(timed):
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (x["step"], key)
    samples = [[json.loads(line) for line in open(tmp_path / name / "samples.jsonl")] for name in ("grpo", "dapo")]
    assert len(samples[0]) == len(samples[1])
    for x, y in zip(*samples):  # the texts equal, the numbers to float rounding
        assert x.keys() == y.keys()
        for key, value in x.items():
            if isinstance(value, float):
                assert y[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
            else:
                assert y[key] == value, key


def test_a_short_run_logs_the_sampling_and_bad_input_stops_with_one_line(tmp_path):
    small = ["--num-steps", "2", "--prompts-per-step", "8", "--group-size", "4", "--micro-batch-size", "32"]
    small += ["--num-eval", "20", "--eval-every", "2", "--log-every", "1", "--max-new-tokens", "4"]
    out = tmp_path / "run"
    run_script("scale/dapo.py", *small, "--overlong-filter", "--output-dir", str(out))
    for m in read_metrics(out)[1:]:
        assert 1 <= m["charts/sample_batches"] <= 3 and m["charts/dropped_groups"] >= 0
        assert 0 <= m["charts/filled_groups"] <= 8 and 0 <= m["charts/overlong_share"] <= 1
    steps = read_metrics(out)[1:]
    assert steps[-1]["charts/rollouts_sampled"] == 32 * sum(m["charts/sample_batches"] for m in steps)
    # every completion cut (2 new tokens; an answer and its EOS need 3): the filter leaves no token, no update
    cut = ["--max-new-tokens", "2", "--overlong-cache", "1", "--max-sample-batches", "1", "--num-steps", "1"]
    proc = run_script("scale/dapo.py", *small, *cut, "--overlong-filter", "--output-dir", str(tmp_path / "cut"))
    assert "step 1: every completion was cut at --max-new-tokens and --overlong-filter" in proc.stdout
    step = read_metrics(tmp_path / "cut")[1]
    assert step["charts/overlong_share"] == 1 and "losses/loss" not in step and "losses/grad_norm" not in step
    start = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "tiny-adder")).state_dict()
    for name, weight in AutoModelForCausalLM.from_pretrained(tmp_path / "cut").state_dict().items():
        assert torch.equal(weight, start[name]), name  # trained on nothing: not moved
    for flags, line in [
        (["--overlong-cache", "9"], "error: --overlong-cache 9: the penalty's zone lies within --max-new-tokens 8"),
        (["--max-sample-batches", "0"], "error: --max-sample-batches"),
    ]:
        proc = run_script("scale/dapo.py", *flags, "--output-dir", str(tmp_path / "bad"), expect_ok=False)
        assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-500:]


@pytest.mark.long
def test_the_benchmark_writes_its_table_from_the_runs(tmp_path):
    """benchmarks/dapo_benchmark.py, the bundled rows for 2 small steps: each row's accuracy and rollouts sampled
    are its runs' (grpo.py's a batch a step), the sampling counts dapo.py's; the figure is written."""
    small = "--num-steps 2 --prompts-per-step 4 --num-eval 16 --eval-every 2 --log-every 1"
    args = ["--seeds", "1", "--rows", "grpo", "dapo", f"--flags={small}", "--out-dir", str(tmp_path)]
    run_script("benchmarks/dapo_benchmark.py", *args, "--runs-dir", str(tmp_path / "runs"))
    page = (tmp_path / "results.md").read_text()
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in page.splitlines() if line.startswith("| ")}
    grpo, dapo_ = read_metrics(tmp_path / "runs" / "grpo__1"), read_metrics(tmp_path / "runs" / "dapo__1")
    assert rows["grpo"][1] == f"{100 * grpo[0]['eval/accuracy']:.1f} → {100 * grpo[-1]['eval/accuracy']:.1f}"
    assert rows["grpo"][2] == "64" and rows["grpo"][4] == "—"  # 2 steps of 4 prompts x 8 completions
    assert rows["dapo"][2] == str(int(dapo_[-1]["charts/rollouts_sampled"]))
    assert int(rows["dapo"][2]) == 32 * sum(m["charts/sample_batches"] for m in dapo_[1:])
    assert (tmp_path / "dapo.png").stat().st_size > 0


def test_every_benchmark_row_is_a_valid_command_of_its_file():
    """Each row of benchmarks/dapo_benchmark.py parses with its file's flags (the SmolLM2 rows, which the test above
    does not run, included); the no-shaping row is dapo-smollm2's command with the overlong penalty off, and only
    that."""
    import sys

    import tyro

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import dapo_benchmark

    files = {"scale/dapo.py": dapo, "scale/grpo.py": grpo}
    parsed = {
        name: tyro.cli(files[script].Args, args=["--seed", "1", *flags, "--output-dir", "out"])
        for name, (script, flags) in dapo_benchmark.ROWS.items()
    }
    assert parsed["dapo-smollm2"].model_name_or_path == "SmolLM2-135M-Instruct"
    assert parsed["dapo-smollm2"].overlong_shaping and not parsed["dapo-smollm2-no-shaping"].overlong_shaping
    differ = {k for k, v in vars(parsed["dapo-smollm2"]).items() if vars(parsed["dapo-smollm2-no-shaping"])[k] != v}
    assert differ == {"overlong_shaping"}
