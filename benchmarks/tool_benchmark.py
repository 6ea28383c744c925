"""tool_grpo.py on the bundled multiplication task, with the tool's tokens masked out of the loss and without, over
several seeds.

Each run is `python scale/tool_grpo.py --seed S [--no-mask-tool-tokens] --output-dir ...`, one at a time, as a user runs
it: the same flags, so the same sample budget. The script then reads every run's metrics.jsonl and writes, from
nothing, the block between the two `tool` marker lines of docs/results.md (the table) and docs/tool_grpo.png
(held-out accuracy and tool-call rate against the step).

    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/tool_benchmark.py                        # 2 rows x 3 seeds
    python benchmarks/tool_benchmark.py --seeds 1 --num-steps 4 --runs-dir /tmp/t --out-dir /tmp/t \
        --flags="--prompts-per-step 4 --num-eval 16"

A run that already finished in --runs-dir with the same command is read, not run again (delete its folder to run
it again). benchmarks/benchmark.py keeps the block when it writes results.md anew.
"""

import os
import statistics
import sys
from dataclasses import dataclass, field

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_benchmark import machine_line, mean_std, run_once, write_block  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = {"masked": [], "not masked": ["--no-mask-tool-tokens"]}  # name: tool_grpo.py's flags
MARK_START, MARK_END = "<!-- tool: written by benchmarks/tool_benchmark.py -->", "<!-- end of tool -->"


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # a run of every row for each seed
    num_steps: int | None = None  # None: the file's default
    flags: str = ""  # more flags for every run, as one string (the test makes the runs small with them)
    runs_dir: str = os.path.join(ROOT, "runs", "tool-benchmark")  # where the runs go (and are found again)
    out_dir: str = os.path.join(ROOT, "docs")  # where results.md's block and tool_grpo.png are written


def run(name, seed, args):
    """The run's metrics and wall seconds, running it unless it finished with this command."""
    out = os.path.join(os.path.abspath(args.runs_dir), f"{name.replace(' ', '-')}__{seed}")
    steps = [] if args.num_steps is None else ["--num-steps", str(args.num_steps)]
    command = ["scale/tool_grpo.py", "--seed", str(seed), *ROWS[name], *steps, *args.flags.split(), "--output-dir", out]
    return run_once(f"{name} seed {seed}", command, out)


def evaluations(metrics):
    return [m for m in metrics if "eval/tool_call_rate" in m]


def row(name, runs):
    """A table row: each number the mean (± std) over the seeds of a per-run value."""
    first, last = [evaluations(r)[0] for r, _ in runs], [evaluations(r)[-1] for r, _ in runs]

    def pct(evals, key):
        return [100 * e[key] for e in evals]

    def change(key):
        return f"{mean_std(pct(first, key))} → {mean_std(pct(last, key))}"

    return [
        name,
        change("eval/accuracy"),
        change("eval/tool_call_rate"),
        mean_std(pct(last, "eval/failed_calls")),
        mean_std([e["eval/turns"] for e in last], 2),
        mean_std([w for _, w in runs], 0),
    ]


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, runs) in enumerate(results.items()):
        curves = [evaluations(r) for r, _ in runs]
        n = min(len(c) for c in curves)
        steps = [c["step"] for c in curves[0][:n]]
        for ax, key in zip(axes, ("eval/accuracy", "eval/tool_call_rate")):
            values = [statistics.mean(100 * c[j][key] for c in curves) for j in range(n)]
            ax.plot(steps, values, marker="os"[i % 2], markersize=4, label=f"tool's tokens {name}")
    for ax, label in zip(axes, ("held-out accuracy (%)", "held-out completions that call the tool (%)")):
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"tool_grpo.py on 3-digit x 2-digit products, the mean over {len(next(iter(results.values())))} seed(s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args):
    os.makedirs(args.runs_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    results = {name: [run(name, seed, args) for seed in args.seeds] for name in ROWS}
    header = [
        "the tool's tokens in the loss",
        "held-out accuracy, step 0 → last (%)",
        "tool-call rate (%)",
        "failed calls, last (%)",
        "turns, last",
        "wall s",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row(name, runs)) + " |" for name, runs in results.items()]
    seeds = " ".join(map(str, args.seeds))
    block = "\n".join(
        [
            MARK_START,
            "",
            "## Tool use: the tool's tokens masked out of the loss, or not (tool_grpo.py)",
            "",
            f"`python benchmarks/tool_benchmark.py` ({len(args.seeds)} seed(s): {seeds}; {machine_line()}): "
            "`python scale/tool_grpo.py` and the same command with `--no-mask-tool-tokens`, from the bundled "
            "`tiny-caller/` on 3-digit x 2-digit products with the calculator, greedy on the 500 held-out prompts "
            "([tool_grpo.md](tool_grpo.md)).",
            "",
            *lines,
            "",
            "![held-out accuracy and tool-call rate against the step](tool_grpo.png)",
            "",
            MARK_END,
        ]
    )
    path = os.path.join(args.out_dir, "results.md")
    write_block(path, MARK_START, MARK_END, block)
    plot(results, os.path.join(args.out_dir, "tool_grpo.png"))
    print(f"wrote {path} and tool_grpo.png")


if __name__ == "__main__":
    main(tyro.cli(Args))
