"""scale/reward_model.py's loss and the token its score is read at."""

import math
import os

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForSequenceClassification, LlamaConfig

from reward_model import bradley_terry_loss, last_token_scores


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])
    loss, stats = bradley_terry_loss(chosen, rejected)
    # differences (1, -1, 0): -log sigmoid(1) = 0.313262, -log sigmoid(-1) = 1.313262, log 2 = 0.693147
    assert loss.item() == pytest.approx((0.313262 + 1.313262 + math.log(2)) / 3, abs=1e-6)
    assert stats["accuracy"].item() == pytest.approx(0.5)  # right, wrong, tie
    assert stats["margin"].item() == pytest.approx(0.0)
    # a margin of 1 on the first pair: -log sigmoid(1 - 1) = log 2
    loss, _ = bradley_terry_loss(chosen[:1], rejected[:1], margin=torch.tensor([1.0]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)


def test_bradley_terry_loss_is_log_2_for_equal_scores():
    scores = torch.tensor([0.3, -5.0, 12.0])
    loss, _ = bradley_terry_loss(scores, scores.clone())
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)


def test_bradley_terry_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = torch.tensor([0.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected)[0].backward()
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)


@pytest.fixture(scope="module")
def reward_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=2,
        eos_token_id=2,
    )  # the pad id is the EOS id, as in many real tokenizers
    model = AutoModelForSequenceClassification.from_config(config).eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ from token to token
    return model


def alone(model, ids):
    with torch.no_grad():
        return last_token_scores(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).item()


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_score_is_read_at_the_last_real_token(reward_model, padding_side):
    EOS = PAD = 2
    sequences = [[11, 12, 13, EOS], [21, 22, 23, 24, 25, 26, 2], [31, 32]]  # the last ends on a non-EOS token
    width = max(len(s) for s in sequences)
    rows, masks = [], []
    for s in sequences:
        pad = [PAD] * (width - len(s))
        rows.append(pad + s if padding_side == "left" else s + pad)
        masks.append(([0] * len(pad) + [1] * len(s)) if padding_side == "left" else ([1] * len(s) + [0] * len(pad)))
    with torch.no_grad():
        batched = last_token_scores(reward_model, torch.tensor(rows), torch.tensor(masks))
    expected = torch.tensor([alone(reward_model, s) for s in sequences])
    torch.testing.assert_close(batched, expected, atol=1e-4, rtol=0)
    # reading at the token before (or after) the last real one gives other numbers, so the test can fail
    assert abs(alone(reward_model, sequences[0][:-1]) - expected[0].item()) > 1e-3


def test_score_in_the_prompt_then_completion_layout(reward_model):
    # left-padded prompt, right-padded completion: the EOS that ends the completion is read, not the padding
    EOS = PAD = 2
    input_ids = torch.tensor([[PAD, PAD, 11, 12, 31, EOS, PAD], [21, 22, 23, 24, 41, 42, EOS]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        got = last_token_scores(reward_model, input_ids, attention_mask)
    expected = torch.tensor(
        [alone(reward_model, [11, 12, 31, EOS]), alone(reward_model, [21, 22, 23, 24, 41, 42, EOS])]
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "pairs, chosen, expected",
    [
        # prompt 1+1= (answer 2) sampled 2, 3, 2, 4; prompt 5+5= (answer 10) sampled 9, 9, 11, 12 (never right)
        ("first", "answer", [("2", "3"), ("10", "9")]),
        ("all", "answer", [("2", "3"), ("2", "4"), ("10", "9"), ("10", "11"), ("10", "12")]),  # distinct wrong ones
        ("all", "sample", [("2", "3"), ("2", "4")]),  # no right sample: no pair for 5+5=
        ("all", "sample-or-answer", [("2", "3"), ("2", "4"), ("10", "9"), ("10", "11"), ("10", "12")]),
        ("first", "sample", [("2", "3")]),
    ],
)
def test_addition_pairs_by_hand(monkeypatch, pairs, chosen, expected):
    from scale import reward_model

    samples = ["2", "3", "2", "4", "9", "9", "11", "12"]  # what the policy "sampled", 4 per prompt
    monkeypatch.setattr(reward_model, "generate", lambda *args: torch.zeros(len(samples), 1, dtype=torch.long))
    monkeypatch.setattr(reward_model, "decode_completions", lambda *args: samples)
    tokenizer = reward_model.AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    policy = reward_model.AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    records = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "5+5=", "answer": "10"}]
    args = reward_model.Args(pair_samples=4, max_new_tokens=4, chosen=chosen, pairs=pairs)
    out = reward_model.addition_pairs(policy, tokenizer, records, torch.device("cpu"), args)
    assert [(p["chosen"], p["rejected"]) for p in out] == expected
    assert all(p["prompt"] == ("1+1=" if p["answer"] == "2" else "5+5=") for p in out)
