"""Checkpoints and resume: a run killed (SIGKILL, or stopped at the same place) after its checkpoint and resumed
ends where an uninterrupted run ends, in every file; bad --resume-from input stops with one line and leaves the
run's folder as it was."""

import json
import os
import re
import shlex
import shutil

import pytest
import torch
from conftest import ROOT, read_metrics, run_here, run_script
from safetensors.torch import load_file
from test_flags import run_harness
from test_scripts import TIMING_KEYS
from transformers import AutoModelForSequenceClassification, AutoTokenizer

# runs a file's main() as `python file ...` does, and kills its own process (SIGKILL: no clean-up, no flush) right
# after the step KILL_AFTER_STEP is logged: every process of a torchrun run does, after that step's collectives
KILLED = """
import os, runpy, signal, sys
sys.argv = sys.argv[1:]
found = runpy.run_path(sys.argv[0], run_name="harness")  # defines everything; main() is not called
run = found["main"].__globals__
log = run["reduce_and_log"]

def log_then_die(output_dir, step, *logged):
    log(output_dir, step, *logged)
    if step == int(os.environ["KILL_AFTER_STEP"]):
        os.kill(os.getpid(), signal.SIGKILL)

run["reduce_and_log"] = log_then_die
run["main"](found["tyro"].cli(found["Args"]))
"""

# 4 steps, a checkpoint every 2, evaluations at 0, 2 and 4; the killed run dies after step 3 is logged
STEPS = ["--num-steps", "4", "--save-every", "2", "--log-every", "1", "--eval-every", "2"]
SAMPLING = (
    "scale/grpo.py",
    "scale/async_grpo.py",
    "scale/rloo.py",
    "scale/gspo.py",
    "scale/cispo.py",
    "scale/ppo.py",
    "scale/process_grpo.py",
    "scale/tool_grpo.py",
    "scale/dapo.py",
    "scale/distill.py",
    "scale/env_grpo.py",
)  # they log rollouts too
RL = ["--prompts-per-step", "4", "--micro-batch-size", "8", "--num-eval", "20", "--max-new-tokens", "6"]
PAIRS = [
    "--batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--num-train-prompts",
    "16",
    "--pair-samples",
    "2",
    "--num-eval",
    "20",
]
FLAGS = {  # several optimizer steps per batch where the file has them: the AdamW state must come back too
    "scale/grpo.py": RL + ["--group-size", "4", "--num-iterations", "2", "--num-minibatches", "2"],
    # eta 1: batch 3, sampled ahead by version 1, is kept in the step-2 checkpoint; batch 4 is sampled after the
    # resume, by version 2, from the random state the checkpoint put back
    "scale/async_grpo.py": RL
    + ["--group-size", "4", "--num-iterations", "2", "--num-minibatches", "2", "--max-staleness", "1"],
    "scale/rloo.py": RL + ["--group-size", "4"],
    # a chain's steps need room: in 6 tokens every completion ends inside its first step, all rewards 0, no update
    "scale/process_grpo.py": RL + ["--group-size", "4", "--num-minibatches", "2", "--max-new-tokens", "16"],
    "scale/dapo.py": RL
    + ["--group-size", "4", "--num-minibatches", "2"],  # its sampled batches' counter comes back too
    # a teacher with the bundled model's tokenizer, trained on another task: the student moves at every step
    "scale/distill.py": RL + ["--group-size", "4", "--num-minibatches", "2", "--teacher-path", "tiny-chainer"],
    "scale/tool_grpo.py": RL
    + ["--group-size", "4", "--num-minibatches", "2", "--max-new-tokens", "24"],  # a call and more
    "scale/gspo.py": RL + ["--group-size", "4", "--num-minibatches", "2"],
    # every secret of the game is a record (--num-eval reads a file's): a few episodes of several turns
    "scale/env_grpo.py": ["--prompts-per-step", "4", "--micro-batch-size", "8", "--group-size", "4"]
    + ["--num-minibatches", "2"],
    "scale/cispo.py": RL + ["--group-size", "4", "--num-minibatches", "2"],
    # a reward model: the KL coefficient adapts and the score's bias is set at step 1, loop state to bring back
    "scale/ppo.py": RL + ["--num-minibatches", "2", "--micro-batch-size", "2", "--reward-model-path", "{rm}"],
    "scale/sft.py": ["--batch-size", "4", "--micro-batch-size", "2", "--num-eval", "4", "--max-new-tokens", "6"],
    "scale/dpo.py": PAIRS,
    "scale/reward_model.py": PAIRS,
}


SAMPLE_KEYS = {
    "rl": ["prompt", "completion", "answer", "reward"],  # sft.py's too: the addition task has answers
    "scale/ppo.py": ["prompt", "completion", "score", "answer", "reward"],
    "scale/dpo.py": ["prompt", "chosen", "rejected", "margin"],
    "scale/reward_model.py": ["prompt", "chosen", "rejected", "chosen_score", "rejected_score"],
    "scale/env_grpo.py": ["record", "episode", "return", "turns"],  # an episode's, its rollouts' too
}
ROLLOUT_KEYS = {"step", "kind", "prompt", "completion", "answer", "reward", "advantage"}


def scorer(path):
    """A reward model with a random head on the bundled model, with its tokenizer."""
    start = os.path.join(ROOT, "tiny-adder")
    AutoModelForSequenceClassification.from_pretrained(start, num_labels=1).save_pretrained(path)
    AutoTokenizer.from_pretrained(start).save_pretrained(path)
    return path


def untimed(metrics):
    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics]


def assert_same_records(a, b):
    """Records (metrics or samples) with the same keys, the same texts and numbers equal to float rounding: two
    processes may round an equal computation differently in the last bits (the kernels follow memory alignment)."""
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for x, y in zip(a, b):
        for k in x:
            if isinstance(x[k], float):
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), (x.get("step"), k)
            else:
                assert x[k] == y[k], (x.get("step"), k)


def assert_resumed_exactly(whole, resumed):
    """The resumed run's folder ends as the uninterrupted one's: the same weights, the same metrics."""
    a, b = (load_file(os.path.join(path, "model.safetensors")) for path in (whole, resumed))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= 1e-6, name
    assert_same_records(untimed(read_metrics(resumed)), untimed(read_metrics(whole)))


# the files killed by a SIGKILL in a process of their own (async_grpo.py's generator thread dies with it); the others
# stop at the same place in the pytest process, which spares a start of torch each
SIGKILLED = ("scale/grpo.py", "scale/async_grpo.py")


@pytest.mark.parametrize("script", list(FLAGS))
def test_a_killed_run_resumes_exactly(script, tmp_path):
    """4 steps without a stop, against a run killed after step 3 and resumed from its step-2 checkpoint with
    `--resume-from <run>` alone: the same weights (to 1e-6) and the same metrics (to float rounding), timings
    aside. Up to its death the killed run logged what the whole run logged (the same seed gives the same metrics in
    a new process); its step-3 line, which the resume writes again, goes (metrics.jsonl keeps steps 0 to 2)."""
    flags = [str(tmp_path / "rm") if f == "{rm}" else f for f in FLAGS[script]] + STEPS
    if script == "scale/ppo.py":
        scorer(str(tmp_path / "rm"))
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    run_script(script, *flags, "--output-dir", whole)
    harness = tmp_path / "killed.py"
    if script in SIGKILLED:
        harness.write_text(KILLED)
        proc = run_script(
            str(harness), script, *flags, "--output-dir", killed, env={"KILL_AFTER_STEP": "3"}, expect_ok=False
        )
    else:  # in this process, which a SIGKILL would end: a SystemExit at the same place stands for it
        harness.write_text(
            KILLED.replace('int(os.environ["KILL_AFTER_STEP"])', "3").replace(
                "os.kill(os.getpid(), signal.SIGKILL)", "raise SystemExit(-9)"
            )
        )
        proc = run_here([str(harness), script, *flags, "--output-dir", killed])
    assert proc.returncode == -9, proc.stderr[-2000:]
    # the README's determinism claim: a second run with the same seed (in a new process for SIGKILLED) logs the same
    # metrics
    assert_same_records(untimed(read_metrics(killed)), untimed(read_metrics(whole))[:4])  # steps 0 to 3
    assert sorted(os.listdir(os.path.join(killed, "checkpoints"))) == ["step_000002"]
    assert not os.path.exists(os.path.join(killed, "model.safetensors"))
    proc = run_script(script, "--resume-from", killed)
    assert f"resuming {killed} from {killed}/checkpoints/step_000002 (step 2)" in proc.stdout
    assert_resumed_exactly(whole, killed)
    assert [m["step"] for m in read_metrics(killed)] == [0, 1, 2, 3, 4]  # step 3 once: the resumed run's
    # at each evaluation (0, 2, 4), up to four held-out prompts or pairs with what the model makes of them, the same as
    # the whole run's; the console showed one
    samples = [json.loads(line) for line in open(os.path.join(killed, "samples.jsonl"))]
    evals = [s for s in samples if s.get("kind", "eval") == "eval"]
    steps = [s["step"] for s in evals]
    assert sorted(set(steps)) == [0, 2, 4] and 1 <= steps.count(0) == steps.count(2) == steps.count(4) <= 4
    assert all(set(s) - {"kind"} == {"step", *SAMPLE_KEYS.get(script, SAMPLE_KEYS["rl"])} for s in evals), evals[0]
    # and, in the files that sample, at each logged step the first rollouts it trained on (docs/training.md)
    rollouts = [s for s in samples if s.get("kind") == "rollout"]
    assert sorted({s["step"] for s in rollouts}) == ([1, 2, 3, 4] if script in SAMPLING else [])
    keys = {"step", "kind", *SAMPLE_KEYS[script]} if script == "scale/env_grpo.py" else ROLLOUT_KEYS
    assert all(set(s) == keys for s in rollouts)
    assert_same_records(samples, [json.loads(line) for line in open(os.path.join(whole, "samples.jsonl"))])
    assert "\n  sample  " in proc.stdout
    # the newest two checkpoints stay, each with the trained model(s) loadable on their own
    assert sorted(os.listdir(os.path.join(killed, "checkpoints"))) == ["step_000002", "step_000004"]
    trained = {"scale/ppo.py": ["policy", "value_model"], "scale/sft.py": ["model"], "scale/reward_model.py": ["model"]}
    for name in trained.get(script, ["policy"]):
        assert os.path.exists(os.path.join(killed, "checkpoints", "step_000004", name, "model.safetensors"))
    # the checkpoint's policy is the final model: the run ended at the checkpoint's step
    final = load_file(os.path.join(killed, "model.safetensors"))
    saved = load_file(
        os.path.join(killed, "checkpoints", "step_000004", trained.get(script, ["policy"])[0], "model.safetensors")
    )
    assert all(torch.equal(final[k], saved[k]) for k in final)
    # and steps 3 and 4 trained it by far more than the 1e-6 the comparison allows: a resume that lost the
    # optimizer state or the weights would show
    earlier = load_file(
        os.path.join(killed, "checkpoints", "step_000002", trained.get(script, ["policy"])[0], "model.safetensors")
    )
    assert max((final[k] - earlier[k]).abs().max().item() for k in final) > 1e-5


def test_a_float16_run_resumes_from_a_checkpoint_written_before_its_loss_scaler(tmp_path, monkeypatch):
    """A checkpoint without the loss scaler's state (written before the scaler was kept, or by a run whose scaler was
    off) resumes a --dtype float16 run with a new scaler: loading its empty state into a scaler that is on raised.
    float16 trains on GPUs only, so here the scaler is made for the CPU and resume() given a float16 model."""
    import functools

    from scale import grpo

    out = str(tmp_path / "run")
    run_script("scale/grpo.py", *FLAGS["scale/grpo.py"], "--num-steps", "1", "--save-every", "1", "--output-dir", out)
    checkpoint = os.path.join(out, "checkpoints", "step_000001")
    rng = torch.load(os.path.join(checkpoint, "rng_0.pt"), weights_only=False)
    assert rng.pop("scaler") == {}  # this run's scaler was off
    torch.save(rng, os.path.join(checkpoint, "rng_0.pt"))
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, "cpu"))  # as on a GPU
    with open(os.path.join(out, "args.json")) as f:
        args = grpo.Args(**{**json.load(f), "dtype": "float32"})
    policy = grpo.load_model(os.path.join(ROOT, "tiny-adder"), args, torch.device("cpu"))
    policy.compute_dtype = torch.float16  # what --dtype float16 makes of it on a GPU
    optimizer = torch.optim.AdamW(policy.parameters())
    step, _ = grpo.resume(checkpoint, {"policy": policy}, optimizer, [])
    assert step == 2 and optimizer.scaler.is_enabled() and optimizer.scaler.get_scale() == 2.0**16


def test_bad_resume_input_stops_with_one_line_and_changes_nothing(tmp_path):
    """A flag that differs from the run's (--output-dir too), another file's run, a checkpoint's folder (whole or cut
    short) in place of the run's, a missing path, fewer steps than done: each one line, status 1, and the folder
    unchanged."""
    save, resume = readme_checkpoint_commands()
    run = str(tmp_path / "run")
    argv = [run if a == "runs/long" else a for a in shlex.split(save)[1:]]
    run_script(
        *argv,
        "--num-steps",
        "3",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "3",
        "--log-every",
        "1",
        *FLAGS["scale/rloo.py"],
    )
    # a checkpoint cut short: its folder never got its final name
    checkpoints = os.path.join(run, "checkpoints")
    shutil.copytree(os.path.join(checkpoints, "step_000003"), os.path.join(checkpoints, "step_000004.partial"))
    os.remove(os.path.join(checkpoints, "step_000004.partial", "trainer_state.json"))
    before = {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(run) for f in fs}
    cases = [
        (
            "scale/grpo.py",
            ["--resume-from", run, "--num-steps", "6", "--learning-rate", "0.5"],
            f"--resume-from {run}: differs from the run: --learning-rate 0.5 (the run's: 0.0001)",
        ),
        (
            "scale/rloo.py",
            ["--resume-from", run, "--num-steps", "6"],
            f"--resume-from {run}: differs from the run: file rloo.py (the run's: grpo.py)",
        ),
        (
            "scale/grpo.py",
            ["--resume-from", os.path.join(checkpoints, "step_000004.partial"), "--num-steps", "6"],
            f"--resume-from {os.path.join(checkpoints, 'step_000004.partial')}: not a run's folder with a whole "
            "checkpoint",
        ),
        (
            "scale/grpo.py",
            ["--resume-from", os.path.join(checkpoints, "step_000002"), "--num-steps", "6"],
            f"--resume-from {os.path.join(checkpoints, 'step_000002')}: not a run's folder with a whole checkpoint",
        ),
        (
            "scale/grpo.py",
            ["--resume-from", str(tmp_path / "nowhere")],
            f"--resume-from {tmp_path / 'nowhere'}: not a run's folder with a whole checkpoint",
        ),
        ("scale/grpo.py", ["--resume-from", run], "--num-steps 3: the checkpoint is at step 3; ask for more steps"),
        (
            "scale/grpo.py",
            ["--resume-from", run, "--num-steps", "6", "--output-dir", str(tmp_path / "elsewhere")],
            f"--resume-from {run}: differs from the run: --output-dir {tmp_path / 'elsewhere'} (the run's: {run})",
        ),
    ]
    # each file's cases in one process (test_flags' harness: a SystemExit's message is the one line that python
    # prints, with status 1; a model built means a check let the case through), and one case as a real process
    results = run_harness(
        {
            script: [script, [argv for s, argv, _ in cases if s == script]]
            for script in ("scale/grpo.py", "scale/rloo.py")
        }
    )
    for script in ("scale/grpo.py", "scale/rloo.py"):
        mine = [(argv, message) for s, argv, message in cases if s == script]
        for (argv, message), (outcome, text) in zip(mine, results[script], strict=True):
            assert outcome == "exit" and text.startswith(f"error: {message}") and "\n" not in text, (argv, text)
    proc = run_script(cases[0][0], *cases[0][1], expect_ok=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {cases[0][2]}"), proc.stderr
    after = {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(run) for f in fs}
    assert after == before
    assert not os.path.exists(tmp_path / "elsewhere")
    # and the README's resume command, given more steps, goes on from step 3 (the cut-short save is cleared away,
    # and so is a metrics line that a crash cut short)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "losses/lo')
    run_script(*[run if a == "runs/long" else a for a in shlex.split(resume)[1:]], "--num-steps", "4")
    assert [m["step"] for m in read_metrics(run)] == [0, 1, 2, 3, 4]  # the line cut short went
    assert sorted(os.listdir(checkpoints)) == ["step_000002", "step_000003", "step_000004"]


def readme_checkpoint_commands():
    """docs/outputs.md's command pair under "Checkpoints and resume": a run that saves, and its resume."""
    with open(os.path.join(ROOT, "docs", "outputs.md")) as f:
        section = f.read().split("## Checkpoints and resume")[1]
    (block,) = re.findall(r"```bash\n(.*?)```", section.split("\n## ")[0].split("\n### ")[0], flags=re.S)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) == 2 and "--save-every" in commands[0] and "--resume-from" in commands[1], commands
    return commands


TORCHRUN = [(script, mode) for script in ("scale/grpo.py", "scale/dpo.py") for mode in ("ddp", "fsdp")]


@pytest.fixture(scope="module")
def torchrun_resumes(tmp_path_factory):
    """Under torchrun (MANY, test_torchrun): in one launch each case's whole run and its killed run, stopped right
    after step 3 is logged on both processes (raising there, which ends the run as a kill would: after that step's
    collectives, before anything else is written); then in a second launch each killed run's resume."""
    from test_torchrun import run_many

    folder, first, resumes = tmp_path_factory.mktemp("torchrun_resume"), {}, {}
    for script, mode in TORCHRUN:
        flags = [script, *FLAGS[script], *STEPS, *(["--fsdp"] if mode == "fsdp" else [])]
        name = f"{os.path.basename(script)}-{mode}"
        first[f"whole-{name}"] = {"argv": flags + ["--output-dir", str(folder / f"whole-{name}")]}
        first[f"killed-{name}"] = {"argv": flags + ["--output-dir", str(folder / f"killed-{name}")], "kill_after": 3}
        resumes[f"resume-{name}"] = {"argv": [script, "--resume-from", str(folder / f"killed-{name}")]}
    results = run_many(first, tmp_path_factory.mktemp("first"))
    killed = {name: [m["step"] for m in read_metrics(folder / name)] for name in first if name.startswith("killed")}
    results.update(run_many(resumes, tmp_path_factory.mktemp("resumes")))
    return folder, results, killed


@pytest.mark.parametrize("script, mode", TORCHRUN)
def test_a_killed_torchrun_run_resumes_exactly(script, mode, torchrun_resumes):
    """The same under torchrun, two gloo processes, with DDP and with --fsdp (each process writes its own shards of
    the weights and AdamW state, and its own random states): both processes stop after step 3, and the resume
    (its flags, --fsdp included, from args.json) ends as the whole run does."""
    folder, results, killed = torchrun_resumes
    name = f"{os.path.basename(script)}-{mode}"
    assert [r["outcome"] for r in results[f"killed-{name}"]] == ["killed", "killed"]
    assert killed[f"killed-{name}"] == [0, 1, 2, 3]
    assert [r["outcome"] for r in results[f"resume-{name}"]] == ["finished", "finished"]
    assert_resumed_exactly(str(folder / f"whole-{name}"), str(folder / f"killed-{name}"))
    state = os.path.join(folder, f"killed-{name}", "checkpoints", "step_000004", "state")
    assert len([f for f in os.listdir(state) if f.endswith(".distcp")]) == 2  # one file of shards per process
