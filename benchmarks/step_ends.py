"""How long process_grpo.py takes to find where each step ends in a batch's token ids, by completion length.

`reward_steps` puts each step's reward at the token whose text first reaches the step's end. It used to decode every
prefix of every completion (quadratic in the length); `text_lengths` decodes each token with the few before it. This
script times both on 256 completions of random ids at 32, 256 and 1,024 tokens, on the bundled tokenizer (a
character a token) and on SmolLM2's (byte-level BPE; `python benchmarks/smollm2.py` makes its folder), and checks that
both put every step end at the same token.

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
import process_grpo  # noqa: E402


@dataclass
class Args:
    lengths: list[int] = field(default_factory=lambda: [32, 256, 1024])  # completion lengths, in tokens
    completions: int = 256  # completions a batch (32 prompts x 8, process_grpo.py's default)
    tokenizers: list[str] = field(default_factory=lambda: ["tiny-chainer", "SmolLM2-135M-Instruct"])
    seed: int = 0


def every_prefix_lengths(tokenizer, ids):
    """The way reward_steps found the ends before: every prefix decoded whole."""
    prefixes = tokenizer.batch_decode([ids[: t + 1] for t in range(len(ids))], skip_special_tokens=True)
    return [len(p) for p in prefixes]


def step_ends(tokenizer, completion_ids, texts, records, lengths_of):
    """(B, T) bool of the step ends reward_steps puts, with lengths_of as its text_lengths."""
    saved = process_grpo.text_lengths
    process_grpo.text_lengths = lambda tokenizer, ids: lengths_of(tokenizer, ids)
    try:
        mask = torch.ones(completion_ids.shape, dtype=torch.bool)
        return process_grpo.reward_steps(tokenizer, completion_ids, mask, texts, records, "process")[1]
    finally:
        process_grpo.text_lengths = saved


def main(args):
    rng = random.Random(args.seed)
    print("| tokenizer | tokens | completions | every prefix (s) | one pass (s) | same ends |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.tokenizers:
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, name))
        for length in args.lengths:
            rows = [[rng.randrange(len(tokenizer)) for _ in range(length)] for _ in range(args.completions)]
            completion_ids = torch.tensor(rows)
            texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
            records = [{"prompt": "47+8-3+5=", "answer": "57"}] * len(rows)
            times, ends = [], []
            for lengths_of in (every_prefix_lengths, process_grpo.text_lengths):
                start = time.perf_counter()
                ends.append(step_ends(tokenizer, completion_ids, texts, records, lengths_of))
                times.append(time.perf_counter() - start)
            same = torch.equal(ends[0], ends[1])
            print(f"| {name} | {length} | {len(rows)} | {times[0]:.2f} | {times[1]:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
