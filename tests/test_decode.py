"""The shared decode loop, generate(): the distribution it samples, its host synchronisations, its compiled step."""

import contextlib
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
import transformers
from conftest import ROOT, run_script
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

from scale import grpo
from scale.grpo import completion_mask, draw, forward, generate, token_logprobs

TINY_ADDER = os.path.join(ROOT, "tiny-adder")


def test_draw_samples_each_token_at_its_probability():
    """Probabilities 0.1, 0.2, 0.7 and an entry of probability 0: at temperature 1 drawn as often as that, at
    temperature 0.5 as 0.01 : 0.04 : 0.49 (p^2, normalised: 0.0185, 0.0741, 0.9074), the zero never; each draw's
    log-prob is the log of its probability at that temperature; greedy (temperature 0, or None) takes the largest."""
    logits = torch.tensor([math.log(0.1), math.log(0.2), math.log(0.7), -math.inf]).repeat(50_000, 1)
    torch.manual_seed(0)
    for temperature, expected in ((1.0, [0.1, 0.2, 0.7, 0.0]), (0.5, [0.01 / 0.54, 0.04 / 0.54, 0.49 / 0.54, 0.0])):
        token, logprob = draw(logits, torch.tensor(temperature), torch.rand(len(logits), 1, dtype=torch.float64))
        share = torch.bincount(token, minlength=4) / len(token)
        assert share[3] == 0
        for seen, p in zip(share.tolist(), expected):
            assert abs(seen - p) < 4 * math.sqrt(p * (1 - p) / len(token)) + 1e-9, (temperature, share, expected)
        torch.testing.assert_close(logprob, torch.tensor(expected).log()[token], atol=1e-6, rtol=0)
    for heat in (torch.tensor(0.0), None):  # a compiled step's greedy, and an eager step's
        token, logprob = draw(logits[:2], heat, torch.full((2, 1), 0.99, dtype=torch.float64))
        assert token.tolist() == [2, 2] and logprob.tolist() == [0.0, 0.0]


def test_draw_finds_in_two_levels_the_token_the_plain_cumulative_sums_find():
    """first_past (the blocks' sums first, then within the block) draws the entry whose plain float64 cumulative
    share passes u, on Qwen's vocabulary of 151,936 (148.375 blocks of 1,024), on one of 2,048 (two whole blocks) and
    on a small one (one block), wherever u is farther than 1e-6 of the total from every sum (the blocks' sums are
    float32 ones); and an entry of probability 0 is never drawn, even at u = 0 or at a block's edge."""
    torch.manual_seed(0)
    for vocab in (151_936, 2048, 37):
        logits = 3 * torch.randn(64, vocab)
        probs = logits.log_softmax(-1).exp().double()
        plain = probs.cumsum(-1)
        u = torch.rand(64, 1, dtype=torch.float64)
        token, _ = draw(logits, torch.tensor(1.0), u)
        expected = (plain < u * plain[:, -1:]).sum(-1)  # the entries whose sum stays below u: the first one above
        far = ((plain - u * plain[:, -1:]).abs() > 1e-6 * plain[:, -1:]).all(-1)  # rows where rounding cannot decide
        assert far.sum() > 32 and token[far].tolist() == expected[far].tolist(), vocab
    logits = torch.full((3, 3000), -math.inf)
    logits[:, [5, 1023, 1024, 2999]] = 0.0  # four tokens of 1/4, two of them either side of the first blocks' edge
    u = torch.tensor([[0.0], [0.5], [0.9999999]], dtype=torch.float64)
    assert draw(logits, torch.tensor(1.0), u)[0].tolist() == [5, 1024, 2999]


def test_generate_draws_one_uniform_number_a_row_and_none_for_greedy():
    """torch.multinomial drew a number for each vocabulary entry (72% of a token's time on a CPU at 151,936
    entries): a sampled token takes one uniform number a row, as many for a vocabulary of 8 as for one of 50,000,
    the rows that pad the batch to the cache's none of their own; greedy takes none, so that an evaluation leaves
    training's random numbers as they are; draw() itself takes none."""
    for temperature, taken in ((1.0, 3), (None, 0)):
        torch.manual_seed(0)
        u = grpo.uniform(5, 3, temperature, torch.device("cpu"))
        after = torch.rand(1).item()
        torch.manual_seed(0)
        torch.rand(taken, 1, dtype=torch.float64)
        assert after == torch.rand(1).item() and u.shape == (5, 1) and u.dtype == torch.float64
        assert torch.equal(u[3:], u[:1].expand(2, 1))
    states = []
    for vocab in (8, 50_000):
        torch.manual_seed(0)
        draw(torch.zeros(4, vocab), torch.tensor(1.0), torch.rand(4, 1, dtype=torch.float64))
        states.append(torch.rand(1).item())
    assert states[0] == states[1]


def tiny(kind):
    torch.manual_seed(0)
    if kind == "gpt2":  # absolute position embeddings
        config = GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=2)
    else:  # rotary position embeddings; "gqa": 2 key-value heads for the 4 query heads, as Qwen's models have
        config = LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2 if kind == "gqa" else 4,
            max_position_embeddings=64,
            eos_token_id=2,
            pad_token_id=0,
        )
    return AutoModelForCausalLM.from_config(config).eval()


def models(chat_model_dir):
    """(name, model, tokenizer-like, prompt ids, prompt mask, stop ids): left-padded prompts of unequal lengths."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_ADDER)
    adder = AutoModelForCausalLM.from_pretrained(TINY_ADDER).eval()
    ids, mask = grpo.tokenize_prompts(tokenizer, ["3+4=", "12+30=", "7+88="], "cpu", grpo.Args())
    yield "tiny-adder", adder, tokenizer, ids, mask, grpo.stop_token_ids(tokenizer, adder)
    chat = grpo.load_tokenizer(chat_model_dir, False)
    qwen = AutoModelForCausalLM.from_pretrained(chat_model_dir).eval()  # its output layer tied to the embedding
    args = grpo.Args(model_name_or_path=chat_model_dir)
    ids, mask = grpo.tokenize_prompts(chat, ["What is 2 + 3?", "Name a colour, please."], "cpu", args)
    yield "tied qwen2", qwen, chat, ids, mask, grpo.stop_token_ids(chat, qwen)
    prompt_ids = torch.tensor([[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]])
    for kind in ("gpt2", "llama"):
        yield kind, tiny(kind), SimpleNamespace(pad_token_id=0), prompt_ids, (prompt_ids != 0).long(), [2]


def test_the_loop_samples_from_the_plain_forward_pass(chat_model_dir, monkeypatch):
    """At every position the loop's float32 logits equal the model's plain forward pass over prompt and completion
    to 1e-5 (the static cache sums in another order), the log-probs it returns equal token_logprobs' (the
    training's pi_old, at the temperature: without it they are far off), greedy completions equal transformers'
    generate(), and the same seed gives the same tokens."""
    for case in models(chat_model_dir):
        check_the_loop(*case, monkeypatch)


def test_the_loop_samples_from_the_plain_forward_pass_of_smollm2(real_model_dir, monkeypatch):
    """The same on SmolLM2-135M-Instruct (30 layers, a 49,152-token vocabulary, its chat template), to 1e-4: its
    logits reach 38, and 30 layers in float32 sum to 6.5e-5 apart in another order (transformers' generate(), with
    its dynamic cache, is 5.1e-5 from the plain forward pass here)."""
    tokenizer = grpo.load_tokenizer(real_model_dir, False)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir).eval()
    args = grpo.Args(model_name_or_path=real_model_dir)
    ids, mask = grpo.tokenize_prompts(tokenizer, ["What is 12 + 30?", "Name a colour."], "cpu", args)
    stops = grpo.stop_token_ids(tokenizer, model)
    check_the_loop("SmolLM2", model, tokenizer, ids, mask, stops, monkeypatch, tolerance=1e-4)


def check_the_loop(name, model, tokenizer, ids, mask, stops, monkeypatch, tolerance=1e-5):
    seen = []
    monkeypatch.setattr(grpo, "draw", lambda logits, heat, u: seen.append(logits) or draw(logits, heat, u))
    torch.manual_seed(3)
    tokens, logprobs = generate(model, tokenizer, ids, mask, 12, 0.7, stops, with_logprobs=True)
    cmask = completion_mask(tokens, stops)
    full_ids, full_mask = torch.cat([ids, tokens], 1), torch.cat([mask, cmask.long()], 1)
    with torch.no_grad():
        plain = forward(model, full_ids, full_mask).logits[:, ids.shape[1] - 1 : -1].float()  # (B, T, vocab)
        training = token_logprobs(model, full_ids, full_mask, ids.shape[1], 0.7, chunk_values=1)  # a row a chunk
        untempered = token_logprobs(model, full_ids, full_mask, ids.shape[1], 1.0)
    loop = torch.stack(seen, dim=1)[:, : tokens.shape[1]]
    assert loop.shape == plain.shape, name
    torch.testing.assert_close(loop[cmask], plain[cmask], atol=tolerance, rtol=0, msg=name)
    torch.testing.assert_close(logprobs[cmask], training[cmask], atol=tolerance, rtol=0, msg=name)
    assert (logprobs[cmask] - untempered[cmask]).abs().max() > 1e-2, name  # the check tells them apart
    assert (logprobs[~cmask] == 0).all() and (tokens[~cmask] == tokenizer.pad_token_id).all(), name
    torch.manual_seed(3)
    assert torch.equal(generate(model, tokenizer, ids, mask, 12, 0.7, stops), tokens), name
    greedy = generate(model, tokenizer, ids, mask, 12, None, stops)
    reference = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
    )[:, ids.shape[1] :]  # fmt: skip
    with torch.no_grad():  # each greedy choice's margin: a near tie may go either way in another summation order
        top = forward(model, torch.cat([ids, reference], 1), torch.cat([mask, torch.ones_like(reference)], 1))
    top = top.logits[:, ids.shape[1] - 1 : -1].float().topk(2, dim=-1).values  # (B, T, 2)
    # positions before any near tie: the loop is held to `tolerance` of the plain pass, generate() about as far off
    clear = int((top[..., 0] - top[..., 1] > max(1e-4, 4 * tolerance)).all(0).long().cumprod(0).sum())
    assert clear > 0 and torch.equal(greedy[:, :clear], reference[:, :clear]), name
    if clear == reference.shape[1]:
        assert torch.equal(greedy, reference), name


def test_a_switch_mid_rollout_samples_each_token_under_the_weights_of_its_time():
    """AReaL's interruption on the shared loop (async_grpo.py --interrupt-every): a stand-in switch loads version
    v + 1 between tokens 6 and 7 of a rollout. The log-probs of tokens 0-6 are version v's and those from token 7
    on version v + 1's, each equal to a fresh forward pass of that version over the same prompt and prefix (the
    rebuilt cache gives its logits, on left-padded prompts of unequal lengths, its 7 tokens refilled in chunks as
    wide as the prompts: 5 and 2); a switch that changes nothing gives the loop's rollout without one, token for
    token."""
    import copy

    prompt_ids = torch.tensor([[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]])
    prompt_mask, pad = (prompt_ids != 0).long(), SimpleNamespace(pad_token_id=0)
    version = [tiny("llama"), tiny("llama")]
    with torch.no_grad():
        for weight in version[1].parameters():
            weight.add_(0.05 * torch.randn_like(weight))
    sampler, asked, chunks = copy.deepcopy(version[0]), [], []

    def switch(t, going):
        asked.append(t)
        if t == 7:
            sampler.load_state_dict(version[1].state_dict())
        return t == 7

    hook = sampler.get_decoder().register_forward_hook(
        lambda module, args, kwargs, out: chunks.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    torch.manual_seed(5)
    tokens, logprobs = generate(sampler, pad, prompt_ids, prompt_mask, 12, 1.0, [-1], with_logprobs=True, switch=switch)
    hook.remove()
    assert asked == list(range(1, 12)) and tokens.shape == (3, 12)  # between every two of the 12 tokens
    assert chunks == [5] + [1] * 6 + [5, 5, 2] + [1] * 4  # the prefill, 6 steps, the refill, 4 steps
    full_ids, full_mask = torch.cat([prompt_ids, tokens], 1), torch.cat([prompt_mask, torch.ones_like(tokens)], 1)
    with torch.no_grad():
        fresh = [token_logprobs(model, full_ids, full_mask, prompt_ids.shape[1], 1.0) for model in version]
    torch.testing.assert_close(logprobs[:, :7], fresh[0][:, :7], atol=1e-5, rtol=0)
    torch.testing.assert_close(logprobs[:, 7:], fresh[1][:, 7:], atol=1e-5, rtol=0)
    assert (fresh[0][:, 7:] - fresh[1][:, 7:]).abs().max() > 1e-2  # the two versions are told apart
    sampler.load_state_dict(version[0].state_dict())
    torch.manual_seed(5)
    unswitched = generate(sampler, pad, prompt_ids, prompt_mask, 12, 1.0, [-1], with_logprobs=True)
    torch.manual_seed(5)
    no_change = generate(sampler, pad, prompt_ids, prompt_mask, 12, 1.0, [-1], True, lambda t, going: False)
    assert torch.equal(unswitched[0], no_change[0])
    torch.testing.assert_close(unswitched[1], no_change[1], atol=1e-6, rtol=0)


def test_the_switch_sees_whether_a_row_goes_on(monkeypatch):
    """With a GPU's look at the stop every 16 tokens, rows that all stop by their third token: going() says True up
    to then and False after, so async_grpo.py's generator makes no switch once every row has stopped."""
    model = tiny("llama")
    prompt_ids = torch.tensor([[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]])
    prompt_mask, pad = (prompt_ids != 0).long(), SimpleNamespace(pad_token_id=0)
    monkeypatch.setattr(grpo, "stop_check_every", lambda device: 16)  # the same rollout, stopped at its third tokens
    stops = sorted(set(generate(model, pad, prompt_ids, prompt_mask, 8, None, [-1])[:, 2].tolist()))
    seen = []
    tokens = generate(model, pad, prompt_ids, prompt_mask, 8, None, stops, switch=lambda t, going: seen.append(going()))
    longest = completion_mask(tokens, stops).sum(1).max().item()
    assert longest <= 3 and seen == [True] * (longest - 1) + [False] * (8 - longest)


class CountSyncs(TorchDispatchMode):
    """Counts the operations that make the host wait for the device (a value read back, a shape that depends on
    one), and the forward passes' tokens."""

    WAITS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "unique", "allclose"}

    def __init__(self):
        super().__init__()
        self.waits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.WAITS:
            self.waits.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("new_tokens", [8, 64])
def test_the_loop_waits_on_the_device_once_in_16_tokens_on_a_gpu(new_tokens, monkeypatch):
    """With a GPU's stop check (every 16 tokens), a rollout of 8 and of 64 tokens that no row stops waits for the
    device once before its first token (transformers' mask for the prompts reads the padding), after every 16th
    token but the last, and once at the end (the completions' length): 2 and 5 waits, 0.08 a token at 64
    (transformers' generate() waited 2.2 times a token, docs/gpu.md); none for the NaN guard or the sampling. On
    a CPU it looks after every token, where a look waits for nothing and a token past the last stop costs a
    forward pass."""
    model = tiny("llama")
    prompt_ids = torch.tensor([[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]])
    prompt_mask, pad = (prompt_ids != 0).long(), SimpleNamespace(pad_token_id=0)
    assert grpo.stop_check_every(torch.device("cuda")) == 16 and grpo.stop_check_every(torch.device("cpu")) == 1
    monkeypatch.setattr(grpo, "stop_check_every", lambda device: 16)
    with CountSyncs() as counter:
        tokens = generate(model, pad, prompt_ids, prompt_mask, new_tokens, 1.0, [-1])
    assert tokens.shape[1] == new_tokens
    assert counter.waits == ["_local_scalar_dense"] * ((new_tokens - 1) // 16 + 2)


def test_the_loop_stops_at_the_longest_completion():
    """Greedy rows whose third token (or an earlier one) stops them: the loop runs as many forward passes as the
    longest row has tokens (the prefill and one a token after the first), not --max-new-tokens' 20, and the
    completions are cut there."""
    model = tiny("llama")
    prompt_ids = torch.tensor([[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]])
    prompt_mask, pad = (prompt_ids != 0).long(), SimpleNamespace(pad_token_id=0)
    unstopped = generate(model, pad, prompt_ids, prompt_mask, 20, None, [-1])  # the same rollout, run to its end
    stops = sorted(set(unstopped[:, 2].tolist()))
    forwards = []
    hook = model.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    tokens = generate(model, pad, prompt_ids, prompt_mask, 20, None, stops)
    hook.remove()
    longest = completion_mask(tokens, stops).sum(1).max().item()
    assert longest <= 3 and tokens.shape[1] == longest and len(forwards) == longest


def cpu_tensor_cores(a, b):
    """tensor_core_mm as a GPU computes it: bfloat16 operands, their products (exact in float32) summed in float32."""
    assert a.dtype == b.dtype == torch.bfloat16
    return a.float() @ b.float()


def eager_compile(monkeypatch, backend="eager"):
    """compiles() says yes, as on a GPU, and compile_step compiles with `backend` (fullgraph=True: a graph break
    fails); the output layer's tensor-core products as cpu_tensor_cores; dynamo's counters cleared."""
    import torch._dynamo

    monkeypatch.setattr(grpo, "compiles", lambda model: True)
    monkeypatch.setattr(grpo, "tensor_core_mm", cpu_tensor_cores)
    monkeypatch.setattr(grpo, "compile_step", lambda f: torch.compile(f, backend=backend, fullgraph=True))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch._dynamo.utils.counters["stats"]


def rollout_prompts(width, rows):
    torch.manual_seed(width)
    ids = torch.randint(3, 300, (rows, width))
    ids[0, :2] = 0
    return ids, (ids != 0).long()


def forcing(patch, tokens):
    """Teacher forcing: the eager rollouts run under `patch` (a monkeypatch context) draw tokens (B, T), a column a
    step, in place of their own, each with its log-prob under the eager step's logits; returns the list that
    receives each step's (logits, heat, u)."""
    seen = []

    def forced(logits, heat, u):
        token = grpo.pad_rows(tokens, len(logits))[:, len(seen)]  # the cache's rows past the batch's too
        seen.append((logits, heat, u))
        if heat is None:
            return token, torch.zeros(len(logits))
        return token, (logits / heat).log_softmax(-1).gather(1, token[:, None]).squeeze(1)

    patch.setattr(grpo, "draw", forced)
    return seen


def assert_draws(seen, tokens, tolerance):
    """Another computation's tokens (B, T), forced through the eager step (`seen`, forcing()): each is where that
    step's uniform number falls among the eager step's cumulative probabilities (greedy: a largest of its logits),
    to tolerance, the two computations' distance (where it falls near an edge, either token may be drawn)."""
    assert len(seen) == tokens.shape[1]
    for (logits, heat, u), token in zip(seen, tokens.T):
        rows, token = len(token), token[:, None]
        logits, u = logits[:rows].double(), u[:rows]
        if heat is None:
            assert (logits.max(-1, keepdim=True).values - logits.gather(1, token) <= tolerance).all()
            continue
        probs = (logits / heat).softmax(-1)
        after = probs.cumsum(-1).gather(1, token)  # the cumulative share at the token's upper edge, (B, 1)
        before = after - probs.gather(1, token)
        assert ((before - tolerance <= u) & (u <= after + tolerance)).all(), (before, u, after)


def test_the_compiled_step_has_no_graph_break_and_compiles_once_for_every_rollout(monkeypatch):
    """As on a GPU (there with CUDA graphs): the one-token step, sampler included, compiled with fullgraph=True,
    which fails at any graph break, draws the eager step's tokens and log-probs: its tokens, forced through the eager
    step, are where each uniform number falls there, to 1e-5 in float32 and 1e-3 in bfloat16 (the padded prompts
    and the longer cache sum in another order). Prompts of 4, 7 and 5 tokens, 10 and 12 new tokens, batches of 3
    and 2, sampled and greedy, all run in the shape of the model's one cache (3 rows, 128 positions): one compile in
    all, one cache held, of 3 x 128 positions' keys and values in --dtype. In bfloat16 the compiled step reads the
    decoder's linear weights from a bfloat16 copy made once a rollout (the same tensors every time, refreshed from
    the masters), each equal to its master cast as autocast casts it. A larger batch makes the one cache again, and
    compiles once more."""
    tokenizer = SimpleNamespace(pad_token_id=0)
    for dtype in (torch.float32, torch.bfloat16):
        stats = eager_compile(monkeypatch)
        model = tiny("llama")
        model.compute_dtype = dtype
        eager, compiled, copies = [], [], []
        for width, rows, new_tokens, temperature in (
            (4, 3, 10, 1.0),
            (7, 3, 12, None),
            (7, 3, 10, 0.7),
            (5, 2, 10, 1.0),
        ):
            ids, mask = rollout_prompts(width, rows)
            with torch.no_grad():
                model.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # the rollout's copy must follow the masters
            torch.manual_seed(1)
            compiled.append(generate(model, tokenizer, ids, mask, new_tokens, temperature, [-1], with_logprobs=True))
            copies.append(dict(model.__dict__.get("rollout_weights", {})))
            with monkeypatch.context() as eager_only:  # the compiled step's tokens, forced through the eager one
                eager_only.setattr(grpo, "compiles", lambda model: False)
                seen = forcing(eager_only, compiled[-1][0])
                torch.manual_seed(1)
                eager.append(generate(model, tokenizer, ids, mask, new_tokens, temperature, [-1], with_logprobs=True))
            assert stats["unique_graphs"] == 1, dict(stats)
            tolerance = 1e-5 if dtype == torch.float32 else 1e-3
            assert_draws(seen, compiled[-1][0], tolerance)
            torch.testing.assert_close(eager[-1][1], compiled[-1][1], atol=tolerance, rtol=0)
        caches = [v for v in model.__dict__.values() if isinstance(v, transformers.StaticCache)]
        assert len(caches) == 1 and (caches[0].rows, caches[0].length) == (3, 128)
        stored = [t for layer in caches[0].layers for t in (layer.keys, layer.values)]
        assert {t.dtype for t in stored} == {dtype} and {tuple(t.shape) for t in stored} == {(3, 4, 128, 8)}
        assert sum(t.nbytes for t in stored) == 2 * 2 * 3 * 4 * 128 * 8 * dtype.itemsize  # layers, K and V
        ids, mask = rollout_prompts(5, 4)
        generate(model, tokenizer, ids, mask, 10, 1.0, [-1])
        assert stats["unique_graphs"] == 2 and (model.rollout_cache.rows, model.rollout_cache.length) == (4, 128)
        if dtype == torch.float32:
            assert copies == [{}] * 4
            continue
        linears = [n for n, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)]
        assert sorted(copies[0]) == sorted([*(f"{n}.weight" for n in linears), "head"])  # no bias in the tiny llama
        heads = [c.pop("head") for c in (copies[0], copies[-1])]  # the output layer's two bfloat16 parts
        for name, copy in copies[-1].items():  # the same tensors every rollout, equal to the masters cast
            assert copy.dtype == torch.bfloat16 and copy.data_ptr() == copies[0][name].data_ptr()
            assert torch.equal(copy, model.model.get_parameter(name).to(torch.bfloat16)), name
        params = sum(model.model.get_parameter(n).numel() for n in copies[-1])
        assert sum(t.nbytes for t in copies[-1].values()) == 2 * params  # one bfloat16 copy of each, no more
        assert [p.data_ptr() for p in heads[0]] == [p.data_ptr() for p in heads[1]]
        assert torch.equal(heads[1][0], model.lm_head.weight.to(torch.bfloat16))
        assert torch.equal(heads[1][1], (model.lm_head.weight - heads[1][0].float()).to(torch.bfloat16))
    torch._dynamo.reset()


def test_the_output_layer_on_tensor_cores_gives_float32s_log_probs_and_gradients(real_model_dir, monkeypatch):
    """On a GPU in bfloat16 the output layer's product is three bfloat16 tensor-core products summed in float32
    (head_product; here as cpu_tensor_cores computes them), on the bundled model, a random Qwen2 with Qwen's
    vocabulary of 151,936 and SmolLM2 (logits up to 32): token_logprobs' log-probs within 3e-5, 1e-5 and 3e-4 of
    float32's product's, and its logits at least 30 times closer than one bfloat16 product's; the gradients of the
    output layer's weight (tied to the embedding) and of the decoder's last norm within 1e-4 of float32's, relative.
    The forward pass is float32's in both: only the output layer differs."""
    monkeypatch.setattr(grpo, "compiles", lambda model: True)
    monkeypatch.setattr(grpo, "tensor_core_mm", cpu_tensor_cores)
    torch.manual_seed(0)
    qwen_vocab = transformers.Qwen2Config(
        vocab_size=151_936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    for name, model, bound in (
        ("tiny-adder", AutoModelForCausalLM.from_pretrained(TINY_ADDER), 3e-5),
        ("qwen vocabulary", AutoModelForCausalLM.from_config(qwen_vocab), 1e-5),
        ("smollm2", AutoModelForCausalLM.from_pretrained(real_model_dir), 3e-4),
    ):
        ids = torch.randint(3, model.config.vocab_size, (4, 40))
        mask = torch.ones_like(ids)
        runs = []
        for dtype in (torch.float32, torch.bfloat16):  # the model's --dtype: bfloat16 takes the tensor cores
            model.compute_dtype = dtype
            model.zero_grad()
            logprobs = token_logprobs(model, ids, mask, 8)
            logprobs.sum().backward()
            grads = [p.grad.clone() for p in (model.lm_head.weight, model.model.norm.weight)]
            runs.append((logprobs.detach(), grads))
        (exact, exact_grads), (split, split_grads) = runs
        assert (split - exact).abs().max() <= bound, name
        for got, expected in zip(split_grads, exact_grads):
            assert (got - expected).norm() <= 1e-4 * expected.norm(), name
        with torch.no_grad():
            hidden = grpo.hidden_states(model, ids, mask).flatten(0, 1)
            weight = model.lm_head.weight
            logits = hidden @ weight.T
            three = grpo.head_product(hidden, weight, None, grpo.head_parts(model)) - logits
            one = cpu_tensor_cores(hidden.bfloat16(), weight.bfloat16().T) - logits
        assert three.abs().max() * 30 <= one.abs().max(), (name, three.abs().max(), one.abs().max())


@pytest.mark.parametrize("lora_r", [0, 4])
def test_the_compiled_step_runs_on_a_checkpointed_model_whose_weights_still_get_their_gradient(
    monkeypatch, tmp_path, lora_r
):
    """With --gradient-checkpointing, transformers (and peft, with --lora-r) hook the input embedding to call
    requires_grad_ on its output at every forward pass. In the compiled step that is a graph break: on a GPU the first
    rollout of the README's GPU command stopped there (torch 2.11, transformers 5.24). The model's first compiled
    step takes the hook off, which non-reentrant checkpointing does not need: the step compiles with fullgraph=True,
    and every trained weight gets a gradient through the checkpointed layers."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    args = grpo.Args(dtype="bfloat16", gradient_checkpointing=True, lora_r=lora_r)
    model = grpo.add_lora(grpo.load_model(str(tmp_path), args, torch.device("cpu")), args)
    assert model.get_input_embeddings()._forward_hooks  # transformers' (peft's, with LoRA)
    stats = eager_compile(monkeypatch)
    ids, mask = rollout_prompts(4, 2)
    completions = generate(model.eval(), SimpleNamespace(pad_token_id=0), ids, mask, 6, 1.0, [-1])
    assert not model.get_input_embeddings()._forward_hooks
    assert completions.shape == (2, 6) and stats["unique_graphs"] == 1, dict(stats)
    sequences = torch.cat([ids, completions], dim=1)
    token_logprobs(model.train(), sequences, torch.cat([mask, torch.ones_like(completions)], 1), 4).sum().backward()
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == (7 * 2 * 2 if lora_r else len(list(model.parameters())))  # 7 linears a layer, A and B
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for name, p in trained if "lora_B" in name or not lora_r)
    torch._dynamo.reset()


def test_the_weights_held_in_the_compute_dtype_are_read_as_they_are(monkeypatch):
    """LoRA's frozen base layers (add_lora holds them in --dtype) and async_grpo.py's generator (its weights in
    --dtype): rollout_weights makes no copy of a weight already in the compute dtype, and a copy of each float32
    one (LoRA's adapters)."""
    model = tiny("llama")
    model.compute_dtype = torch.bfloat16
    base = model.model.layers[0].self_attn.q_proj
    base.to(torch.bfloat16)
    weights = grpo.rollout_weights(model, True)
    assert weights["layers.0.self_attn.q_proj.weight"] is base.weight
    held = {k for k, v in weights.items() if any(v is p for p in model.parameters())}
    made = [v for k, v in weights.items() if k != "head"] + list(weights["head"])
    assert held == {"layers.0.self_attn.q_proj.weight"} and all(v.dtype == torch.bfloat16 for v in made)
    assert grpo.rollout_weights(model, False) == {}


def test_grouped_attention_reads_each_key_value_head_once_and_equals_transformers_sdpa(monkeypatch):
    """One new token over 2 key-value heads for 4 query heads, with left padding: grouped_sdpa's output equals
    transformers' SDPA attention (which copies the keys and values to every query head, or packs the queries on
    5.24 when not compiling) to 1e-6, and its one SDPA call reads the 2 key-value heads as they are. A rollout with
    it, its tokens forced through one without it, draws that one's tokens and log-probs, to 1e-5 in float32 and
    1e-3 in bfloat16, and the model's attention is transformers' SDPA again after."""
    model = tiny("gqa")
    layer = model.model.layers[0].self_attn
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 9, 8), torch.randn(3, 2, 9, 8)
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4] = False  # a left-padded row
    sdpa = transformers.AttentionInterface()["sdpa"]
    expected, _ = sdpa(layer, query, key, value, mask, scaling=layer.scaling)
    calls, plain_sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, k, v, **kw: calls.append(k.shape[1]) or plain_sdpa(q, k, v, **kw),
    )
    out, _ = grpo.grouped_sdpa(layer, query, key, value, mask, scaling=layer.scaling)
    monkeypatch.undo()
    assert calls == [2] and out.shape == expected.shape == (3, 1, 4, 8)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    prompt_ids = torch.tensor([[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]])
    prompt_mask, pad = (prompt_ids != 0).long(), SimpleNamespace(pad_token_id=0)
    for dtype in (torch.float32, torch.bfloat16):
        model.compute_dtype = dtype
        torch.manual_seed(2)
        grouped = generate(model, pad, prompt_ids, prompt_mask, 10, 1.0, [-1], with_logprobs=True)
        assert model.config._attn_implementation == "sdpa"
        with monkeypatch.context() as plain:  # the grouped rollout's tokens, forced through transformers' attention
            plain.setattr(grpo, "grouped_attention", lambda model: contextlib.nullcontext())
            seen = forcing(plain, grouped[0])
            torch.manual_seed(2)
            ungrouped = generate(model, pad, prompt_ids, prompt_mask, 10, 1.0, [-1], with_logprobs=True)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-3  # each one's rounding, where the two sum otherwise
        assert_draws(seen, grouped[0], tolerance)
        torch.testing.assert_close(grouped[1], ungrouped[1], atol=tolerance, rtol=0)


def test_the_cache_keeps_keys_and_values_in_the_compute_dtype(monkeypatch):
    """In bfloat16 the cache stores keys (float32 after RoPE) and values in bfloat16, on every transformers version
    (5.17-5.23 made the values' tensor in the keys' dtype, and a bfloat16 value failed to go in); the rollout's tokens,
    forced through the eager step over a cache that stores both in float32 (autocast's attention reads them in
    bfloat16 either way), are its draws and log-probs to bfloat16's rounding, eager and compiled."""
    prompt_ids = torch.tensor([[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]])
    prompt_mask, pad = (prompt_ids != 0).long(), SimpleNamespace(pad_token_id=0)
    model = tiny("gqa")
    model.compute_dtype = torch.bfloat16
    cache_class, made = grpo.RolloutCache, []

    def make(config, rows, length, dtype):
        made.append(cache_class(config, rows, length, store))
        return made[-1]

    runs = []
    for compiled in (False, True):
        if compiled:
            eager_compile(monkeypatch)
        for store in (torch.bfloat16, torch.float32):
            model.__dict__.pop("rollout_cache", None)
            with monkeypatch.context() as m:
                m.setattr(grpo, "RolloutCache", make)
                torch.manual_seed(4)
                runs.append(generate(model, pad, prompt_ids, prompt_mask, 10, 1.0, [-1], with_logprobs=True))
            assert {t.dtype for layer in made[-1].layers for t in (layer.keys, layer.values)} == {store}
    store = torch.float32
    for tokens, logprobs in runs:  # each forced through the eager step over a float32 cache
        model.__dict__.pop("rollout_cache", None)
        with monkeypatch.context() as m:
            m.setattr(grpo, "RolloutCache", make)
            m.setattr(grpo, "compiles", lambda model: False)
            seen = forcing(m, tokens)
            torch.manual_seed(4)
            forced = generate(model, pad, prompt_ids, prompt_mask, 10, 1.0, [-1], with_logprobs=True)
        assert_draws(seen, tokens, 1e-3)
        torch.testing.assert_close(forced[1], logprobs, atol=1e-3, rtol=0)
    torch._dynamo.reset()


def test_the_compiled_step_runs_without_deterministic_algorithms_and_the_same_seed_gives_the_same_run(monkeypatch):
    """The compiled step (in the main thread) runs with deterministic algorithms off and inductor's deterministic mode
    on, and both are on again after every token; the same seed gives the same tokens twice. In another thread
    (async_grpo.py's generator, beside its trainer) the algorithms stay deterministic."""
    import threading

    import torch._inductor.config

    seen, run = [], grpo.decode_step
    eager_compile(monkeypatch)

    def flags(*args):  # deterministic algorithms, and inductor's own deterministic mode (no kernel picked by timing)
        seen.append((torch.are_deterministic_algorithms_enabled(), torch._inductor.config.deterministic))
        return run(*args)

    monkeypatch.setattr(grpo, "compile_step", lambda f: flags)
    model, pad = tiny("gqa"), SimpleNamespace(pad_token_id=0)
    ids, mask = rollout_prompts(5, 3)
    torch.use_deterministic_algorithms(True)
    try:
        outs = []
        for _ in range(2):
            torch.manual_seed(7)
            outs.append(generate(model, pad, ids, mask, 8, 1.0, [-1], with_logprobs=True))
            assert torch.are_deterministic_algorithms_enabled() and torch._inductor.config.deterministic
        assert (
            seen == [(False, True)] * 14 and torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        )
        seen.clear()
        thread = threading.Thread(target=generate, args=(model, pad, ids, mask, 8, 1.0, [-1]))
        thread.start()
        thread.join()
        assert seen == [(True, True)] * 7
    finally:
        torch.use_deterministic_algorithms(False)
        torch._dynamo.reset()


@pytest.mark.long
def test_inductor_compiles_the_step_and_it_samples_the_eager_steps_tokens(monkeypatch):
    """The compiled step as inductor lowers it (on this CPU: C++ kernels, no CUDA graphs), a 1-layer model with 2
    key-value heads for 4 query heads and left-padded prompts: one graph, and, its tokens forced through the eager
    step, the eager step's draws, sampled and greedy, and log-probs, to 1e-5 (inductor's kernels sum in another
    order)."""
    stats = eager_compile(monkeypatch, backend="inductor")
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config = LlamaConfig(vocab_size=300, num_hidden_layers=1, max_position_embeddings=256, pad_token_id=0, **shape)
    model, pad = AutoModelForCausalLM.from_config(config).eval(), SimpleNamespace(pad_token_id=0)
    ids, mask = rollout_prompts(5, 3)
    for temperature in (1.0, None):
        torch.manual_seed(3)
        tokens, logprobs = generate(model, pad, ids, mask, 12, temperature, [-1], with_logprobs=True)
        with monkeypatch.context() as eager_only:
            eager_only.setattr(grpo, "compiles", lambda model: False)
            seen = forcing(eager_only, tokens)
            torch.manual_seed(3)
            eager = generate(model, pad, ids, mask, 12, temperature, [-1], with_logprobs=True)
        assert_draws(seen, tokens, 1e-5)
        torch.testing.assert_close(eager[1], logprobs, atol=1e-5, rtol=0)
    assert stats["unique_graphs"] == 1, dict(stats)
    torch._dynamo.reset()


@pytest.mark.long
def test_the_gpu_benchmark_runs_on_the_cpu(real_model_dir, tmp_path):
    """benchmarks/gpu_benchmark.py at its small shape (a random 2-layer Qwen2 with Qwen's 151,936-token vocabulary
    and SmolLM2's tokenizer) prints each step's split, its decode mode the loop's ms and waits a token, --host the
    loop's host time a token on the compiled path (one graph for three rollouts), and --profile the profiler's tables
    of one rollout and one update. The tokenizer comes from a folder that holds it alone (--tokenizer), as the
    device's carried copy does; a folder without one stops it with one line."""
    AutoTokenizer.from_pretrained(real_model_dir).save_pretrained(tmp_path / "tokenizer")
    small = ["--small", "--steps", "2", "--max-new-tokens", "8", "--tokenizer"]
    out = run_script("benchmarks/gpu_benchmark.py", *small, str(tmp_path / "tokenizer")).stdout
    assert "a random Qwen2 of 9.8 M parameters (small's shape)" in out, out
    steps = re.findall(r"step (\d): ([\d.]+) s: generation ([\d.]+) s .* log-probs ([\d.]+) s, update ([\d.]+) s", out)
    assert [s[0] for s in steps] == ["1", "2"], out
    assert all(float(step) + 0.02 >= float(g) + float(lp) + float(u) for _, step, g, lp, u in steps), out  # rounded
    bad = run_script("benchmarks/gpu_benchmark.py", *small, str(tmp_path), expect_ok=False)
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "no tokenizer there (benchmarks/gpu_check.sh prepare makes one)"
    )
    out = run_script("benchmarks/gpu_benchmark.py", "--decode", "--batch", "4", "--max-new-tokens", "8").stdout
    waits = re.search(r"this: [\d.]+ ms a token .* ([\d.]+) host waits a token", out)
    assert waits and float(waits.group(1)) == 9 / 8, out  # the prompts' mask, a CPU's 7 stop checks, the length
    host = ["--decode", "--host", "--batch", "4", "--max-new-tokens", "8", "--repeats", "2"]
    out = run_script("benchmarks/gpu_benchmark.py", *host).stdout
    turn, call, graphs = re.search(
        r"loop ([\d.]+) ms, of which the compiled call ([\d.]+) ms.*graphs: (\d+)", out
    ).groups()
    assert 0 < float(call) < float(turn) and graphs == "1", out  # the second and third rollouts compiled nothing
    out = run_script("benchmarks/gpu_benchmark.py", "--small", "--profile", "--max-new-tokens", "8").stdout
    heads = re.findall(r"one (rollout|update): 16 rows, 95 \+ 8 tokens, float32, on cpu", out)
    assert heads == ["rollout", "update"] and out.count("Self CPU time total") == 2, out
