"""On-policy against off-policy distillation where a completion is long enough to go wrong midway.

On the bundled addition task an answer is 2-4 tokens, and no prefix of the student's own is far from the teacher's.
The chain task of process_grpo.py (`47+8-3+5=` answered `47+8=55 55-3=52 52+5=57`, about 24 tokens) has long
completions: a student that slips at the first step writes the rest from a state the teacher never wrote. Both rows
start from the same student, tiny-chainer/ (sft.py's 300 steps on the chain task), and learn from the same teacher,
tiny-chainer/ fine-tuned further here (`sft.py --task chain`, TEACHER_STEPS more steps); both see 256 completions a
step, at distill.py's learning rate, for the same steps:

    on-policy   distill.py's default (the forward KL over the vocabulary at the student's own samples' prefixes)
    off-policy  sft.py on the teacher's samples (one a training prompt at temperature 1, drawn here): sequence-level
                distillation, the student's loss at the teacher's prefixes only

Both are scored on the chain task's 500 held-out prompts (greedy, the answer after the last '='). The script writes
the block between the `distill-chain` marker lines of docs/distill.md.

    python benchmarks/distill_chain.py                       # the teacher, then 2 rows x 3 seeds
    python benchmarks/distill_chain.py --quick --runs-dir /tmp/dc --out-dir /tmp/dc   # the suite's form
"""

import json
import os
import statistics
import sys
from dataclasses import dataclass, field

import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_benchmark import machine_line, run_once, write_block  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from scale import process_grpo  # noqa: E402  (the chain task and the decode loop)

STUDENT = os.path.join(ROOT, "tiny-chainer")
TEACHER_STEPS, STEPS, BATCH, LENGTH, NUM_EVAL = 600, 300, 256, 32, 500
MARK_START, MARK_END = "<!-- distill-chain: written by benchmarks/distill_chain.py -->", "<!-- end of distill-chain -->"


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # a run of each row for each seed
    quick: bool = False  # the suite's form: a 2-step teacher, 2 steps a row, 8 completions a step, 16 held out
    runs_dir: str = os.path.join(ROOT, "runs", "distill-chain")  # where the runs go (and are found again)
    out_dir: str = os.path.join(ROOT, "docs")  # where distill.md's block goes


def sizes(args):
    """(the teacher's extra steps, a row's steps, completions a step, held-out prompts, evaluate every)."""
    if args.quick:
        return 2, 2, 8, 16, 1
    return TEACHER_STEPS, STEPS, BATCH, NUM_EVAL, STEPS // 6


def write_records(args):
    """chain_train.jsonl (prompt, answer) and chain_eval.jsonl (prompt, completion: the steps, answer): the task's
    records as process_grpo.py holds them out, so every row and the teacher are scored on the same prompts."""
    train, held_out = process_grpo.chain_task(sizes(args)[3])  # held out: the first --num-eval, as every row's
    paths = [os.path.join(args.runs_dir, f"chain_{name}.jsonl") for name in ("train", "eval")]
    with open(paths[0], "w") as f:
        for r in train:
            f.write(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n")
    with open(paths[1], "w") as f:
        for r in held_out:
            f.write(json.dumps({"prompt": r["prompt"], "completion": r["steps"], "answer": r["answer"]}) + "\n")
    return train, paths


def teacher_samples(args, teacher, train, seed):
    """teacher_samples_<seed>_<n>.jsonl: one completion of the teacher at temperature 1 for each of n = steps x batch
    training prompts drawn with the seed (prompt, completion), for the off-policy row."""
    _, steps, batch, _, _ = sizes(args)
    path = os.path.join(args.runs_dir, f"teacher_samples_{seed}_{steps * batch}.jsonl")
    if os.path.exists(path):
        return path
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher).eval()
    model.compute_dtype = torch.float32
    stop_ids = process_grpo.stop_token_ids(tokenizer, model)
    rng, settings = torch.Generator().manual_seed(seed), process_grpo.Args()
    torch.manual_seed(seed)
    with open(path + ".partial", "w") as f:
        for _ in range(steps):
            prompts = [train[i]["prompt"] for i in torch.randint(len(train), (batch,), generator=rng).tolist()]
            ids, mask = process_grpo.tokenize_prompts(tokenizer, prompts, "cpu", settings)
            completions = process_grpo.generate(model, tokenizer, ids, mask, LENGTH, 1.0, stop_ids)
            texts = process_grpo.decode_completions(
                tokenizer, completions, process_grpo.completion_mask(completions, stop_ids)
            )
            for prompt, text in zip(prompts, texts):
                f.write(json.dumps({"prompt": prompt, "completion": text}) + "\n")
    os.replace(path + ".partial", path)
    return path


def accuracy_curve(metrics):
    """[(step, held-out greedy accuracy in %)] of each evaluation."""
    return [(m["step"], 100 * m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]


def main(argv=None):
    args = tyro.cli(Args, args=argv)
    transformers.utils.logging.disable_progress_bar()
    os.makedirs(args.runs_dir, exist_ok=True)
    teacher_steps, steps, batch, num_eval, every = sizes(args)
    train, (train_path, eval_path) = write_records(args)
    common = ["--model-name-or-path", STUDENT, "--eval-dataset", eval_path, "--num-eval", str(num_eval)]
    common += ["--max-new-tokens", str(LENGTH), "--num-steps", str(steps), "--eval-every", str(every)]
    teacher = os.path.join(args.runs_dir, "teacher")
    flags = ["--model-name-or-path", STUDENT, "--task", "chain", "--num-eval", str(num_eval), "--num-steps"]
    flags += [str(teacher_steps), "--eval-every", str(teacher_steps), "--max-new-tokens", str(LENGTH)]
    teacher_metrics, _ = run_once("teacher", ["scale/sft.py", *flags, "--output-dir", teacher], teacher)
    results = {"teacher": 100 * teacher_metrics[-1]["eval/accuracy"], "student": None, "rows": {}}
    for seed in args.seeds:
        on = os.path.join(args.runs_dir, f"on-policy__{seed}")
        command = ["scale/distill.py", *common, "--dataset", train_path, "--teacher-path", teacher]
        command += ["--prompts-per-step", str(batch), "--seed", str(seed), "--output-dir", on]
        metrics, wall = run_once(f"on-policy seed {seed}", command, on)
        results["rows"].setdefault("on-policy", []).append((accuracy_curve(metrics), wall))
        off = os.path.join(args.runs_dir, f"off-policy__{seed}")
        samples = teacher_samples(args, teacher, train, seed)
        command = ["scale/sft.py", *common, "--dataset", samples, "--batch-size", str(batch), "--learning-rate", "1e-4"]
        command += ["--micro-batch-size", str(min(batch, 64)), "--seed", str(seed), "--output-dir", off]
        metrics, wall = run_once(f"off-policy seed {seed}", command, off)
        results["rows"].setdefault("off-policy", []).append((accuracy_curve(metrics), wall))
    results["student"] = results["rows"]["on-policy"][0][0][0][1]  # step 0 of the first run: tiny-chainer's
    block = table(results, args)
    print(block)
    write_block(os.path.join(args.out_dir, "distill.md"), MARK_START, MARK_END, block)
    return results


def table(results, args):
    """The block: the setting, and each row's held-out accuracy at each evaluation (mean ± std over the seeds)."""
    steps = [step for step, _ in results["rows"]["on-policy"][0][0]]
    lines = [
        MARK_START,
        f"`python benchmarks/distill_chain.py` ({len(args.seeds)} seed(s): {' '.join(map(str, args.seeds))}; "
        f"{machine_line()}; one run at a time). The student, tiny-chainer/, scores {results['student']:.1f}% on the "
        f"chain task's held-out prompts; the teacher, {results['teacher']:.1f}%. Held-out greedy accuracy (%):",
        "",
        "| row | " + " | ".join(f"step {s}" for s in steps) + " | wall s |",
        "| --- | " + " | ".join("---" for _ in steps) + " | --- |",
    ]
    for name, runs in results["rows"].items():
        cells = []
        for i in range(len(steps)):
            values = [curve[i][1] for curve, _ in runs]
            spread = f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):.1f}{spread}")
        walls = [wall for _, wall in runs]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {statistics.mean(walls):.0f} |")
    lines.append(MARK_END)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
