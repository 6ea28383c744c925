"""The benchmark command's quick variant, run as the README says, and what it writes."""

import importlib
import json
import os
import re
import shlex
import shutil
import struct
import sys

import pytest
from conftest import ROOT, read_metrics, run_script
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import benchmark  # noqa: E402
from benchmark import REAL_COMMON, REAL_FLAGS  # noqa: E402

# the quick benchmark's rows that this file runs: the bundled model's pipeline and every kind of row (rloo, gspo and
# cispo are grpo's rows in another file: their quick commands are parsed below, and test_scripts runs their defaults;
# rloo.py and dpo.py run on the real model in test_real_model.py)
BUNDLED = [
    "sft",
    "grpo",
    "ppo",
    "dpo",
    "reward_model",
    "ppo-learned-rm",
    "reward_model-one-pair",
    "ppo-learned-rm-one-pair",
]
REWARD_MODELS = ("reward_model", "reward_model-one-pair")
REAL = ["grpo-smollm2", "grpo-smollm2-bf16"]  # SmolLM2-135M-Instruct, --task addition-question; the second is the
# first with --dtype bfloat16
ALGORITHMS = BUNDLED + REAL
ONLINE = ["grpo", "ppo", "ppo-learned-rm", "ppo-learned-rm-one-pair", "grpo-smollm2", "grpo-smollm2-bf16"]


# each process of the quick benchmark (a run, the real model's conversion, a memory case) has this budget, which
# benchmark.py enforces; the longest took well under it on a 2-core machine with its other core busy
RUN_BUDGET = 600


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    # the budget is per process; the whole command's limit is only a backstop far beyond the sum of its runs
    proc = run_script(
        "benchmarks/benchmark.py",
        "--quick",
        "--algorithms",
        *ALGORITHMS,
        "--run-timeout",
        str(RUN_BUDGET),
        "--runs-dir",
        str(out / "runs"),
        "--out-dir",
        str(out),
        timeout=4 * 3600,
    )
    with open(out / "results.md") as f:
        return out, f.read(), proc.stdout


def table_rows(text, heading):
    """The rows of the first table after a heading, each a list of its cells."""
    rows = []
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and the separator


@pytest.mark.long
def test_every_algorithm_has_a_row_that_matches_its_metrics(quick):
    out, text, _ = quick
    rows = {row[0]: row for row in table_rows(text, "## Every algorithm on the bundled task")}
    assert list(rows) == BUNDLED
    real_rows = {row[0]: row for row in table_rows(text, "## A real pretrained chat model: SmolLM2-135M-Instruct")}
    assert list(real_rows) == REAL
    rows.update(real_rows)
    for name in ALGORITHMS:
        with open(out / "runs" / f"{name}__1" / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f]
        accuracy = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
        _, acc_cell, best_cell, pair_cell, wall, peak, tokens = rows[name]
        if accuracy:  # one seed: the numbers themselves, in %
            assert acc_cell == f"{100 * accuracy[0]:.1f} → {100 * accuracy[-1]:.1f}"
            assert best_cell == f"{100 * max(accuracy):.1f}"
        else:
            assert name in REWARD_MODELS and acc_cell == "—"
        pairs = [m["eval/pair_accuracy"] for m in metrics if "eval/pair_accuracy" in m]
        assert (pair_cell != "—") == (name in ("dpo", "dpo-smollm2", *REWARD_MODELS))
        if pairs:
            assert pair_cell == f"{100 * pairs[0]:.1f} → {100 * pairs[-1]:.1f}"
        with open(out / "runs" / f"{name}__1.json") as f:
            record = json.load(f)
        assert wall == f"{record['wall_seconds']:.0f}" and float(wall) > 0
        assert 0.1 < float(peak) < 24  # GB: a python process with torch, less than the machine has
        # the mean of the logged steps' tokens/s, as the run logged it (a slow bfloat16 row on a CPU without bfloat16
        # instructions can round to 0)
        speeds = [m["charts/tokens_per_sec"] for m in metrics if "charts/tokens_per_sec" in m]
        assert tokens == f"{sum(speeds) / len(speeds):.0f}" and min(speeds) > 0


@pytest.mark.parametrize("name", benchmark.ALGORITHMS)
def test_every_quick_command_is_a_valid_command_of_its_file(name):
    """Each row's --quick command, as run_algorithm builds it, parses with its file's flags (the rows the fixture
    does not run included)."""
    import tyro

    module = importlib.import_module(f"scale.{name.split('-')[0]}")  # the benchmark runs the scale tier
    argv = [
        "--seed",
        "1",
        "--output-dir",
        "out",
        *(REAL_COMMON + REAL_FLAGS[name] if name in REAL_FLAGS else []),
        *(["--vllm"] if name.endswith("-vllm") else []),
        *benchmark.ONE_PAIR_FLAGS.get(name, []),
        *(["--reward-model-path", "rm"] if name in benchmark.REWARD_MODEL_OF else []),
        *benchmark.QUICK_COMMON,
        *benchmark.QUICK_FLAGS[name],
    ]
    args = tyro.cli(module.Args, args=argv)
    assert args.seed == 1 and args.num_steps == (1 if name in REAL_FLAGS else 4)
    assert args.num_eval == (2 if name in REAL_FLAGS else 8)  # a row's own flags win over the common ones


@pytest.mark.long
def test_every_run_saved_a_model_that_loads(quick):
    """What the README's test runs for a command: the saved model loads, the arguments are recorded."""
    out, _, _ = quick
    for name in ALGORITHMS:
        run = out / "runs" / f"{name}__1"
        model_class = AutoModelForSequenceClassification if name in REWARD_MODELS else AutoModelForCausalLM
        assert model_class.from_pretrained(run).num_parameters() > 0
        args = json.loads((run / "args.json").read_text())
        steps = 1 if name in REAL else 4  # --quick: 4 steps of the bundled model, 1 of the real one
        assert args["seed"] == 1 and args["num_steps"] == steps
        assert read_metrics(str(run))[-1]["step"] == steps
        if name in REAL:  # SmolLM2-135M-Instruct: its tokenizer comes back with the chat template
            assert args["task"] == "addition-question" and args["model_name_or_path"] == "SmolLM2-135M-Instruct"
            tokenizer = AutoTokenizer.from_pretrained(run)
            assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.long
def test_the_time_breakdown_adds_up(quick):
    _, text, _ = quick
    rows = table_rows(text, "## Where a training step's time goes")
    assert [row[0] for row in rows] == ONLINE
    for name, step_ms, *shares, logged in rows:
        percents = [int(s.rstrip("%")) for s in shares]
        assert float(step_ms) > 0 and int(logged) == (1 if name in REAL else 4)  # --quick: every step logged
        assert all(p >= 0 for p in percents) and abs(sum(percents) - 100) <= 3  # rounding of four shares
        assert percents[0] > 0 and percents[2] > 0  # every online step samples and trains


@pytest.mark.long
def test_the_bfloat16_rows_compare_the_same_command_in_two_dtypes(quick):
    """grpo-smollm2-bf16 is grpo-smollm2 with --dtype bfloat16 and nothing else, and its row's numbers are its runs'."""
    out, text, _ = quick
    rows = {row[0]: row for row in table_rows(text, "## bfloat16 compute on this CPU")}
    assert list(rows) == ["grpo-smollm2", "grpo-smollm2-bf16"]
    assert [rows[name][1] for name in rows] == ["float32", "bfloat16"]
    args = {name: json.loads((out / "runs" / f"{name}__1" / "args.json").read_text()) for name in rows}
    differs = {k for k in args["grpo-smollm2"] if args["grpo-smollm2"][k] != args["grpo-smollm2-bf16"][k]}
    assert differs == {"dtype", "output_dir", "run_name"} and args["grpo-smollm2-bf16"]["dtype"] == "bfloat16"
    for name, row in rows.items():
        steps = [m for m in read_metrics(str(out / "runs" / f"{name}__1")) if "charts/step_time" in m]
        assert float(row[2]) == pytest.approx(sum(m["charts/step_time"] for m in steps) / len(steps), abs=0.006)
        assert sum(float(x) for x in row[3:6]) <= float(row[2]) + 0.02  # the phases lie within the step
    assert re.search(r"This CPU's bfloat16 instructions: ([a-z0-9_]+(, )?)+\.", text)


@pytest.mark.long
def test_the_memory_cases_compute_the_same_log_probs(quick):
    _, text, _ = quick
    rows = table_rows(text, "## Memory of the log-prob computation")
    cases = [(r[0], r[1].startswith("forward"), r[2]) for r in rows]
    assert cases == [
        ("plain", False, "float32"),
        ("chunked", False, "float32"),
        ("plain", True, "float32"),
        ("chunked", True, "float32"),
        ("plain", True, "bfloat16"),
        ("chunked", True, "bfloat16"),
    ]
    # the same sum of log-probs for the same weights, whichever way it was computed: equal up to float rounding
    # (the two ways sum in another order) and the page's one decimal
    for dtype in ("float32", "bfloat16"):
        sums = [float(r[6]) for r in rows if r[2] == dtype]
        assert max(sums) - min(sums) <= 0.1 + 1e-5 * max(abs(x) for x in sums), (dtype, sums)
    assert all(float(r[3]) > 0 for r in rows)
    assert "Chunked against plain, same gradient and weights: without gradient, float32:" in text


@pytest.mark.parametrize("figure", ["learning_curves.png", "overoptimisation.png"])
@pytest.mark.long
def test_the_figures_are_pngs(quick, figure):
    out, text, _ = quick
    assert f"]({figure})" in text
    with open(out / figure, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 800 and height > 300


@pytest.mark.long
def test_the_one_pair_rows_run_the_old_setting(quick):
    """The over-optimisation figure's old setting is the pipeline's flags before: one pair, raw score, fixed beta."""
    out, _, _ = quick
    args = {
        name: json.loads((out / "runs" / f"{name}__1" / "args.json").read_text())
        for name in ("reward_model", "reward_model-one-pair", "ppo-learned-rm", "ppo-learned-rm-one-pair")
    }
    assert (args["reward_model"]["pairs"], args["reward_model"]["chosen"]) == ("all", "sample-or-answer")
    assert (args["reward_model-one-pair"]["pairs"], args["reward_model-one-pair"]["chosen"]) == ("first", "answer")
    new, old = args["ppo-learned-rm"], args["ppo-learned-rm-one-pair"]
    assert new["reward_model_path"].endswith("reward_model__1") and new["kl_target"] == 0.5 and new["normalize_reward"]
    assert old["reward_model_path"].endswith("reward_model-one-pair__1")
    assert old["kl_target"] == 0 and not old["normalize_reward"] and old["learning_rate"] == 1e-4
    metrics = read_metrics(str(out / "runs" / "ppo-learned-rm__1"))
    assert all("charts/kl_coef" in m for m in metrics[1:])


@pytest.mark.long
def test_the_page_says_which_machine_and_date(quick):
    _, text, _ = quick
    assert re.search(r"- Date: \d{4}-\d\d-\d\d( to \d{4}-\d\d-\d\d)? \(UTC\)", text)  # a run over midnight: two
    assert re.search(r"- Machine: .*\d+ cores, \d+ GiB of memory", text)
    assert "- Start model: the bundled `tiny-adder/`, 527,232 parameters; and a real one" in text
    assert "(134,515,008 parameters)" in text
    assert "--quick" in text and "they measure nothing" in text


@pytest.mark.long
def test_a_finished_run_is_read_again_only_for_the_same_command(quick, tmp_path):
    out, _, _ = quick
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("sft", "grpo"):
        shutil.copytree(out / "runs" / f"{name}__1", runs / f"{name}__1")
        record = json.loads((out / "runs" / f"{name}__1.json").read_text())
        record["command"] = [
            str(runs / f"{name}__1") if a == str(out / "runs" / f"{name}__1") else a for a in record["command"]
        ]  # the copy's own folder
        if name == "grpo":
            record["command"][record["command"].index("--num-eval") + 1] = "10"  # a different command
        (runs / f"{name}__1.json").write_text(json.dumps(record))
    proc = run_script(
        "benchmarks/benchmark.py",
        "--quick",
        "--algorithms",
        "sft",
        "grpo",
        "--no-measure-memory",
        "--runs-dir",
        str(runs),
        "--out-dir",
        str(tmp_path),
    )
    assert "sft seed 1: finished before" in proc.stdout
    assert "grpo seed 1: scale/grpo.py --seed 1" in proc.stdout  # run again: its record was another command's
    command = json.loads((runs / "grpo__1.json").read_text())["command"]
    assert command[command.index("--num-eval") + 1] == "8"  # --quick's --num-eval
    text = (tmp_path / "results.md").read_text()
    assert "| sft |" in text and "## Memory" not in text and "log-prob memory" not in proc.stdout


def test_a_run_over_its_budget_is_stopped_and_named(tmp_path):
    proc = run_script(
        "benchmarks/benchmark.py",
        "--quick",
        "--algorithms",
        "sft",
        "--no-measure-memory",
        "--run-timeout",
        "0.5",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--out-dir",
        str(tmp_path),
        expect_ok=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: sft seed 1 took more than --run-timeout 0.5 s and was stopped "
        f"(its log: {tmp_path / 'runs' / 'sft__1'}.log)"
    )
    assert not os.path.exists(tmp_path / "results.md") and not os.path.exists(tmp_path / "runs" / "sft__1.json")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--algorithms", "trpo"], "--algorithms: unknown trpo"),
        (["--run-timeout", "0"], "--run-timeout 0.0: give a number of seconds above 0"),
        (["--algorithms", "ppo-learned-rm", "--quick"], "needs the reward_model run of that seed"),
        (["--seeds", "1", "1"], "--seeds: give one or more different seeds"),
        (["--real-seeds", "2", "2"], "--real-seeds: give one or more different seeds"),
    ],
)
def test_bad_input_stops_with_one_line(flags, message, tmp_path):
    proc = run_script(
        "benchmarks/benchmark.py",
        *flags,
        "--runs-dir",
        str(tmp_path / "runs"),
        "--out-dir",
        str(tmp_path),
        expect_ok=False,
    )
    assert proc.returncode == 1
    assert message in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert not os.path.exists(tmp_path / "results.md")


def test_the_readme_defaults_are_among_the_benchmark_runs():
    """test_scripts.py leaves the README's bare defaults to this file: each must be a benchmark run."""
    from test_scripts import readme_commands

    bare = {c.split()[1] for c in readme_commands() if re.fullmatch(r"python \w+\.py", c)}  # the plain files
    # async_grpo.py's default has its own benchmark (benchmarks/async_benchmark.py), and test_async_grpo.py runs it
    # for 40 steps; so have process_grpo.py's and tool_grpo.py's (benchmarks/process_benchmark.py and
    # tool_benchmark.py), which test_scripts.py and test_tool_grpo.py run for 10 and 5; dapo.py's (dapo_benchmark.py),
    # which test_learns runs for 10; distill.py's (distill_benchmark.py), which test_distill.py runs for 2 with its
    # default teacher (and 20 steps from a noisy student, where accuracy must climb); env_grpo.py's, whose three
    # seeds docs/env_grpo.md gives with their commands, and which test_plain.py and test_scripts.py run for 30
    own = {"async_grpo.py", "process_grpo.py", "tool_grpo.py", "dapo.py", "distill.py", "env_grpo.py"}
    assert "grpo.py" in bare and bare <= {f"{name.split('-')[0]}.py" for name in benchmark.ALGORITHMS} | own


def test_the_readme_real_model_commands_are_the_benchmark_runs():
    """The README's real-model commands are the ones whose numbers results.md gives, flag for flag."""
    from test_scripts import readme_commands

    # the README gives GRPO's, docs/smollm2.md the others, docs/gpu.md the bfloat16 one; docs/distill.md GRPO's
    # again with an output folder (its teacher), then distill.py's, which test_real_model.py runs
    readme = sorted(
        {
            tuple([os.path.basename(argv[0]), *(argv[1:-2] if argv[-2] == "--output-dir" else argv[1:])])
            for argv in (shlex.split(c)[1:] for c in readme_commands() if "--task addition-question" in c)
            if os.path.basename(argv[0]) != "distill.py"
        }
    )
    expected = sorted(
        tuple([f"{name.split('-')[0]}.py"] + REAL_COMMON + flags)
        for name, flags in REAL_FLAGS.items()
        if not name.endswith("-vllm")
    )
    assert readme == expected
    # and the --vllm ones, in docs/vllm.md's `shell` block (run in vLLM's own environment)
    readme = [shlex.split(c)[1:] for c in readme_commands("shell") if "--task addition-question" in c]
    readme = [[os.path.basename(argv[0]), *argv[1:]] for argv in readme]
    expected = [
        [f"{name.split('-')[0]}.py"] + REAL_COMMON + flags + ["--vllm"]
        for name, flags in REAL_FLAGS.items()
        if name.endswith("-vllm")
    ]
    assert readme == expected


def test_a_benchmark_run_is_read_again_only_with_the_same_command_and_data(tmp_path):
    """async_benchmark.run_once, which the benchmarks share: a run that finished is read again for the same command,
    and run again, in a fresh folder, once a .jsonl the command names holds other records."""
    import async_benchmark

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n' * 40)
    out = str(tmp_path / "run")
    command = ["scale/sft.py", "--model-name-or-path", "tiny-adder", "--dataset", str(data), "--num-steps", "1"]
    command += ["--num-eval", "4", "--eval-every", "1", "--output-dir", out]
    metrics = tmp_path / "run" / "metrics.jsonl"
    async_benchmark.run_once("sft", command, out)
    first = metrics.stat().st_mtime_ns
    async_benchmark.run_once("sft", command, out)
    assert metrics.stat().st_mtime_ns == first  # read again
    data.write_text('{"prompt": "1+1=", "completion": "3"}\n' * 40)
    async_benchmark.run_once("sft", command, out)
    assert metrics.stat().st_mtime_ns != first  # run again


def test_in_turn_finds_the_phase_a_change_slowed(tmp_path, capsys):
    """benchmarks/in_turn.py against a copy of grpo.py whose sample() first sleeps 50 ms: the rollouts' ratio (this
    file's over the copy's) falls well below 1, and every phase is printed with its rounds (the first warms up)."""
    import in_turn

    slowed = tmp_path / "grpo.py"
    source = open(os.path.join(ROOT, "scale/grpo.py")).read()
    wrapper = "\n_sample = sample\n\n\ndef sample(*args, **kwargs):\n    time.sleep(0.05)\n"
    wrapper += "    return _sample(*args, **kwargs)\n"
    slowed.write_text(source.replace('\nif __name__ == "__main__":', wrapper + '\nif __name__ == "__main__":'))
    in_turn.main(in_turn.Args(vs=str(slowed), prompts=2, group_size=2, micro_batch_size=2, max_new_tokens=4, rounds=3))
    out = capsys.readouterr().out
    found = dict(re.findall(r"^(rollouts|reference's log-probs|update): .* ratio ([\d.]+) .*, 2 rounds$", out, re.M))
    assert set(found) == {"rollouts", "reference's log-probs", "update"}, out
    assert float(found["rollouts"]) < 0.9, out
    for bad, flag in ((dict(vs=str(tmp_path / "none.py")), "--vs"), (dict(vs=str(slowed), rounds=1), "--rounds")):
        with pytest.raises(SystemExit, match=flag):
            in_turn.main(in_turn.Args(**bad))
