"""Asynchronous GRPO on the bundled task: synchronous training against a generator that runs eta = 1, 2, 4 versions
ahead, each with and without the decoupled objective, and at eta = 1, 2 with AReaL's interruption (a rollout moves
to the next version every 2 tokens), over several seeds; grpo.py's default beside them.

Each run is `python scale/async_grpo.py --seed S --output-dir ...` (or scale/grpo.py), one at a time, as a user runs
it. The script then reads every run's metrics.jsonl and writes, from nothing, the block between the two `results`
marker lines of docs/async_grpo.md (the table) and docs/async_grpo.png (held-out accuracy against step and against
wall-clock seconds).

    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/async_benchmark.py                        # 10 rows x 3 seeds: 30 runs
    python benchmarks/async_benchmark.py --rows eta1 eta1-interrupt2 eta2 eta2-interrupt2 --out-dir /tmp/interrupt
    python benchmarks/async_benchmark.py --seeds 1 --rows sync eta2 --num-steps 20 --runs-dir /tmp/a --out-dir /tmp/a

A run that already finished in --runs-dir with the same command is read, not run again (delete its folder to
run it again).
"""

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (file, flags). "sync" is async_grpo.py with eta 0: the generator never runs ahead (the same metrics as
# grpo.py with the same seed, tests/test_async_grpo.py); "-coupled" centres the clip on pi_behav (--no-decoupled)
ROWS = {
    "grpo.py": ("scale/grpo.py", []),
    "sync": ("scale/async_grpo.py", ["--max-staleness", "0"]),
    **{
        f"eta{eta}{suffix}": ("scale/async_grpo.py", ["--max-staleness", str(eta), *flags])
        for eta in (1, 2, 4)
        for suffix, flags in (("", []), ("-coupled", ["--no-decoupled"]))
    },
    # "-interrupt2": --interrupt-every 2, a rollout in flight moves to the next version every 2 tokens
    **{
        f"eta{eta}-interrupt2": ("scale/async_grpo.py", ["--max-staleness", str(eta), "--interrupt-every", "2"])
        for eta in (1, 2)
    },
}
MARK_START, MARK_END = "<!-- results: written by benchmarks/async_benchmark.py -->", "<!-- end of results -->"


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # a run of every row for each seed
    rows: list[str] = field(default_factory=lambda: list(ROWS))  # which rows (see ROWS)
    num_steps: int | None = None  # None: the files' default (300)
    runs_dir: str = os.path.join(ROOT, "runs", "async-benchmark")  # where the runs go (and are found again)
    out_dir: str = os.path.join(ROOT, "docs")  # where async_grpo.md's results and async_grpo.png are written


def fail(message):
    raise SystemExit(f"error: {message}")


def run(name, seed, args):
    """The run's metrics (a list of dicts) and wall seconds, running it unless it finished with this command."""
    script, flags = ROWS[name]
    out = os.path.join(os.path.abspath(args.runs_dir), f"{name}__{seed}")
    steps = [] if args.num_steps is None else ["--num-steps", str(args.num_steps)]
    return run_once(f"{name} seed {seed}", [script, "--seed", str(seed), *flags, *steps, "--output-dir", out], out)


def run_once(label, command, out):
    """`python *command` from the repository root, its output in out.log, unless out.json says that it finished with
    this command and the same data (the content of the .jsonl files it names); then (the run's metrics, its wall
    seconds). process_, tool_, dapo_, distill_benchmark.py and distill_chain.py use it too."""
    record_path = out + ".json"
    data = {a: hashlib.sha256(open(a, "rb").read()).hexdigest() for a in command if a.endswith(".jsonl")}
    if os.path.exists(record_path):
        with open(record_path) as f:
            record = json.load(f)
        if record["command"] == command and record.get("data") == data:
            print(f"{label}: read from {out}", flush=True)
            return read_metrics(out), record["wall_seconds"]
    if os.path.exists(out):
        subprocess.run(["rm", "-rf", out], check=True)
    print(f"{label}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(out + ".log", "w") as log:
        proc = subprocess.run([sys.executable, *command], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        fail(f"{label} failed (exit {proc.returncode}); see {out}.log")
    with open(record_path, "w") as f:
        json.dump({"command": command, "data": data, "wall_seconds": wall}, f)
    return read_metrics(out), wall


def write_block(path, start, end, block):
    """Puts block (which begins with start and ends with end) in the page at path in place of the old one, or at
    its end; the rest of the page stays as it is."""
    page = ""
    if os.path.exists(path):
        with open(path) as f:
            page = f.read()
    if start in page:
        page = page[: page.index(start)] + block + page[page.index(end) + len(end) :]
    else:
        page = page.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(page)


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mean_std(values, digits=1):
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def row_cells(name, runs):
    """One table row from the runs of the seeds: each number the mean (± std) over the seeds of a per-run value."""
    first = [100 * [m for m in r if "eval/accuracy" in m][0]["eval/accuracy"] for r, _ in runs]
    last = [100 * [m for m in r if "eval/accuracy" in m][-1]["eval/accuracy"] for r, _ in runs]
    steps = [[m for m in r if "charts/step_time" in m] for r, _ in runs]  # the logged training steps

    def per_run(key, reduce=statistics.mean):
        return [reduce([m[key] for m in s]) for s in steps] if all(key in s[0] for s in steps) else None

    stale, stale_max = per_run("charts/staleness"), per_run("charts/staleness_max", max)
    weight, capped, wait = per_run("losses/behav_weight"), per_run("losses/behav_capped"), per_run("charts/wait_time")
    return [
        name,
        f"{mean_std(first)} → {mean_std(last)}",
        "—" if stale is None else f"{statistics.mean(stale):.2f} / {max(stale_max):.0f}",
        "—"
        if weight is None or name.endswith("-coupled")
        # the coupled objective weighs nothing
        else f"{statistics.mean(weight):.4f} / {100 * statistics.mean(capped):.2f}%",
        mean_std(per_run("charts/step_time"), 3),
        mean_std(per_run("charts/generation_time"), 3),
        "—" if wait is None else mean_std(wait, 3),
        mean_std([w for _, w in runs], 0),
    ]


def version_mix(name, runs):
    """For a row with --interrupt-every: the share of the tokens each version sampled, by lag, the versions in a
    completion and the switches a batch saw, each the mean over the logged steps and the seeds; else None."""
    steps = [m for r, _ in runs for m in r if "charts/switches" in m]
    if not steps:
        return None
    lags = sorted({int(k.rsplit("lag", 1)[1]) for m in steps for k in m if k.startswith("charts/token_share_lag")})
    shares = [100 * statistics.mean(m.get(f"charts/token_share_lag{d}", 0.0) for m in steps) for d in lags]
    return (
        f"{name}: of the tokens, "
        + ", ".join(f"{share:.1f}% sampled {d} version(s) old" for d, share in zip(lags, shares))
        + f" (a token's lag {statistics.mean(m['charts/token_staleness'] for m in steps):.2f} versions on average);"
        f" {statistics.mean(m['charts/versions_per_completion'] for m in steps):.2f} versions in a completion"
        f" (at most {max(m['charts/versions_per_completion_max'] for m in steps):.0f}),"
        f" {statistics.mean(m['charts/switches'] for m in steps):.2f} switches a batch."
    )


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors, markers = plt.get_cmap("tab10"), "os^vDP*X"  # every line its own colour and marker
    for i, (name, runs) in enumerate(results.items()):
        curves = [[m for m in r if "eval/accuracy" in m] for r, _ in runs]
        n = min(len(c) for c in curves)
        steps = [c["step"] for c in curves[0][:n]]
        accuracy = [statistics.mean(100 * c[j]["eval/accuracy"] for c in curves) for j in range(n)]
        seconds = [statistics.mean(c[j].get("charts/elapsed_time", 0.0) for c in curves) for j in range(n)]
        style = {
            "marker": markers[i % len(markers)],
            "markersize": 4,
            "color": colors(i % 10),
            "label": name,
            "linestyle": "--" if name.endswith("-coupled") else "-",
        }
        axes[0].plot(steps, accuracy, **style)
        axes[1].plot(seconds, accuracy, **style)
    for ax, xlabel in zip(axes, ("training step", "wall-clock seconds of training (evaluations included)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"async_grpo.py on the addition task, the mean over {len(next(iter(results.values())))} seed(s): "
        "eta = versions the generator may run ahead; -coupled: --no-decoupled"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine_line():
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return (
        f"{cpu}, {os.cpu_count()} cores, no GPU; Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def main(args):
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        fail(f"--rows {' '.join(unknown)}: no such row; the rows are {' '.join(ROWS)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("matplotlib is missing: pip install -r benchmarks/requirements.txt")
    os.makedirs(args.runs_dir, exist_ok=True)
    start = time.time()
    results = {name: [run(name, seed, args) for seed in args.seeds] for name in args.rows}
    header = [
        "row",
        "held-out accuracy, step 0 → last (%)",
        "staleness mean / max (versions)",
        "pi_prox/pi_behav mean / left out",
        "s per step",
        "generation s per batch",
        "trainer wait s per step",
        "wall s",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row_cells(name, runs)) + " |" for name, runs in results.items()]
    mixes = [mix for mix in (version_mix(name, runs) for name, runs in results.items()) if mix]
    if mixes:
        lines += ["", "Versions in the interrupted rows' batches (staleness above: a batch's first version):", ""]
        lines += [f"- {mix}" for mix in mixes]
    total = sum(w for runs in results.values() for _, w in runs)
    block = "\n".join(
        [
            MARK_START,
            "",
            f"Measured by `python benchmarks/async_benchmark.py` ({len(args.seeds)} seed(s): "
            f"{' '.join(map(str, args.seeds))};"
            f" {sum(len(r) for r in results.values())} runs, {total / 60:.0f} min of runs, one at a time) on "
            f"{machine_line()}. Mean ± std over the seeds; staleness, weights and times are the means over the logged "
            "steps of each run (the max: the largest lag any logged step saw).",
            "",
            *lines,
            "",
            "![held-out accuracy against step and wall-clock time](async_grpo.png)",
            "",
            MARK_END,
        ]
    )
    os.makedirs(args.out_dir, exist_ok=True)
    page = os.path.join(args.out_dir, "async_grpo.md")
    text = open(page).read() if os.path.exists(page) else f"# async_grpo.py\n\n{MARK_START}\n{MARK_END}\n"
    if MARK_START not in text or MARK_END not in text:
        fail(f"{page}: the results marker lines are missing; put them back where the results go")
    before, rest = text.split(MARK_START, 1)
    with open(page, "w") as f:
        f.write(before + block + rest.split(MARK_END, 1)[1])
    plot(results, os.path.join(args.out_dir, "async_grpo.png"))
    print("\n".join(lines))
    print(f"wrote {page} and async_grpo.png in {(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    main(tyro.cli(Args))
