"""Bad input is refused with one line before any work starts: every numeric flag of every file at the edges of
its range, the types of a dataset's records, and the output folder.

The ranges below are written out here, from what each flag means, not read from the scripts: a script whose
check is missing or wrong for a flag fails, and so does a numeric flag that this table does not know.
"""

import importlib
import json
import math
import os
import subprocess
import sys
import typing

import pytest
import torch
from conftest import ROOT, run_script
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from scale import grpo, ppo

SCRIPTS = [
    "scale/grpo.py",
    "scale/rloo.py",
    "scale/gspo.py",
    "scale/cispo.py",
    "scale/ppo.py",
    "scale/dpo.py",
    "scale/reward_model.py",
    "scale/sft.py",
    "scale/async_grpo.py",
    "scale/process_grpo.py",
    "scale/tool_grpo.py",
    "scale/dapo.py",
    "scale/distill.py",
    "scale/env_grpo.py",
]

# (low, low included, high, high included); None: no bound on that side
POSITIVE, NON_NEGATIVE, UNIT = (0, False, None, False), (0, True, None, False), (0, True, 1, True)
COMMON = {
    "seed": (0, True, 2**32 - 1, True),
    "log_every": POSITIVE,
    "num_eval": POSITIVE,
    "eval_every": POSITIVE,
    "max_new_tokens": POSITIVE,
    "num_steps": POSITIVE,
    "learning_rate": POSITIVE,
    "weight_decay": NON_NEGATIVE,
    "max_grad_norm": POSITIVE,
    "micro_batch_size": POSITIVE,
    "max_prompt_length": POSITIVE,
    "save_every": NON_NEGATIVE,
    "keep_checkpoints": POSITIVE,
    "warmup_steps": NON_NEGATIVE,
}
TRAINED_LM = {
    "lora_r": NON_NEGATIVE,
    "lora_alpha": POSITIVE,
    "eval_samples": NON_NEGATIVE,  # not reward_model.py
    "eval_temperature": POSITIVE,
}
GROUP = {"prompts_per_step": POSITIVE, "group_size": (2, True, None, False), "temperature": POSITIVE}
CLIPPED = {"num_iterations": POSITIVE, "num_minibatches": POSITIVE, "clip_eps_low": UNIT, "clip_eps_high": NON_NEGATIVE}
PAIRS = {"num_train_prompts": POSITIVE, "pair_samples": POSITIVE, "pair_temperature": POSITIVE, "batch_size": POSITIVE}
LENGTH = {"max_length": (2, True, None, False)}  # with --max-prompt-length below it
VLLM = {"vllm_kv_cache_gib": POSITIVE, "rollout_cap": (1, True, None, False)}  # the files that sample
RANGES = {
    "scale/grpo.py": {**COMMON, **TRAINED_LM, **GROUP, **CLIPPED, **VLLM, "beta": NON_NEGATIVE},
    "scale/process_grpo.py": {**COMMON, **TRAINED_LM, **GROUP, **CLIPPED, **VLLM, "beta": NON_NEGATIVE},
    "scale/dapo.py": {
        **COMMON,
        **TRAINED_LM,
        **GROUP,
        **CLIPPED,
        **VLLM,
        "beta": NON_NEGATIVE,
        "max_sample_batches": POSITIVE,
        "overlong_cache": POSITIVE,
    },
    "scale/tool_grpo.py": {
        **COMMON,
        **TRAINED_LM,
        **GROUP,
        **CLIPPED,
        "beta": NON_NEGATIVE,
        "max_turns": POSITIVE,
        "tool_reward": NON_NEGATIVE,
        "rollout_cap": VLLM["rollout_cap"],  # no --vllm, but the corrections
    },
    "scale/env_grpo.py": {
        **COMMON,
        "lora_r": NON_NEGATIVE,
        "lora_alpha": POSITIVE,
        **GROUP,
        **CLIPPED,
        "beta": NON_NEGATIVE,
        "max_turns": POSITIVE,
        "rollout_cap": VLLM["rollout_cap"],  # no --vllm, but the corrections
    },
    "scale/async_grpo.py": {
        **COMMON,
        **TRAINED_LM,
        **GROUP,
        **CLIPPED,
        "beta": NON_NEGATIVE,
        "max_staleness": NON_NEGATIVE,
        "interrupt_every": NON_NEGATIVE,
        "behav_imp_cap": (1, True, None, False),
    },
    "scale/rloo.py": {**COMMON, **TRAINED_LM, **GROUP, **VLLM, "beta": NON_NEGATIVE},
    "scale/distill.py": {**COMMON, **TRAINED_LM, **GROUP, **CLIPPED, **VLLM, "group_size": POSITIVE, "jsd_beta": UNIT},
    "scale/gspo.py": {**COMMON, **TRAINED_LM, **GROUP, **CLIPPED, **VLLM},
    "scale/cispo.py": {**COMMON, **TRAINED_LM, **GROUP, **CLIPPED, **VLLM},
    "scale/ppo.py": {
        **COMMON,
        **TRAINED_LM,
        **VLLM,
        "prompts_per_step": POSITIVE,
        "temperature": POSITIVE,
        "ppo_epochs": POSITIVE,
        "num_minibatches": POSITIVE,
        "beta": NON_NEGATIVE,
        "kl_target": NON_NEGATIVE,
        "kl_horizon": POSITIVE,
        "clip_eps": (0, False, 1, True),
        "clip_value": NON_NEGATIVE,
        "vf_coef": NON_NEGATIVE,
        "gamma": UNIT,
        "lam": UNIT,
        "missing_eos_penalty": NON_NEGATIVE,
    },
    "scale/dpo.py": {
        **COMMON,
        **TRAINED_LM,
        **PAIRS,
        **LENGTH,
        "beta": POSITIVE,
        "label_smoothing": (0, True, 0.5, False),
    },
    "scale/reward_model.py": {**COMMON, **PAIRS, **LENGTH},
    "scale/sft.py": {
        **COMMON,
        **TRAINED_LM,
        **LENGTH,
        "batch_size": POSITIVE,
        "hidden_size": POSITIVE,
        "num_layers": POSITIVE,
        "num_heads": POSITIVE,
        "num_train": POSITIVE,
    },
}
# a valid value at an edge can still make a batch that does not divide: these flags keep the rest valid
VALID_WITH = {
    ("scale/ppo.py", "prompts_per_step"): ["--num-minibatches", "1"],
    ("scale/sft.py", "hidden_size"): ["--num-heads", "1"],
    **{
        (script, "max_length"): ["--max-prompt-length", "1"]
        for script in ("scale/dpo.py", "scale/reward_model.py", "scale/sft.py")
    },
}

# runs each script's cases in one process, as `python script ...` does: `main(parse_args())` with the case's argv, the
# script loaded once (loaded again for each case, it was compiled again and tyro built its parser again for the new
# Args class: 5x the time); building any model stops the case. One process for every script: {name: [script,
# [argv, ...]]} in, {name: [[outcome, message], ...]} out
HARNESS = """
import contextlib, io, json, runpy, sys, transformers

def no_model(*args, **kwargs):
    raise RuntimeError("a model was built")

transformers.PreTrainedModel.__init__ = no_model
results = {}
for name, (script, cases) in json.loads(sys.argv[1]).items():
    results[name] = []
    module = runpy.run_path(script, run_name="harness")  # its definitions; as __main__ it runs main(parse_args())
    for argv in cases:
        sys.argv = [script, *argv]
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                module["main"](module["parse_args"]())
            results[name].append(["finished", ""])
        except SystemExit as e:
            message = e.code if isinstance(e.code, str) else f"code {e.code}: {stderr.getvalue()}"
            results[name].append(["exit", message])
        except RuntimeError as e:
            results[name].append(["model", str(e)])
print(json.dumps(results))
"""


def run_harness(cases):
    """{name: [script, its argvs]} -> {name: [outcome, message] per argv}, every script's cases in one process."""
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS, json.dumps(cases)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def numeric_flags(module):
    """The numeric fields of a script's Args that a user sets (not those filled in at run time)."""
    with open(module.__file__) as f:
        runtime = f.read().split("# to be filled in at runtime", 1)[1].split("\n\n", 1)[0]
    hints = typing.get_type_hints(module.Args)
    numeric = (int, float, int | None, float | None)
    return {name for name, kind in hints.items() if kind in numeric and f"    {name}:" not in runtime}


def is_int(module, name):
    return typing.get_type_hints(module.Args)[name] in (int, int | None)


def edges(low, low_in, high, high_in, integer):
    """(the first invalid values, the valid values at the edges) of a range."""
    invalid, valid = [], []
    for bound, included, down in ((low, low_in, True), (high, high_in, False)):
        if bound is None:
            continue
        step = -1 if down else 1
        if integer:
            invalid.append(bound + step if included else bound)
            valid.append(bound if included else bound - step)
        else:
            outward, inward = (-math.inf, math.inf) if down else (math.inf, -math.inf)
            invalid.append(math.nextafter(bound, outward) if included else bound)
            valid.append(bound if included else math.nextafter(bound, inward))
    return invalid, valid


def edge_cases(script, folder):
    """For each numeric flag of a script: the argvs of its first invalid and its valid edge values, each with
    (flag, value, valid, its output folder); then an output folder that cannot be made (its parent is a file)."""
    module = importlib.import_module(script[:-3].replace("/", "."))
    cases, expected = [], []
    for i, (name, (low, low_in, high, high_in)) in enumerate(sorted(RANGES[script].items())):
        flag, integer = "--" + name.replace("_", "-"), is_int(module, name)
        invalid, valid = edges(low, low_in, high, high_in, integer)
        if not integer:
            invalid += [math.nan, math.inf, -math.inf]
        for j, value in enumerate(invalid + valid):
            out = str(folder / f"out_{i}_{j}")
            is_valid = j >= len(invalid)
            cases.append(
                [f"{flag}={value!r}", "--output-dir", out, *(VALID_WITH.get((script, name), []) if is_valid else [])]
            )
            expected.append((flag, value, is_valid, out))
    (folder / "a_file").write_text("")
    cases.append(["--output-dir", str(folder / "a_file" / "run")])
    return cases, expected


# the flags of test_flags_that_cannot_work_together_name_what_to_change, with what grpo.py must say
CONFLICTS = [
    (
        ["--prompts-per-step", "3", "--group-size", "2", "--num-minibatches", "4"],
        "--prompts-per-step x --group-size (per process) by --num-minibatches: 6 does not divide by 4",
    ),
    (
        ["--prompts-per-step", "2", "--group-size", "4", "--micro-batch-size", "3"],
        "a minibatch (--prompts-per-step x --group-size / --num-minibatches, per process) by "
        "--micro-batch-size: 8 does not divide by 3",
    ),
    (["--lora-r", "4", "--fsdp"], "--lora-r with --fsdp: LoRA runs under DDP (torchrun without --fsdp)"),
]


@pytest.fixture(scope="module")
def harness_results(tmp_path_factory):
    """Every script's edge cases and grpo.py's conflicting flags, in one harness process (one start-up, not ten):
    {name: (folder, the argvs' expectations, their results)}."""
    cases, expected, folders = {}, {}, {}
    for script in SCRIPTS:
        folders[script] = tmp_path_factory.mktemp(os.path.basename(script)[:-3])
        argvs, expected[script] = edge_cases(script, folders[script])
        cases[script] = [script, argvs]
    folders["conflicts"] = tmp_path_factory.mktemp("conflicts")
    expected["conflicts"] = [str(folders["conflicts"] / f"out{i}") for i in range(len(CONFLICTS))]
    cases["conflicts"] = [
        "scale/grpo.py",
        [flags + ["--output-dir", out] for (flags, _), out in zip(CONFLICTS, expected["conflicts"])],
    ]
    results = run_harness(cases)
    assert set(results) == set(cases) and all(len(results[k]) == len(cases[k][1]) for k in cases)
    return {name: (folders[name], expected[name], results[name]) for name in cases}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_numeric_flag_is_checked_at_its_edges_before_anything_is_loaded(script, harness_results):
    """For each numeric flag: the first invalid value at each end of its range (and NaN and infinity for a float)
    stops with one line that names the flag, the value and the range, before a model is built and before the
    output folder is made; the valid value at each edge gets past every check (to the first model). An output
    folder that cannot be made is refused before a model is built too."""
    module = importlib.import_module(script[:-3].replace("/", "."))
    assert numeric_flags(module) == set(RANGES[script]), "a numeric flag without a range here, or one gone"
    folder, expected, results = harness_results[script]
    results = list(results)
    assert results.pop() == [
        "exit",
        f"error: --output-dir {folder / 'a_file' / 'run'}: cannot write there (Not a "
        "directory); choose a folder you can write to",
    ]
    assert len(results) == len(expected)
    for (flag, value, valid, out), (outcome, message) in zip(expected, results):
        if valid:
            assert outcome == "model", f"{flag} {value} is in range, but: {outcome} {message}"
            continue
        assert outcome == "exit", f"{flag} {value} was not refused before a model was built: {outcome} {message}"
        assert message.startswith(f"error: {flag} ") and ": must be " in message and "\n" not in message, message
        assert not os.path.exists(out), f"{flag} {value}: the output folder was made"
        if isinstance(value, float) and not math.isfinite(value):
            assert "must be a finite number" in message


def test_flags_that_cannot_work_together_name_what_to_change(harness_results):
    _, outs, results = harness_results["conflicts"]
    assert len(results) == len(CONFLICTS)
    for (outcome, text), (_, message), out in zip(results, CONFLICTS, outs):
        assert outcome == "exit" and text.startswith("error: ") and message in text, text
        assert not os.path.exists(out)


TEXT = "text or a list of role/content messages"  # a field other than an answer


@pytest.mark.parametrize(
    "schema, record, field, needs",
    [
        (("prompt", "answer"), {"prompt": None, "answer": "2"}, "prompt", TEXT),
        (("prompt", "answer"), {"prompt": "1+1=", "answer": None}, "answer", "text or a finite number"),
        (("prompt", "answer"), {"prompt": "1+1=", "answer": True}, "answer", "text or a finite number"),
        (("prompt", "answer"), {"prompt": ["1+1="], "answer": 2}, "prompt", TEXT),
        (("question", "answer"), {"question": 7, "answer": "7"}, "question", TEXT),
        (("prompt", "completion"), {"prompt": "a", "completion": 3}, "completion", TEXT),
        (("prompt", "chosen", "rejected"), {"prompt": "a", "chosen": "b", "rejected": {"x": 1}}, "rejected", TEXT),
    ],
)
def test_a_record_of_the_wrong_type_names_the_file_the_line_and_the_field(schema, record, field, needs, tmp_path):
    path = tmp_path / "data.jsonl"
    good = {k: "1" for k in schema}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    schemas = [schema] + ([("question", "answer")] if schema == ("prompt", "answer") else [])
    with pytest.raises(SystemExit) as stop:
        grpo.read_jsonl(str(path), *schemas)
    message = str(stop.value)
    assert message.startswith(f"error: --dataset {path}: line 2: field {field!r} holds ") and message.endswith(
        f"; it needs {needs}"
    ), message


def test_answers_may_be_finite_numbers_and_nan_is_refused(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "1.5+1=", "answer": 2.5}\n')
    assert [r["answer"] for r in grpo.read_jsonl(str(path), ("prompt", "answer"))] == [2, 2.5]
    path.write_text('{"prompt": "1+1=", "answer": NaN}\n')  # Python's json reads NaN; it is no answer
    with pytest.raises(SystemExit, match="line 1: field 'answer' holds NaN"):
        grpo.read_jsonl(str(path), ("prompt", "answer"))


def test_a_script_stops_on_a_null_field_with_one_line(tmp_path):
    """As a user runs it: the RL file's dataset holds a record whose prompt is null."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 3 + '{"prompt": null, "answer": "2"}\n')
    proc = run_script(
        "scale/grpo.py", "--dataset", str(path), "--num-eval", "1", "--output-dir", str(tmp_path / "o"), expect_ok=False
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --dataset {path}: line 4: field 'prompt' holds null; it needs " + TEXT
    )


def test_a_failure_to_write_metrics_or_the_model_names_the_folder(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    grpo.reduce_and_log(str(out), 0, {"eval/accuracy": 0.5})
    os.remove(out / "metrics.jsonl")
    os.mkdir(out / "metrics.jsonl")  # the file cannot be opened for writing now
    with pytest.raises(SystemExit, match=rf"^error: --output-dir {out}: cannot write its metrics \(Is a directory\)"):
        grpo.reduce_and_log(str(out), 1, {"eval/accuracy": 0.5})
    model = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    (tmp_path / "a_file").write_text("")  # the run's folder is gone, and a file stands where it was made
    with pytest.raises(SystemExit, match=r"^error: --output-dir .*a_file/run: cannot save the model there"):
        grpo.save(model, tokenizer, str(tmp_path / "a_file" / "run"))


def test_a_new_score_head_is_one_line_and_any_other_load_problem_still_shows(tmp_path, capsys, caplog):
    """On a language model's checkpoint the score head is new: one line of ours, no load report. A checkpoint that
    also lacks another weight gets a line naming every missing weight; a reward model's own checkpoint gets none."""
    args, cpu = ppo.Args(dtype="float32"), torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    model = ppo.load_scorer(os.path.join(ROOT, "tiny-adder"), args, cpu, "the value model", tokenizer)
    out = capsys.readouterr().out
    assert out.count("the value model: a new score head on") == 1 and "LOAD REPORT" not in caplog.text + out
    assert model.score.weight.shape[0] == 1
    broken = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    state = {k: v for k, v in broken.state_dict().items() if k != "model.norm.weight"}
    broken.save_pretrained(tmp_path / "broken", state_dict=state)
    ppo.load_scorer(str(tmp_path / "broken"), args, cpu, "the value model", tokenizer)
    out = capsys.readouterr().out
    assert "a new score head" not in out and "model.norm.weight" in out and "score.weight" in out
    scorer = AutoModelForSequenceClassification.from_pretrained(os.path.join(ROOT, "tiny-adder"), num_labels=1)
    scorer.save_pretrained(tmp_path / "rm")
    caplog.clear()
    capsys.readouterr()
    ppo.load_scorer(str(tmp_path / "rm"), args, cpu, "the reward model", tokenizer)
    assert capsys.readouterr().out == "" and "LOAD REPORT" not in caplog.text
