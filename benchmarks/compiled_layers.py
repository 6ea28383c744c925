"""What compiling the decoder layers (compile_layers, a GPU's path) changes in one micro-batch of the update, shown on
the CPU with inductor: the operations a layer runs (forward, recomputation and backward, checkpointed, under bfloat16
autocast), eager and compiled, and the kernels inductor fuses the rest into; and the micro-batch's seconds on this
CPU, whose time is its matrix products (so the CPU runs the layers as they are). A layer's count is the difference
between a 2-layer and a 1-layer model of Qwen2.5-0.5B's layer shape. docs/gpu.md gives the numbers.

    python benchmarks/compiled_layers.py
"""

import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch._inductor.metrics
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scale import grpo  # noqa: E402

LAYOUT = {"aten::" + name for name in "empty empty_strided view as_strided detach t transpose reshape".split()}
LAYOUT |= {"aten::" + name for name in "_unsafe_view expand slice select alias unsqueeze squeeze permute".split()}


def micro_batch(model, ids, mask):
    grpo.token_logprobs(model, ids, mask, ids.shape[1] // 2).sum().backward()
    model.zero_grad(set_to_none=True)


def measure(folder, compiled, ids, mask):
    """(ATen operations of one micro-batch, views and allocations aside; kernels inductor generated; seconds)."""
    args = SimpleNamespace(dtype="bfloat16", gradient_checkpointing=True, trust_remote_code=False, fsdp=False)
    grpo.compiles = lambda model: compiled  # as on a GPU: the layers compiled, the rows rolled
    model = grpo.load_model(folder, args, torch.device("cpu")).train()
    generated = torch._inductor.metrics.generated_kernel_count
    micro_batch(model, ids, mask)  # compiles
    generated = torch._inductor.metrics.generated_kernel_count - generated
    with torch.profiler.profile() as profile:
        micro_batch(model, ids, mask)
    operations = sum(e.count for e in profile.key_averages() if e.key.startswith("aten::") and e.key not in LAYOUT)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        micro_batch(model, ids, mask)
        seconds.append(time.perf_counter() - start)
    return operations, generated, statistics.median(seconds)


QWEN_LAYER = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2)


def main(rows=4, width=256, shape=QWEN_LAYER):
    torch.manual_seed(0)
    plain = grpo.hidden_states
    grpo.hidden_states = lambda *a: plain(*a, rolled_on=("cpu",))
    grpo.tensor_core_mm = lambda a, b: a.float() @ b.float()  # the output layer's tensor-core products, on a CPU
    ids = torch.randint(3, 1024, (rows, width))
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for layers in (1, 2):
            config = Qwen2Config(vocab_size=1024, num_hidden_layers=layers, tie_word_embeddings=True, **shape)
            AutoModelForCausalLM.from_config(config).save_pretrained(f"{folder}/{layers}")
            for compiled in (False, True):
                found[layers, compiled] = measure(f"{folder}/{layers}", compiled, ids, torch.ones_like(ids))
    for compiled, name in ((False, "eager"), (True, "compiled")):
        layer = found[2, compiled][0] - found[1, compiled][0]
        print(
            f"{name}: {layer} ATen operations a layer in a micro-batch of {rows} x {width} tokens, "
            f"{found[1, compiled][1]} kernels generated; the 2-layer micro-batch {found[2, compiled][2]:.3f} s"
        )
    return found


if __name__ == "__main__":
    main()
