"""distill.py against grpo.py from the same student, tiny-adder/, on the bundled task, over several seeds.

Each run is `python <file> --seed S [flags] --output-dir ...`, one at a time, as a user runs it: both files' defaults,
so the same student, the same rollouts a step (grpo.py's 32 prompts x 8, distill.py's 256 x 1) and the same steps;
distill.py's teacher is tiny-teacher/ (docs/distill.md says how it is made). The script reads every run's
metrics.jsonl and writes, from nothing, the block between the two `distill` marker lines of docs/distill.md and of
docs/results.md (the table: steps, rollouts and wall time to reach 95% of the teacher's held-out accuracy; accuracy at
equal steps; whether distillation ends above grpo.py's best) and docs/distill.png (held-out accuracy against the step
and wall time).

    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/distill_benchmark.py                     # 4 rows x 3 seeds
    python benchmarks/distill_benchmark.py --seeds 1 --rows grpo distill --runs-dir /tmp/d --out-dir /tmp/d \
        --flags="--num-steps 4 --prompts-per-step 4 --num-eval 16"

A run that already finished in --runs-dir with the same command is read, not run again (delete its folder to run
it again). benchmarks/benchmark.py keeps the results.md block when it writes that page anew.
"""

import json
import os
import statistics
import sys
from dataclasses import dataclass, field

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_benchmark import fail, machine_line, mean_std, run_once, write_block  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = {  # name: (file, flags)
    "grpo": ("scale/grpo.py", []),
    "distill": ("scale/distill.py", []),  # the default: 256 prompts x 1, the forward KL over the vocabulary
    "distill-reverse-kl": ("scale/distill.py", ["--loss", "reverse-kl"]),  # the sampled reverse KL's policy gradient
    "distill-exact-reverse-kl": ("scale/distill.py", ["--jsd-beta", "1"]),  # the reverse KL over the vocabulary
}
SHARE = 0.95  # the target: this share of the teacher's held-out accuracy
MARK_START, MARK_END = "<!-- distill: written by benchmarks/distill_benchmark.py -->", "<!-- end of distill -->"


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # a run of every row for each seed
    rows: list[str] = field(default_factory=lambda: list(ROWS))  # which rows (one of distill.py's at least)
    flags: str = ""  # more flags for every run, as one string (the test makes the runs small with them)
    runs_dir: str = os.path.join(ROOT, "runs", "distill-benchmark")  # where the runs go (and are found again)
    out_dir: str = os.path.join(ROOT, "docs")  # where distill.md's and results.md's blocks and distill.png go


def run(name, seed, args):
    """The run's metrics and wall seconds, running it unless it finished with this command."""
    script, flags = ROWS[name]
    out = run_dir(name, seed, args)
    command = [script, "--seed", str(seed), *flags, *args.flags.split(), "--output-dir", out]
    return run_once(f"{name} seed {seed}", command, out)


def run_dir(name, seed, args):
    return os.path.join(os.path.abspath(args.runs_dir), f"{name}__{seed}")


def evaluations(metrics):
    """[(step, held-out accuracy in %, seconds since the run's start)] of each evaluation (step 0: 0 s)."""
    return [
        (m["step"], 100 * m["eval/accuracy"], m.get("charts/elapsed_time", 0.0))
        for m in metrics
        if "eval/accuracy" in m
    ]


def batch_size(name, seed, args):
    """The completions a step of the run (its args.json)."""
    with open(os.path.join(run_dir(name, seed, args), "args.json")) as f:
        return json.load(f)["batch_size"]


def first_reaching(evals, target):
    """(step, seconds) of the first evaluation at or above target, or None."""
    return next(((step, seconds) for step, accuracy, seconds in evals if accuracy >= target), None)


def reached(values, total):
    """A cell: the mean (± std) over the seeds that reached the target, and how many did when not all."""
    if not values:
        return f"not reached (0/{total})"
    return mean_std(values, 0) + ("" if len(values) == total else f" ({len(values)}/{total} seeds)")


def equal_steps(results):
    """The evaluation steps every run shares, thinned to the 1st, 2nd, 4th, 8th ... evaluation and the last."""
    shared = sorted(
        set.intersection(*(set(s for s, _, _ in evaluations(r)) for runs in results.values() for r, _ in runs))
    )
    shared = [s for s in shared if s > 0]
    picked = [s for i, s in enumerate(shared, start=1) if i & (i - 1) == 0]
    return picked + ([shared[-1]] if shared and shared[-1] not in picked else [])


def row(name, runs, target, steps, grpo_best, args):
    """A table row: each number the mean (± std) over the seeds of a per-run value."""
    evals = [evaluations(r) for r, _ in runs]
    hits = [first_reaching(e, target) for e in evals]
    batches = [batch_size(name, seed, args) for seed in args.seeds]
    at_step = [mean_std([next(a for s, a, _ in e if s == step) for e in evals]) for step in steps]
    best = [max(a for _, a, _ in e) for e in evals]
    if name == "grpo" or grpo_best is None:
        past = "—"
    else:  # the seed's last evaluation above grpo.py's best evaluation of the same seed
        past = f"{sum(e[-1][1] > b for e, b in zip(evals, grpo_best))}/{len(evals)}"
    return [
        name,
        f"{mean_std([e[0][1] for e in evals])} → {mean_std([e[-1][1] for e in evals])}",
        mean_std(best),
        *at_step,
        reached([h[0] for h in hits if h], len(hits)),
        reached([h[0] * b for h, b in zip(hits, batches) if h], len(hits)),
        reached([h[1] for h in hits if h], len(hits)),
        mean_std([w for _, w in runs], 0),
        past,
    ]


def plot(results, teacher, target, path):
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (name, runs) in enumerate(results.items()):
        evals = [evaluations(r) for r, _ in runs]
        n = min(len(e) for e in evals)
        mean = [statistics.mean(e[j][1] for e in evals) for j in range(n)]
        style = {"marker": "os^"[i % 3], "color": f"C{i}", "label": name}
        axes[0].plot([evals[0][j][0] for j in range(n)], mean, **style)
        axes[1].plot([statistics.mean(e[j][2] for e in evals) for j in range(n)], mean, **style)
    for ax, label in zip(axes, ("training step", "seconds since the run's start")):
        ax.axhline(teacher, color="k", linewidth=1, label=f"teacher {teacher:.1f}%")
        ax.axhline(target, color="k", linewidth=1, linestyle="--", label=f"{100 * SHARE:.0f}% of it")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    seeds = len(next(iter(results.values())))
    fig.suptitle(
        f"distill.py against grpo.py from tiny-adder/, the same rollouts a step; the mean over {seeds} seed(s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def command_flags(args):
    """The flags of this command that are not the defaults, as the block's command line gives them."""
    default, flags = Args(), ""
    if args.seeds != default.seeds:
        flags += f" --seeds {' '.join(map(str, args.seeds))}"
    if args.rows != default.rows:
        flags += f" --rows {' '.join(args.rows)}"
    if args.flags:
        flags += f' --flags="{args.flags}"'
    return flags


def main(args):
    os.makedirs(args.runs_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    results = {name: [run(name, seed, args) for seed in args.seeds] for name in args.rows}
    # the teacher's held-out accuracy, which a distill.py run logs at step 0 (the same in every seed: greedy)
    teacher = statistics.mean(
        100 * r[0]["eval/teacher_accuracy"] for name, runs in results.items() if name != "grpo" for r, _ in runs
    )
    target = SHARE * teacher
    steps = equal_steps(results)
    grpo_best = None
    if "grpo" in results:
        grpo_best = [max(a for _, a, _ in evaluations(r)) for r, _ in results["grpo"]]
    header = [
        "row",
        "held-out accuracy, step 0 → last (%)",
        "best (%)",
        *[f"at step {s} (%)" for s in steps],
        f"steps to {100 * SHARE:.0f}% of the teacher",
        "rollouts to it",
        "seconds to it",
        "wall s",
        "seeds ending above grpo.py's best",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| " + " | ".join(row(name, runs, target, steps, grpo_best, args)) + " |" for name, runs in results.items()
    ]
    commands = [f"- {name}: `{' '.join(['python', ROWS[name][0], *ROWS[name][1]])}`" for name in results]
    seeds = f"{len(args.seeds)} seed(s): {' '.join(map(str, args.seeds))}"
    text = [
        f"`python benchmarks/distill_benchmark.py{command_flags(args)}` ({seeds}; {machine_line()}; one run at a "
        "time). Every row starts from the bundled `tiny-adder/` and samples the same prompts x completions a step "
        f"(its file's defaults); distill.py's teacher, `tiny-teacher/`, scores {teacher:.1f}% on the held-out prompts, "
        f"so the target is {target:.1f}%. Steps, rollouts (completions sampled) and seconds to the target: at the "
        "first evaluation at or above it, the mean over the seeds that reached it; the seconds since the run's start "
        "(`charts/elapsed_time`: evaluations included, loading not); wall s: the whole command. The last column: "
        "the seeds whose last evaluation is above grpo.py's best evaluation of the same seed.",
        "",
        *commands,
        "",
        *lines,
        "",
        "![held-out accuracy against the step and the seconds since the run's start](distill.png)",
    ]
    results_block = [MARK_START, "", "## On-policy distillation against GRPO (distill.py)", "", *text, "", MARK_END]
    write_block(os.path.join(args.out_dir, "results.md"), MARK_START, MARK_END, "\n".join(results_block))
    write_block(
        os.path.join(args.out_dir, "distill.md"), MARK_START, MARK_END, "\n".join([MARK_START, "", *text, "", MARK_END])
    )
    plot(results, teacher, target, os.path.join(args.out_dir, "distill.png"))
    print("\n".join(lines))
    print(f"wrote results.md, distill.md and distill.png in {args.out_dir}")


if __name__ == "__main__":
    args = tyro.cli(Args)
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        fail(f"--rows: unknown {', '.join(unknown)}; choose among {', '.join(ROWS)}")
    if not any(ROWS[r][0] == "scale/distill.py" for r in args.rows):
        fail("--rows: give one of distill.py's rows at least (its runs log the teacher's accuracy)")
    main(args)
