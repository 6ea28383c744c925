"""Process supervision against outcome supervision on the bundled chain task (process_grpo.py), over several seeds.

Each run is `python scale/process_grpo.py --seed S [--supervision outcome] --output-dir ...`, one at a time, as a user
runs it: the same flags, so the same sample budget (prompts x completions a step, steps). The script then reads every
run's metrics.jsonl and writes, from nothing, the block between the two `process` marker lines of docs/results.md (the
table) and docs/process_grpo.png (held-out accuracy and trace error against the step).

    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/process_benchmark.py                     # 2 rows x 3 seeds
    python benchmarks/process_benchmark.py --seeds 1 --num-steps 4 --runs-dir /tmp/p --out-dir /tmp/p \
        --flags="--prompts-per-step 4 --num-eval 16"

A run that already finished in --runs-dir with the same command is read, not run again (delete its folder to run
it again). benchmarks/benchmark.py keeps the block when it writes results.md anew.
"""

import os
import random
import statistics
import sys
from dataclasses import dataclass, field

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from async_benchmark import machine_line, mean_std, run_once, write_block  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = {"process": [], "outcome": ["--supervision", "outcome"]}  # name: process_grpo.py's flags
MARK_START, MARK_END = "<!-- process: written by benchmarks/process_benchmark.py -->", "<!-- end of process -->"


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # a run of every row for each seed
    num_steps: int | None = None  # None: the file's default
    flags: str = ""  # more flags for every run, as one string (the test makes the runs small with them)
    runs_dir: str = os.path.join(ROOT, "runs", "process-benchmark")  # where the runs go (and are found again)
    out_dir: str = os.path.join(ROOT, "docs")  # where results.md's block and process_grpo.png are written


def run(name, seed, args):
    """The run's metrics and wall seconds, running it unless it finished with this command."""
    out = os.path.join(os.path.abspath(args.runs_dir), f"{name}__{seed}")
    steps = [] if args.num_steps is None else ["--num-steps", str(args.num_steps)]
    command = [
        "scale/process_grpo.py",
        "--seed",
        str(seed),
        *ROWS[name],
        *steps,
        *args.flags.split(),
        "--output-dir",
        out,
    ]
    return run_once(f"{name} seed {seed}", command, out)


def evaluations(metrics):
    return [m for m in metrics if "eval/trace_error" in m]


def row(name, runs):
    """A table row: each number the mean (± std) over the seeds of a per-run value."""
    first, last = [evaluations(r)[0] for r, _ in runs], [evaluations(r)[-1] for r, _ in runs]

    def pct(evals, key):
        return [100 * e[key] for e in evals]

    right = [e["eval/right_answers"] for e in last]
    return [
        name,
        f"{mean_std(pct(first, 'eval/accuracy'))} → {mean_std(pct(last, 'eval/accuracy'))}",
        f"{mean_std(pct(first, 'eval/step_accuracy'))} → {mean_std(pct(last, 'eval/step_accuracy'))}",
        f"{mean_std(pct(first, 'eval/trace_error'))} → {mean_std(pct(last, 'eval/trace_error'))}",
        mean_std(right, 0),
        mean_std([w for _, w in runs], 0),
    ]


@torch.no_grad()
def advantage_scale(model_dir, seed=1, prompts=64, group_size=8):
    """The mean |A| on the tokens of the first, second and third step of the three-step completions, under process and
    outcome supervision, of one batch that the model at model_dir samples on the chain task at temperature 1."""
    from scale import process_grpo as p

    torch.manual_seed(seed)
    args = p.Args(model_name_or_path=model_dir, dtype="float32", cuda=False)
    tokenizer = p.load_tokenizer(model_dir, False)
    policy = p.load_model(model_dir, args, torch.device("cpu")).eval()
    stop_ids = p.stop_token_ids(tokenizer, policy)
    records = random.Random(seed).sample(p.chain_task(args.num_eval)[0], prompts)
    group = [r for r in records for _ in range(group_size)]
    ids, mask = p.tokenize_prompts(tokenizer, [r["prompt"] for r in group], "cpu", args)
    completion_ids = p.generate(policy, tokenizer, ids, mask, args.max_new_tokens, 1.0, stop_ids)
    completion = p.completion_mask(completion_ids, stop_ids)
    texts = p.decode_completions(tokenizer, completion_ids, completion)
    rewards, ends = p.reward_steps(tokenizer, completion_ids, completion, texts, group, "process")
    later = ends.long().flip(1).cumsum(1).flip(1)  # (B, T): the steps that end at or after each token
    completion = completion & (ends.sum(dim=1) == 3)[:, None]  # the completions of three steps
    scale = {}
    for supervision in ("process", "outcome"):
        rewards, ends = p.reward_steps(tokenizer, completion_ids, completion, texts, group, supervision)
        advantages = p.process_advantages(rewards, ends, group_size).abs()
        scale[supervision] = [advantages[(later == k) & completion].mean().item() for k in (3, 2, 1)]
    return scale


def scale_line(seed):
    scale = advantage_scale(os.path.join(ROOT, "tiny-chainer"), seed)
    return "; ".join(f"{name} supervision {' / '.join(f'{x:.2f}' for x in scale[name])}" for name in scale)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, runs) in enumerate(results.items()):
        curves = [evaluations(r) for r, _ in runs]
        n = min(len(c) for c in curves)
        steps = [c["step"] for c in curves[0][:n]]
        for ax, key in zip(axes, ("eval/accuracy", "eval/trace_error")):
            values = [statistics.mean(100 * c[j][key] for c in curves) for j in range(n)]
            ax.plot(steps, values, marker="os"[i % 2], markersize=4, label=f"{name} supervision")
    labels = ("held-out final-answer accuracy (%)", "trace error: right answers with a wrong step (%)")
    for ax, label in zip(axes, labels):
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"process_grpo.py on the chain task, the mean over {len(next(iter(results.values())))} seed(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args):
    os.makedirs(args.runs_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    results = {name: [run(name, seed, args) for seed in args.seeds] for name in ROWS}
    header = [
        "supervision",
        "held-out accuracy, step 0 → last (%)",
        "step accuracy (%)",
        "trace error (%)",
        "right final answers (of 500)",
        "wall s",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row(name, runs)) + " |" for name, runs in results.items()]
    seeds = " ".join(map(str, args.seeds))
    block = "\n".join(
        [
            MARK_START,
            "",
            "## Process against outcome supervision (process_grpo.py)",
            "",
            f"`python benchmarks/process_benchmark.py` ({len(args.seeds)} seed(s): {seeds}; {machine_line()}): "
            "`python scale/process_grpo.py` and the same command with `--supervision outcome`, from the bundled "
            "`tiny-chainer/` on the chain task, the same prompts and completions a step. The trace error is the share "
            "of the right final answers (their count beside it) whose greedy completion has a wrong step "
            "([process_grpo.md](process_grpo.md)).",
            "",
            *lines,
            "",
            "The scale of the advantage: the mean |A| on the tokens of the first, second and third step of the "
            "three-step completions in one batch of 64 prompts x 8 completions that `tiny-chainer/` samples: "
            f"{scale_line(args.seeds[0])}.",
            "",
            "![held-out accuracy and trace error against the step](process_grpo.png)",
            "",
            MARK_END,
        ]
    )
    path = os.path.join(args.out_dir, "results.md")
    write_block(path, MARK_START, MARK_END, block)
    plot(results, os.path.join(args.out_dir, "process_grpo.png"))
    print(f"wrote {path} and process_grpo.png")


if __name__ == "__main__":
    main(tyro.cli(Args))
