"""One file's training run as a GPU runs it, on the CPU: the path that only a GPU takes, whole, before a GPU runs it.
The switches a GPU sets are set by hand: compiles() says yes (load_model compiles the decoder layers with
inductor, a rollout's step is compiled whole, the output layer's products come from bfloat16 parts), the update's
rows are rolled left (hidden_states), a rollout looks for the last stop every 16 tokens, and --dtype is bfloat16
unless given. Not run: what only CUDA has (Triton's kernels, where inductor writes C++ ones here; the CUDA graphs;
the tensor-core product itself, a float32 product of the bfloat16 parts here), nor what differs by device (the
operations autocast casts, SDPA's kernel choice, async_grpo.py's CUDA streams). The file's flags follow its name.

    python benchmarks/as_on_a_gpu.py grpo.py --num-steps 30 --output-dir runs/as-on-a-gpu
    python benchmarks/as_on_a_gpu.py --eager grpo.py ...   the same run on the CPU's own path (bfloat16 still)
"""

import importlib.util
import os
import sys
import time

import torch
import torch._inductor.metrics
from torch._dynamo.utils import counters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def as_on_a_gpu(module):
    """Sets a loaded file's switches as a GPU run has them."""
    from torch.distributed.fsdp import FSDPModule

    def compiles(model):  # the GPU's answer (compiles() reads the device's type)
        sharded = any(isinstance(m, FSDPModule) for m in model.modules())
        return os.environ.get("TORCH_COMPILE_DISABLE") != "1" and not sharded

    module.compiles = compiles
    module.hidden_states.__defaults__ = (("cuda", "cpu"),)  # rows rolled left, as on a GPU
    module.tensor_core_mm = lambda a, b: a.float() @ b.float()  # bfloat16 parts' exact products, summed in float32
    module.stop_check_every = lambda device: 16


def main(argv):
    eager = argv[:1] == ["--eager"]
    script, *flags = argv[eager:]
    if not os.path.isfile(os.path.join(ROOT, script)):
        sys.exit(f"error: {script}: no such file in {ROOT}; name an algorithm file, as grpo.py")
    if not any(f == "--dtype" or f.startswith("--dtype=") for f in flags):
        flags += ["--dtype", "bfloat16"]
    spec = importlib.util.spec_from_file_location(os.path.basename(script)[:-3], os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not eager:
        as_on_a_gpu(module)
    sys.argv, start, end = [script, *flags], time.perf_counter(), module.end_processes

    def end_processes():  # main's last call, which under torchrun ends the process: the run's summary before it
        stats = counters["stats"]
        dropped = counters["frames"]["total"] - counters["frames"]["ok"]  # frames dynamo gave up on, run as they are
        compiled = f"{stats['unique_graphs']} graphs, {len(counters['graph_break'])} kinds of graph break, "
        compiled += f"{dropped} frames left eager, "
        compiled += f"{torch._inductor.metrics.generated_kernel_count} kernels generated"
        seconds = time.perf_counter() - start
        print(f"{script} {'eager' if eager else 'as on a GPU'}: {seconds:.1f} s; {compiled}", flush=True)
        end()

    module.end_processes = end_processes
    module.main(module.parse_args())


if __name__ == "__main__":
    if sys.argv[1:] in ([], ["--eager"]):
        sys.exit("usage: python benchmarks/as_on_a_gpu.py [--eager] FILE.py [its flags]")
    main(sys.argv[1:])
