"""The paths a GPU run takes and the default CPU run does not, shown on the CPU where the CPU can show them: the random
numbers another thread draws during a checkpointed backward pass, the output layer under bfloat16 autocast, the
reference against the policy at step 0, and the forward passes that are not generation (docs/gpu.md)."""

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from scale import grpo
from scale.grpo import add_lora, hidden_states, load_model, token_logprobs


def tiny_llama(path, vocab_size=300):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # logits at a real model's scale (their std about 3, the largest about 20)
        model.lm_head.weight.mul_(60.0)
    model.save_pretrained(path)
    return path


def flags(dtype="float32", gradient_checkpointing=False, fsdp=False):
    return SimpleNamespace(
        dtype=dtype, gradient_checkpointing=gradient_checkpointing, trust_remote_code=False, fsdp=fsdp
    )


def batch(vocab_size=300, rows=6, length=12, prompt_len=5):
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, vocab_size, (rows, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # a left-padded prompt
    return input_ids, attention_mask, prompt_len


def test_a_checkpointed_backward_pass_leaves_another_threads_random_numbers_alone(tmp_path):
    """async_grpo.py samples in a thread while the trainer trains. torch.utils.checkpoint with preserve_rng_state
    rewinds the process's generator around each recomputation, and the other thread's draws with it (the issue's
    measurement: 198 of 400 draws as undisturbed). Nothing the files checkpoint is random (dropout is off), so no
    state is saved or restored: the thread draws exactly its undisturbed sequence."""
    device = torch.device("cpu")
    model = load_model(tiny_llama(tmp_path / "m"), flags(gradient_checkpointing=True), device).train()
    input_ids, attention_mask, prompt_len = batch()
    torch.manual_seed(7)
    undisturbed = torch.rand(100_000)
    torch.manual_seed(7)
    draws, done = [], threading.Event()

    def sample():  # one draw at a time, letting the trainer run in between, as generation does
        while not done.is_set():
            draws.append(torch.rand(1).item())
            time.sleep(1e-4)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        for _ in range(40):  # the decoder's layers and the output layer's chunks are recomputed in backward
            token_logprobs(model, input_ids, attention_mask, prompt_len, chunk_values=300 * 4).sum().backward()
    finally:
        done.set()
        thread.join()
    assert len(draws) > 200
    assert torch.equal(
        torch.tensor(draws), undisturbed[: len(draws)]
    )  # random draws, not float arithmetic: bit for bit


SIX_LAYERS = """
import torch
from torch._dynamo.utils import counters

before = counters["stats"]["unique_graphs"]
for width in range(1, 7):  # six layers compiled as the files compile theirs: nn.Module's call, one code for all
    layer = torch.nn.Linear(width, 3)
    layer.compile(backend="eager", dynamic=False)
    layer(torch.randn(2, width))
made = counters["stats"]["unique_graphs"] - before
if made != 6:
    raise SystemExit(f"error: {6 - made} of 6 layers ran eagerly")
"""


def test_a_file_run_in_the_tests_process_after_others_still_compiles_its_layers(tmp_path):
    """The tests run the files in their own process (run_here), as the GPU check's learning tests do, one after
    another: each file finds torch.compile's caches empty, as in a new process. Without that, a second file's layers
    found the recompile limit of nn.Module's call spent by the first's and ran eagerly, and nothing said so."""
    from conftest import run_here

    script = tmp_path / "six_layers.py"
    script.write_text(SIX_LAYERS)
    for _ in range(2):
        proc = run_here([str(script)], tmp_path)
        assert proc.returncode == 0, proc.stderr


HEAD_PEAK = """
import sys
import torch
sys.path.insert(0, sys.argv[2])
from scale import grpo


def tensor_cores(a, b):  # bfloat16 operands, float32 sums, a block of rows at a time: the stand-in's own float32
    out, b = torch.empty(a.shape[0], b.shape[1]), b.float()  # copies stay small (tensor cores make none)
    for i in range(0, a.shape[0], 1024):
        out[i : i + 1024] = a[i : i + 1024].float() @ b
    return out


def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))


grpo.tensor_core_mm = tensor_cores
n, d, vocab = 256, 3584, 32768  # a chunk of 256 positions at a 7B model's width
torch.manual_seed(0)
hidden, weight = torch.randn(n, d, requires_grad=True), (torch.randn(vocab, d) * 0.02).requires_grad_()
parts, grad = grpo.bf16_parts(weight.detach()), torch.randn(n, vocab)
try:
    open("/proc/self/clear_refs", "w").write("5")  # the peak resident set counts from here
except OSError:
    sys.exit("no clear_refs")
start = status("VmRSS:")
if sys.argv[1] == "float32":
    logits = torch.nn.functional.linear(hidden, weight)
else:
    logits = grpo.SplitProduct.apply(hidden, weight, *parts)
logits.backward(grad)
print((status("VmHWM:") - start) / 1024)
"""


@pytest.mark.long
def test_the_split_output_layer_takes_little_more_memory_than_float32s(tmp_path):
    """The output layer's forward and backward at a 7B model's width (3,584; a chunk of 256 positions, a vocabulary of
    32,768), the tensor-core products as a CPU stand-in that copies little: the peak resident memory above the start
    at most 1.5 times float32's product's. The weight's gradient is one product over the inner dimension stacked
    (the three bfloat16 products summed by the tensor cores); made as three products and summed, with a (2 x vocab,
    d) float32 intermediate, it took 4.7 times float32's."""
    script = tmp_path / "head_peak.py"
    script.write_text(HEAD_PEAK)
    peak = {}
    for way in ("float32", "split"):
        proc = subprocess.run([sys.executable, str(script), way, ROOT], capture_output=True, text=True)
        if "no clear_refs" in proc.stderr:
            pytest.skip("this kernel lets no process reset its peak resident memory (/proc/self/clear_refs)")
        assert proc.returncode == 0, proc.stderr
        peak[way] = float(proc.stdout.split()[-1])  # MiB
    assert peak["float32"] > 400 and peak["split"] <= 1.5 * peak["float32"], peak


def test_the_split_output_layer_keeps_its_low_part_when_compiled(monkeypatch):
    """The decode step is compiled, and so is its output layer's split product: bf16_parts compiled gives eager's
    parts bit for bit (a low part that a compiled cast-and-back leaves 0), and split_product compiled, with the
    tensor-core product as a GPU computes it, is within 1e-5 of float64's product where one bfloat16 product is 1e-4
    and more away (relative, in norm)."""
    monkeypatch.setattr(grpo, "tensor_core_mm", lambda a, b: a.float() @ b.float())  # bfloat16 in, float32 sums
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, w = torch.randn(16, 256), torch.randn(256, 512)
    parts, compiled_parts = grpo.bf16_parts(w), torch.compile(grpo.bf16_parts)(w)
    assert all(torch.equal(a, b) for a, b in zip(parts, compiled_parts)) and (parts[1] != 0).float().mean() > 0.99
    exact = x.double() @ w.double()
    product = torch.compile(lambda a, b: grpo.split_product(a, *grpo.bf16_parts(b)))(x, w)
    one = x.bfloat16().double() @ w.bfloat16().double()
    assert (product.double() - exact).norm() <= 1e-5 * exact.norm() < (one - exact).norm() / 10
    torch._dynamo.reset()


def test_the_output_layer_computes_in_float32_under_bfloat16_autocast(tmp_path):
    """Rounding logits of about 20 to bfloat16 moves a log-prob by up to about 0.1, a thousand times the log-ratio of
    a small update. The output layer's matmul runs in float32 (its logits are chunked for memory already): the
    log-probs equal float32's log-softmax of the same decoder states, within 1e-5, with gradient (chunked) or not."""
    device = torch.device("cpu")
    model = load_model(tiny_llama(tmp_path / "m"), flags("bfloat16"), device)
    input_ids, attention_mask, prompt_len = batch()
    states = []
    hook = model.get_decoder().register_forward_hook(lambda module, inputs, out: states.append(out[0]))
    with torch.no_grad():
        plain = token_logprobs(model, input_ids, attention_mask, prompt_len, temperature=0.7)
    chunked = token_logprobs(model, input_ids, attention_mask, prompt_len, temperature=0.7, chunk_values=300 * 4)
    hook.remove()
    hidden = states[0][:, prompt_len - 1 : -1].float()  # (B, T, d)
    logits = hidden @ model.lm_head.weight.float().T / 0.7  # (B, T, vocab), in float32
    assert logits.abs().max() > 10  # at a real model's scale, where bfloat16 logits are off by 0.03 to 0.1
    by_hand = logits.log_softmax(-1).gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)
    torch.testing.assert_close(plain, by_hand, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked.detach(), by_hand, atol=1e-5, rtol=0)


def test_the_frozen_reference_computes_as_the_policy_at_step_0_under_bfloat16(tmp_path):
    """The reference (frozen) and the policy (trained) load the same weights and run the same autocast over weights
    of the same dtype, so their log-probs agree to float32 rounding at step 0 and the KL starts at 0 (a reference held
    in bfloat16 beside float32 masters was off by 4e-4 a token on average)."""
    device = torch.device("cpu")
    path = tiny_llama(tmp_path / "m")
    policy = load_model(path, flags("bfloat16"), device)
    reference = load_model(path, flags("bfloat16"), device, frozen=True)
    assert not any(p.requires_grad for p in reference.parameters())
    input_ids, attention_mask, prompt_len = batch()
    with torch.no_grad():
        a = token_logprobs(policy, input_ids, attention_mask, prompt_len)
        b = token_logprobs(reference, input_ids, attention_mask, prompt_len)
    assert (a - b).abs().max() < 1e-5


def test_forward_passes_that_are_not_generation_build_no_kv_cache(tmp_path):
    device = torch.device("cpu")
    model = load_model(tiny_llama(tmp_path / "m"), flags(), device)
    seen = []
    decoder = model.get_decoder()
    hook = decoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("use_cache")), with_kwargs=True
    )
    input_ids, attention_mask, prompt_len = batch()
    token_logprobs(model, input_ids, attention_mask, prompt_len).sum().backward()
    with torch.no_grad():
        token_logprobs(model, input_ids, attention_mask, prompt_len)
    hook.remove()
    assert seen == [False, False]


def test_rows_rolled_left_give_the_padded_rows_log_probs_and_gradients(tmp_path, monkeypatch):
    """On a GPU, hidden_states runs each row rolled left to its first attended token, with no mask but the causal one
    (flash attention, each key-value head read once). Against the padded rows under their mask (the CPU's pass), on a
    Llama with grouped key-value heads and on the bundled model: the same log-probs and gradients to 1e-5, rows
    padded on both sides and one not at all; and a score head's states (reward_model.py, ppo.py's values) at every
    attended position."""
    device = torch.device("cpu")
    tiny = tiny_llama(tmp_path / "m")
    config = LlamaConfig.from_pretrained(tiny)
    config.num_key_value_heads = 2
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gqa")
    input_ids, attention_mask, prompt_len = batch(vocab_size=18, rows=5, length=14, prompt_len=6)
    attention_mask[1, :4] = 0  # left-padded prompts
    attention_mask[2, :1] = 0
    attention_mask[1, 11:] = 0  # completions that stopped
    attention_mask[3, 9:] = 0
    plain = hidden_states
    for path in (tmp_path / "gqa", "tiny-adder"):
        found = []
        for rolled_on in ((), ("cpu",)):
            monkeypatch.setattr(grpo, "hidden_states", lambda *a, on=rolled_on: plain(*a, rolled_on=on))
            model = load_model(str(path), flags(), device)
            logprobs = token_logprobs(model, input_ids, attention_mask, prompt_len)
            (logprobs * attention_mask[:, prompt_len:]).sum().backward()
            found.append((logprobs, [p.grad for p in model.parameters()]))
        (a, grads_a), (b, grads_b) = found
        kept = attention_mask[:, prompt_len:].bool()
        assert (a - b)[kept].abs().max() < 1e-5, path
        for x, y in zip(grads_a, grads_b):
            assert (x - y).abs().max() <= 1e-5 * (1 + x.abs().max()), path
    scorer = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    with torch.no_grad():
        a, b = (plain(scorer, input_ids, attention_mask, rolled_on=on) for on in ((), ("cpu",)))
    assert a.shape == b.shape and (a - b)[attention_mask.bool()].abs().max() < 1e-5


@pytest.mark.long
def test_the_layers_compiled_for_whole_sequences_give_the_eager_layers_log_probs_gradients_and_rollouts(
    tmp_path, monkeypatch
):
    """On a GPU, load_model compiles each decoder layer (regional compile, inductor): here on the CPU, compiles()
    saying yes, rows rolled as a GPU rolls them, checkpointed. Against the eager layers, three widths each: in
    float32 the log-probs and gradients to float32's rounding; in bfloat16 log-probs as near to float32's as the
    eager layers' are, on average (the largest gaps vary from one CPU kind to another); without gradient (pi_old's
    pass, the reference's) the log-probs of the pass with it; no graph more for the second and third widths. A
    rollout runs the layers as they are (gathered()): the tokens of the layers made plain by hand, the layers
    compiled again after it.
    Under --fsdp no layer is compiled."""
    from torch._dynamo.utils import counters

    device, path, plain = torch.device("cpu"), tiny_llama(tmp_path / "m"), hidden_states
    monkeypatch.setattr(grpo, "hidden_states", lambda *a: plain(*a, rolled_on=("cpu",)))
    monkeypatch.setattr(grpo, "compile_step", lambda f: torch.compile(f, backend="eager", fullgraph=True))
    torch._dynamo.reset()

    def load(dtype, compiled, fsdp=False):
        with monkeypatch.context() as m:
            m.setattr(grpo, "compiles", lambda model: compiled)
            model = load_model(path, flags(dtype, gradient_checkpointing=True, fsdp=fsdp), device)
        layers, expected = grpo.decoder_layers(model), compiled and not fsdp
        assert len(layers) == 2 and all((layer._compiled_call_impl is not None) == expected for layer in layers)
        return model

    def passes(model):
        found, graphs = [], []
        for rows, length in ((6, 12), (4, 9), (6, 15)):
            input_ids, attention_mask, prompt_len = batch(rows=rows, length=length)
            model.train().zero_grad()
            logprobs = token_logprobs(model, input_ids, attention_mask, prompt_len)
            logprobs.sum().backward()
            with torch.no_grad():
                again = token_logprobs(model.eval(), input_ids, attention_mask, prompt_len)
            found.append((logprobs.detach(), again, [p.grad.clone() for p in model.parameters()]))
            graphs.append(counters["stats"]["unique_graphs"])
        assert len(set(graphs)) == 1, f"graphs after each width: {graphs}"
        return found

    exact = passes(load("float32", False))
    compiled_model = load("float32", True)
    for (a, _, grads_a), (b, again, grads_b) in zip(exact, passes(compiled_model)):
        assert (a - b).abs().max() < 2e-5 and (b - again).abs().max() < 1e-5  # the KL starts at 0
        for x, y in zip(grads_a, grads_b):
            assert (x - y).abs().max() <= 1e-5 * (1 + x.abs().max())
    eager, compiled = passes(load("bfloat16", False)), passes(load("bfloat16", True))
    assert all((c - again).abs().max() < 1e-5 for c, again, _ in compiled)
    gaps = [torch.cat([(b - a).flatten() for (a, _, _), (b, _, _) in zip(exact, way)]) for way in (eager, compiled)]
    assert gaps[1].abs().mean() <= 1.5 * gaps[0].abs().mean(), "bfloat16's compiled layers further from float32's"

    pad, ids, mask = SimpleNamespace(pad_token_id=0), *batch(rows=3, length=6)[:2]
    called = []
    hook = (
        compiled_model.get_decoder()
        .layers[0]
        .register_forward_pre_hook(lambda layer, args: called.append(layer._compiled_call_impl))
    )
    with monkeypatch.context() as m:
        m.setattr(grpo, "compiles", lambda model: True)  # the compiled step, and its prefill eager
        tokens = grpo.generate(compiled_model, pad, ids, mask, 5, None, [-1])
        hook.remove()
        kept = {layer: layer._compiled_call_impl for layer in grpo.decoder_layers(compiled_model)}
        assert set(called) == {None} and None not in kept.values()  # plain in the rollout, compiled after it
        for layer in kept:  # the same rollout with the layers made plain by hand: the same computation
            layer._compiled_call_impl = None
        assert torch.equal(tokens, grpo.generate(compiled_model, pad, ids, mask, 5, None, [-1]))
    load("float32", True, fsdp=True)
    torch._dynamo.reset()


@pytest.mark.long
def test_the_compiled_layers_benchmark_counts_fewer_operations_compiled(monkeypatch):
    """benchmarks/compiled_layers.py at a small layer shape: a compiled layer runs fewer ATen operations than an eager
    one, the rest in kernels inductor generated."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import compiled_layers

    for name in ("compiles", "hidden_states", "tensor_core_mm"):  # the benchmark sets them as a GPU run has them
        monkeypatch.setattr(grpo, name, getattr(grpo, name))
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    found = compiled_layers.main(rows=2, width=16, shape=shape)
    eager, compiled = (found[2, way][0] - found[1, way][0] for way in (False, True))
    assert 0 < compiled < eager and found[1, True][1] > 0 and found[1, False][1] == 0, found
    torch._dynamo.reset()


def test_torch_compile_disable_runs_a_gpu_run_eagerly(monkeypatch):
    """TORCH_COMPILE_DISABLE=1, torch's switch, makes compiles() say no on a GPU too (a stand-in for a CUDA model):
    the rollouts' step, load_model's layers and the tensor-core head then run eagerly, where the compiled step,
    compiled whole, would raise under it."""
    model = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda"))]), modules=list)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    assert grpo.compiles(model)
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    assert not grpo.compiles(model)


def test_a_checkpoints_random_states_bring_back_numpys_too(tmp_path):
    """vLLM's CUDA model runner seeds each request from numpy's global generator: a checkpoint keeps its state with
    torch's, Python's and the loop's generators (through torch.load's weights-only unpickler), so that a resumed
    --vllm run samples as the uninterrupted one."""
    import random

    import numpy

    from scale.grpo import resume, save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_llama(tmp_path / "m"))
    optimizer = torch.optim.AdamW(model.parameters())
    tokenizer = SimpleNamespace(save_pretrained=lambda path: None)
    shuffle = torch.Generator().manual_seed(5)
    assert resume(None, {"m": model}, optimizer, [shuffle]) == (1, {})  # a new run, as main() starts one
    save_checkpoint(
        SimpleNamespace(save_every=1, keep_checkpoints=1),
        str(tmp_path),
        3,
        tokenizer,
        {"m": model},
        optimizer,
        [shuffle],
        signal=2,
    )

    def draws():
        return (
            numpy.random.rand(3).tolist(),
            random.random(),
            torch.rand(2).tolist(),
            torch.rand(2, generator=shuffle).tolist(),
        )

    first = draws()
    assert resume(str(tmp_path / "checkpoints" / "step_000003"), {"m": model}, optimizer, [shuffle]) == (
        4,
        {"signal": 2},
    )
    assert draws() == first


def test_the_bfloat16_cost_benchmark_runs_and_measures_a_gap():
    """benchmarks/bf16_costs.py (docs/gpu.md's timings), on a small model: it times both ways of each choice, and
    the bfloat16 output layer's logits do move the log-probs (at a real model's logit scale)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bf16_costs

    per_token, one, float32_seconds, bfloat16_seconds, gap = bf16_costs.main(
        hidden_size=112, intermediate_size=224, vocab_size=4096, repeats=1
    )
    assert min(per_token, one, float32_seconds, bfloat16_seconds) > 0 and gap > 1e-3


def lora_flags(dtype, target_modules=("all-linear",)):
    return SimpleNamespace(**vars(flags(dtype)), lora_r=4, lora_alpha=8.0, lora_target_modules=list(target_modules))


def test_lora_under_bfloat16_casts_no_frozen_decoder_weight_at_every_token(tmp_path):
    """Autocast caches its bfloat16 copy of a float32 weight only for a weight that is trained: peft's frozen bases
    were cast again at every generated token. They are held in bfloat16 now, which computes exactly as autocast's
    cast did; the embedding, the norms and the output layer (which the log-probs multiply in float32) stay float32,
    and generate() multiplies the output layer in float32 too, so no frozen weight is cast (docs/gpu.md)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from scale.grpo import generate

    device, path = torch.device("cpu"), tiny_llama(tmp_path / "m")
    policy = add_lora(load_model(path, lora_flags("bfloat16"), device), lora_flags("bfloat16"))
    dtypes = {n: p.dtype for n, p in policy.named_parameters()}
    frozen_linear = [n for n in dtypes if "proj.base_layer" in n]
    assert len(frozen_linear) == 14 and all(dtypes[n] == torch.bfloat16 for n in frozen_linear)
    assert all(dtypes[n] == torch.float32 for n in dtypes if n not in frozen_linear)  # lora_, norms, embedding, head
    names = {p.untyped_storage().data_ptr(): n for n, p in policy.named_parameters()}
    casts = dict.fromkeys(dtypes, 0)

    class CountCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = names.get(args[0].untyped_storage().data_ptr()) if args and torch.is_tensor(args[0]) else None
            if func is torch.ops.aten._to_copy.default and name and kwargs.get("dtype") == torch.bfloat16:
                casts[name] += 1
            return func(*args, **kwargs)

    prompt_ids, prompt_mask, _ = batch(length=5)
    forwards = []
    hook = policy.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    with CountCasts():
        generate(policy, SimpleNamespace(pad_token_id=0), prompt_ids, prompt_mask, 10, None, [-1])
    hook.remove()
    assert len(forwards) == 10
    head = "base_model.model.lm_head.weight"
    assert casts.pop(head) == 0  # frozen and float32: the logits multiply it in float32 (it was cast at each token)
    assert all(n == 0 for k, n in casts.items() if k in frozen_linear)  # was 10 each
    assert all(n == 1 for k, n in casts.items() if "lora_" in k)  # trained: cast once, cached for the rollout
    # at no loss: the adapters start at zero, and the policy's log-probs are those of the plain model under autocast
    plain = load_model(path, flags("bfloat16"), device)
    input_ids, attention_mask, prompt_len = batch()
    with torch.no_grad():
        a = token_logprobs(policy, input_ids, attention_mask, prompt_len)
        b = token_logprobs(plain, input_ids, attention_mask, prompt_len)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_the_engine_takes_the_merged_weights_a_layer_at_a_time(tmp_path):
    """sync_engine hands vLLM the LoRA-merged weights lazily: when the engine takes a merged weight, no other merged
    copy is alive (they were all built first, a float32 copy of every adapted layer beside the trainer's weights).
    Each is W + (alpha / r) B A, worked from the layer's own tensors, and the policy's weights are left as they were
    (never merged into and back)."""
    import gc
    import weakref

    from scale.grpo import sync_engine

    device, path = torch.device("cpu"), tiny_llama(tmp_path / "m")
    policy = add_lora(load_model(path, lora_flags("float32"), device), lora_flags("float32"))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    layers = {n: m for n, m in policy.get_base_model().named_modules() if hasattr(m, "get_delta_weight")}
    taken, alive_at_take = {}, []

    class Engine:  # vLLM's side of a weight sync: takes the weights one at a time
        llm_engine = SimpleNamespace(is_sleeping=lambda: False)

        def collective_rpc(self, method, kwargs):
            refs = []
            for name, tensor in kwargs["weights_iterator"]:
                gc.collect()
                if name[: -len(".weight")] in layers:
                    alive_at_take.append(sum(r() is not None for r in refs))
                    refs.append(weakref.ref(tensor))
                taken[name] = tensor.clone()

        def reset_prefix_cache(self):
            pass

    sync_engine(Engine(), policy)
    assert len(alive_at_take) == 14 and max(alive_at_take) == 0  # was 1, 2, ..., 13
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert taken.keys() == plain.state_dict().keys()
    for name, layer in layers.items():
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (r, in), (out, r)
        by_hand = layer.base_layer.weight + (8.0 / 4) * b @ a
        torch.testing.assert_close(taken[f"{name}.weight"], by_hand.detach(), atol=1e-6, rtol=0)
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())


def test_the_lora_cast_benchmark_counts_the_casts_both_ways():
    """benchmarks/lora_casts.py (docs/gpu.md's counts), on the bundled model: with its 14 frozen linear layers in
    float32 (as before) a token casts them, 14; held in bfloat16, none (generate() multiplies the output layer in
    float32: it cast it at each token, 15 and 1, before the decode loop of its own)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import lora_casts

    found = lora_casts.main(sequences=2, new_tokens=4, repeats=1)
    assert found["float32 (before)"][0] == 14 and found["bfloat16 (add_lora)"][0] == 0
    assert all(speed > 0 for _, _, speed in found.values())


@pytest.mark.long
def test_the_device_scripts_first_part_runs_at_a_small_shape_and_a_step_cut_short_is_still_told(tmp_path):
    """benchmarks/gpu_check.sh 1 --small on the CPU: scale/grpo.py's default run, its accuracy and rollout/logprob_diff
    told in steps.log, the README's GPU step with its metrics kept, the profile's table; and with every limit cut to
    2 s (CAP), each step is still told, with the timeout's exit."""
    script = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
    env = {**os.environ, "OUT": str(tmp_path / "cut"), "CAP": "2"}
    subprocess.run(["bash", script, "1", "--small"], cwd=ROOT, env=env, check=True, capture_output=True)
    told = (tmp_path / "cut" / "steps.log").read_text()
    assert [line.split(":")[0] for line in told.splitlines() if "exit" in line] == ["default", "readme", "profile"]
    assert told.count("exit 124") == 3, told
    env = {**os.environ, "OUT": str(tmp_path / "whole")}
    subprocess.run(["bash", script, "1", "--small"], cwd=ROOT, env=env, check=True, capture_output=True)
    told = (tmp_path / "whole" / "steps.log").read_text()
    assert told.count("exit 0") == 3 and "held-out accuracy 0.348 -> " in told and "rollout/logprob_diff mean" in told
    steps = [json.loads(line) for line in (tmp_path / "whole" / "readme" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "charts/step_time" in m] == [1, 2, 3]
    assert not (tmp_path / "whole" / "readme" / "model.safetensors").exists()
    assert "Self CPU" in (tmp_path / "whole" / "profile.log").read_text()


@pytest.mark.long
def test_the_gpu_check_runs_every_step_on_the_cpu():
    """benchmarks/gpu_benchmark.py --check, the decode loop's GPU half step by step (issue 63), at a small shape on
    the CPU (nothing compiled, no GPU memory): its ten steps in order, the eager bfloat16 rollout's tokens, the
    grouped attention level with transformers' to bfloat16's rounding, one cache held after a smaller batch followed
    a larger one, the profile's table, the output layer's three tensor-core products (as a CPU computes them)
    within 1e-3 of float32's logits (of std 10) and 1e-4 of its gradients, relative, an update's micro-batch
    rolled left as near the padded rows' log-probs, and through the compiled layers, as bfloat16 allows, that
    micro-batch at three sizes, and a decoded token's linear layers fused as near the seven products as bfloat16
    allows."""
    from conftest import run_script

    out = run_script(
        "benchmarks/gpu_benchmark.py", "--check", "--small", "--batch", "4", "--max-new-tokens", "4"
    ).stdout
    steps = [line.split(".")[0] for line in out.splitlines() if re.match(r"\d+\. ", line)]
    assert steps == ["1", "2", "3", "4", "5", "5", "6", "6", "7", "7", "8", "9", "10"], out
    for line in [line for line in out.splitlines() if line.startswith("7.")]:  # the three products against float32's
        logits, grads = (float(x) for x in re.findall(r"(\S+) apart", line))
        assert logits < 1e-3 and grads < 1e-4, line
    assert "a 4-token bfloat16 eager generate(), 4 prompts: (4, 4) tokens" in out, out
    gap = float(out.split("outputs ")[1].split(" apart")[0])
    assert gap < 1e-2, out  # bfloat16 inputs, summed in another order
    assert "grouped over the written half alone" in out, out
    held = [line for line in out.splitlines() if "caches held" in line]
    assert len(held) == 2 and all("caches held: 1," in line for line in held), out
    assert "Name" in out and "Self CPU" in out, out  # the profile's top operations
    update = next(line for line in out.splitlines() if line.startswith("8."))
    padded, compiled = (float(x) for x in re.findall(r"(\S+) \((?:padded|compiled)\)", update))
    assert padded < 5e-2 and compiled < 5e-2, update
    sizes = next(line for line in out.splitlines() if line.startswith("9."))
    assert [int(n) for n in re.findall(r"(\d+) rows \S+ ms a row", sizes)] == [8, 16, 32] * 2, sizes  # with, without
    apart = re.search(r"log-probs at most (\S+), (\S+), (\S+) apart", sizes)  # the update's pass and pi_old's
    assert apart and all(float(x) < 1e-5 for x in apart.groups()), sizes
    linears = next(line for line in out.splitlines() if line.startswith("10."))
    assert float(linears.split("outputs ")[1].split(" apart")[0]) < 1e-2, linears  # the same products, fused


@pytest.mark.long
def test_a_run_as_on_a_gpu_compiles_whole_and_writes_a_runs_metrics(tmp_path, monkeypatch):
    """benchmarks/as_on_a_gpu.py: grpo.py's run on the path only a GPU takes (compiles() yes: the layers and the
    rollouts' step compiled by inductor, the output layer's bfloat16 parts, rows rolled, bfloat16), two steps with a
    rollout, the reference's pass and an update each: it ends, every compile whole (no graph break, no frame that
    dynamo gave up on), its metrics written; and its numbers are a run's (rewards in [0, 1], a finite loss)."""
    from conftest import read_metrics, run_script

    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)  # the subprocess's environment is this one

    out = tmp_path / "run"
    small = ["--num-steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--micro-batch-size", "2"]
    small += ["--num-eval", "2", "--eval-every", "2", "--max-new-tokens", "6"]
    proc = run_script("benchmarks/as_on_a_gpu.py", "scale/grpo.py", *small, "--output-dir", str(out))
    summary = r"grpo.py as on a GPU: \S+ s; (\d+) graphs, (\d+) kinds of graph break, (\d+) frames left eager, (\d+)"
    ran = re.search(summary, proc.stdout)
    assert ran and int(ran[1]) >= 3 and int(ran[2]) == int(ran[3]) == 0 and int(ran[4]) > 0, proc.stdout[-2000:]
    last = read_metrics(str(out))[-1]
    assert last["step"] == 2 and 0 <= last["charts/reward"] <= 1 and math.isfinite(last["losses/loss"]), last
