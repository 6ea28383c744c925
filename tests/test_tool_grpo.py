"""tool_grpo.py: the calculator, the calls read from a turn, the masked loss against numbers worked out by hand, the
multi-turn rollout's token ids and masks (with a stand-in policy), a chat template's tool format, and short runs."""

import os
import re

import pytest
import torch
from conftest import PLAIN_TEMPLATE, ROOT, read_metrics, run_script
from transformers import AutoTokenizer

from scale import tool_grpo
from scale.tool_grpo import calculator, call_tool, parse_call, tool_format
from tool_grpo import grpo_loss, policy_tokens

CALLER = os.path.join(ROOT, "tiny-caller")
SENTINEL = 1e6  # at the tool's positions: it must reach neither the loss nor its gradient


def test_the_calculator_computes_arithmetic_and_refuses_anything_else():
    assert calculator("347*86") == ("29842", 0.0)
    assert calculator(" (1 + 2) * -3 ") == ("-9", 0.0)
    assert calculator("7/2") == ("3.5", 0.0) and calculator("6/3") == ("2", 0.0) and calculator("1/3")[0] == "0.333333"
    for text, message in [
        ("2**8", "not BinOp"),
        ("__import__('os').system('ls')", "not Call"),
        ("x", "not Name"),
        ("'a'*3", "not Constant"),
        ("1/0", "division by zero"),
        ("9" * 101, "longer than 100 characters"),
        ("99999999999999999*99999999999999999", "over 30 digits"),
        ("2+", "not an arithmetic expression"),
    ]:
        with pytest.raises(ValueError, match=message):
            calculator(text)
    # a failing call is a message to the policy, with the tool's reward -1; never a traceback
    assert call_tool(calculator, {"expression": "2**8"}) == (
        "error: only numbers, + - * / and parentheses, not BinOp",
        -1.0,
        False,
    )
    assert call_tool(calculator, {"expression": "3*4"}) == ("12", 0.0, True)
    assert call_tool(calculator, {"formula": "3*4"})[2] is False  # arguments the tool does not take
    assert call_tool(lambda expression: "plain text", {"expression": ""}) == ("plain text", 0.0, True)


def test_a_call_is_read_from_the_turn_or_named_as_unreadable():
    assert parse_call("12", "<call>", "</call>", False) == (None, None)
    assert parse_call("<call>3*4</call>", "<call>", "</call>", False) == ({"expression": "3*4"}, None)
    assert parse_call("<call>3*4", "<call>", "</call>", False)[1] == "error: a call ends with </call>"
    qwen = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*86"}}\n</tool_call>'
    assert parse_call(qwen, "<tool_call>", "</tool_call>", True) == ({"expression": "347*86"}, None)
    for bad in ['{"name": "search", "arguments": {"expression": "1"}}', "{not json}", '{"name": "calculator"}']:
        arguments, error = parse_call(f"<tool_call>{bad}</tool_call>", "<tool_call>", "</tool_call>", True)
        assert arguments is None and error.startswith("error: a call is")


def masked_loss(logprobs, old, ref, advantages, mask, tool_mask, on=True):
    loss, _ = grpo_loss(logprobs, old, ref, advantages, policy_tokens(mask, tool_mask, on), beta=0.1)
    return loss


def test_the_tools_tokens_carry_no_loss_by_hand():
    """One completion: the policy's 2 tokens, the tool's 2, the policy's 1, a pad. A = 2, ratios (1.5, 1, ., ., 0.5),
    eps 0.2, ref = the policy (KL 0): t0 min(3, 2.4) = 2.4; t1 2; t4 min(1.0, 1.6) = 1.0. loss = -(2.4 + 2 + 1) / 3
    = -1.8, whatever the log-probs at the tool's tokens. GRPO's advantage is one a completion, so no advantage sits
    at a tool's position; what the tool's positions hold is log-probs (new, old, reference)."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]]).bool()
    tool_mask = torch.tensor([[0, 0, 1, 1, 0, 0]]).bool()
    old = torch.full((1, 6), -1.0)
    logprobs = (old + torch.tensor([[1.5, 1.0, 1.0, 1.0, 0.5, 1.0]]).log()).requires_grad_()
    advantages = torch.tensor([2.0])
    loss = masked_loss(logprobs, old, logprobs.detach(), advantages, mask, tool_mask)
    torch.testing.assert_close(loss, torch.tensor(-1.8))
    (grad,) = torch.autograd.grad(loss, logprobs)

    # the tool's positions changed in every input: the same loss and gradient; no gradient at those positions
    changed = torch.tensor([[0, 0, 1, 1, 0, 0]]).bool()
    other = torch.where(changed, SENTINEL, logprobs.detach()).requires_grad_()
    loss2 = masked_loss(
        other,
        torch.where(changed, -SENTINEL, old),
        torch.where(changed, 3.0, other.detach()),
        advantages,
        mask,
        tool_mask,
    )
    (grad2,) = torch.autograd.grad(loss2, other)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad2, grad, rtol=0, atol=1e-6)
    assert grad[0, 2:4].abs().sum() == 0 and grad[0, 5] == 0
    # the ablation (--no-mask-tool-tokens) counts them: the loss changes with them, so the check above can fail
    off = masked_loss(logprobs, old, logprobs.detach(), advantages, mask, tool_mask, on=False)
    off2 = masked_loss(other, old, other.detach() + 1.0, advantages, mask, tool_mask, on=False)
    assert off.item() != loss.item() and off2.item() != off.item()
    (grad_off,) = torch.autograd.grad(
        masked_loss(logprobs, old, logprobs.detach(), advantages, mask, tool_mask, False), logprobs
    )
    assert grad_off[0, 2:4].abs().sum() > 0


class ScriptedPolicy:
    """Stands in for generate(): writes each prompt's scripted turns in order, the batch padded with pad ids after
    each turn's stop token, and keeps the contexts it was given; asked for log-probs, the t-th token of a turn has
    log-prob -(t + 1) / 10, and the padding 0."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.contexts = tokenizer, turns, []

    def __call__(
        self, model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids, logprobs=False
    ):
        rows = []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            context = [t for t, m in zip(ids, mask) if m]
            self.contexts.append(context)
            prompt = self.tokenizer.decode(context).split("=")[0] + "="
            rows.append(self.turns[prompt].pop(0))
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        if not logprobs:
            return ids
        return ids, torch.tensor([[-(t + 1) / 10 for t in range(len(r))] + [0.0] * (width - len(r)) for r in rows])


def test_a_rollout_appends_the_tools_result_as_ids_and_masks_it_even_when_pad_is_eos(monkeypatch):
    """Two prompts: 12*3= calls the calculator, then answers; 5*5= answers at once. The pad token is the EOS token
    (TRL #4974): the masks come from the turns, not from the ids, so the answer's EOS is trained on and the padding
    after it is not."""
    tokenizer = AutoTokenizer.from_pretrained(CALLER)
    tokenizer.pad_token = tokenizer.eos_token
    eos = tokenizer.eos_token_id

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    call, result, answer = ids("<call>12*3</call>"), ids("<result>36</result>"), ids("36") + [eos]
    policy = ScriptedPolicy(tokenizer, {"12*3=": [call, answer], "5*5=": [ids("25") + [eos]]})
    monkeypatch.setattr(tool_grpo, "generate", policy)
    args = tool_grpo.Args(max_new_tokens=24, max_turns=2)
    tool = tool_format(tokenizer, args)
    prompt_ids, prompt_mask = tool_grpo.tokenize_prompts(tokenizer, ["12*3=", "5*5="], "cpu", args)
    out = tool_grpo.rollout(None, tokenizer, prompt_ids, prompt_mask, args, [eos], tool, 1.0)

    whole = call + result + answer
    assert out["completion_ids"][0].tolist() == whole
    assert out["completion_ids"][1].tolist() == ids("25") + [eos] + [eos] * (len(whole) - 3)  # padded with EOS ids
    assert out["mask"].tolist() == [[True] * len(whole), [True] * 3 + [False] * (len(whole) - 3)]
    assert out["tool_mask"][0].tolist() == [False] * len(call) + [True] * len(result) + [False] * len(answer)
    assert not out["tool_mask"][1].any()
    # the second turn's context is the prompt and the ids so far, as ids: nothing decoded and tokenised again
    assert policy.contexts[2] == ids("12*3=") + call + result
    assert out["answers"] == ["36", "25"] and out["calls"] == [1, 0] and out["turns"] == [2, 1]
    assert out["texts"][0] == "<call>12*3</call><result>36</result>36"
    # the loss's tokens are the policy's: the call, the answer and its EOS
    loss_tokens = policy_tokens(out["mask"], out["tool_mask"])
    assert loss_tokens.sum(dim=1).tolist() == [len(call) + len(answer), 3]

    # each token's log-prob as the sampler drew it, each turn's from its first token; the tool's and padding's 0
    def turn(n):
        return [-(t + 1) / 10 for t in range(n)]

    expected = [turn(len(call)) + [0.0] * len(result) + turn(len(answer)), turn(3) + [0.0] * (len(whole) - 3)]
    torch.testing.assert_close(out["logprobs"], torch.tensor(expected))


def scripted_rollout(monkeypatch, turns, prompts=("12*3=",), **flags):
    """tool_grpo.rollout of tiny-caller's tokenizer, its turns written by ScriptedPolicy ({prompt: [ids, ...]})."""
    tokenizer = AutoTokenizer.from_pretrained(CALLER)
    monkeypatch.setattr(tool_grpo, "generate", ScriptedPolicy(tokenizer, turns))
    args = tool_grpo.Args(**flags)
    prompt_ids, prompt_mask = tool_grpo.tokenize_prompts(tokenizer, list(prompts), "cpu", args)
    stop = [tokenizer.eos_token_id]
    return tool_grpo.rollout(None, tokenizer, prompt_ids, prompt_mask, args, stop, tool_format(tokenizer, args), 1.0)


def caller_ids(text):
    return AutoTokenizer.from_pretrained(CALLER)(text, add_special_tokens=False)["input_ids"]


def test_a_call_with_no_turn_or_room_left_ends_the_completion_unanswered(monkeypatch):
    """A call in the last turn is not run; one whose result leaves no room for a token after it ran, but its result
    is not appended. Either way the completion ends on the call, and has no answer (not the call's last number)."""
    call = caller_ids("<call>0+36</call>")  # its last number is 12*3's answer: it must not score as one
    cases = [({"max_turns": 1, "max_new_tokens": 24}, 0), ({"max_turns": 2, "max_new_tokens": len(call) + 4}, 1)]
    for flags, ran in cases:  # a turn left, but only room for the result, <result>36</result> (4 ids), not after it
        out = scripted_rollout(monkeypatch, {"12*3=": [call]}, **flags)
        assert out["completion_ids"][0].tolist() == call and not out["tool_mask"].any()
        assert out["calls"] == [1] and out["ran"] == [ran] and out["failed"] == [0] and out["turns"] == [1]
        assert out["answers"] == [""] and tool_grpo.reward_fn(out["answers"][0], {"answer": "36"}) == 0.0
        assert tool_grpo.reward_fn(out["texts"][0], {"answer": "36"}) == 1.0  # what the whole text would have scored


def test_only_the_calls_run_are_rewarded_and_counted_as_failed(monkeypatch):
    """5*5= writes a call the calculator refuses, reads the error, and ends on a second call in its last turn;
    12*3= answers at once. The first call ran and failed (-1 with --tool-reward); the last was not run: no reward,
    and not a failure. failed_calls = 1 failed of 1 run (not of the 2 written)."""
    bad, last = caller_ids("<call>2--</call>"), caller_ids("<call>5*5</call>")
    turns = {"5*5=": [bad, last], "12*3=": [caller_ids("36") + [AutoTokenizer.from_pretrained(CALLER).eos_token_id]]}
    out = scripted_rollout(monkeypatch, turns, prompts=("5*5=", "12*3="), max_turns=2, max_new_tokens=120)
    assert out["calls"] == [2, 0] and out["ran"] == [1, 0] and out["failed"] == [1, 0]
    assert out["call_rewards"].tolist() == [-1.0, 0.0] and out["answers"] == ["", "36"]
    metrics = tool_grpo.tool_metrics(out, "charts/")
    assert metrics["charts/failed_calls"] == 1.0 and metrics["charts/calls"] == 1.0
    assert metrics["charts/tool_call_rate"] == pytest.approx(0.5)


def test_a_process_whose_completions_ended_writes_a_token_while_another_goes_on(monkeypatch):
    """Under torchrun a process whose completions have all ended keeps running forward passes while another
    process's go on. Here all_sum says another process still has one going, and this process's one completion was
    cut at the length limit: its stand-in turn asks for at least one token (it asked for 0, and generate() raised
    while the other process waited in a collective)."""
    tokenizer = AutoTokenizer.from_pretrained(CALLER)
    policy = tool_grpo.AutoModelForCausalLM.from_pretrained(CALLER)
    asked = []

    def generate(model, tokenizer, ids, mask, max_new_tokens, temperature, stop_ids, with_logprobs=False):
        asked.append(max_new_tokens)
        return real_generate(model, tokenizer, ids, mask, max_new_tokens, temperature, stop_ids, with_logprobs)

    real_generate = tool_grpo.generate
    monkeypatch.setattr(tool_grpo, "generate", generate)
    monkeypatch.setattr(tool_grpo, "all_sum", lambda x: x + 1)  # another process has a completion going
    args = tool_grpo.Args(max_turns=3, max_new_tokens=3)
    prompt_ids, prompt_mask = tool_grpo.tokenize_prompts(tokenizer, ["347*86="], "cpu", args)
    stop = tool_grpo.stop_token_ids(tokenizer, policy)
    out = tool_grpo.rollout(policy, tokenizer, prompt_ids, prompt_mask, args, stop, tool_format(tokenizer, args), None)
    assert asked == [3, 1, 1] and out["mask"].sum() == 3 and out["turns"] == [1]  # the stand-in turns are dropped


# the chat templates docs/tool_grpo.md names (TRL's copies: conftest.real_chat_templates), each model's end of turn,
# and a call as the model writes it (Qwen3 thinks first: its template would drop that block from the history)
REAL_TEMPLATES_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call>'
REAL_TEMPLATES = {
    "Qwen2.5": ("qwen2_5.jinja", "<|im_end|>", REAL_TEMPLATES_CALL),
    "Qwen3": ("qwen3.jinja", "<|im_end|>", "<think>\nThe calculator.\n</think>\n\n" + REAL_TEMPLATES_CALL),
    "Llama 3.1": ("llama3_1.jinja", "<|eot_id|>", '{"name": "calculator", "parameters": {"expression": "12*3"}}'),
}
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def test_the_chat_templates_the_docs_name_run_a_call_and_others_stop_with_one_line(
    chat_model_dir, real_chat_templates, monkeypatch
):
    """Each template the docs name, on the tiny chat tokenizer: the policy's call in its model's format is read and
    run, and the next turn's context is the prompt, the call as sampled, and the tool's message as the template
    writes one (with the result 36). Templates whose calls the file cannot read, that are not prefix-stable, or that
    write no tools stop with one line that says so."""
    docs = open(os.path.join(ROOT, "docs", "tool_grpo.md")).read()
    user = {"role": "user", "content": "What is 12*3?"}
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*3"}}}

    def tokenizer_with(template, end="<|im_end|>"):  # the tiny chat tokenizer, with Llama's special tokens too
        tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA_TOKENS})
        tokenizer.chat_template, tokenizer.eos_token, tokenizer.bos_token = template, end, LLAMA_TOKENS[0]
        return tokenizer

    for name, (file, end, written) in REAL_TEMPLATES.items():
        assert name in docs and file in docs
        tokenizer = tokenizer_with(real_chat_templates[file], end)
        args = tool_grpo.Args(model_name_or_path=name, max_turns=2, max_new_tokens=400)
        tool = tool_format(tokenizer, args)
        stop = [tokenizer.convert_tokens_to_ids(end)]
        turns = [tokenizer(written, add_special_tokens=False)["input_ids"] + stop, tokenizer("36")["input_ids"] + stop]
        contexts = []

        def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids, logprobs):
            contexts.append(tokenizer.decode(prompt_ids[0][prompt_mask[0].bool()]))
            ids = torch.tensor([turns.pop(0)])
            return ids, torch.zeros(ids.shape)

        monkeypatch.setattr(tool_grpo, "generate", generate)
        prompt_ids, prompt_mask = tool_grpo.tokenize_prompts(tokenizer, [user["content"]], "cpu", args, tool["tools"])
        out = tool_grpo.rollout(None, tokenizer, prompt_ids, prompt_mask, args, stop, tool, 1.0)
        assert (out["calls"], out["ran"], out["failed"], out["answers"]) == ([1], [1], [0], ["36"]), name
        messages = [user, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "36"}]
        rendered = tokenizer.apply_chat_template(
            messages, tools=tool["tools"], tokenize=False, add_generation_prompt=True
        )
        tool_message = rendered[rendered.index(end, len(contexts[0])) + len(end) :]  # after the calling turn's end
        assert contexts[1] == contexts[0] + written + end + tool_message, name
    for file, line in [
        ("qwen3_5_think.jinja", "its chat template writes a call as '"),  # <function=calculator> in XML
        ("nemotron_3_nano.jinja", "its chat template writes the prompt otherwise once a call and its result follow"),
        ("llama3.jinja", "its chat template does not write the tools it is given"),  # Llama 3's, before tools
    ]:
        tokenizer = tokenizer_with(real_chat_templates[file])
        with pytest.raises(SystemExit, match=f"^error: --model-name-or-path x: {re.escape(line)}") as caught:
            tool_format(tokenizer, tool_grpo.Args(model_name_or_path="x"))
        assert "\n" not in str(caught.value) and str(caught.value).endswith("(docs/tool_grpo.md)")


def test_a_chat_templates_tool_format_and_one_without_tools(chat_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)  # TOOL_TEMPLATE, Qwen2.5's format
    args = tool_grpo.Args(model_name_or_path=chat_model_dir)
    tool = tool_format(tokenizer, args)
    assert tool["stop_ids"] == [] and tool["tools"][0]["function"]["name"] == "calculator"
    # after the calling turn's <|im_end|>: the newline the template writes, the tool's turn, the next turn's start
    assert tool["result"]("29842") == (
        "\n<|im_start|>user\n<tool_response>\n29842\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    turn = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*86"}}</tool_call><|im_end|>'
    assert tool["parse"](turn) == ({"expression": "347*86"}, None)
    prompt_ids, _ = tool_grpo.tokenize_prompts(tokenizer, ["What is 347*86?"], "cpu", args, tool["tools"])
    assert '"name": "calculator"' in tokenizer.decode(prompt_ids[0])
    tokenizer.chat_template = PLAIN_TEMPLATE  # ChatML without tools
    with pytest.raises(SystemExit, match="its chat template does not write the tools it is given"):
        tool_format(tokenizer, args)
    # the bundled format needs <call> tokens: tiny-adder has none
    with pytest.raises(SystemExit, match="no chat template and no <call> and </call> tokens"):
        tool_format(AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-adder")), tool_grpo.Args())


def test_it_learns_to_call_the_tool_and_short_runs_log_the_tool_metrics(tmp_path):
    """The default run for 5 steps (100 held-out prompts): accuracy and the tool-call rate rise clearly (a sign and
    wiring check; benchmarks/tool_benchmark.py measures the whole run). Then the ablation's flags, 2 small steps."""
    out = str(tmp_path / "learns")
    run_script("scale/tool_grpo.py", "--num-steps", "5", "--eval-every", "5", "--num-eval", "100", "--output-dir", out)
    first, last = read_metrics(out)[0], read_metrics(out)[-1]
    assert last["eval/accuracy"] >= first["eval/accuracy"] + 0.10, (first, last)
    assert last["eval/tool_call_rate"] >= first["eval/tool_call_rate"] + 0.10, (first, last)
    assert 0 < first["eval/tool_call_rate"] < 1 and last["eval/turns"] > 1
    small = ["--num-steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--micro-batch-size", "16"]
    small += ["--num-eval", "16", "--eval-every", "2", "--log-every", "1"]
    out = str(tmp_path / "ablation")
    run_script("scale/tool_grpo.py", *small, "--no-mask-tool-tokens", "--tool-reward", "0.5", "--output-dir", out)
    for key in ("tool_call_rate", "calls", "failed_calls", "turns", "tool_tokens"):
        assert read_metrics(out)[1][f"charts/{key}"] >= 0
    # bad input: one line, before any work; --vllm is not a flag of this file, and the command line says so
    proc = run_script("scale/tool_grpo.py", "--vllm", "--output-dir", str(tmp_path / "bad"), expect_ok=False)
    assert proc.returncode != 0 and "--vllm" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-500:]
    for flags, line in [
        (["--model-name-or-path", "tiny-adder"], "error: --model-name-or-path tiny-adder: its tokenizer has no chat"),
        (["--max-turns", "0"], "error: --max-turns"),
    ]:
        proc = run_script("scale/tool_grpo.py", *flags, "--output-dir", str(tmp_path / "bad"), expect_ok=False)
        assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-500:]
        assert "Traceback" not in proc.stderr


@pytest.mark.long
def test_the_benchmark_runs_both_rows_and_writes_their_table(tmp_path):
    """benchmarks/tool_benchmark.py (results.md's comparison), with small runs: the tool's tokens masked and not,
    each with its tool metrics at every evaluation; the table and the figure are written."""
    small = "--prompts-per-step 4 --group-size 4 --num-eval 16 --eval-every 2 --log-every 1"
    args = ["--seeds", "1", "--num-steps", "2", f"--flags={small}"]
    run_script("benchmarks/tool_benchmark.py", *args, "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path))
    for name in ("masked", "not-masked"):
        evals = [m for m in read_metrics(str(tmp_path / "runs" / f"{name}__1")) if "eval/tool_call_rate" in m]
        assert len(evals) == 2 and all(0 <= m["eval/tool_call_rate"] <= 1 for m in evals)
    page = (tmp_path / "results.md").read_text()
    assert "\n| masked | " in page and "\n| not masked | " in page and (tmp_path / "tool_grpo.png").stat().st_size > 0


def test_extra_tokens_that_the_vocabulary_has_stop_sft_with_one_line(tmp_path):
    for tokens in (["+"], ["*", "*"], ["<eos>"]):
        proc = run_script(
            "scale/sft.py", "--extra-tokens", *tokens, "--output-dir", str(tmp_path / "o"), expect_ok=False
        )
        assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: --extra-tokens")
        assert not (tmp_path / "o").exists()
