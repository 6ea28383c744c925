"""Peak memory of one log-prob computation, in a process of its own (benchmark.py starts one per case).

A random one-layer Qwen2 model with Qwen's vocabulary (151,936 tokens) reads a batch of sequences;
the log-probs of the last (seq_len - prompt_len) tokens are computed either the way the algorithm
files do (`token_logprobs`: the output layer and a float32 log-softmax a chunk of positions at a
time, each chunk recomputed in the backward pass) or with one plain `log_softmax` over the model's
whole float32 logits of those positions. On the CPU the peak resident memory of the process
(ru_maxrss) is read before and after; the difference is what the computation added. With --device
cuda it is the rise of torch.cuda.max_memory_allocated instead. --dtype bfloat16 gives the model
bfloat16 weights. Prints one JSON line.

    python benchmarks/logprob_memory.py --method chunked --grad
    python benchmarks/logprob_memory.py --method plain --grad --dtype bfloat16
"""

import argparse
import json
import os
import resource
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scale.grpo import token_logprobs  # noqa: E402  (every algorithm file has the same copy)


def peak_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def plain_logprobs(model, input_ids, attention_mask, prompt_len):
    """The straightforward way: one float32 log_softmax over the whole (B, T, vocab) logits."""
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=input_ids.shape[1] - prompt_len + 1,
    ).logits[:, :-1]  # (B, T, vocab)
    return logits.float().log_softmax(dim=-1).gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)  # (B, T)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["chunked", "plain"], required=True)
    parser.add_argument("--grad", action="store_true", help="with gradient, and run the backward pass")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to measure GPU memory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's weights")
    args = parser.parse_args()
    if not 0 < args.prompt_len < args.seq_len:
        sys.exit(f"--prompt-len must be between 0 and --seq-len ({args.seq_len}), got {args.prompt_len}")

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_config(config).to(device, getattr(torch, args.dtype))
    input_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len)).to(device)
    attention_mask = torch.ones_like(input_ids)
    compute = token_logprobs if args.method == "chunked" else plain_logprobs

    before = peak_gb(device)
    start = time.perf_counter()
    with torch.set_grad_enabled(args.grad):
        logprobs = compute(model, input_ids, attention_mask, args.prompt_len)  # (B, T)
        if args.grad:
            logprobs.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    completion_len = args.seq_len - args.prompt_len
    peak = peak_gb(device)
    print(
        json.dumps(
            {
                "method": args.method,
                "grad": args.grad,
                "device": args.device,
                "dtype": args.dtype,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "prompt_len": args.prompt_len,
                "vocab_size": args.vocab_size,
                "logits_gb": args.batch_size * completion_len * args.vocab_size * 4 / 2**30,
                "before_gb": before,
                "peak_gb": peak,
                "added_gb": peak - before,
                "seconds": seconds,
                "logprob_sum": logprobs.sum().item(),
            }
        )
    )
