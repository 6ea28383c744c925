"""docs/training.md's options, run as a user runs them: LoRA, --eval-dataset, --eval-samples, the learning-rate
schedule, and the rollouts of a step in samples.jsonl."""

import json
import math
import shutil
import statistics
import types

import pytest
import torch
from conftest import ROOT, read_metrics, run_script
from test_resume import assert_same_records  # equal to float rounding: two processes may round differently
from transformers import AutoModelForCausalLM

from scale import grpo

SMALL = [
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--micro-batch-size",
    "16",
    "--num-eval",
    "16",
    "--max-new-tokens",
    "4",
    "--log-every",
    "1",
]


def untimed(metrics):
    return [{k: v for k, v in m.items() if "time" not in k and "per_sec" not in k} for m in metrics]


def read_samples(folder):
    with open(folder / "samples.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    run_script(
        "scale/grpo.py",
        *SMALL,
        "--num-steps",
        "4",
        "--eval-every",
        "4",
        "--save-every",
        "2",
        "--lora-r",
        "4",
        "--learning-rate",
        "1e-2",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "1",
        "--output-dir",
        str(out),
    )
    return out


def test_lora_trains_only_the_adapters_against_the_policy_without_them(lora_run):
    peft = pytest.importorskip("peft")
    kl = [m["losses/kl"] for m in read_metrics(lora_run) if "losses/kl" in m]
    assert kl[0] < 1e-6 and kl[-1] > 1e-6  # B starts at 0: the policy is its own reference, then moves from it
    start = AutoModelForCausalLM.from_pretrained(f"{ROOT}/tiny-adder", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(lora_run, dtype=torch.float32)  # the merged model loads alone
    before, after = start.state_dict(), merged.state_dict()
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.endswith("proj.weight") for name in changed)  # the linear layers, nothing else
    adapted = peft.PeftModel.from_pretrained(start, lora_run / "adapter")  # the adapter beside it, on the start
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_alone(lora_run):
    """state/ leaves the frozen weights out (a resume takes them from --model-name-or-path), and a checkpoint keeps
    adapter/ and no merged model; the final save has both. (Before: state/ held the frozen float32 model, and every
    checkpoint a merged float32 copy besides.)"""
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = lora_run / "checkpoints" / "step_000002"
    keys = FileSystemReader(str(checkpoint / "state")).read_metadata().state_dict_metadata.keys()
    weights = [k for k in keys if k.startswith("models.")]
    moments = [k for k in keys if k.startswith("optimizer.state.") and k.endswith(".exp_avg")]
    assert len(weights) == len(moments) == 28  # A and B of each of 14 layers
    assert all("lora_" in k for k in weights + moments)
    assert sorted(p.name for p in (checkpoint / "policy").iterdir()) == ["adapter"]
    assert (checkpoint / "policy" / "adapter" / "adapter_model.safetensors").is_file()
    assert (lora_run / "model.safetensors").is_file() and (lora_run / "adapter" / "adapter_model.safetensors").is_file()


def test_a_killed_lora_run_resumes_to_the_same_metrics_and_schedule(lora_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(lora_run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000004")
    run_script("scale/grpo.py", "--resume-from", str(copy))
    assert_same_records(untimed(read_metrics(copy)), untimed(read_metrics(lora_run)))
    rates = [m["charts/learning_rate"] for m in read_metrics(lora_run) if m["step"] > 0]
    assert rates == pytest.approx([1e-2, 1e-2, 0.75e-2, 0.25e-2])  # 1 step of warm-up, then cosine over 3


@pytest.mark.parametrize(
    "schedule, factors",
    [
        ("constant", [0.5, 1, 1, 1, 1, 1]),
        ("linear", [0.5, 1, 1, 0.75, 0.5, 0.25]),
        ("cosine", [0.5, 1, 1, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2]),
    ],
)
def test_the_learning_rate_warms_up_then_decays_as_worked_out_by_hand(schedule, factors):
    """--warmup-steps 2 of --num-steps 6: step 1 at half the rate, step 2 at all of it, then the decay over the
    4 steps after the warm-up: progress 0, 1/4, 1/2, 3/4 at steps 3 to 6. A resumed run picks it up at its step."""
    args = types.SimpleNamespace(learning_rate=0.1, warmup_steps=2, num_steps=6, lr_schedule=schedule)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler, rates = grpo.lr_scheduler(optimizer, args, first_step=1), []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.1 * f for f in factors], abs=1e-12)
    resumed = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    grpo.lr_scheduler(resumed, args, first_step=4)
    assert resumed.param_groups[0]["lr"] == pytest.approx(rates[3], abs=1e-12)


def test_sampled_evaluation_leaves_training_alone_and_at_a_tiny_temperature_is_greedy(tmp_path):
    plain, cold, warm = (tmp_path / name for name in ("plain", "cold", "warm"))
    run_script("scale/grpo.py", *SMALL, "--num-steps", "2", "--eval-every", "2", "--output-dir", str(plain))
    run_script(
        "scale/grpo.py",
        *SMALL,
        "--num-steps",
        "2",
        "--eval-every",
        "2",
        "--eval-samples",
        "3",
        "--eval-temperature",
        "1e-6",
        "--output-dir",
        str(cold),
    )
    run_script(
        "scale/grpo.py",
        *SMALL,
        "--num-steps",
        "2",
        "--eval-every",
        "2",
        "--eval-samples",
        "3",
        "--output-dir",
        str(warm),
    )
    for m in read_metrics(cold):  # the 3 samples a prompt, a batch of 48, against greedy in a batch of 16: a near tie
        if "eval/accuracy" in m:  # (two logits under 1e-5 apart) may go either way; one prompt of the 16 is allowed
            assert abs(m["eval/mean@k"] - m["eval/accuracy"]) <= 1 / 16
            assert abs(m["eval/pass@k"] - m["eval/mean@k"]) <= 1 / 16  # the 3 samples alike
    drop = ("eval/mean@k", "eval/pass@k")
    assert_same_records(
        [{k: v for k, v in m.items() if k not in drop} for m in untimed(read_metrics(warm))],
        untimed(read_metrics(plain)),
    )  # the samples draw their own random numbers
    evals = [m for m in read_metrics(warm) if "eval/pass@k" in m]
    assert len(evals) == 2 and all(0 <= m["eval/mean@k"] <= m["eval/pass@k"] <= 1 for m in evals)
    assert any(m["eval/mean@k"] != m["eval/accuracy"] for m in evals)  # sampled, not greedy


def test_the_rollouts_of_each_logged_step_go_to_samples_with_their_advantages(lora_run):
    rows = read_samples(lora_run)
    assert {r["kind"] for r in rows} == {"eval", "rollout"}
    for step in (1, 2, 3, 4):
        group = [r for r in rows if r["kind"] == "rollout" and r["step"] == step]
        assert len(group) == 4 and len({r["prompt"] for r in group}) == 1  # the first group of the step
        rewards = [r["reward"] for r in group]
        mean, std = statistics.mean(rewards), statistics.stdev(rewards)
        assert [r["advantage"] for r in group] == pytest.approx([(x - mean) / (std + 1e-4) for x in rewards])
        assert all(r["reward"] == grpo.reward_fn(r["completion"], r) for r in group)


def test_held_out_records_come_from_eval_dataset_and_all_of_dataset_is_trained_on(tmp_path):
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": a + 1}) + "\n" for a in range(10)))
    held_out.write_text("".join(json.dumps({"prompt": f"{a}+2=", "answer": a + 2}) + "\n" for a in range(6)))
    out = tmp_path / "run"
    proc = run_script(
        "scale/grpo.py",
        *SMALL,
        "--num-steps",
        "1",
        "--dataset",
        str(train),
        "--eval-dataset",
        str(held_out),
        "--num-eval",
        "4",
        "--output-dir",
        str(out),
    )
    assert ": 10 training prompts, 4 held out," in proc.stdout
    evals = [r["prompt"] for r in read_samples(out) if r["kind"] == "eval"]
    assert evals and all(p in {f"{a}+2=" for a in range(4)} for p in evals)
    missing = run_script(
        "scale/grpo.py",
        "--eval-dataset",
        str(tmp_path / "none.jsonl"),
        "--output-dir",
        str(tmp_path / "r2"),
        expect_ok=False,
    )
    assert missing.returncode != 0
    assert f"error: --eval-dataset {tmp_path / 'none.jsonl'}: no such file" in missing.stderr
    held_out.write_text('{"prompt": "1+1="}\n')
    bad = run_script(
        "scale/grpo.py", "--eval-dataset", str(held_out), "--output-dir", str(tmp_path / "r3"), expect_ok=False
    )
    assert f"error: --eval-dataset {held_out}: line 1 has no field 'answer'" in bad.stderr


@pytest.mark.parametrize(
    "script, dataset, record",
    [
        ("scale/dpo.py", "pairs_tiny.jsonl", {"chosen": "4", "rejected": "5"}),  # text completions without a prompt
        ("scale/reward_model.py", "pairs_tiny.jsonl", {"chosen": "4", "rejected": "5"}),
        ("scale/sft.py", "sft_tiny.jsonl", {"messages": [{"role": "user", "content": "2+2?"}]}),  # no assistant message
    ],
)
def test_a_record_of_eval_dataset_that_cannot_be_read_is_named_by_that_flag(script, dataset, record, tmp_path):
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps(record) + "\n")
    proc = run_script(
        script,
        "--dataset",
        f"tests/fixtures/{dataset}",
        "--eval-dataset",
        str(held_out),
        "--output-dir",
        str(tmp_path / "run"),
        expect_ok=False,
    )
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --eval-dataset {held_out}: "
    )


@pytest.mark.parametrize(
    "script, flags, message",
    [
        (
            "scale/grpo.py",
            ["--lora-r", "4", "--lora-target-modules", "nope"],
            "error: --lora-target-modules nope: Target modules {'nope'} not found",
        ),
        # the bundled model ties its output layer to its embedding: an adapter on either would reach one of them only
        (
            "scale/grpo.py",
            ["--lora-r", "4", "--lora-target-modules", "q_proj", "embed_tokens"],
            "error: --lora-target-modules q_proj embed_tokens: model.embed_tokens is tied to the output layer, which "
            "would keep no adapter; leave it out",
        ),
        (
            "scale/sft.py",
            ["--lora-r", "4", "--lora-target-modules", "lm_head"],
            "error: --lora-target-modules lm_head: lm_head "
            "is the output layer, whose weight the log-probs multiply without an adapter; leave it out",
        ),
        (
            "scale/dpo.py",
            ["--dataset", "tests/fixtures/pairs_tiny.jsonl", "--eval-samples", "2"],
            "error: --eval-samples scores samples against the built-in task's answers; --dataset has none",
        ),
        (
            "scale/sft.py",
            ["--dataset", "tests/fixtures/sft_tiny.jsonl", "--num-eval", "2", "--eval-samples", "2"],
            "error: --eval-samples scores samples against the held-out records' answers, and they have none",
        ),
        *[
            (
                script,
                ["--eval-dataset", "tests/fixtures/pairs_tiny.jsonl"],
                "error: --eval-dataset needs --dataset: the addition task holds out its own prompts",
            )
            for script in ("scale/dpo.py", "scale/reward_model.py")
        ],
        (
            "scale/ppo.py",
            ["--reward-model-path", "rm", "--eval-samples", "2"],
            "error: --eval-samples scores samples with the verifier; with --reward-model-path it has none",
        ),
    ],
)
def test_options_that_cannot_work_stop_with_one_line(script, flags, message, tmp_path):
    proc = run_script(script, *flags, "--output-dir", str(tmp_path / "run"), expect_ok=False)
    if script != "scale/sft.py" and "--lora-target-modules" not in flags:  # refused before the run's folder is made
        assert not (tmp_path / "run").exists()  # (sft.py finds no answers, and peft no layer, only once they read)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-500:]
