"""--vllm: the rollouts sampled by a vLLM engine in the training process.

The tests that need the engine run in vLLM's own virtual environment (.ci/vllm-cpu-venv, which .ci/run calls:
vllm-cpu pins its own torch and transformers), and skip where vLLM is not installed, unless VLLM_REQUIRED is set;
the test of the error without vLLM runs where it is not installed (the main environment)."""

import importlib.util
import json
import os
import re

import pytest
from conftest import ROOT, RUN_MAIN, read_metrics, run_script
from test_scripts import python_commands
from test_torchrun import torchrun

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM and not os.environ.get("VLLM_REQUIRED"), reason="vLLM not installed")
SAMPLING_FILES = [
    "scale/grpo.py",
    "scale/rloo.py",
    "scale/gspo.py",
    "scale/cispo.py",
    "scale/ppo.py",
    "scale/process_grpo.py",
    "scale/dapo.py",
    "scale/distill.py",
]
TEACHER = {"scale/distill.py": ["--teacher-path", "tiny-chainer"]}  # the bundled tokenizer's, trained on another task
SMALL = [
    "--prompts-per-step",
    "4",
    "--num-eval",
    "10",
    "--eval-every",
    "2",
    "--log-every",
    "1",
    "--vllm-kv-cache-gib",
    "0.25",
]
GROUPS = ["--group-size", "4"]  # all but ppo.py

# runs a file's main() with --vllm, then copies the trained policy into the engine and scores one fixed completion
# with both: the engine's log-prob of each completion token (its prompt log-probs) and the trainer's
CHECK = (
    RUN_MAIN
    + """
import json, os, sys, torch
from vllm import SamplingParams
sys.argv = sys.argv[1:]
# vLLM starts a process group even in one process: end_processes would destroy it and leave before the check
torch.distributed.destroy_process_group, os._exit = lambda *group: None, lambda status: None
run = run_main(sys.argv[0])
engine, policy, tokenizer = run["engine"], run["policy"], run["tokenizer"]
prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
completion = tokenizer("46", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
ids = prompt + completion
if os.environ.get("PERTURB"):  # a random model on the addition task earns no reward, so its steps move nothing
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
run["sync_engine"](engine, policy)
out = engine.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                      use_tqdm=False)[0]
by_engine = [out.prompt_logprobs[t][ids[t]].logprob for t in range(len(prompt), len(ids))]
input_ids = torch.tensor([ids])
with torch.no_grad():
    by_trainer = run["token_logprobs"](policy, input_ids, torch.ones_like(input_ids), len(prompt), 1.0)[0]
    start = run["load_model"](run["args"].model_name_or_path, run["args"], torch.device("cpu"))
    at_start = run["token_logprobs"](start, input_ids, torch.ones_like(input_ids), len(prompt), 1.0)[0]
with open(os.path.join(run["output_dir"], "check.json"), "w") as f:
    json.dump({"engine": by_engine, "trainer": by_trainer.tolist(), "start": at_start.tolist()}, f)
"""
)


def test_vllm_without_vllm_installed_is_one_line(tmp_path):
    """setup(), the same in every file, checks: one file stands for all (test_shared keeps the copies equal)."""
    if HAVE_VLLM:
        pytest.skip("vLLM is installed here")
    proc = run_script("scale/ppo.py", "--vllm", "--output-dir", str(tmp_path / "run"), expect_ok=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: --vllm: vLLM is not installed; install requirements-vllm.txt"), lines
    assert not (tmp_path / "run").exists()  # stopped before its output folder was made


@pytest.mark.parametrize("script", ["scale/dpo.py", "scale/async_grpo.py"])
def test_vllm_in_a_file_without_an_engine_is_refused(script, tmp_path):
    """The files without an engine have no --vllm flag: the command line refuses it as any unknown flag, before
    anything is made (dpo.py stands for sft.py and reward_model.py too; async_grpo.py samples in a thread of its
    own with generate())."""
    proc = run_script(script, "--vllm", "--output-dir", str(tmp_path / "o"), expect_ok=False)
    assert proc.returncode != 0 and "--vllm" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def check_synced(out, minimum_move):
    """The engine's log-probs of the fixed completion are the trained policy's, and the policy moved far from
    the start (so that log-probs from unsynced weights would fail the check)."""
    check = json.loads((out / "check.json").read_text())
    engine_gap = max(abs(a - b) for a, b in zip(check["engine"], check["trainer"]))
    moved = max(abs(a - b) for a, b in zip(check["start"], check["trainer"]))
    assert engine_gap < 1e-3 and moved > minimum_move, (engine_gap, moved, check)


@needs_vllm
@pytest.mark.parametrize("script", SAMPLING_FILES)
def test_a_step_with_vllm_on_the_bundled_model(script, tmp_path):
    """Two steps of each file with --vllm at a learning rate that moves the tiny model far: the engine samples
    from the trained weights (step 2's engine-trainer gap stays at rounding, the tied model's too), and after
    the run it scores a fixed completion as the trainer does."""
    harness = tmp_path / "check.py"
    harness.write_text(CHECK)
    out = tmp_path / "run"
    flags = [*SMALL, *([] if script == "scale/ppo.py" else GROUPS), "--num-steps", "2", "--learning-rate", "1e-2"]
    flags += ["--loss", "reverse-kl"] if script == "scale/distill.py" else []  # its default, jsd, weighs no token
    run_script(str(harness), script, "--vllm", *flags, *TEACHER.get(script, []), "--output-dir", str(out))
    step2 = [m for m in read_metrics(out) if m["step"] == 2][0]
    assert step2["rollout/logprob_diff"] < 1e-4 and step2["rollout/is_weight"] == pytest.approx(1.0, abs=1e-3)
    check_synced(out, minimum_move=0.05)


@needs_vllm
def test_distill_jsd_with_vllm(tmp_path):
    """distill.py --loss jsd --vllm: the whole-vocabulary loss at the prefixes the engine sampled, with no importance
    weight (no token is sampled for the loss) but the mismatch logged, the exact reverse KL logged; the engine samples
    from the trained weights."""
    harness = tmp_path / "check.py"
    harness.write_text(CHECK)
    out = tmp_path / "run"
    flags = [*SMALL, *GROUPS, "--num-steps", "2", "--learning-rate", "1e-2", "--loss", "jsd"]
    run_script(
        str(harness), "scale/distill.py", "--vllm", *flags, *TEACHER["scale/distill.py"], "--output-dir", str(out)
    )
    step2 = [m for m in read_metrics(out) if m["step"] == 2][0]
    assert step2["losses/reverse_kl_exact"] > 0 and step2["rollout/logprob_diff"] < 1e-4, step2
    assert "rollout/is_weight" not in step2, step2
    check_synced(out, minimum_move=0.05)


@needs_vllm
def test_a_step_with_vllm_on_a_tied_qwen2(chat_model_dir, tmp_path):
    """The test suite's tiny Qwen2 (tied embeddings, a ChatML template, two stop ids): GRPO with --vllm; it earns
    no reward, so the check moves its weights by noise before the sync. Its heads made 32 wide (hidden 64, 2 query
    heads, 1 key-value head): vLLM's CPU attention has no 8-wide heads."""
    import transformers

    model_dir = tmp_path / "qwen2"
    config = transformers.AutoConfig.from_pretrained(chat_model_dir)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1})
    assert config.tie_word_embeddings
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    transformers.AutoTokenizer.from_pretrained(chat_model_dir).save_pretrained(model_dir)
    harness = tmp_path / "check.py"
    harness.write_text(CHECK)
    out = tmp_path / "run"
    run_script(
        str(harness),
        "scale/grpo.py",
        "--vllm",
        "--model-name-or-path",
        str(model_dir),
        "--task",
        "addition-question",
        *SMALL,
        *GROUPS,
        "--num-steps",
        "2",
        "--learning-rate",
        "1e-2",
        "--output-dir",
        str(out),
        env={"PERTURB": "1"},
    )
    step2 = [m for m in read_metrics(out) if m["step"] == 2][0]
    assert step2["rollout/logprob_diff"] < 1e-4, step2
    check_synced(out, minimum_move=0.05)  # after the run, every weight moved by noise, the tied embedding too


@needs_vllm
def test_same_seed_same_metrics_with_vllm(tmp_path):
    """The engine samples in this process from torch's generator, seeded once: two runs give the same samples."""
    runs = []
    for name in ("a", "b"):
        run_script("scale/grpo.py", "--vllm", *SMALL, *GROUPS, "--num-steps", "2", "--output-dir", str(tmp_path / name))
        runs.append(
            [
                {k: v for k, v in m.items() if k.startswith(("charts/reward", "charts/completion_length"))}
                for m in read_metrics(tmp_path / name)
            ]
        )
    assert runs[0] == runs[1]


# after a 1-step run: a prompt longer than a KV-cache block (vLLM's CPU blocks hold 128 tokens) sampled once, the
# weights changed, the same prompt sampled again after the sync: the engine's log-probs of the second sample against
# the trainer's. Keys and values of the prompt's full blocks kept in the prefix cache from before the change would
# give the engine the old model's log-probs.
PREFIX = (
    RUN_MAIN
    + """
import json, os, sys, torch
sys.argv = sys.argv[1:]
torch.distributed.destroy_process_group, os._exit = lambda *group: None, lambda status: None
run = run_main(sys.argv[0])
engine, policy, tokenizer, stop_ids = run["engine"], run["policy"], run["tokenizer"], run["stop_ids"]
prompt_ids = torch.tensor([tokenizer("3 boxes of 4 " * 60, add_special_tokens=False)["input_ids"][:200]])
mask = torch.ones_like(prompt_ids)
gaps = []
for _ in range(2):
    completion, by_engine = run["sample"](policy, engine, tokenizer, prompt_ids, mask, run["args"], stop_ids)
    completion_mask = run["completion_mask"](completion, stop_ids)
    with torch.no_grad():
        by_trainer = run["token_logprobs"](policy, torch.cat([prompt_ids, completion], 1),
                                              torch.cat([mask, completion_mask.long()], 1), prompt_ids.shape[1])
        gaps.append((by_engine - by_trainer)[completion_mask].abs().max().item())
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
with open(os.path.join(run["output_dir"], "gaps.json"), "w") as f:
    json.dump(gaps, f)
"""
)


@needs_vllm
def test_the_engine_forgets_its_prefix_cache_when_the_weights_change(chat_model_dir, tmp_path):
    """A 200-token prompt sampled, the weights changed, the prompt sampled again: both times the engine scores its
    tokens as the trainer does (the prefix cache is emptied at every sync), where keys and values cached from the
    old weights would put the second sample's log-probs off."""
    import transformers

    model_dir = tmp_path / "qwen2"
    config = transformers.AutoConfig.from_pretrained(chat_model_dir)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    transformers.AutoTokenizer.from_pretrained(chat_model_dir).save_pretrained(model_dir)
    harness = tmp_path / "prefix.py"
    harness.write_text(PREFIX)
    out = tmp_path / "run"
    run_script(
        str(harness),
        "scale/grpo.py",
        "--vllm",
        "--model-name-or-path",
        str(model_dir),
        "--task",
        "addition-question",
        *SMALL,
        *GROUPS,
        "--num-steps",
        "1",
        "--output-dir",
        str(out),
    )
    gaps = json.loads((out / "gaps.json").read_text())
    assert max(gaps) < 1e-3, gaps


@needs_vllm
def test_a_model_vllm_does_not_serve_is_one_line(tmp_path):
    """A transformers architecture that vLLM lacks (BioGPT): one line that names the flag and vLLM's reason."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    config = transformers.BioGptConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "biogpt")
    tokenizer.save_pretrained(tmp_path / "biogpt")
    proc = run_script(
        "scale/grpo.py",
        "--vllm",
        "--model-name-or-path",
        str(tmp_path / "biogpt"),
        "--output-dir",
        str(tmp_path / "run"),
        expect_ok=False,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith(f"error: --vllm: vLLM cannot serve --model-name-or-path {tmp_path / 'biogpt'}: "), last
    assert "BioGptForCausalLM" in last and "not supported" in last, last


@needs_vllm
def test_vllm_with_lora_samples_from_the_merged_weights(tmp_path):
    """--lora-r: the engine takes the policy's weights with its adapters merged, under the plain model's names: at
    step 2, after an update that moved the policy from its reference, it samples as the trainer scores."""
    out = tmp_path / "run"
    run_script(
        "scale/grpo.py",
        "--vllm",
        "--lora-r",
        "8",
        *SMALL,
        *GROUPS,
        "--num-steps",
        "2",
        "--learning-rate",
        "1e-2",
        "--output-dir",
        str(out),
    )
    step2 = [m for m in read_metrics(out) if m["step"] == 2][0]
    assert step2["rollout/logprob_diff"] < 1e-4 and step2["losses/kl"] > 1e-4, step2


@needs_vllm
@pytest.mark.parametrize("fsdp", [False, True])
def test_vllm_under_torchrun(fsdp, tmp_path):
    """Two processes, an engine in each (vLLM's external launcher): under DDP and under FSDP2 (every process
    gathers the full weights for its engine), the engines sample from the trained weights at step 2."""
    flags = ["--vllm", *SMALL, *GROUPS, "--prompts-per-step", "8", "--num-steps", "2", "--learning-rate", "1e-2"]
    out = tmp_path / "run"
    torchrun("scale/grpo.py", *flags, *(["--fsdp"] if fsdp else []), "--output-dir", str(out))
    step2 = [m for m in read_metrics(out) if m["step"] == 2][0]
    assert step2["rollout/logprob_diff"] < 1e-4 and step2["losses/kl"] > 0.01, step2  # the policy moved


@needs_vllm
def test_a_killed_vllm_run_resumes_exactly(tmp_path):
    """GRPO with --vllm killed after step 3 and resumed from its step-2 checkpoint ends as the run that was not
    stopped: the engine of the resumed run takes the checkpoint's weights, and the sampling seeds come from the
    restored generator (the engine is built, and reseeds torch, before the checkpoint's states come back)."""
    from test_resume import FLAGS, KILLED, STEPS, assert_resumed_exactly

    flags = ["--vllm", "--vllm-kv-cache-gib", "0.25", *FLAGS["scale/grpo.py"], *STEPS]
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    run_script("scale/grpo.py", *flags, "--output-dir", whole)
    harness = tmp_path / "killed.py"
    harness.write_text(KILLED)
    proc = run_script(
        str(harness), "scale/grpo.py", *flags, "--output-dir", killed, env={"KILL_AFTER_STEP": "3"}, expect_ok=False
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    run_script("scale/grpo.py", "--resume-from", killed)
    assert_resumed_exactly(whole, killed)


def test_the_readmes_vllm_commands(tmp_path):
    """docs/vllm.md's `shell` block: its environment lines are this file's .ci/vllm-cpu-venv's, and its bundled-model
    command runs here with small flags (the SmolLM2 one is the benchmark's grpo-smollm2-vllm: test_benchmark)."""
    with open(os.path.join(ROOT, "docs", "vllm.md")) as f:
        (block,) = re.findall(r"```shell\n(.*?)```", f.read(), flags=re.S)
    with open(os.path.join(ROOT, ".ci", "vllm-cpu-venv")) as f:
        assert "pip install -r requirements-vllm-cpu.txt && pip uninstall -y torchvision torchaudio\n" in f.read()
    assert "pip install -r requirements-vllm-cpu.txt && pip uninstall -y torchvision torchaudio" in block
    commands = python_commands(block)
    assert "python scale/grpo.py --vllm" in commands
    if not HAVE_VLLM and not os.environ.get("VLLM_REQUIRED"):
        pytest.skip("vLLM not installed: the command is run in vLLM's environment")
    out = tmp_path / "run"
    run_script("scale/grpo.py", "--vllm", *SMALL, *GROUPS, "--num-steps", "2", "--output-dir", str(out))
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2]


@needs_vllm
def test_a_kv_cache_too_small_for_one_sequence_is_one_line(tmp_path):
    """vLLM's own message names its gpu_memory_utilization; the line also names the flag that sizes the cache."""
    proc = run_script(
        "scale/grpo.py",
        "--vllm",
        "--vllm-kv-cache-gib",
        "0.0001",
        "--output-dir",
        str(tmp_path / "run"),
        expect_ok=False,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("error: --vllm: vLLM cannot serve --model-name-or-path tiny-adder: "), last
    assert last.endswith("(--vllm-kv-cache-gib, --max-prompt-length, --max-new-tokens)"), last
