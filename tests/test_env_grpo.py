"""env_grpo.py: the two credits against numbers worked out by hand, the environment's tokens out of the loss, the
episode's token ids turn by turn (a stand-in policy), truncation, the trainer's log-probs against the sampler's, the
bundled game and its blind evaluation, an observation written by a chat template, and bad input."""

import os

import pytest
import torch
from conftest import ROOT
from transformers import AutoTokenizer

import env_grpo
from env_grpo import GuessTheNumber, group_advantages, grpo_loss, token_advantages, turn_advantages
from scale import env_grpo as scale_env_grpo

GUESSER = os.path.join(ROOT, "tiny-guesser")
SENTINEL = 1e6  # at the environment's positions: it must reach neither the loss nor its gradient


def test_the_turn_credit_of_three_episodes_by_hand():
    """A group of 3: episode a, 3 turns, rewards (0, 0.5, 1); b, 1 turn, (1); c, 2 turns, (0, 0). Rewards-to-go:
    a (1.5, 1.5, 1), b (1), c (0, 0). An ended episode counts at later turns with what it ended with (its last
    turn's), so turn 0: (1.5, 1, 0), turn 1: (1.5, 1, 0), turn 2: (1, 1, 0). Unscaled, minus the turn's mean:
    turn 0 and 1: 1.5 - 2.5/3 = 0.6667, 1 - 0.8333 = 0.1667, -0.8333; turn 2: 1/3, 1/3, -2/3. Scaled by the
    unbiased std (turn 0: sqrt(((2/3)^2 + (1/6)^2 + (5/6)^2) / 2) = 0.7638; turn 2: 0.5774), eps 1e-4 aside."""
    rewards = torch.tensor([[0.0, 0.5, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    turns = torch.tensor([3, 1, 2])
    unscaled = turn_advantages(rewards, turns, 3, scale=False)
    expected = torch.tensor([[2 / 3, 2 / 3, 1 / 3], [1 / 6, 1 / 6, 1 / 3], [-5 / 6, -5 / 6, -2 / 3]])
    torch.testing.assert_close(unscaled, expected)
    std0, std2 = (
        (((2 / 3) ** 2 + (1 / 6) ** 2 + (5 / 6) ** 2) / 2) ** 0.5,
        ((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2) ** 0.5,
    )
    assert std0 == pytest.approx(0.7638, abs=1e-4) and std2 == pytest.approx(0.5774, abs=1e-4)
    scaled = turn_advantages(rewards, turns, 3)
    torch.testing.assert_close(scaled[:, 0], expected[:, 0] / (std0 + 1e-4))
    torch.testing.assert_close(scaled[:, 2], expected[:, 2] / (std2 + 1e-4))
    # the outcome credit of the same group: the returns (1.5, 1, 0), one advantage an episode
    torch.testing.assert_close(group_advantages(rewards.sum(1), 3, scale=False), torch.tensor([2 / 3, 1 / 6, -5 / 6]))


def test_with_rewards_at_the_last_turn_alone_turn_credit_is_outcome_credit_and_a_no_op_turn_changes_nothing():
    """Two groups of 4 episodes of 1 to 4 turns whose only reward is at their last turn: at every turn each episode's
    advantage is GRPO's of its return, scaled or not. A first turn that every episode takes with reward 0 (a
    greeting the environment asks for) leaves every later turn's advantage as it was, and takes them itself."""
    turns = torch.tensor([1, 3, 4, 2, 2, 2, 4, 1])
    last = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.25, 1.0, 0.0])
    rewards = torch.zeros(8, 4)
    rewards[torch.arange(8), turns - 1] = last
    for scale in (True, False):
        by_turn = turn_advantages(rewards, turns, 4, scale)
        outcome = group_advantages(last, 4, scale)
        torch.testing.assert_close(by_turn, outcome[:, None].expand(8, 4))
        greeted = turn_advantages(torch.cat([torch.zeros(8, 1), rewards], dim=1), turns + 1, 4, scale)
        torch.testing.assert_close(greeted[:, 1:], by_turn)
        torch.testing.assert_close(greeted[:, 0], by_turn[:, 0])
    # an intermediate reward makes them differ: the check above can fail
    rewards[1, 0] = 1.0
    assert not torch.allclose(turn_advantages(rewards, turns, 4), group_advantages(rewards.sum(1), 4)[:, None])


def test_each_policy_token_gets_its_turns_advantage_and_the_environments_none():
    turn_ids = torch.tensor([[0, 0, -1, 1, 1, -1], [0, -1, 1, -1, -1, -1]])
    by_turn = torch.tensor([[0.5, -1.0], [2.0, 3.0]])
    expected = torch.tensor([[0.5, 0.5, 0, -1.0, -1.0, 0], [2.0, 0, 3.0, 0, 0, 0]])
    torch.testing.assert_close(token_advantages(by_turn, turn_ids), expected)
    by_episode = torch.tensor([0.5, -2.0])
    expected = torch.tensor([[0.5, 0.5, 0, 0.5, 0.5, 0], [-2.0, 0, -2.0, 0, 0, 0]])
    torch.testing.assert_close(token_advantages(by_episode, turn_ids), expected)


def test_the_environments_tokens_carry_no_loss_and_no_gradient_by_hand():
    """One episode: the policy's 2 tokens (turn 0, A = 2), the environment's 2, the policy's 1 (turn 1, A = -1), a
    pad. Ratios (1.5, 1, ., ., 0.5), eps 0.2, no KL: t0 -min(3, 2.4) = -2.4; t1 -2; t4 -min(-0.5, -0.8) = 0.8.
    loss = (-2.4 - 2 + 0.8) / 3 = -1.2, whatever the environment's positions hold (log-probs, advantages)."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]]).bool()
    env_mask = torch.tensor([[0, 0, 1, 1, 0, 0]]).bool()
    turn_ids = torch.tensor([[0, 0, -1, -1, 1, -1]])
    old = torch.full((1, 6), -1.0)
    logprobs = (old + torch.tensor([[1.5, 1.0, 1.0, 1.0, 0.5, 1.0]]).log()).requires_grad_()
    advantages = token_advantages(torch.tensor([[2.0, -1.0]]), turn_ids)
    loss, _ = grpo_loss(logprobs, old, None, advantages, mask & ~env_mask, beta=0.0)
    torch.testing.assert_close(loss, torch.tensor(-1.2))
    (grad,) = torch.autograd.grad(loss, logprobs)
    changed = env_mask | ~mask
    other = torch.where(changed, SENTINEL, logprobs.detach()).requires_grad_()
    advantages2 = torch.where(changed, SENTINEL, advantages)
    loss2, _ = grpo_loss(other, torch.where(changed, -SENTINEL, old), None, advantages2, mask & ~env_mask, beta=0.0)
    (grad2,) = torch.autograd.grad(loss2, other)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad2, grad, rtol=0, atol=1e-6)
    assert grad[0, 2:4].abs().sum() == 0 and grad[0, 5] == 0 and grad[0, 1] != 0  # t0 and t4 clipped: 0 too


def test_the_game_answers_higher_lower_right_and_the_blind_game_answers_alike():
    game = GuessTheNumber()
    assert game.reset({"secret": 37, "high": 63}) == "?"
    assert game.step("32") == ("+", 0.0, False) and game.step("48") == ("-", 0.0, False)
    assert game.step("") == ("?", 0.0, False) and game.step("64") == ("?", 0.0, False) and game.step("0")[0] == "?"
    assert game.step("37") == ("=", 1.0, True)
    game.reset({"secret": 5})  # 1-31 unless the record says
    assert game.step("32") == ("?", 0.0, False) and game.step("31") == ("-", 0.0, False)
    blind = env_grpo.Blind(GuessTheNumber())
    assert blind.reset({"secret": 17}) == "?"
    assert blind.step("20") == ("+", 0.0, False) and blind.step("17") == ("+", 1.0, True)
    train, held_out = env_grpo.guess_records()
    assert [r["secret"] for r in train] == list(range(1, 32)) and held_out == train


class ScriptedPolicy:
    """Stands in for generate(): writes each episode's scripted turns in order (by the secret, which the test keys its
    prompt on: the i-th row of the first call is episode i), padded after each turn's stop token; keeps the contexts
    it was given; asked for log-probs, the t-th token of a turn has log-prob -(t + 1) / 10, the padding 0."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.contexts, self.rows_of = tokenizer, turns, [], None

    def __call__(
        self, model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids, logprobs=False
    ):
        going = [i for i, t in enumerate(self.turns) if t] if self.rows_of is None else self.rows_of()
        rows = []
        for i, (ids, mask) in zip(going, zip(prompt_ids.tolist(), prompt_mask.tolist())):
            self.contexts.append([t for t, m in zip(ids, mask) if m])
            rows.append(self.turns[i].pop(0)[:max_new_tokens])
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        if not logprobs:
            return ids
        return ids, torch.tensor([[-(t + 1) / 10 for t in range(len(r))] + [0.0] * (width - len(r)) for r in rows])


class CountingGame(GuessTheNumber):
    sent = []

    def step(self, action):
        CountingGame.sent.append(action)
        return super().step(action)


@pytest.mark.parametrize("module", [env_grpo, scale_env_grpo], ids=["plain", "scale"])
def test_an_episodes_ids_are_the_sampled_ids_and_the_environments_turn_by_turn(monkeypatch, module):
    """Three games of secret 21 with max_turns 3: a guesses 16 (+), 24 (-), 21 (=): done; b guesses 30 (-), then a
    turn the token budget cuts (no stop token): truncated, and the cut turn is never sent; c guesses 1 (+), 2 (+),
    3: its turns run out, truncated, its last observation not appended. The ids trained on are each turn's sampled
    ids and the environment's answers, as ids; each turn's context is the prompt and the ids so far."""
    tokenizer = AutoTokenizer.from_pretrained(GUESSER)
    eos = tokenizer.eos_token_id

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    turns = [
        [ids("16") + [eos], ids("24") + [eos], ids("21") + [eos]],
        [ids("30") + [eos], ids("4444444")],
        [ids("1") + [eos], ids("2") + [eos], ids("3") + [eos]],
    ]
    policy = ScriptedPolicy(tokenizer, [list(t) for t in turns])
    monkeypatch.setattr(module, "generate", policy)
    CountingGame.sent = []
    envs = [CountingGame() for _ in range(3)]
    first = [env.reset({"secret": 21}) for env in envs]
    args = module.Args(max_turns=3, max_new_tokens=12)
    if module is env_grpo:
        prompt_ids, prompt_mask = module.tokenize_prompts(tokenizer, first, "cpu")
    else:
        prompt_ids, prompt_mask = module.tokenize_prompts(tokenizer, first, "cpu", args)
    rows = iter([[0, 1, 2], [0, 1, 2], [0, 2]])
    policy.rows_of = lambda: next(rows)
    out = module.play_episodes(None, tokenizer, prompt_ids, prompt_mask, envs, args, [eos], 1.0)

    a = turns[0][0] + ids("+") + turns[0][1] + ids("-") + turns[0][2]
    b = turns[1][0] + ids("-") + turns[1][1][:7]
    c = turns[2][0] + ids("+") + turns[2][1] + ids("+") + turns[2][2]
    for row, expected in zip(out["completion_ids"].tolist(), (a, b, c)):
        assert row[: len(expected)] == expected
    assert out["mask"].sum(dim=1).tolist() == [len(a), len(b), len(c)]
    assert out["env_mask"].sum(dim=1).tolist() == [2, 1, 2]
    assert out["turn_ids"][0, : len(a)].tolist() == [0, 0, 0, -1, 1, 1, 1, -1, 2, 2, 2]
    assert policy.contexts[3] == ids("?") + turns[0][0] + ids("+")  # the second turn's context, as ids
    assert CountingGame.sent == ["16", "30", "1", "24", "2", "21", "3"]  # b's cut turn never sent
    assert out["done"] == [True, False, False] and out["truncated"] == [False, True, True]
    assert out["turns"].tolist() == [3, 2, 3]
    assert out["rewards"].tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    metrics = module.episode_metrics(out, "eval/")
    assert metrics["eval/accuracy"] == pytest.approx(1 / 3) and metrics["eval/turns"] == pytest.approx(8 / 3)
    assert metrics["eval/env_tokens"] == pytest.approx(5 / 3) and metrics["eval/truncated"] == pytest.approx(2 / 3)
    if module is scale_env_grpo:  # each token's log-prob as the sampler drew it; the environment's and padding's 0
        drawn = out["logprobs"][0, : len(a)].tolist()
        assert drawn == pytest.approx([-0.1, -0.2, -0.3, 0.0, -0.1, -0.2, -0.3, 0.0, -0.1, -0.2, -0.3])


def test_the_trainers_log_probs_of_the_policys_tokens_are_the_samplers(monkeypatch):
    """scale/env_grpo.py's episodes of the bundled model, sampled by the decode loop turn by turn: the trainer's
    log-probs (token_logprobs over the prompt, every turn and every answer, left-padded) of the policy's tokens equal
    the log-probs the sampler drew them with, within 1e-5 (test_decode's bound); the environment's positions hold 0."""
    m = scale_env_grpo
    tokenizer = AutoTokenizer.from_pretrained(GUESSER)
    args = m.Args(dtype="float32")
    policy = m.load_model(GUESSER, args, torch.device("cpu"))
    stop_ids = m.stop_token_ids(tokenizer, policy)
    torch.manual_seed(0)
    envs = [GuessTheNumber() for _ in range(8)]
    first = [env.reset({"secret": s}) for env, s in zip(envs, (1, 7, 12, 16, 17, 25, 30, 31))]
    prompt_ids, prompt_mask = m.tokenize_prompts(tokenizer, first, "cpu", args)
    out = m.play_episodes(policy, tokenizer, prompt_ids, prompt_mask, envs, args, stop_ids, 1.0)
    assert out["turns"].max() >= 3 and out["env_mask"].any()
    input_ids = torch.cat([prompt_ids, out["completion_ids"]], dim=1)
    attention_mask = torch.cat([prompt_mask, out["mask"].long()], dim=1)
    with torch.no_grad():
        trainer = m.token_logprobs(policy, input_ids, attention_mask, prompt_ids.shape[1], 1.0)
    policy_tokens = out["mask"] & ~out["env_mask"]
    gap = (trainer - out["logprobs"]).abs()[policy_tokens].max().item()
    assert gap < 1e-5, gap
    assert (out["logprobs"][out["env_mask"]] == 0).all()


def test_an_observation_is_a_user_message_of_the_chat_template(chat_model_dir):
    """With a chat template the observation is written as the template writes a user's message after an assistant's
    turn (from the end of that turn to the next turn's start); without one, as it is."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    observe = env_grpo.observation_format(tokenizer, chat_model_dir)
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "32"}, {"role": "user", "content": "+"}]
    whole = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    start = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert start + "32" + tokenizer.eos_token + observe("+") == whole
    assert env_grpo.observation_format(AutoTokenizer.from_pretrained(GUESSER), GUESSER)("+") == "+"
    assert scale_env_grpo.observation_format(tokenizer, chat_model_dir)("-") == observe("-")


def test_a_record_the_environment_refuses_stops_the_run_in_one_line(tmp_path):
    """A --dataset record that the environment's reset() cannot start from: exit status 1 and one line that names
    the file, the record and the environment's complaint, before any episode is played."""
    from conftest import run_script

    data = tmp_path / "records.jsonl"
    data.write_text('{"secret": 3}\n{"prompt": "1+1="}\n{"secret": 4}\n')
    proc = run_script(
        "env_grpo.py", "--dataset", str(data), "--num-eval", "1", "--output-dir", str(tmp_path / "o"), expect_ok=False
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines == [
        f"error: --dataset {data}: record 2 starts no --env guess episode (KeyError: 'secret')"
    ], lines


def test_the_pages_quiz_plays_as_the_page_says_and_trains_when_added_as_it_says(tmp_path, chat_model_dir):
    """docs/env_grpo.md's worked example beyond the game, as its code block stands: three tries, reward 1, 0.5 or
    0.25 for a right answer, 0 and done after three wrong ones. Then added to a copy of env_grpo.py as the page
    says (the class, ENVIRONMENTS, the Literal of --env), the copy alone in a folder trains on a --dataset of quiz
    records with a chat model for 2 steps."""
    import json
    import re

    from conftest import run_script
    from test_scripts import RL_SMALL

    with open(os.path.join(ROOT, "docs", "env_grpo.md"), encoding="utf-8") as f:
        block = next(b for b in re.findall(r"```python\n(.*?)```", f.read(), flags=re.S) if "class Quiz" in b)
    scope = {"reward_fn": env_grpo.reward_fn, "GuessTheNumber": GuessTheNumber}
    exec(block, scope)  # the page's own code, from this repository
    record = {"prompt": "What is 7*8?", "answer": "56"}
    quiz = scope["Quiz"]()
    assert quiz.reset(record) == "What is 7*8?"
    assert quiz.step("It is 56.") == ("", 1.0, True)
    quiz.reset(record)
    assert quiz.step("54") == ("Wrong. Try again.", 0.0, False) and quiz.step("55")[2] is False
    assert quiz.step("56") == ("", 0.25, True)
    quiz.reset(record)
    assert [quiz.step("7")[1:] for _ in range(3)] == [(0.0, False), (0.0, False), (0.0, True)]
    assert set(scope["ENVIRONMENTS"]) == {"guess", "quiz"}

    with open(os.path.join(ROOT, "env_grpo.py"), encoding="utf-8") as f:
        source = f.read()
    line = 'ENVIRONMENTS = {"guess": GuessTheNumber}\n'
    assert source.count(line) == 1 and source.count('env: Literal["guess"]') == 1
    source = source.replace(line, block).replace('env: Literal["guess"]', 'env: Literal["guess", "quiz"]')
    (tmp_path / "env_grpo.py").write_text(source, encoding="utf-8")
    data = tmp_path / "quiz.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a}*{a + 1}?", "answer": str(a * (a + 1))}) + "\n" for a in range(2, 10)
        )
    )
    out = tmp_path / "run"
    args = ["--env", "quiz", "--dataset", str(data), "--model-name-or-path", chat_model_dir, *RL_SMALL]
    run_script(str(tmp_path / "env_grpo.py"), *args, "--output-dir", str(out), cwd=str(tmp_path))
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows[-1]["step"] == 2 and "eval/accuracy" in rows[-1]
