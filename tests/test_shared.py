"""The shared skeleton: task, reward, masks, log-probs, and that every file holds the same copy."""

import ast
import os
import re
import sys

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import reading  # noqa: E402

from scale.grpo import (
    addition_task,
    batched_logprobs,
    completion_mask,
    last_number,
    masked_mean,
    minibatches,
    prompt_answer,
    reward_fn,
    token_logprobs,
)

ALGORITHM_FILES = [
    "scale/grpo.py",
    "scale/rloo.py",
    "scale/gspo.py",
    "scale/cispo.py",
    "scale/ppo.py",
    "scale/dpo.py",
    "scale/reward_model.py",
    "scale/sft.py",
    "scale/async_grpo.py",
    "scale/process_grpo.py",
    "scale/tool_grpo.py",
    "scale/dapo.py",
    "scale/distill.py",
    "scale/env_grpo.py",
]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("55", "55", 1.0),
        ("5", "55", 0.0),  # no substring match
        ("555", "55", 0.0),
        ("55.0", "55", 1.0),  # the same number
        ("", "55", 0.0),
        ("+", "55", 0.0),
        ("so 3 * 4 = 12, the answer is 12", "12", 1.0),  # GSM8K style: the last number counts
        ("12 ... no, 13", "12", 0.0),
        ("The total is 1,234.", "1234", 1.0),
        ("-7", "-7", 1.0),
    ],
)
def test_reward_is_an_exact_number_match(completion, answer, expected):
    assert reward_fn(completion, {"prompt": "?", "answer": answer}) == expected
    assert reward_fn(completion, {"prompt": "?", "answer": float(answer)}) == expected  # a number in JSON


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("Paris", "Paris", 1.0),  # the old rule scored every text answer 0: no number in either
        ("paris.", "Paris", 1.0),  # case and surrounding punctuation do not count
        ("The capital of France is  Paris.", "Paris", 1.0),  # ends with the answer, as whole words
        ("Paris is not it. Lyon", "Paris", 0.0),  # the answer must come last
        ("Comparison", "Paris", 0.0),  # whole words: 'comparison' does not end with ' paris'
        ("It is Saint Paris", "Saint Paris", 1.0),
        ("", "Paris", 0.0),
        ("anything", "", 0.0),  # an empty answer matches nothing
    ],
)
def test_a_text_answer_is_compared_as_normalised_text(completion, answer, expected):
    assert reward_fn(completion, {"prompt": "?", "answer": answer}) == expected


def test_the_reward_examples_of_the_docs_score_as_worked_out_by_hand():
    """docs/your_own_task.md's two reward functions, run as written (with the files' last_number at hand)."""
    with open(os.path.join(ROOT, "docs", "your_own_task.md")) as f:
        exact_source, tagged_source = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    exact, tagged = {}, {"last_number": last_number}
    exec(exact_source, exact)
    exec(tagged_source, tagged)
    paris = {"prompt": "The capital of France? One word.", "answer": "Paris"}
    assert [exact["reward_fn"](c, paris) for c in (" Paris\n", "paris", "Paris.", "It is Paris")] == [1, 0, 0, 0]
    twelve = {"prompt": "3 * 4?", "answer": "12"}
    cases = {
        "<answer>12</answer>": 1.2,
        "so 3 * 4 = <answer>12</answer>": 1.2,
        "<answer>13</answer>": 0.2,
        "12": 0.0,
        "<answer>12</answer> or <answer>13</answer>": 0.0,
    }
    assert {c: tagged["reward_fn"](c, twelve) for c in cases} == pytest.approx(cases)


def test_last_number_and_gsm8k_answers():
    assert last_number("3 boxes of 4 make 12") == 12.0
    assert last_number("no digits") is None
    record = prompt_answer({"question": "How many?", "answer": "3 * 4 = <<3*4=12>>12\n#### 12", "id": 7})
    assert (record["prompt"], record["answer"], record["id"]) == ("How many?", "12", 7)  # other fields stay


def test_addition_task_held_out_is_fixed_and_disjoint():
    train, held_out = addition_task(num_eval=500)
    assert len(held_out) == 500 and len(train) == 100 * 100 - 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert addition_task(num_eval=500)[1] == held_out  # the same for every run
    a, b = held_out[0]["prompt"].rstrip("=").split("+")
    assert held_out[0]["answer"] == str(int(a) + int(b))


def test_completion_mask_stops_after_the_first_eos():
    eos, pad = 2, 0
    ids = torch.tensor([[5, 7, eos, pad], [6, 6, 6, 6], [eos, eos, eos, eos], [4, eos, 9, eos]])
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]).bool()
    assert torch.equal(completion_mask(ids, [eos]), expected)
    # two stop ids (Qwen's <|im_end|> and <|endoftext|>): the first of either ends the completion
    assert torch.equal(completion_mask(torch.tensor([[5, 3, 2, 2]]), [2, 3]), torch.tensor([[1, 1, 0, 0]]).bool())


def test_masked_mean_ignores_padding_even_inf_and_nan():
    x = torch.tensor([[1.0, 3.0, float("inf")], [2.0, float("nan"), 1e30]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)  # (1 + 3 + 2) / 3
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([2.0, 2.0]))


def test_held_out_records_are_shared_evenly_or_the_run_says_why(monkeypatch, capsys):
    """Under torchrun each process evaluates every N-th held-out record, as many each: 7 records over 3 processes
    leave the last one out and say so; 2 records over 3 processes stop the run (every process had none, and the
    evaluation divided by zero)."""
    from scale import grpo

    monkeypatch.setattr(grpo, "rank_and_world", lambda: (1, 3))
    assert grpo.process_share(list(range(7))) == [1, 4]
    assert "note: the last 1 of 7 held-out records are left out" in capsys.readouterr().out
    assert grpo.process_share(list(range(6))) == [1, 4] and capsys.readouterr().out == ""
    with pytest.raises(SystemExit, match="error: 2 held-out records for 3 processes, which need one each"):
        grpo.process_share([0, 1])


def source_segment(lines, node):
    """ast.get_source_segment(source, node) for lines = source's lines as UTF-8 bytes (ends kept): Python 3.11's
    splits the whole source again at each call, 20 s of this file's test."""
    start, end = node.lineno - 1, node.end_lineno - 1
    if start == end:
        return lines[start][node.col_offset : node.end_col_offset].decode()
    return (
        lines[start][node.col_offset :] + b"".join(lines[start + 1 : end]) + lines[end][: node.end_col_offset]
    ).decode()


def top_level_functions(path):
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    lines = [line.encode() for line in source.splitlines(keepends=True)]
    named = {
        node.name: source_segment(lines, node)
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name != "Args"
    }
    # and the module's constants (COMMON_RANGES, VLLM_RANGES)
    named.update(
        {
            node.targets[0].id: source_segment(lines, node)
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        }
    )
    return named, tree, source


def common_args_block(tree, source):
    """The common block of Args: the fields before `# Model and data`."""
    args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    text = ast.get_source_segment(source, args)
    return text[: text.index("# Model and data")]


OWN_HELPERS = {"check_args", "batch_sizes", "held_out_metrics"}


def test_shared_helpers_are_identical_in_every_file():
    files = [f for f in ALGORITHM_FILES if os.path.exists(os.path.join(ROOT, f))]
    assert {"scale/grpo.py", "scale/sft.py"} <= set(files)
    parsed = {f: top_level_functions(os.path.join(ROOT, f)) for f in files}
    reference_args = common_args_block(*parsed["scale/grpo.py"][1:])
    for name in files:
        functions, tree, source = parsed[name]
        assert common_args_block(tree, source) == reference_args, f"the common Args block of {name} differs"
        shared_with_grpo = set(functions) & set(parsed["scale/grpo.py"][0]) - {"grpo_loss"}
        assert len(shared_with_grpo) >= 15, f"{name} shares only {sorted(shared_with_grpo)} with grpo.py"
        # every function two files both define is the same, word for word, above the banner too (the algorithms'
        # own functions have names of their own: grpo_loss, gspo_loss, dpo_loss ...; main is each file's loop, and
        # the helpers it calls for its flags, its batch sizes and its held-out metrics are each file's own)
        for other in files:
            for helper in sorted(set(functions) & set(parsed[other][0]) - {"main", *OWN_HELPERS}):
                assert functions[helper] == parsed[other][0][helper], f"{helper} differs between {name} and {other}"


READER_STOPS = (
    "# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares"
    " ====\n"
)
BANNER = (
    "# ==== Everything below this line is the same in every file, byte for byte (tests/test_shared.py checks it) ====\n"
)
LOSSES = {
    "scale/grpo.py": "grpo_loss",
    "scale/rloo.py": "rloo_loss",
    "scale/gspo.py": "gspo_loss",
    "scale/cispo.py": "cispo_loss",
    "scale/ppo.py": "ppo_policy_loss",
    "scale/dpo.py": "dpo_loss",
    "scale/reward_model.py": "bradley_terry_loss",
    "scale/sft.py": "sft_loss",
    "scale/async_grpo.py": "decoupled_loss",
    "scale/process_grpo.py": "grpo_loss",
    "scale/tool_grpo.py": "grpo_loss",
    "scale/dapo.py": "overlong_penalty",
    "scale/distill.py": "pg_loss",
    "scale/env_grpo.py": "grpo_loss",
}


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_every_file_puts_the_algorithm_first_and_the_shared_part_below_one_banner():
    """docstring, imports, Args, ALGO LOGIC, the task and its reward (reward_fn), main(args) and right after it the
    first banner, where the reader stops; the file's own machinery, the second banner, then a part that is the same
    text in every file, ending with the __main__ guard; the loss within the first 220 lines (on the code as ruff
    lays it out: async_grpo.py's decoupled_loss starts at line 207)."""
    below = {}
    for name in ALGORITHM_FILES:
        source = read(name)
        assert source.count(BANNER) == 1, f"{name}: the banner line must appear exactly once"
        assert source.count(READER_STOPS) == 1, f"{name}: the first banner must appear exactly once"
        above, below[name] = source.split(BANNER)
        algorithm, own = above.split(READER_STOPS)
        assert "\ndef reward_fn(completion, record):" in algorithm, f"{name}: reward_fn belongs above the first banner"
        main_end = algorithm.rindex("\ndef main(args):")
        assert not re.search(r"\n(def|class) ", algorithm[main_end + 1 :]), (
            f"{name}: nothing between main() and the banner"
        )
        tree = ast.parse(source)
        order = [
            node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else type(node).__name__
            for node in tree.body
        ]
        assert isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)  # the docstring
        first_def = next(
            i for i, node in enumerate(tree.body) if not isinstance(node, (ast.Expr, ast.Import, ast.ImportFrom))
        )
        assert order[first_def] == "Args", f"{name}: Args must follow the imports"
        algo = above.index("\n# ---- ALGO LOGIC")
        assert above.index("\nclass Args:") < algo < above.index("\ndef main(args):"), name
        loss_line = source[: source.index(f"\ndef {LOSSES[name]}(")].count("\n") + 2
        assert loss_line <= 220, f"{name}: {LOSSES[name]} starts at line {loss_line}"
        assert order[-1] == "If" and source.endswith('\n\nif __name__ == "__main__":\n    main(parse_args())\n')
    for name in ALGORITHM_FILES:
        assert below[name] == below["scale/grpo.py"], f"below the banner, {name} differs from grpo.py"


ALLOWED_IMPORTS = {"torch", "transformers", "tyro", "wandb"} | set(sys.stdlib_module_names)


@pytest.mark.parametrize("name", ALGORITHM_FILES)
def test_a_file_imports_nothing_of_this_repository(name):
    """So that it runs when copied alone into an empty folder: every import, also inside a function, is the
    standard library, torch, transformers, tyro or wandb (datasets only where a hub dataset is asked for, vllm
    only with --vllm, which the files that sample have, peft only with --lora-r)."""
    modules = set()
    for node in ast.walk(ast.parse(read(name))):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: a relative import"
            modules.add(node.module.split(".")[0])
    assert modules - {"datasets", "vllm", "peft"} <= ALLOWED_IMPORTS, (
        f"{name} imports {sorted(modules - ALLOWED_IMPORTS)}"
    )


def changed_code_lines(a, b):  # of two files, comments and docstrings aside (benchmarks/reading.py counts them)
    return reading.changed_code_lines(read(a), read(b))


def test_code_lines_leave_out_comments_and_docstrings_only():
    code_lines = reading.code_lines
    source = 'def f(x):\n    """doc\n    more"""\n    y = "text"  # note\n    # a comment\n    return y\n'
    assert code_lines(source) == ["def f(x):", '    y = "text"', "    return y"]


@pytest.mark.parametrize("other", ["scale/gspo.py", "scale/cispo.py"])
def test_diffing_two_sibling_files_shows_only_the_algorithm(other):
    """GSPO and CISPO change GRPO's loss (and a few flags): their code differs from grpo.py's in at most 80 lines,
    comments and docstrings aside, on the code as ruff lays it out (measured: 77 and 73, with the step's statistics
    weighed as each loss averages: GSPO's by sequences, GRPO's and CISPO's token means by tokens, and --vllm's
    importance weights applied as each loss is written: per token, or per sequence in GSPO; tests/test_style.py
    bounds every sibling's diff)."""
    changed = changed_code_lines("scale/grpo.py", other)
    assert 0 < len(changed) <= 80, f"{other}: {len(changed)} changed code lines against grpo.py"


def plain_logprobs(model, input_ids, attention_mask, prompt_len, temperature):
    """The straightforward computation: the model's own full logits, one float32 log_softmax."""
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logprobs = (logits[:, prompt_len - 1 : -1].float() / temperature).log_softmax(dim=-1)  # (B, T, vocab)
    entropy = -(logprobs.exp() * logprobs).sum(dim=-1)
    return logprobs.gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1), entropy


def tiny_llama(layers, tied=False):
    """A random Llama of width 32 and a 300-token vocabulary, the same weights for the same arguments."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_positions", [3, 10])
def test_chunked_logprobs_and_gradients_equal_the_plain_computation(tied, chunk_positions):
    """From the hidden states, 3 positions a chunk (10 positions: 3 + 3 + 3 + 1) or all 10 in one,
    temperature 0.7, left padding: the same log-probs and entropies, and the same gradient for every
    parameter, the output layer's (tied to the input embedding or not) and the decoder's (through the
    hidden states)."""
    model = tiny_llama(layers=2, tied=tied)
    model.lm_head.bias = None
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    input_ids = torch.randint(3, 300, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # the first prompt is left-padded
    prompt_len, temperature = 4, 0.7  # 2 sequences x 5 completion positions
    weights = torch.randn(2, 5)  # a loss that weighs every position differently

    def gradients(compute):
        model.zero_grad()
        logprobs, entropy = compute()
        ((logprobs * weights).sum() + entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # a tied weight is named once
        return logprobs.detach(), entropy.detach(), {**grads, "output layer": model.lm_head.weight.grad.clone()}

    chunked = gradients(
        lambda: token_logprobs(
            model,
            input_ids,
            attention_mask,
            prompt_len,
            temperature,
            with_entropy=True,
            chunk_values=chunk_positions * 300,
        )
    )
    plain = gradients(lambda: plain_logprobs(model, input_ids, attention_mask, prompt_len, temperature))
    torch.testing.assert_close(chunked[0], plain[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1], plain[1], atol=1e-5, rtol=1e-5)
    assert chunked[2].keys() == plain[2].keys()
    for name in plain[2]:
        torch.testing.assert_close(chunked[2][name], plain[2][name], atol=1e-5, rtol=1e-4, msg=name)
    assert plain[2]["output layer"].abs().sum() > 0 and plain[2]["model.norm.weight"].abs().sum() > 0


def test_a_micro_batch_computes_only_the_columns_some_row_attends_to():
    """Three rows whose prompts share 2 columns of left padding and whose completions all end 2 columns before the
    batch's end: the forward pass sees the 8 columns between (not 12), the output layer makes no logits of its own,
    and the log-probs, entropies and gradients of the attended positions equal the plain computation's over all 12
    columns; the 2 columns cut off get log-prob 0."""
    model = tiny_llama(layers=2)
    input_ids = torch.randint(3, 300, (3, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, :2] = 0  # every prompt has 2 padding columns, the first one 3
    attention_mask[0, 2] = 0
    prompt_len = 6  # 6 completion columns: the rows end after 1, 4 and 3 of them
    for row, end in enumerate([7, 10, 9]):
        attention_mask[row, end:] = 0
    loss_mask = attention_mask[:, prompt_len:].bool()
    widths, logit_rows = [], []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    model.lm_head.register_forward_hook(lambda module, args, out: logit_rows.append(out.shape[1]))

    def gradients(compute):
        model.zero_grad()
        logprobs, entropy = compute()
        (torch.where(loss_mask, logprobs + entropy, 0.0).sum()).backward()
        return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    cut = gradients(lambda: token_logprobs(model, input_ids, attention_mask, prompt_len, 0.7, with_entropy=True))
    assert widths == [8] and logit_rows == [0]
    plain = gradients(lambda: plain_logprobs(model, input_ids, attention_mask, prompt_len, 0.7))
    assert widths == [8, 12]
    torch.testing.assert_close(cut[0][loss_mask], plain[0][loss_mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cut[1][loss_mask], plain[1][loss_mask], atol=1e-5, rtol=1e-5)
    assert (cut[0][:, 4:] == 0).all() and (cut[1][:, 4:] == 0).all() and (cut[0][1, :4] != 0).all()
    for name in plain[2]:
        torch.testing.assert_close(cut[2][name], plain[2][name], atol=1e-5, rtol=1e-4, msg=name)


def test_minibatches_hold_the_shuffled_rows_in_order_of_length():
    """Two passes over 8 rows in minibatches of 4: each pass's minibatches hold the rows a shuffle of the generator
    puts together (every row once), each in order of attended length, ties in the shuffle's order."""
    attention_mask = torch.zeros(8, 6, dtype=torch.long)
    for row, length in enumerate([5, 1, 3, 3, 6, 2, 4, 1]):
        attention_mask[row, :length] = 1
    got = list(minibatches(attention_mask, 4, 2, torch.Generator().manual_seed(5)))
    generator = torch.Generator().manual_seed(5)
    shuffled = [block for _ in range(2) for block in torch.randperm(8, generator=generator).split(4)]
    assert len(got) == 4
    for block, rows in zip(got, shuffled):
        lengths = attention_mask.sum(1)[block]
        assert sorted(block.tolist()) == sorted(rows.tolist()) and (lengths[1:] >= lengths[:-1]).all()
        for a, b in zip(block[:-1].tolist(), block[1:].tolist()):  # equal lengths keep the shuffle's order
            assert attention_mask[a].sum() < attention_mask[b].sum() or rows.tolist().index(a) < rows.tolist().index(b)
    assert torch.cat(got[:2]).sort().values.tolist() == list(range(8))


def test_batched_logprobs_are_in_the_batchs_order_from_batches_of_like_length():
    """Six rows of completions 1 to 6 tokens long, in batches of 2: the log-probs of each row where the row attends
    (to 1e-5) are those of the row alone, in the batch's order; the forward passes see batches of like length (the
    two shortest rows: 6 columns, not 10)."""
    model = tiny_llama(layers=1)
    input_ids = torch.randint(3, 300, (6, 10))
    attention_mask = torch.ones_like(input_ids)
    for row, length in enumerate([4, 1, 6, 2, 5, 3]):  # the completion's; every prompt is 4 tokens
        attention_mask[row, 4 + length :] = 0
    widths = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    logprobs = batched_logprobs(model, input_ids, attention_mask, 4, 0.7, 2)
    assert widths == [6, 8, 10]
    for row in range(6):
        n = int(attention_mask[row].sum()) - 4
        alone = token_logprobs(model, input_ids[row : row + 1, : 4 + n], attention_mask[row : row + 1, : 4 + n], 4, 0.7)
        torch.testing.assert_close(logprobs[row, :n], alone[0].detach(), atol=1e-5, rtol=1e-5)


def test_with_gradient_no_logits_beyond_one_chunk_are_kept_for_the_backward_pass():
    """What autograd keeps for the backward pass: with 3 positions a chunk, the tensors over the vocabulary
    (other than the weights) add up to at most one chunk's logits, since each chunk is recomputed in the
    backward pass; the plain computation keeps all 10 positions' logits, and so would the chunks without
    recomputation."""
    model = tiny_llama(layers=1)
    input_ids = torch.randint(3, 300, (2, 9))
    attention_mask = torch.ones_like(input_ids)

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_vocabulary_values(compute):
        sizes = [0]

        def pack(tensor):  # logits, or anything else over the vocabulary that is not the weights themselves
            is_weight = tensor.untyped_storage().data_ptr() in weights
            if tensor.shape and tensor.shape[-1] == 300 and tensor.dtype.is_floating_point and not is_weight:
                sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logprobs = compute()
        logprobs[0].sum().backward()
        return sum(sizes)

    chunked = saved_vocabulary_values(
        lambda: token_logprobs(model, input_ids, attention_mask, 4, 0.7, with_entropy=True, chunk_values=3 * 300)
    )
    plain = saved_vocabulary_values(lambda: plain_logprobs(model, input_ids, attention_mask, 4, 0.7))
    assert plain >= 10 * 300  # the check sees the logits when they are kept
    assert chunked <= 3 * 300


def test_a_model_whose_logits_are_more_than_a_linear_layer_keeps_the_models_logits():
    """Gemma 2 soft-caps its logits after the output layer: the helper must not skip that."""
    from transformers import Gemma2Config

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        final_logit_softcapping=1.0,
    )  # a cap this low changes every logit visibly
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits of a few units, which a cap of 1 squeezes
    input_ids = torch.randint(3, 300, (2, 8))
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        got = token_logprobs(model, input_ids, attention_mask, 5, 1.3, chunk_values=300)
        expected, _ = plain_logprobs(model, input_ids, attention_mask, 5, 1.3)
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, 4:-1]
        uncapped = (model.lm_head(hidden) / 1.3).log_softmax(-1).gather(-1, input_ids[:, 5:, None]).squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (uncapped - expected).abs().max() > 0.1  # what skipping the cap would have given
