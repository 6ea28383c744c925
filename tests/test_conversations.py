"""Conversational records: prompts as lists of messages, preference pairs and SFT data in TRL's conversational forms,
--system-prompt; and the one-line error of a tokenizer without a chat template."""

import json
import os

import pytest
import torch
from conftest import FIXTURES, ROOT, read_metrics, run_script
from transformers import AutoTokenizer

from scale.dpo import preference_pair
from scale.grpo import Args, tokenize_prompts
from scale.sft import sft_record

USER, ASSISTANT = "user", "assistant"


def message(role, content):
    return {"role": role, "content": content}


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, ("2+2?", "4", "5")),  # plain text: unchanged
        (
            {"prompt": "2+2?", "chosen": [message(ASSISTANT, "4")], "rejected": [message(ASSISTANT, "5")]},
            ("2+2?", "4", "5"),
        ),  # one assistant message each
        (
            {
                "prompt": [message(USER, "2+2?")],
                "chosen": [message(USER, "2+2?"), message(ASSISTANT, "4")],
                "rejected": [message(USER, "2+2?"), message(ASSISTANT, "5")],
            },
            ([message(USER, "2+2?")], "4", "5"),
        ),  # whole conversations after prompt messages
        (
            {
                "chosen": [message("system", "Be brief."), message(USER, "2+2?"), message(ASSISTANT, "4")],
                "rejected": [message("system", "Be brief."), message(USER, "2+2?"), message(ASSISTANT, "5")],
            },
            ([message("system", "Be brief."), message(USER, "2+2?")], "4", "5"),
        ),  # no prompt: the common beginning
    ],
)
def test_a_preference_record_in_each_form_gives_the_same_pair(record, expected):
    pair = preference_pair({**record, "margin": 2}, "--dataset pairs.jsonl")
    assert (pair["prompt"], pair["chosen"], pair["rejected"]) == expected and pair["margin"] == 2


def test_conversational_records_that_cannot_be_read_stop_with_one_line():
    with pytest.raises(SystemExit, match="^error: --dataset d.jsonl: a record with text completions needs a 'prompt'"):
        preference_pair({"chosen": "4", "rejected": "5"}, "--dataset d.jsonl")
    two_turns = [message(ASSISTANT, "4"), message(ASSISTANT, "really, 4")]
    with pytest.raises(SystemExit, match="one assistant message after the prompt$"):
        preference_pair(
            {"prompt": "2+2?", "chosen": two_turns, "rejected": [message(ASSISTANT, "5")]}, "--dataset d.jsonl"
        )
    with pytest.raises(SystemExit, match="must end with one assistant message"):
        sft_record({"messages": [message(USER, "2+2?"), message(USER, "well?")]}, "--dataset d.jsonl")


def test_an_sft_conversation_is_its_last_assistant_message_after_the_rest():
    record = sft_record(
        {"messages": [message("system", "Be brief."), message(USER, "2+2?"), message(ASSISTANT, "4")]},
        "--dataset d.jsonl",
    )
    assert record["prompt"] == [message("system", "Be brief."), message(USER, "2+2?")] and record["completion"] == "4"
    record = sft_record({"prompt": "2+2?", "completion": [message(ASSISTANT, "4")]}, "--dataset d.jsonl")
    assert record["completion"] == "4"


def test_a_conversation_goes_through_the_chat_template_as_given_and_the_system_prompt_comes_first(chat_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    conversation = [message("system", "Reply with the number only."), message(USER, "What is 2 + 3?")]
    ids, mask = tokenize_prompts(tokenizer, [conversation, "What is 2 + 3?"], "cpu", Args())
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids[0][mask[0].bool()]) == expected
    assert expected.startswith("<|im_start|>system\nReply with the number only.<|im_end|>")
    # --system-prompt goes before a text prompt, which becomes the user's message; a conversation is kept as given
    user_only = [message(USER, "What is 2 + 3?")]
    ids, mask = tokenize_prompts(
        tokenizer, ["What is 2 + 3?", user_only], "cpu", Args(system_prompt="Reply with the number only.")
    )
    assert tokenizer.decode(ids[0][mask[0].bool()]) == expected
    assert tokenizer.decode(ids[1][mask[1].bool()]) == tokenizer.apply_chat_template(
        user_only, tokenize=False, add_generation_prompt=True
    )


def test_without_a_chat_template_conversations_and_a_system_prompt_stop_with_one_line(tmp_path):
    """The bundled model has no chat template: neither a conversational file nor --system-prompt can work."""
    data = os.path.join(FIXTURES, "prompts_chat.jsonl")
    for i, (flags, what) in enumerate(
        (
            (["--dataset", data, "--num-eval", "2"], "conversational records (--dataset, --eval-dataset)"),
            (["--system-prompt", "Be brief."], "--system-prompt"),
        )
    ):
        proc = run_script("scale/grpo.py", *flags, "--output-dir", str(tmp_path / f"o{i}"), expect_ok=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: {what} need a tokenizer with a chat template, and tiny-adder has none"
        )


@pytest.mark.parametrize(
    "script, data, flags",
    [
        ("scale/grpo.py", "prompts_chat.jsonl", ["--prompts-per-step", "2", "--group-size", "2"]),
        (
            "scale/grpo.py",
            "gsm8k_tiny.jsonl",
            ["--prompts-per-step", "2", "--group-size", "2", "--system-prompt", "Be brief."],
        ),
        ("scale/dpo.py", "pairs_chat.jsonl", ["--batch-size", "2"]),
        ("scale/reward_model.py", "pairs_chat.jsonl", ["--batch-size", "2"]),
        ("scale/sft.py", "sft_messages.jsonl", ["--batch-size", "2"]),
    ],
)
def test_each_file_trains_on_conversational_records(script, data, flags, chat_model_dir, tmp_path):
    out = tmp_path / "run"
    run_script(
        script,
        "--model-name-or-path",
        chat_model_dir,
        "--dataset",
        os.path.join(FIXTURES, data),
        "--num-eval",
        "2",
        "--num-steps",
        "2",
        "--eval-every",
        "2",
        "--micro-batch-size",
        "2",
        "--max-new-tokens",
        "6",
        *flags,
        "--output-dir",
        str(out),
    )
    metrics = read_metrics(str(out))
    assert metrics[-1]["step"] == 2 and all(torch.isfinite(torch.tensor(v)) for v in metrics[-1].values())
    assert json.loads((out / "args.json").read_text())["dataset"].endswith(data)


def test_the_fixtures_hold_each_conversational_form():
    with open(os.path.join(FIXTURES, "pairs_chat.jsonl")) as f:
        records = [json.loads(line) for line in f]
    forms = {("prompt" in r, isinstance(r.get("prompt"), list), len(r["chosen"])) for r in records}
    assert forms == {(True, False, 1), (True, True, 2), (False, False, 2)}
    assert os.path.exists(os.path.join(ROOT, "tests", "fixtures", "sft_messages.jsonl"))
