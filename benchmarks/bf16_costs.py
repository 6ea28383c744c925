"""What two bfloat16 choices of the shared code cost, timed on this machine's CPU (docs/gpu.md gives the numbers).

1. generate() runs the whole rollout under one torch.autocast, so each float32 weight is cast to bfloat16 once; under
   the model's own autocast-wrapped forward alone, every new token casts every weight again. Generated tokens/s of both.
2. The output layer of the log-prob pass multiplies in float32; in bfloat16 its logits (about 20 at a real model's
   scale) are rounded to 8 bits of mantissa first. Seconds of a forward and backward pass (token_logprobs) with
   each, and how far the bfloat16 logits move the log-probs.

The model: random, with Qwen2.5-0.5B's width and vocabulary (151,936 tokens: the log-prob pass takes two chunks) and
2 layers; its output layer scaled so that its logits have a real model's spread.

    python benchmarks/bf16_costs.py
"""

import contextlib
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scale import grpo  # noqa: E402


def bfloat16_head(linear, vocab_size):
    """torch.nn.functional.linear, but the output layer's (vocab_size outputs) in bfloat16, as the files had it."""

    def patched(x, weight, bias=None):
        if weight.shape[0] != vocab_size:
            return linear(x, weight, bias)
        return linear(x.bfloat16(), weight.bfloat16(), None if bias is None else bias.bfloat16()).float()

    return patched


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main(hidden_size=896, intermediate_size=4864, vocab_size=151936, repeats=2):
    """Prints the timings; returns (tokens/s per-token, one autocast, seconds float32, bfloat16 head, mean gap)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=512,
    )
    folder = tempfile.mkdtemp()
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(5.0)
    model.save_pretrained(folder)
    args = SimpleNamespace(dtype="bfloat16", gradient_checkpointing=False, trust_remote_code=False, fsdp=False)
    policy = grpo.load_model(folder, args, torch.device("cpu")).eval()
    prompt_ids = torch.randint(3, config.vocab_size, (16, 32))
    prompt_mask = torch.ones_like(prompt_ids)
    tokenizer = SimpleNamespace(pad_token_id=0)
    new_tokens = 32

    def rollout(one_autocast):
        torch.manual_seed(1)
        autocast, next_logits = grpo.autocast, grpo.next_logits
        if not one_autocast:  # autocast entered and left at every token, as the model's own wrapped forward does
            grpo.autocast = lambda model: contextlib.nullcontext()
            grpo.next_logits = torch.autocast("cpu", dtype=torch.bfloat16)(next_logits)
        try:
            return grpo.generate(policy, tokenizer, prompt_ids, prompt_mask, new_tokens, 1.0, [2])
        finally:
            grpo.autocast, grpo.next_logits = autocast, next_logits

    speed = {}
    for name, one_autocast in (
        ("per-token autocast", False),
        ("one autocast", True),
        ("per-token autocast", False),
        ("one autocast", True),
    ):
        seconds, out = timed(lambda: rollout(one_autocast), repeats)
        speed[name] = out.numel() / seconds
        print(f"generate, {name}: {speed[name]:.0f} generated tokens/s ({seconds:.2f} s for {out.numel()})")

    policy.train()
    input_ids = torch.randint(3, config.vocab_size, (8, 32 + 96))
    attention_mask = torch.ones_like(input_ids)

    def logprob_pass():
        logprobs = grpo.token_logprobs(policy, input_ids, attention_mask, 32)
        logprobs.sum().backward()
        return logprobs.detach()

    linear = torch.nn.functional.linear
    results, seconds = {}, {}
    for name in ("float32", "bfloat16", "float32", "bfloat16"):
        torch.nn.functional.linear = linear if name == "float32" else bfloat16_head(linear, vocab_size)
        try:
            seconds[name], results[name] = timed(logprob_pass, repeats)
        finally:
            torch.nn.functional.linear = linear
        print(f"log-prob pass with gradient, output layer in {name}: {seconds[name]:.2f} s")
    gap = (results["bfloat16"] - results["float32"]).abs()
    print(f"bfloat16 logits move the log-probs by {gap.mean():.4f} on average, {gap.max():.4f} at most")
    return speed["per-token autocast"], speed["one autocast"], seconds["float32"], seconds["bfloat16"], gap.mean()


if __name__ == "__main__":
    main()
