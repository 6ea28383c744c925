"""How long process_grpo.py takes to find where each step ends in a batch's token ids, by completion length.

`reward_steps` puts each step's reward at the token whose text first reaches the step's end. At commit 8bbd1fe it
decoded every prefix of every completion (quadratic in the length); now `text_lengths` decodes each token with the few
before it. This script times both on 256 completions of random ids at 32, 256 and 1,024 tokens, on the bundled
tokenizer (a character a token) and on SmolLM2's (byte-level BPE; `python benchmarks/smollm2.py` makes its folder),
and checks that both put the same rewards at the same tokens.

    python benchmarks/step_ends.py                      # both tokenizers, 32 / 256 / 1,024 tokens
    python benchmarks/step_ends.py --lengths 32 256 --completions 64
"""

import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch
import tyro
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from scale import process_grpo  # noqa: E402


@dataclass
class Args:
    lengths: list[int] = field(default_factory=lambda: [32, 256, 1024])  # completion lengths, in tokens
    completions: int = 256  # completions a batch (32 prompts x 8, process_grpo.py's default)
    tokenizers: list[str] = field(default_factory=lambda: ["tiny-chainer", "SmolLM2-135M-Instruct"])
    seed: int = 0


def reward_steps_before(tokenizer, completion_ids, mask, texts, records):
    """reward_steps as it was at commit 8bbd1fe (process supervision): every prefix of every completion decoded."""
    step_rewards, step_ends = torch.zeros(mask.shape), torch.zeros(mask.shape, dtype=torch.bool)
    for i, (ids, text, record) in enumerate(zip(completion_ids.tolist(), texts, records)):
        length = int(mask[i].sum())
        steps = process_grpo.scored_steps(text, record)  # the rewards as today's, for the same ends
        prefixes = [
            len(p) for p in tokenizer.batch_decode([ids[: t + 1] for t in range(length)], skip_special_tokens=True)
        ]
        for k, (end, reward) in enumerate(steps):
            t = next((t for t, n in enumerate(prefixes) if n >= end), length - 1)
            if k == len(steps) - 1:
                t = length - 1
            step_rewards[i, t], step_ends[i, t] = reward, True
    return step_rewards, step_ends


def reward_steps_now(tokenizer, completion_ids, mask, texts, records):
    return process_grpo.reward_steps(tokenizer, completion_ids, mask, texts, records, "process")


def main(args):
    rng = random.Random(args.seed)
    print(
        "| tokenizer | tokens | completions | every prefix, 8bbd1fe (s) | one pass (s) | same step ends and rewards |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.tokenizers:
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, name))
        for length in args.lengths:
            rows = [[rng.randrange(len(tokenizer)) for _ in range(length)] for _ in range(args.completions)]
            completion_ids = torch.tensor(rows)
            texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
            records = [{"prompt": "47+8-3+5=", "answer": "57"}] * len(rows)
            mask = torch.ones(completion_ids.shape, dtype=torch.bool)
            times, outs = [], []
            for reward_steps in (reward_steps_before, reward_steps_now):
                start = time.perf_counter()
                outs.append(reward_steps(tokenizer, completion_ids, mask, texts, records))
                times.append(time.perf_counter() - start)
            same = all(torch.equal(a, b) for a, b in zip(*outs))
            print(f"| {name} | {length} | {len(rows)} | {times[0]:.2f} | {times[1]:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
