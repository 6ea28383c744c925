"""GRPO that learns by acting in an environment over many turns, in one file.

An episode is a conversation between the policy and an environment. The environment's first observation is the
prompt; the policy writes an action (a turn, up to its end-of-turn token); the environment answers with an
observation, a reward and whether the episode is done; the observation is appended to the episode as token ids and
the policy writes the next turn, up to `--max-turns` turns and `--max-new-tokens` tokens in all. The policy's own
tokens are never decoded and tokenised again: its ids are kept as they were sampled, and only the environment's
text is tokenised. The G episodes of a prompt start from the same state (one record), so their returns compare as
GRPO's completions do (grpo.py; Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300, eq. 3 and 4), and
the loss is GRPO's on the policy's tokens alone (m_t = 1 on them, 0 on the environment's):

    loss = -1/G sum_i 1/|o_i|_m sum_t m_it [ min(r_it A_it, clip(r_it, 1-eps, 1+eps) A_it) - beta KL_it ]

`--credit outcome` gives every token of episode i the z-score of its return within the group (GRPO's A_i);
`--credit turn` gives the tokens of turn k the z-score of the reward-to-go from turn k, G_ik = sum_{t>=k} r_it,
among the group's at the same turn, an episode that has ended counting with what it ended with (turn_advantages).
An episode stops when the environment says done, or is truncated: its turns or its tokens ran out (a turn the token
budget cut is never sent). The bundled environment is guess the number: a secret in 1-31, five guesses, each answered
`+` (higher), `-` (lower) or `=` (right, reward 1). Its optimum, binary search, solves every game in 4.16 guesses on
average; a guesser that ignores the answers solves at most 5/31 = 16.1%. See docs/env_grpo.md, and how to write an
environment of your own. `diff grpo.py env_grpo.py` shows what the environment changes: the episode (tool_grpo.py's
multi-turn rollout, the tool become an environment) and the credit; scale/env_grpo.py is this file with what scale
needs (its own decode loop, torchrun, LoRA, resume).

    python env_grpo.py                                   # bundled tiny model (tiny-guesser), guess the number, CPU
    python env_grpo.py --credit turn                     # each turn's reward-to-go in place of the episode's return
"""

import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # names the run: runs/<exp_name>__<seed>__<time>
    seed: int = 1  # seed of the experiment (data order, sampling, initialisation)
    torch_deterministic: bool = True  # deterministic algorithms only (`--no-torch-deterministic`: any)
    cuda: bool = True  # use CUDA when it is available
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # of the forward passes (auto: bfloat16 on a GPU)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass to save memory
    track: bool = False  # log to Weights & Biases (`WANDB_MODE=offline` keeps it on disk)
    wandb_project_name: str = "onefile-rl"  # the wandb project
    wandb_entity: str | None = None  # the wandb entity (team or user)
    output_dir: str | None = None  # the run's folder, which must not exist yet (default: runs/<run name>)
    trust_remote_code: bool = False  # let transformers run code shipped with a hub model you trust
    log_every: int = 5  # write metrics and a console line every this many steps

    # Model and data
    model_name_or_path: str = "tiny-guesser"  # the starting policy: a local folder or a hub id
    dataset: str | None = None  # a .jsonl of records, each the start of an episode (reset's argument)
    env: Literal["guess"] = "guess"  # the environment (ENVIRONMENTS); without --dataset, its own records
    num_eval: int = 500  # held-out records: a .jsonl's last (the game evaluates on every secret)
    eval_every: int = 10  # greedy accuracy on the held-out records every this many steps, and at 0
    max_new_tokens: int = 20  # the longest episode after the prompt, in tokens: every turn, the observations included

    # Optimisation
    num_steps: int = 300  # training steps (each: one batch of episodes, then its updates)
    learning_rate: float = 3e-4  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 64  # sequences per forward/backward pass

    # Algorithm specific arguments
    prompts_per_step: int = 16  # records (starting states) per batch of episodes
    group_size: int = 8  # episodes per record (G in the paper), all from the same starting state
    temperature: float = 1.0  # sampling temperature; log-probs are computed at the same temperature
    num_iterations: int = 1  # passes over each batch of episodes (the paper's mu)
    num_minibatches: int = 1  # optimizer steps per pass over a batch of episodes
    beta: float = 0.0  # weight of the KL penalty to the reference (0: none loaded; GRPO's 0.04 learned the game slower)
    clip_eps_low: float = 0.2  # the ratio is clipped below at 1 - clip_eps_low
    clip_eps_high: float = 0.2  # the ratio is clipped above at 1 + clip_eps_high (DAPO raises it to 0.28)
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """how token losses are averaged: the paper's, DAPO's, or Dr. GRPO's (docs/grpo.md)"""
    scale_rewards: bool = True  # divide by the group's std (`--no-scale-rewards`: Dr. GRPO)
    max_turns: int = 5  # the policy's turns in an episode (the game's guesses)
    credit: Literal["outcome", "turn"] = "outcome"  # the episode's return for every token, or each turn's reward-to-go


# ---- ALGO LOGIC: GRPO's advantage and loss, the turn's credit, and which tokens the loss counts
def group_advantages(rewards, group_size, scale=True, eps=1e-4):
    """A_i = (R_i - mean(R_group)) / (std(R_group) + eps), or R_i - mean(R_group) if not scale.

    rewards: (B,) group-contiguous, B = num_prompts * group_size; the std is the unbiased one.
    rewards = [1, 0, 0, 0,  1, 1, 1, 1]  (G = 4) -> [1.5, -0.5, -0.5, -0.5,  0, 0, 0, 0]
    """
    grouped = rewards.view(-1, group_size)  # (num_prompts, G)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.view(-1)  # (B,)


def turn_advantages(rewards, turns, group_size, scale=True, eps=1e-4):
    """A_ik = (G_ik - mean_j G_jk) / (std_j G_jk + eps): turn k's reward-to-go G_ik = sum_{t >= k} r_it against the
    group's at the same turn, where an episode that has ended counts with G at its last turn (what it ended with), so
    that every episode of the group is in every turn's baseline, whenever it stopped (no bias to stop early or late).
    With rewards at the last turn alone, G_ik is the return at every turn and A_ik is group_advantages' A_i.

    rewards: (B, K) each turn's reward, 0 after the episode's turns; turns: (B,) their count (>= 1). Returns (B, K).
    rewards = [[0, 1], [1, 0], [0, 0]], turns = [2, 1, 2] (G = 3): G = [[1, 1], [1, 1], [0, 0]]
    -> each turn [0.577, 0.577, -1.155] (the returns' z-scores)
    """
    to_go = rewards.flip(1).cumsum(1).flip(1)  # (B, K): G_ik
    ended = torch.arange(rewards.shape[1], device=rewards.device) >= turns[:, None]  # (B, K): after the last turn
    to_go = torch.where(ended, to_go.gather(1, turns[:, None] - 1), to_go)
    grouped = to_go.view(-1, group_size, rewards.shape[1])  # (num_prompts, G, K)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.view(-1, rewards.shape[1])  # (B, K)


def grpo_loss(
    logprobs,
    old_logprobs,
    ref_logprobs,
    advantages,
    mask,
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    beta=0.04,
    loss_agg="seq-mean-token-mean",
    max_completion_length=None,
):
    """GRPO's clipped surrogate plus beta times the k3 KL to the reference, to be minimised.

    logprobs (B, T) carries the gradient; old_logprobs, ref_logprobs (B, T) and advantages (B,), or (B, T) with an
    advantage for every token (process_grpo.py), are constants; mask (B, T) marks completion tokens. Per token:
        l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) + beta (exp(d_t) - d_t - 1),
        r_t = exp(logprobs_t - old_logprobs_t),  d_t = ref_logprobs_t - logprobs_t.
    loss_agg: "seq-mean-token-mean"     1/B sum_i 1/|o_i| sum_t l_it   (the paper)
              "token-mean"              1/sum_i |o_i| sum_i sum_t l_it (DAPO)
              "seq-mean-token-sum-norm" 1/B sum_i sum_t l_it / max_completion_length (Dr. GRPO)
    """
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, 0.0)  # padding never reaches exp()
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = torch.where(m, advantages.reshape(len(advantages), -1), 0.0)  # (B, T): A_i, or A_it; 0 on padding
    clipped_ratio = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)  # (B, T)
    stats = {}
    if beta > 0:
        d = torch.where(m, ref_logprobs - logprobs, 0.0)
        kl = torch.exp(d) - d - 1  # k3 >= 0, its gradient flows through logprobs
        per_token = per_token + beta * kl
        stats["kl"] = masked_mean(kl, m).detach()
    if loss_agg == "seq-mean-token-mean":
        loss = masked_mean(per_token, m, dim=1).mean()
    elif loss_agg == "token-mean":
        loss = masked_mean(per_token, m)
    elif loss_agg == "seq-mean-token-sum-norm":
        loss = (torch.where(m, per_token, 0.0).sum(dim=1) / max_completion_length).mean()
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    # a token is clipped when the clipped branch wins the min and so gives no gradient
    clipped = ((ratio < 1 - clip_eps_low) & (adv < 0)) | ((ratio > 1 + clip_eps_high) & (adv > 0))
    stats["clip_frac"] = masked_mean(clipped.float(), m).detach()
    stats["ratio"] = masked_mean(ratio, m).detach()
    return loss, stats


def token_advantages(advantages, turn_ids):
    """Each policy token's advantage: its episode's (advantages (B,), outcome credit) or its turn's ((B, K), turn
    credit); turn_ids (B, T) holds each policy token's turn, and -1 on the environment's tokens and padding (0 there).

    advantages = [[0.5, -1.0]], turn_ids = [[0, 0, -1, 1, 1, -1]] -> [[0.5, 0.5, 0, -1.0, -1.0, 0]]
    """
    if advantages.dim() == 1:  # outcome: A_i on every token of episode i
        per_token = advantages[:, None].expand(-1, turn_ids.shape[1])
    else:  # turn: A_ik on the tokens of turn k
        per_token = advantages.gather(1, turn_ids.clamp(min=0))
    return torch.where(turn_ids >= 0, per_token, 0.0)  # (B, T)


# ---- The task and its reward: an environment, what a user writes for a task of their own (docs/env_grpo.md)
class GuessTheNumber:
    """The bundled environment. reset(record) -> the first observation (the prompt); step(action) -> (observation,
    reward, done). A secret in 1..high (the record's; high 31 unless it says); each action is a guess, its last
    number, answered "+" (the secret is higher), "-" (lower) or "=" (right: reward 1, done), or "?" if no number in
    range. blind_answer: what the blind evaluation answers every guess with (Blind)."""

    blind_answer = "+"

    def reset(self, record):
        self.secret, self.high = int(record["secret"]), int(record.get("high", 31))
        return "?"

    def step(self, action):
        guess = last_number(action)  # the action's last number, judged as the other files judge answers
        if reward_fn(action, {"answer": self.secret}):
            return "=", 1.0, True
        if guess is None or not 1 <= guess <= self.high:
            return "?", 0.0, False
        return ("+" if guess < self.secret else "-"), 0.0, False


class Blind:
    """The environment with every observation after the first replaced by its blind_answer, its rewards and ends
    kept: a policy that reads its environment falls to the success of one that ignores it (the game's 5/31)."""

    def __init__(self, env):
        self.env = env

    def reset(self, record):
        return self.env.reset(record)

    def step(self, action):
        observation, reward, done = self.env.step(action)
        return self.env.blind_answer, reward, done


ENVIRONMENTS = {"guess": GuessTheNumber}


def last_number(text):
    """The last number in text, as a float ('1,234.5' -> 1234.5), or None."""
    found = re.findall(r"-?\d+(?:,\d{3})*(?:\.\d+)?", text)
    return float(found[-1].replace(",", "")) if found else None


def reward_fn(completion, record):
    """1.0 if the completion ends with the answer: its last number, or its last words (docs/your_own_task.md)."""
    answer = str(record["answer"])
    if last_number(answer) is not None:
        return float(last_number(completion) == last_number(answer))
    text, expected = (" ".join(s.lower().split()).strip(" .,;:!?\"'`*()[]{}") for s in (completion, answer))
    return float(bool(expected) and (text == expected or text.endswith(" " + expected)))


def guess_records(high=31):
    """(train, evaluation) records of the game, a secret in 1..high each: every secret in both, since the game has no
    unseen states to hold out (a policy trained without some secrets learns never to guess them: docs/env_grpo.md)."""
    records = [{"secret": n, "high": high} for n in range(1, high + 1)]
    return records, records


# ---- The episode: the policy and its environment in turn, token ids in and out
def observation_format(tokenizer, name):
    """How an observation is written after the policy's turn: as is, or with a chat template as a user's message
    after an assistant's (what the template writes from the end of the assistant's turn to the next turn's start)."""
    if not tokenizer.chat_template:
        return lambda observation: observation
    mark, end = "(the observation)", "y" + tokenizer.eos_token
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": mark}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if end not in text or mark not in text:
        fail(f"--model-name-or-path {name}: its chat template does not end an assistant's turn with {end[1:]!r}")
    after = text[text.index(end) + len(end) :]
    return lambda observation: after.replace(mark, observation)


@torch.no_grad()
def play_episodes(policy, tokenizer, prompt_ids, prompt_mask, envs, args, stop_ids, temperature):
    """Episodes, one an environment (already reset; prompt_ids hold its first observation), sampled at temperature
    (None: greedy), token ids in and out: the policy writes a turn with generate() until a stop token (its end of
    turn) or the token budget; a finished turn is decoded and sent as the action, and the environment's observation
    is appended as its ids (observation_format's text; only it is tokenised, the policy's ids kept as sampled), up to
    --max-turns turns and --max-new-tokens tokens in all. An episode ends done (the environment says so) or
    truncated: a turn the budget cut (never sent: its reward is 0), no turn left, or no room for the observation and
    a token after it. Nothing is appended after an episode's last turn.

    Returns {"completion_ids", "mask" (every token), "env_mask" (the environment's), "turn_ids" (each policy token's
    turn; -1 elsewhere): (B, T); "rewards" (B, max_turns): each turn's, 0 after the last; "turns" (B,); "done",
    "truncated", "texts" and "env_tokens" (lists)}."""
    device, size, pad = prompt_ids.device, len(prompt_ids), tokenizer.pad_token_id
    observe = observation_format(tokenizer, args.model_name_or_path)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
    ids, turn_of = [[] for _ in range(size)], [[] for _ in range(size)]  # each episode's ids; a token's turn (-1: env)
    rewards, done, truncated = [[] for _ in range(size)], [False] * size, [False] * size
    going = list(range(size))  # the episodes that write another turn
    for turn in range(args.max_turns):
        if not going:
            break
        room = max(args.max_new_tokens - len(ids[i]) for i in going)
        contexts = [prompts[i] + ids[i] for i in going]  # ids, never text
        width = max(len(c) for c in contexts)
        context_ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts], device=device)
        context_mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=device)
        new_ids = generate(policy, tokenizer, context_ids, context_mask, room, temperature, stop_ids)
        new_mask = completion_mask(new_ids, stop_ids)  # up to and including the turn's stop token
        still = []
        for i, row, keep in zip(going, new_ids.tolist(), new_mask.tolist()):
            row = [t for t, k in zip(row, keep) if k][: args.max_new_tokens - len(ids[i])]
            ids[i], turn_of[i] = ids[i] + row, turn_of[i] + [turn] * len(row)
            if row[-1] not in stop_ids:  # the budget cut the turn: truncated, and the action never sent
                rewards[i], truncated[i] = rewards[i] + [0.0], True
                continue
            observation, reward, done[i] = envs[i].step(tokenizer.decode(row[:-1], skip_special_tokens=True))
            rewards[i].append(float(reward))
            observation_ids = tokenizer(observe(observation), add_special_tokens=False)["input_ids"]
            if done[i]:
                continue
            if turn + 1 == args.max_turns or len(ids[i]) + len(observation_ids) >= args.max_new_tokens:
                truncated[i] = True  # no turn left, or no room to answer
                continue
            ids[i], turn_of[i] = ids[i] + observation_ids, turn_of[i] + [-1] * len(observation_ids)
            still.append(i)
        going = still
    width = max(len(r) for r in ids)
    turn_ids = torch.tensor([t + [-1] * (width - len(t)) for t in turn_of], device=device)
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in ids], device=device)
    return {
        "completion_ids": torch.tensor([r + [pad] * (width - len(r)) for r in ids], device=device),
        "mask": mask,
        "env_mask": mask & (turn_ids < 0),
        "turn_ids": turn_ids,
        "rewards": torch.tensor([r + [0.0] * (args.max_turns - len(r)) for r in rewards], device=device),
        "turns": torch.tensor([len(r) for r in rewards], device=device),
        "done": done,
        "truncated": truncated,
        "texts": [tokenizer.decode(r, skip_special_tokens=True) for r in ids],
        "env_tokens": [t.count(-1) for t in turn_of],
    }


def episode_metrics(episodes, prefix):
    """Per episode, never per turn: accuracy (the share solved: a positive return), the return, turns, the policy's
    and the environment's tokens, and the share done (ended by the environment) and truncated."""
    returns, mask = episodes["rewards"].sum(dim=1), episodes["mask"]
    env_tokens = torch.tensor(episodes["env_tokens"], dtype=torch.float)
    return {
        f"{prefix}accuracy": (returns > 0).float().mean(),
        f"{prefix}return": returns.mean(),
        f"{prefix}turns": episodes["turns"].float().mean(),
        f"{prefix}policy_tokens": mask.sum(dim=1).float().mean() - env_tokens.mean(),
        f"{prefix}env_tokens": env_tokens.mean(),
        f"{prefix}done": torch.tensor(episodes["done"], dtype=torch.float).mean(),
        f"{prefix}truncated": torch.tensor(episodes["truncated"], dtype=torch.float).mean(),
    }


def main(args):
    check_args(args)
    device = setup(args)
    output_dir = make_output_dir(args)

    # the policy, and a frozen reference only when the KL term is on
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    policy = load_model(args.model_name_or_path, args, device)
    stop_ids = stop_token_ids(tokenizer, policy)
    if args.beta > 0:
        ref_policy = load_model(args.model_name_or_path, args, device, frozen=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    train_records, eval_records = load_env_task(args)
    data_rng, shuffle_gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    batch_size = args.prompts_per_step * args.group_size
    print(f"{output_dir}: {len(train_records)} training records, {len(eval_records)} held out, device {device}")
    loss_args = dict(clip_eps_low=args.clip_eps_low, clip_eps_high=args.clip_eps_high, beta=args.beta)
    loss_args.update(loss_agg=args.loss_agg, max_completion_length=args.max_new_tokens)  # grpo_loss's constants
    start, samples = time.time(), []  # samples: a few held-out episodes, for samples.jsonl
    log(output_dir, 0, held_out_metrics(policy, tokenizer, eval_records, args, stop_ids, samples), samples)
    for step in range(1, args.num_steps + 1):
        step_start = time.time()
        # 1. episodes: G per record, each with its own environment from the record's state, group-contiguous
        records = data_rng.choices(train_records, k=args.prompts_per_step)
        group = [r for r in records for _ in range(args.group_size)]
        envs = [ENVIRONMENTS[args.env]() for _ in group]
        policy.eval()
        first = [env.reset(r) for env, r in zip(envs, group)]  # the first observations: the prompts
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, first, device)  # (B, P)
        episodes = play_episodes(policy, tokenizer, prompt_ids, prompt_mask, envs, args, stop_ids, args.temperature)
        completion_ids, mask, env_mask = episodes["completion_ids"], episodes["mask"], episodes["env_mask"]  # (B, T)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + T)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)  # the environment's tokens: context, no loss
        prompt_len = prompt_ids.shape[1]
        loss_mask = mask & ~env_mask  # (B, T): the policy's tokens, the ones the loss counts

        # 2. credit: the episode's return normalised within its group, or each turn's reward-to-go within the group
        rewards = episodes["rewards"].sum(dim=1)  # (B,): the returns
        if args.credit == "outcome":
            advantages = group_advantages(rewards, args.group_size, scale=args.scale_rewards)  # (B,)
        else:
            advantages = turn_advantages(episodes["rewards"], episodes["turns"], args.group_size, args.scale_rewards)
        advantages = token_advantages(advantages, episodes["turn_ids"])  # (B, T)

        # 3. log-probs of pi_old and pi_ref, once per batch, without gradient. With one update per batch, pi_old is
        # the policy being updated: its log-probs are the new ones, detached, and need no pass here.
        one_update = args.num_iterations == 1 and args.num_minibatches == 1
        if not one_update:
            old_logprobs = batched_logprobs(
                policy, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
            )
        if args.beta > 0:
            ref_logprobs = batched_logprobs(
                ref_policy, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
            )

        # 4. num_iterations passes over the batch, each num_minibatches optimizer steps; a micro-batch's loss weighs
        # its share of the minibatch's episodes, or with DAPO's token mean, of its policy tokens
        policy.train()
        step_stats, grad_norms = [], []
        passes = [torch.randperm(batch_size, generator=shuffle_gen) for _ in range(args.num_iterations)]
        for minibatch in torch.cat(passes).split(batch_size // args.num_minibatches):
            optimizer.zero_grad()
            for i in minibatch.split(args.micro_batch_size):
                logprobs = token_logprobs(policy, input_ids[i], attention_mask[i], prompt_len, args.temperature)
                old = logprobs.detach() if one_update else old_logprobs[i]
                ref = ref_logprobs[i] if args.beta > 0 else None
                loss, stats = grpo_loss(logprobs, old, ref, advantages[i], loss_mask[i], **loss_args)
                share = len(i) / len(minibatch)
                if args.loss_agg == "token-mean":
                    share = loss_mask[i].sum() / loss_mask[minibatch].sum()
                (loss * share).backward()
                # the loss as the optimizer weighed it; the token means (kl, clip_frac, ratio) by tokens
                step_stats += [({"loss": loss.detach()}, share), (stats, loss_mask[i].sum())]
            grad_norms.append(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
            optimizer.step()

        # 5. log, and evaluate on the held-out records
        evaluate_now = step % args.eval_every == 0 or step == args.num_steps
        if step % args.log_every == 0 or evaluate_now:
            grad_norm = torch.stack(grad_norms).mean().item()  # the mean over the optimizer steps, once they are done
            step_time = time.time() - step_start
            metrics = {
                **weighted_means(step_stats, "losses/"),
                "charts/reward": rewards.mean(),
                "charts/reward_std": rewards.std(),
                "charts/zero_std_groups": (rewards.view(-1, args.group_size).std(dim=1) == 0).float().mean(),
                **episode_metrics(episodes, "charts/"),
                "losses/grad_norm": grad_norm,
                "charts/step_time": step_time,
                "charts/tokens_per_sec": mask.sum() / step_time,
                "charts/elapsed_time": time.time() - start,
            }
            samples = episode_samples(group, episodes["texts"], rewards, episodes["turns"])
            if evaluate_now:
                metrics.update(held_out_metrics(policy, tokenizer, eval_records, args, stop_ids, samples))
            log(output_dir, step, metrics, samples)

    save(policy, tokenizer, output_dir)
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")


# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares ====
def check_args(args):
    """Stops at a flag outside its range, or at batch sizes that do not divide, before anything loads."""
    ranges = dict(prompts_per_step="> 0", group_size=">= 2 (GRPO compares the episodes of a group)")
    ranges.update(temperature="> 0", num_iterations="> 0", num_minibatches="> 0", beta=">= 0", max_turns="> 0")
    check_ranges(args, clip_eps_low="in [0, 1]", clip_eps_high=">= 0", **ranges)
    minibatch = exact_div(
        args.prompts_per_step * args.group_size, args.num_minibatches, "--prompts-per-step x --group-size"
    )
    exact_div(minibatch, args.micro_batch_size, "a minibatch (--prompts-per-step x --group-size / --num-minibatches)")


def load_env_task(args):
    """(train, held-out) records, each the start of an episode: the bundled game's, or a .jsonl's (its last --num-eval
    held out), whose fields the environment's reset() reads."""
    if args.dataset is None:
        return guess_records()
    records = read_jsonl(args.dataset, ())  # any fields: the environment's reset() reads them
    for n, record in enumerate(records, start=1):
        try:
            ENVIRONMENTS[args.env]().reset(record)
        except Exception as e:  # the environment's own complaint, in one line
            fail(f"--dataset {args.dataset}: record {n} starts no --env {args.env} episode ({type(e).__name__}: {e})")
    if len(records) <= args.num_eval:
        fail(f"--dataset {args.dataset}: {len(records)} records, but --num-eval {args.num_eval} are held out")
    return records[: -args.num_eval], records[-args.num_eval :]


def held_out_metrics(policy, tokenizer, records, args, stop_ids, samples):
    """Greedy episodes on the held-out records: their per-episode metrics (eval/...), the first four to samples; and
    where the environment has a blind_answer, the same with every answer replaced by it (eval/blind_...), which a
    policy that reads its environment cannot solve beyond chance."""
    policy.eval()
    metrics, device = {}, next(policy.parameters()).device
    for prefix in ("eval/", "eval/blind_")[: 1 + hasattr(ENVIRONMENTS[args.env], "blind_answer")]:
        envs = [ENVIRONMENTS[args.env]() for _ in records]
        if prefix == "eval/blind_":
            envs = [Blind(env) for env in envs]
        ids, mask = tokenize_prompts(tokenizer, [env.reset(r) for env, r in zip(envs, records)], device)
        episodes = play_episodes(policy, tokenizer, ids, mask, envs, args, stop_ids, None)
        metrics.update(episode_metrics(episodes, prefix))
        if prefix == "eval/":
            returns, turns = episodes["rewards"].sum(dim=1).tolist(), episodes["turns"].tolist()
            for r, t, x, k in zip(records[:4], episodes["texts"], returns, turns):
                samples.append({"kind": "eval", "record": r, "episode": t, "return": x, "turns": k})
    return metrics


def episode_samples(records, texts, returns, turns):
    """The first four episodes of a step, for samples.jsonl: record, episode, return and turns."""
    rows = zip(records[:4], texts, returns.tolist(), turns.tolist())
    return [{"kind": "rollout", "record": r, "episode": t, "return": x, "turns": k} for r, t, x, k in rows]


# ==== Everything below this line is the same in every file, byte for byte (tests/test_shared.py checks it) ====
def check_ranges(args, **ranges):
    """Stops at the first flag outside its range ('> 0', '>= 2', 'in [0, 1]', maybe with a reason): the flags every
    file has, then the file's own."""
    positive = "log_every num_eval eval_every max_new_tokens num_steps learning_rate max_grad_norm micro_batch_size"
    common = {**dict.fromkeys(positive.split(), "> 0"), "seed": "in [0, 4294967295]", "weight_decay": ">= 0"}
    for name, spec in {**common, **ranges}.items():
        x, (op, bound) = getattr(args, name), spec.split()[:2]
        if op == "in":
            low, high = (float(b) for b in spec[spec.index("[") + 1 : spec.index("]")].split(","))
            ok = low <= x <= high
        else:
            ok = x > float(bound) if op == ">" else x >= float(bound)
        if not (ok and math.isfinite(x)):
            fail(f"--{name.replace('_', '-')} {x}: must be {spec}")


def setup(args):
    """The device; seeds Python's and torch's generators; deterministic algorithms unless --no-torch-deterministic."""
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    if args.dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        fail("--dtype bfloat16: this GPU has no bfloat16; use --dtype float32")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(args.torch_deterministic)
    return device


def make_output_dir(args):
    """The run's new folder, with args.json in it; with --track, the wandb run."""
    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    path = os.path.join("runs", run_name) if args.output_dir is None else args.output_dir
    if os.path.exists(path):
        fail(f"--output-dir {path} already exists; choose a new folder")
    try:
        os.makedirs(path)
        with open(os.path.join(path, "args.json"), "w") as f:
            json.dump(asdict(args), f, indent=2)
    except OSError as e:
        fail(f"--output-dir {path}: cannot write there ({e.strerror}); choose a folder you can write to")
    if args.track:
        import wandb

        wandb.init(
            project=args.wandb_project_name, entity=args.wandb_entity, name=run_name, config=vars(args), dir=path
        )
    return path


def from_pretrained(cls, path, trust_remote_code, **kwargs):
    """cls.from_pretrained(path), or a one-line error naming --model-name-or-path."""
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.exists(path)):
        fail(f"--model-name-or-path {path}: no such folder")
    try:
        return cls.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        fail(f"--model-name-or-path {path}: not a model folder, nor loadable from the hub ({type(e).__name__})")


def load_tokenizer(path, trust_remote_code):
    tokenizer = from_pretrained(AutoTokenizer, path, trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path, args, device, frozen=False):
    """The model with float32 weights and dropout off; its decoder computes under autocast in --dtype (auto: bfloat16
    on a GPU), its output layer in float32, so that the log-probs come from float32 logits."""
    model = from_pretrained(AutoModelForCausalLM, path, args.trust_remote_code, dtype=torch.float32)
    model.requires_grad_(not frozen)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # the policy that samples is the one trained
    if args.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)  # < 5.24
        enable({"use_reentrant": False, "preserve_rng_state": False})  # no dropout to replay; no thread's draw rewound
    if args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda"):
        decoder = model.get_decoder()
        decoder.forward = torch.autocast(device.type, dtype=torch.bfloat16)(decoder.forward)
    return model.to(device)


def stop_token_ids(tokenizer, model):
    """Every id that ends a completion: the tokenizer's EOS and the generation config's (None, an id, or a list)."""
    ids = model.generation_config.eos_token_id
    return sorted({tokenizer.eos_token_id, *(ids if isinstance(ids, list) else [ids])} - {None})


def tokenize_prompts(tokenizer, prompts, device):
    """Left-padded ids and mask (B, P) of the prompts, each a user turn of the chat template if there is one."""
    if tokenizer.chat_template:
        chats = [[{"role": "user", "content": p}] for p in prompts]
        prompts = tokenizer.apply_chat_template(chats, tokenize=False, add_generation_prompt=True)
    batch = tokenizer(prompts, padding=True, padding_side="left", add_special_tokens=not tokenizer.chat_template)
    return torch.tensor(batch["input_ids"], device=device), torch.tensor(batch["attention_mask"], device=device)


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids):
    """Completion ids (B, T), T <= max_new_tokens, sampled at temperature (None: greedy) from exactly the distribution
    that token_logprobs scores: no top-k, top-p nor penalty, whatever the model's generation config says."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
    config.update(do_sample=temperature is not None, min_new_tokens=0, repetition_penalty=1.0, no_repeat_ngram_size=0)
    if temperature is not None:  # plain sampling: every other way to reshape the distribution off
        config.update(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
        config.update(typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    return out[:, prompt_ids.shape[1] :]


def completion_mask(completion_ids, stop_ids):
    """1 up to and including the first stop token: [[5, 7, EOS, PAD], [6, 6, 6, 6]] -> [[1, 1, 1, 0], [1, 1, 1, 1]]"""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device)).long()
    return (is_stop.cumsum(dim=1) - is_stop) == 0  # no stop token before this one


def decode_completions(tokenizer, completion_ids, mask):
    return [tokenizer.decode(ids[m], skip_special_tokens=True) for ids, m in zip(completion_ids, mask)]


def token_logprobs(model, input_ids, attention_mask, prompt_len, temperature=1.0, with_entropy=False):
    """Log-probs (B, T) of the completion tokens input_ids[:, prompt_len:], float32 (and entropies (B, T)).

    input_ids = [PAD, PAD, 4, 7, 13 | 5, 5, EOS]   left-padded prompt | completion (T = 3)
    attention = [0,   0,   1, 1, 1  | 1, 1, 1  ]   positions [0, 0, 0, 1, 2 | 3, 4, 5], as generate() makes them
    The logits at prompt_len - 1 + t predict token t; float32 (load_model), their log-softmax a few rows at a time.
    """
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    kept = input_ids.shape[1] - prompt_len + 1
    logits = model(input_ids, attention_mask=attention_mask, position_ids=positions, logits_to_keep=kept).logits
    logprobs, entropies = [], []
    for chunk, targets in zip(logits[:, :-1].split(8), input_ids[:, prompt_len:].split(8)):  # (8, T, vocab), (8, T)
        chunk = chunk.float() / temperature
        logsumexp = chunk.logsumexp(dim=-1)
        logprobs.append(chunk.gather(-1, targets[..., None]).squeeze(-1) - logsumexp)
        entropies.append(logsumexp - (chunk.softmax(dim=-1) * chunk).sum(dim=-1) if with_entropy else None)
    return (torch.cat(logprobs), torch.cat(entropies)) if with_entropy else torch.cat(logprobs)


@torch.no_grad()
def batched_logprobs(model, input_ids, attention_mask, prompt_len, temperature, batch_size):
    """token_logprobs (B, T) without gradient, batch_size rows a forward pass."""
    model.eval()
    batches = zip(input_ids.split(batch_size), attention_mask.split(batch_size))
    return torch.cat([token_logprobs(model, ids, mask, prompt_len, temperature) for ids, mask in batches])


@torch.no_grad()
def evaluate(model, tokenizer, records, args, stop_ids, samples):
    """{"eval/accuracy": the mean reward of greedy completions of the records}; the first four go to samples."""
    model.eval()
    texts, device = [], next(model.parameters()).device
    for i in range(0, len(records), 128):
        ids, mask = tokenize_prompts(tokenizer, [r["prompt"] for r in records[i : i + 128]], device)
        completion_ids = generate(model, tokenizer, ids, mask, args.max_new_tokens, None, stop_ids)
        texts += decode_completions(tokenizer, completion_ids, completion_mask(completion_ids, stop_ids))
    rewards = [reward_fn(t, r) for t, r in zip(texts, records)]
    for r, t, x in zip(records[:4], texts, rewards):
        samples.append({"kind": "eval", "prompt": r["prompt"], "completion": t, "answer": r["answer"], "reward": x})
    return {"eval/accuracy": sum(rewards) / len(rewards)}


def weighted_means(records, prefix=""):
    """{prefix + name: sum w x / sum w} of (stats, w) records: [({"kl": 1.0}, 1), ({"kl": 0.0}, 3)] -> {"kl": 0.25}"""
    sums, totals = {}, {}
    for stats, weight in records:
        for name, value in stats.items():
            sums[name] = sums.get(name, 0.0) + float(value) * float(weight)
            totals[name] = totals.get(name, 0.0) + float(weight)
    return {prefix + name: sums[name] / totals[name] for name in sums}


def log(output_dir, step, metrics, samples=()):
    """The step's metrics and samples to metrics.jsonl and samples.jsonl, to wandb with --track, and the console."""
    metrics = {k: float(v) for k, v in metrics.items()}
    for name, rows in (("metrics", [metrics]), ("samples", samples)):
        with open(os.path.join(output_dir, f"{name}.jsonl"), "a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
    if getattr(sys.modules.get("wandb"), "run", None) is not None:  # --track: make_output_dir started it
        sys.modules["wandb"].log(metrics, step=step)
    shown = ["charts/reward", "losses/loss", "eval/loss", "eval/accuracy", "eval/pair_accuracy", "charts/step_time"]
    print(f"step {step:5d}  " + "  ".join(f"{k} {metrics[k]:.4f}" for k in shown if k in metrics), flush=True)


def save(model, tokenizer, output_dir):
    """The model and the tokenizer, loadable with from_pretrained; with --track, the wandb run ends."""
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    if getattr(sys.modules.get("wandb"), "run", None) is not None:
        sys.modules["wandb"].finish()


def masked_mean(x, mask, dim=None):
    """Mean of x where mask is 1; masked positions never leak, even inf or nan."""
    x = torch.where(mask.bool(), x, 0.0)
    return x.sum() / mask.sum().clamp(min=1) if dim is None else x.sum(dim) / mask.sum(dim).clamp(min=1)


def exact_div(a, b, what):
    """a // b; unless b divides a, the run stops, naming what to change."""
    if a % b != 0:
        fail(f"{what}: {a} does not divide by {b}")
    return a // b


def fail(message):
    raise SystemExit(f"error: {message}")


def read_jsonl(path, *schemas):
    """The records of a JSONL file, each with the text fields of a schema (or a number for 'answer'); a bad record
    stops the run, naming its line."""
    if not os.path.isfile(path):
        fail(f"--dataset {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = [(f"--dataset {path}: line {n}", line) for n, line in enumerate(f, start=1) if line.strip()]
    records, needs = [], " or ".join(" and ".join(s) for s in schemas)
    for at, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            fail(f"{at} is not valid JSON ({e.msg})")
        fields = next((s for s in schemas if isinstance(records[-1], dict) and set(s) <= set(records[-1])), None)
        if fields is None:
            fail(f"{at} lacks a field: a record needs {needs}")
        for k, v in ((k, records[-1][k]) for k in fields):
            if not isinstance(v, str) and not (k == "answer" and type(v) in (int, float) and math.isfinite(v)):
                fail(f"{at}: field {k!r} holds {json.dumps(v)[:40]}; it needs text")
    if not records:
        fail(f"--dataset {path}: the file holds no records")
    return records


def load_hub_split(name, config, split):
    """The records of a hub dataset's split (`pip install datasets`)."""
    try:
        import datasets
    except ImportError:
        fail(f"--dataset {name}: a hub dataset needs the datasets library: pip install datasets")
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:  # the library raises many kinds
        fail(f"--dataset {name}: could not load split {split!r} ({type(e).__name__}: {e})".splitlines()[0])


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__.splitlines()[0]))
