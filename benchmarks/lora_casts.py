"""What LoRA's frozen weights cost generate() under bfloat16 autocast, held in bfloat16 (add_lora) or in float32.

Autocast keeps its bfloat16 copy of a float32 weight for the whole autocast region only when the weight requires grad,
so a frozen float32 weight is cast again at every generated token. add_lora holds the decoder's frozen linear
layers in the compute dtype under --lora-r; this script puts them back in float32 (as the files held them before) to
compare: the casts of frozen weights a token, counted with a TorchDispatchMode over one rollout, and generated
tokens/s, the two ways timed in turn (docs/gpu.md gives the numbers).

    python benchmarks/lora_casts.py                                   # the bundled model, --lora-r 4
    python benchmarks/lora_casts.py --model SmolLM2-135M-Instruct --lora-r 16 --task addition-question
"""

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scale import grpo  # noqa: E402


class CastCounter(TorchDispatchMode):
    """Counts the casts to bfloat16 of the given tensors (by storage) and the elements cast."""

    def __init__(self, tensors):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.casts, self.elements = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            if args[0].untyped_storage().data_ptr() in self.storages:
                self.casts += 1
                self.elements += args[0].numel()
        return func(*args, **kwargs)


def frozen_linears(policy):
    head = policy.get_output_embeddings()
    return [
        m for m in policy.modules() if isinstance(m, torch.nn.Linear) and m is not head and not m.weight.requires_grad
    ]


def main(model="tiny-adder", lora_r=4, task="addition", sequences=8, new_tokens=32, repeats=4):
    """{way: (casts of frozen weights a token, their elements a token, median tokens/s)} for the two ways."""
    args = grpo.Args(model_name_or_path=model, dtype="bfloat16", lora_r=lora_r, cuda=False)
    device = torch.device("cpu")
    tokenizer = grpo.load_tokenizer(model, args.trust_remote_code)
    policies = {"bfloat16 (add_lora)": grpo.add_lora(grpo.load_model(model, args, device), args)}
    policies["float32 (before)"] = grpo.add_lora(grpo.load_model(model, args, device), args)
    for module in frozen_linears(policies["float32 (before)"]):
        module.float()
    prompts = [r["prompt"] for r in grpo.addition_task(sequences, task)[1]]
    prompt_ids, prompt_mask = grpo.tokenize_prompts(tokenizer, prompts, device, args)
    never = [len(tokenizer)]  # no stop token: every rollout is new_tokens long

    def rollout(policy):
        return grpo.generate(policy, tokenizer, prompt_ids, prompt_mask, new_tokens, 1.0, never)

    results, speeds = {}, {way: [] for way in policies}
    for way, policy in policies.items():
        frozen = [p for p in policy.parameters() if not p.requires_grad]
        with CastCounter(frozen) as counter:
            out = rollout(policy)
        results[way] = (counter.casts / out.shape[1], counter.elements / out.shape[1])
    for i in range(repeats):  # in turn, so that both see the machine alike
        for way in sorted(policies, reverse=i % 2 == 1):
            start = time.perf_counter()
            out = rollout(policies[way])
            speeds[way].append(out.numel() / (time.perf_counter() - start))
    return {way: (*results[way], statistics.median(speeds[way])) for way in policies}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-adder")
    parser.add_argument("--lora-r", type=int, default=4)
    parser.add_argument("--task", default="addition", choices=["addition", "addition-question"])
    parser.add_argument("--repeats", type=int, default=8)
    options = parser.parse_args()
    torch.manual_seed(0)
    found = main(options.model, options.lora_r, options.task, repeats=options.repeats)
    print(f"{options.model}, --lora-r {options.lora_r}, --dtype bfloat16: 8 sequences of 32 new tokens")
    for way, (casts, elements, speed) in found.items():
        print(
            f"frozen linear layers in {way}: {casts:.0f} casts of frozen weights a token ({elements / 1e6:.1f} M "
            f"elements), {speed:.1f} generated tokens/s (median of {options.repeats})"
        )
