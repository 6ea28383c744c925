"""Whether a change leaves the CPU path as fast as it was: a step's three phases, this checkout's grpo.py against
another's (an older commit's, checked out elsewhere), in one process, in turn, so that the machine's drift over
minutes falls on both alike. Each round runs, for each file, the rollouts (`sample()`), the reference's log-probs
(`batched_logprobs`, no gradient) and the update's forward and backward passes (`token_logprobs`, a micro-batch at a
time) on the same model and prompts, the two files' order swapped every round; the first round warms up. It prints
each phase's median seconds and the median of the ratios round by round (this file's over the other's), with
their range. Timing whole processes in turn (`/usr/bin/time`) measures start-up too; this times what a step runs,
where a change's cost is a few percent of a process.

    git worktree add /tmp/base 82d72d2
    python benchmarks/in_turn.py --vs /tmp/base/grpo.py                     # the default task, 256 rollouts
    python benchmarks/in_turn.py --vs /tmp/base/grpo.py --model SmolLM2-135M-Instruct --task addition-question \\
        --prompts 8 --group-size 4 --micro-batch-size 8 --max-new-tokens 16 --rounds 9
"""

import importlib.util
import os
import statistics
import time
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    vs: str  # the other grpo.py
    model: str = os.path.join(ROOT, "tiny-adder")
    task: str = "addition"
    prompts: int = 32  # prompts a batch, each sampled group-size times (grpo.py's defaults)
    group_size: int = 8
    micro_batch_size: int = 64
    max_new_tokens: int = 8
    rounds: int = 25  # the first warms up


def module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def setup(grpo, args):
    """(the module, its Args, tokenizer, model, prompt ids, prompt mask, stop ids), as its main() makes them."""
    flags = grpo.Args(model_name_or_path=args.model, task=args.task, max_new_tokens=args.max_new_tokens)
    flags.dtype, flags.batch_size = "float32", args.prompts * args.group_size
    if hasattr(grpo, "check_vllm"):
        grpo.check_vllm(flags)  # settles what main() settles before sampling (--rollout-correction auto)
    tokenizer = grpo.load_tokenizer(args.model, False)
    model = grpo.load_model(args.model, flags, torch.device("cpu"))
    train, _ = grpo.addition_task(2, args.task)
    prompts = [r["prompt"] for r in train[: args.prompts] for _ in range(args.group_size)]
    ids, mask = grpo.tokenize_prompts(tokenizer, prompts, torch.device("cpu"), flags)
    return grpo, flags, tokenizer, model, ids, mask, grpo.stop_token_ids(tokenizer, model)


def phases(grpo, flags, tokenizer, model, ids, mask, stops, micro):
    """Seconds of the rollouts, the reference's log-probs and the update's passes."""
    start = time.perf_counter()
    completions = grpo.sample(model, None, tokenizer, ids, mask, flags, stops)[0]
    sampled = time.perf_counter()
    input_ids = torch.cat([ids, completions], dim=1)
    attention = torch.cat([mask, grpo.completion_mask(completions, stops)], dim=1)
    with torch.no_grad():
        grpo.batched_logprobs(model, input_ids, attention, ids.shape[1], 1.0, micro)
    scored = time.perf_counter()
    model.train()
    for i in range(0, len(input_ids), micro):
        grpo.token_logprobs(model, input_ids[i : i + micro], attention[i : i + micro], ids.shape[1]).sum().backward()
    model.zero_grad(set_to_none=True)
    return sampled - start, scored - sampled, time.perf_counter() - scored


def main(args):
    if not os.path.isfile(args.vs):
        raise SystemExit(f"--vs {args.vs}: no such file; give another checkout's grpo.py")
    if args.rounds < 2:
        raise SystemExit(f"--rounds {args.rounds}: give at least 2 (the first warms up)")
    files = {"this": module(os.path.join(ROOT, "scale/grpo.py"), "this_grpo"), "vs": module(args.vs, "vs_grpo")}
    setups = {name: setup(grpo, args) for name, grpo in files.items()}
    seconds = {name: [] for name in files}
    for r in range(args.rounds):
        for name in list(files)[:: 1 if r % 2 == 0 else -1]:
            torch.manual_seed(r)  # the same draws for both
            times = phases(*setups[name], args.micro_batch_size)
            if r:
                seconds[name].append(times)
    for i, phase in enumerate(("rollouts", "reference's log-probs", "update")):
        this, other = ([t[i] for t in seconds[name]] for name in files)
        ratios = [a / b for a, b in zip(this, other)]
        print(
            f"{phase}: {statistics.median(this):.4f} s against {statistics.median(other):.4f} s, "
            f"ratio {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), {len(ratios)} rounds"
        )


if __name__ == "__main__":
    main(tyro.cli(Args))
