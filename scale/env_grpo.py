"""GRPO that learns by acting in an environment over many turns, in one file.

An episode is a conversation between the policy and an environment: the environment's first observation is the
prompt, the policy writes a turn (an action), the environment answers with an observation, a reward and whether the
episode is done, and the observation is appended as token ids, up to `--max-turns` turns and `--max-new-tokens`
tokens in all. The policy's tokens are kept as sampled (never decoded and tokenised again); the environment's carry
no loss. The loss is GRPO's (grpo.py; Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300, eq. 3 and 4)
on the policy's tokens, each with its episode's advantage (`--credit outcome`) or its turn's (`--credit turn`: the
reward-to-go from the turn against the group's at the same turn). The bundled environment is guess the number (1-31,
five guesses, answered +, - or =). See docs/env_grpo.md; `diff scale/grpo.py scale/env_grpo.py` shows the episode and
the credit; env_grpo.py is this file without what scale needs.

    python scale/env_grpo.py                             # bundled tiny model (tiny-guesser), guess the number, CPU
    python scale/env_grpo.py --credit turn               # each turn's reward-to-go in place of the episode's return
"""

import contextlib
import glob
import importlib.util
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils.checkpoint
import transformers
import tyro
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # names the run: runs/<exp_name>__<seed>__<time>
    seed: int = 1  # seed of the experiment (data order, sampling, initialisation)
    torch_deterministic: bool = True  # deterministic algorithms only (`--no-torch-deterministic`: any)
    cuda: bool = True  # use CUDA when it is available
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # of the forward passes (auto: bfloat16 on a GPU)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass to save memory
    fsdp: bool = False  # under torchrun: shard the models across the processes (FSDP2), not copy them (DDP)
    track: bool = False  # log to Weights & Biases (`WANDB_MODE=offline` keeps it on disk)
    wandb_project_name: str = "onefile-rl"  # the wandb project
    wandb_entity: str | None = None  # the wandb entity (team or user)
    output_dir: str | None = None  # the run's folder, which must not exist yet (default: runs/<run name>)
    trust_remote_code: bool = False  # let transformers run code shipped with a hub model you trust
    log_every: int = 5  # write metrics and a console line every this many steps
    save_every: int = 0  # write a checkpoint every this many steps (0: none)
    keep_checkpoints: int = 2  # keep the newest this many checkpoints
    resume_from: str | None = None  # continue the run in this folder from its last checkpoint

    # Model and data
    model_name_or_path: str = "tiny-guesser"  # the starting policy: a local folder or a hub id
    dataset: str | None = None  # a .jsonl of records, each the start of an episode (reset's argument)
    env: Literal["guess"] = "guess"  # the environment (ENVIRONMENTS); without --dataset, its own records
    num_eval: int = 500  # held-out records: a .jsonl's last (the game evaluates on every secret)
    eval_every: int = 10  # greedy accuracy on the held-out records every this many steps, and at 0
    max_new_tokens: int = 20  # the longest episode after the prompt, in tokens: every turn, the observations included
    max_prompt_length: int | None = None  # a longer prompt (chat template included) keeps its last tokens
    system_prompt: str | None = None  # a system message before each text prompt (needs a chat template)

    # Optimisation
    num_steps: int = 300  # training steps (each: one batch of episodes, then its updates)
    learning_rate: float = 3e-4  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 64  # sequences per forward/backward pass, per process
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up, decay to 0 at --num-steps
    warmup_steps: int = 0  # steps of linear warm-up of the learning rate
    lora_r: int = 0  # train LoRA adapters of this rank (peft), not every weight (0: off; docs/training.md)
    lora_alpha: float = 16.0  # the adapters' output is scaled by lora_alpha / lora_r
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # layers with adapters

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

    rollout_correction: Literal["none", "token-tis", "token-mis", "seq-tis", "seq-mis", "icepop"] = "none"
    """how the loss weighs tokens the sampler drew with other log-probs than pi_old's (rollout_correction); the decode
    loop's are pi_old's to rounding on a CPU (docs/mismatch.md)"""
    rollout_cap: float = 2.0  # the cap of --rollout-correction's weights (IcePop's band: [1 / cap, cap])

    # to be filled in at runtime (not flags: the command line cannot set them)
    batch_size: tyro.conf.Suppress[int] = 0  # completions per batch of rollouts (prompts_per_step * group_size)
    minibatch_size: tyro.conf.Suppress[int] = 0  # completions per optimizer step (batch_size // num_minibatches)
    run_name: tyro.conf.Suppress[str] = ""  # exp_name__seed__time


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


# ---- Only at scale: the sampler's policy against the trainer's (docs/mismatch.md)
def rollout_correction(old_logprobs, rollout_logprobs, mask, mode, cap):
    """The sampler's policy against the trainer's: the tokens were drawn with log-probs rollout_logprobs (the decode
    loop's own, or vLLM's), the loss takes old_logprobs as pi_old's, so each token's policy-gradient term is weighed by
    a constant w_t made from r_t = pi_old(o_t) / pi_rollout(o_t) (Yao et al. 2025, TIS; verl's rollout_corr; IcePop,
    arXiv 2510.18855; docs/mismatch.md says which to pick). Each file's main() applies them to its policy-gradient
    term, through the advantages (GSPO: a sequence's, by the mean of its tokens' w_t) or RLOO's log-probs, so that the
    loss functions stay the plain tier's, unweighted; for w_t >= 0 that weighs the term and no other (not the KL's):

        none        no weight (w_t = 1)
        token-tis   w_t = min(r_t, cap)                          truncated
        token-mis   w_t = r_t if r_t <= cap, else 0              masked
        seq-tis     w_t = min(g, cap),  g = exp(mean_t log r_t)  the row's geometric mean, truncated
        seq-mis     w_t = g if g <= cap, else 0                  the row's, masked
        icepop      w_t = r_t if 1/cap <= r_t <= cap, else 0     masked on both sides

    old_logprobs, rollout_logprobs, mask: (B, T); 0 at padding. One row, cap = 2:
    old = log [0.5, 0.3, 0.1, 0.1], rollout = log [0.5, 0.5, 0.01, 0.4]: r = [1, 0.6, 10, 0.25], g = 1.5^(1/4) = 1.107
    -> token-tis [1, 0.6, 2, 0.25], token-mis [1, 0.6, 0, 0.25], seq-tis and seq-mis [1.107] * 4, icepop [1, 0.6, 0, 0]
    Also the mismatch's statistics, in every mode: logprob_diff, the mean |log r_t| over the tokens; beyond_2, the
    share of them with r_t outside [1/2, 2]; with weights, is_weight (their mean) and is_capped (the share the cap
    truncated or masked).
    """
    m = mask.bool()
    log_ratio = torch.where(m, old_logprobs - rollout_logprobs, 0.0).detach()  # padding never reaches exp()
    stats = {
        "logprob_diff": masked_mean(log_ratio.abs(), m),
        "beyond_2": masked_mean((log_ratio.abs() > math.log(2)).float(), m),
    }
    if mode == "none":
        return None, stats
    if mode.startswith("seq"):  # the mean log-ratio of the row, on each of its tokens
        log_ratio = (log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    capped = ratio > cap
    if mode == "icepop":
        capped = capped | (ratio < 1 / cap)
    if mode.endswith("tis"):
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where(capped, 0.0, ratio)
    weights = torch.where(m, weights, 0.0)
    return weights, {**stats, "is_weight": masked_mean(weights, m), "is_capped": masked_mean(capped.float(), m)}


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
    "truncated", "texts" and "env_tokens" (lists); "logprobs" (B, T): each sampled token's, as the decode loop drew
    it (the environment's: 0)}."""
    device, size, pad = prompt_ids.device, len(prompt_ids), tokenizer.pad_token_id
    observe = observation_format(tokenizer, args.model_name_or_path)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
    ids, turn_of = [[] for _ in range(size)], [[] for _ in range(size)]  # each episode's ids; a token's turn (-1: env)
    rewards, done, truncated = [[] for _ in range(size)], [False] * size, [False] * size
    drawn = [[] for _ in range(size)]  # the log-prob of each id (the environment's: 0)
    going = list(range(size))  # the episodes that write another turn
    for turn in range(args.max_turns):
        if all_sum(torch.tensor(len(going))).item() == 0:  # every process stops at the same turn
            break
        batch, room = going, max((args.max_new_tokens - len(ids[i]) for i in going), default=1)
        if not going:  # this process's episodes have all ended: under FSDP every process runs each forward pass,
            batch = [0]  # so it writes one more token for its first prompt, and drops it
        contexts = [prompts[i] + ids[i] for i in batch]  # ids, never text
        width = max(len(c) for c in contexts)
        context_ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts], device=device)
        context_mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=device)
        new_ids, logprobs = generate(policy, tokenizer, context_ids, context_mask, room, temperature, stop_ids, True)
        new_mask = completion_mask(new_ids, stop_ids)  # up to and including the turn's stop token
        still = []
        for i, row, keep, row_logprobs in zip(going, new_ids.tolist(), new_mask.tolist(), logprobs.tolist()):
            row = [t for t, k in zip(row, keep) if k][: args.max_new_tokens - len(ids[i])]
            ids[i], turn_of[i] = ids[i] + row, turn_of[i] + [turn] * len(row)
            drawn[i] += row_logprobs[: len(row)]
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
            drawn[i] += [0.0] * len(observation_ids)
            still.append(i)
        going = still
    width = max(1, *(len(r) for r in ids))
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
        "logprobs": torch.tensor([r + [0.0] * (width - len(r)) for r in drawn], device=device),
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
    rank = rank_and_world()[0]
    num_prompts, _, minibatch_size = batch_sizes(args)  # this process's records and minibatch, each step
    checkpoint = checkpoint_to_resume(args)  # --resume-from: the run's last checkpoint, its flags checked
    output_dir = make_output_dir(args, checkpoint)

    # the policy, and a frozen reference only when the KL term is on
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    policy = add_lora(load_model(args.model_name_or_path, args, device), args)  # --lora-r: the adapters alone train
    stop_ids = stop_token_ids(tokenizer, policy)
    policy = distribute(policy, args.fsdp)  # under torchrun: DDP, or FSDP2 with --fsdp
    if args.beta > 0:
        ref_policy = reference_model(policy, args, device)  # with --lora-r: the policy, its adapters off
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    train_records, eval_records = load_env_task(args)
    data_rng, shuffle_gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    # a new run starts at 1; --resume-from puts back its checkpoint's weights and states, and goes on after it
    first_step, saved = resume(checkpoint, {"policy": policy}, optimizer, [data_rng, shuffle_gen])
    scheduler = lr_scheduler(optimizer, args, first_step)
    signal = saved.get("signal", 0)  # groups whose rewards differed in the first steps (no_signal_note)
    print(f"{output_dir}: {len(train_records)} training records, {len(eval_records)} held out, device {device}")
    loss_args = dict(clip_eps_low=args.clip_eps_low, clip_eps_high=args.clip_eps_high, beta=args.beta)
    loss_args.update(loss_agg=args.loss_agg, max_completion_length=args.max_new_tokens)  # grpo_loss's constants
    correction = dict(mode=args.rollout_correction, cap=args.rollout_cap)  # rollout_correction's
    start, samples = time.time(), []  # samples: a few held-out episodes, for samples.jsonl
    if first_step == 1:
        metrics = held_out_metrics(policy, tokenizer, eval_records, args, stop_ids, samples)
        reduce_and_log(output_dir, 0, metrics, samples)
    for step in range(first_step, args.num_steps + 1):
        timer = Timer(device, start)
        # 1. episodes: G per record, each with its own environment from the record's state, group-contiguous
        records = data_rng.choices(train_records, k=args.prompts_per_step)
        records = records[rank * num_prompts : (rank + 1) * num_prompts]  # every process its share of the records
        group = [r for r in records for _ in range(args.group_size)]
        envs = [ENVIRONMENTS[args.env]() for _ in group]
        policy.eval()
        first = [env.reset(r) for env, r in zip(envs, group)]  # the first observations: the prompts
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, first, device, args)  # (B, P)
        episodes = play_episodes(policy, tokenizer, prompt_ids, prompt_mask, envs, args, stop_ids, args.temperature)
        timer.lap("generation")
        completion_ids, mask, env_mask = episodes["completion_ids"], episodes["mask"], episodes["env_mask"]  # (B, T)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + T)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)  # the environment's tokens: context, no loss
        prompt_len = prompt_ids.shape[1]
        loss_mask = mask & ~env_mask  # (B, T): the policy's tokens, the ones the loss counts

        # 2. credit: the episode's return normalised within its group, or each turn's reward-to-go within the group
        rewards = episodes["rewards"].sum(dim=1)  # (B,): the returns
        signal = no_signal_note(step, rewards, args.group_size, signal)
        if args.credit == "outcome":
            advantages = group_advantages(rewards, args.group_size, scale=args.scale_rewards)  # (B,)
        else:
            advantages = turn_advantages(episodes["rewards"], episodes["turns"], args.group_size, args.scale_rewards)
        advantages = token_advantages(advantages, episodes["turn_ids"])  # (B, T)

        # 3. log-probs of pi_old and pi_ref, once per batch, without gradient. With one update per batch, pi_old is
        # the policy being updated: its log-probs are the new ones, detached, and need no pass here.
        timer.lap()  # the rewards: no phase
        one_update = args.num_iterations == 1 and args.num_minibatches == 1
        if not one_update:
            old_logprobs = batched_logprobs(
                policy, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
            )
        if args.beta > 0:
            with adapters_off(ref_policy):
                ref_logprobs = batched_logprobs(
                    ref_policy, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
                )
        timer.lap("logprob")

        # 4. num_iterations passes over the batch, each num_minibatches optimizer steps; a micro-batch's loss weighs
        # its share of the minibatch's episodes, or with DAPO's token mean, of its policy tokens
        policy.train()
        step_stats, rollout_stats, grad_norms = [], [], []
        token_mask = loss_mask if args.loss_agg == "token-mean" else None
        for minibatch in minibatches(attention_mask, minibatch_size, args.num_iterations, shuffle_gen):
            optimizer.zero_grad()
            for i, share in micro_batches(minibatch, args.micro_batch_size, [policy], token_mask):
                logprobs = token_logprobs(policy, input_ids[i], attention_mask[i], prompt_len, args.temperature)
                old = logprobs.detach() if one_update else old_logprobs[i]
                ref = ref_logprobs[i] if args.beta > 0 else None
                is_weights, is_stats = rollout_correction(old, episodes["logprobs"][i], loss_mask[i], **correction)
                adv = advantages[i] if is_weights is None else advantages[i] * is_weights  # (b, T)
                loss, stats = grpo_loss(logprobs, old, ref, adv, loss_mask[i], **loss_args)
                check_finite(loss, step, optimizer)
                optimizer.scaler.scale(loss * share).backward()
                # the loss as the optimizer weighed it; the token means (kl, clip_frac, ratio) by tokens
                step_stats += [({"loss": loss.detach()}, share), (stats, loss_mask[i].sum())]
                rollout_stats.append((is_stats, loss_mask[i].sum()))
            grad_norms.append(clipped_step(optimizer, policy.parameters(), args.max_grad_norm))
        timer.lap("update")

        # 5. log, and evaluate on the held-out records
        evaluate_now = step % args.eval_every == 0 or step == args.num_steps
        if step % args.log_every == 0 or evaluate_now:
            metrics = {
                **weighted_means(step_stats, "losses/"),
                **weighted_means(rollout_stats, "rollout/"),
                "charts/reward": rewards.mean(),
                "charts/reward_std": rewards.std(),
                "charts/zero_std_groups": (rewards.view(-1, args.group_size).std(dim=1) == 0).float().mean(),
                **episode_metrics(episodes, "charts/"),
                "charts/learning_rate": optimizer.param_groups[0]["lr"],
                "losses/grad_norm": torch.stack(grad_norms).mean(),  # the mean over the optimizer steps
                **timer.metrics(tokens=mask.sum()),
            }
            samples = episode_samples(group, episodes["texts"], rewards, episodes["turns"])
            if evaluate_now:
                metrics.update(held_out_metrics(policy, tokenizer, eval_records, args, stop_ids, samples))
            reduce_and_log(output_dir, step, metrics, samples)
        scheduler.step()
        models, generators = {"policy": policy}, [data_rng, shuffle_gen]
        save_checkpoint(args, output_dir, step, tokenizer, models, optimizer, generators, signal=signal)  # --save-every

    save(policy, tokenizer, output_dir)
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")
    end_processes()


# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares ====
def check_args(args):
    """Stops at a flag outside its range, or at options that cannot run together, before anything loads."""
    ranges = {
        "prompts_per_step": "> 0",
        "temperature": "> 0",
        "group_size": ">= 2 (GRPO compares the episodes of a group)",
        "num_iterations": "> 0",
        "num_minibatches": "> 0",
        "beta": ">= 0",
        "clip_eps_low": "in [0, 1]",
        "clip_eps_high": ">= 0",
        "max_turns": "> 0",
        "rollout_cap": ">= 1",
    }
    check_ranges(args, {**COMMON_RANGES, **ranges})
    check_lora(args)


def batch_sizes(args):
    """(prompts, completions, completions of a minibatch) of this process at each step; a division that is not exact
    stops the run, naming the flags. Sets args.batch_size and args.minibatch_size (of all processes)."""
    world = rank_and_world()[1]
    num_prompts = exact_div(args.prompts_per_step, world, "--prompts-per-step among the processes")
    batch_size = num_prompts * args.group_size
    what = "--prompts-per-step x --group-size"
    minibatch_size = exact_div(batch_size, args.num_minibatches, f"{what} (per process) by --num-minibatches")
    fit_micro_batches(args, minibatch_size, f"a minibatch ({what} / --num-minibatches, per process)")
    args.batch_size, args.minibatch_size = batch_size * world, minibatch_size * world
    return num_prompts, batch_size, minibatch_size


def load_env_task(args):
    """(train, held-out) records, each the start of an episode: the bundled game's, or a .jsonl's (its last --num-eval
    held out), whose fields the environment's reset() reads."""
    if args.dataset is None:
        return guess_records()
    records = read_jsonl(args.dataset, (), flag="--dataset")  # any fields: the environment's reset() reads them
    for n, record in enumerate(records, start=1):
        try:
            ENVIRONMENTS[args.env]().reset(record)
        except Exception as e:  # the environment's own complaint, in one line
            fail(f"--dataset {args.dataset}: record {n} starts no --env {args.env} episode ({type(e).__name__}: {e})")
    if len(records) <= args.num_eval:
        fail(f"--dataset {args.dataset}: {len(records)} records, but --num-eval {args.num_eval} are held out")
    return records[: -args.num_eval], records[-args.num_eval :]


def held_out_metrics(policy, tokenizer, records, args, stop_ids, samples):
    """Greedy episodes on this process's share of the held-out records: their per-episode metrics (eval/...), the
    first four to samples; and where the environment has a blind_answer, the same with every answer replaced by it
    (eval/blind_...), which a policy that reads its environment cannot solve beyond chance."""
    policy.eval()
    share, metrics, device = process_share(records), {}, next(policy.parameters()).device
    for prefix in ("eval/", "eval/blind_")[: 1 + hasattr(ENVIRONMENTS[args.env], "blind_answer")]:
        envs = [ENVIRONMENTS[args.env]() for _ in share]
        if prefix == "eval/blind_":
            envs = [Blind(env) for env in envs]
        ids, mask = tokenize_prompts(tokenizer, [env.reset(r) for env, r in zip(envs, share)], device, args)
        episodes = play_episodes(policy, tokenizer, ids, mask, envs, args, stop_ids, None)
        metrics.update(episode_metrics(episodes, prefix))
        if prefix == "eval/":
            returns, turns = episodes["rewards"].sum(dim=1).tolist(), episodes["turns"].tolist()
            for r, t, x, k in zip(share[:4], episodes["texts"], returns, turns):
                samples.append({"kind": "eval", "record": r, "episode": t, "return": x, "turns": k})
    return metrics


def episode_samples(records, texts, returns, turns):
    """The first four episodes of a step, for samples.jsonl: record, episode, return and turns."""
    rows = zip(records[:4], texts, returns.tolist(), turns.tolist())
    return [{"kind": "rollout", "record": r, "episode": t, "return": x, "turns": k} for r, t, x, k in rows]


# ==== Everything below this line is the same in every file, byte for byte (tests/test_shared.py checks it) ====
# Why each piece is as it is, with its measurements: docs/gpu.md, docs/distributed.md, docs/outputs.md; laid out
# in the order in which grpo.py's main() first calls it, what grpo.py never calls at the end

# the range of each numeric flag that every file has; each file adds its own
COMMON_RANGES = {
    "seed": "in [0, 4294967295]",
    "log_every": "> 0",
    "num_eval": "> 0",
    "eval_every": "> 0",
    "max_new_tokens": "> 0",
    "num_steps": "> 0",
    "learning_rate": "> 0",
    "weight_decay": ">= 0",
    "max_grad_norm": "> 0",
    "micro_batch_size": "> 0",
    "max_prompt_length": "> 0",
    "save_every": ">= 0",
    "keep_checkpoints": "> 0",
    "warmup_steps": ">= 0",
    "lora_r": ">= 0",
    "lora_alpha": "> 0",
    "eval_samples": ">= 0",
    "eval_temperature": "> 0",
}


def setup(args):
    """The device; names the run, settles --dtype auto, seeds (seed + rank) and joins torchrun's processes."""
    transformers.utils.logging.disable_progress_bar()
    if not args.run_name:
        args.run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
    cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    bfloat16 = not cuda or torch.cuda.is_bf16_supported()
    if args.dtype == "bfloat16" and not bfloat16:
        fail("--dtype bfloat16: this GPU has no bfloat16; use --dtype float16 or float32")
    if args.dtype == "float16" and (not cuda or args.fsdp):  # its loss scaler reads whole gradients (resume)
        fail("--dtype float16 trains on GPUs, not sharded: use --dtype bfloat16 (or float32) on a CPU or with --fsdp")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda and bfloat16 else "float32"
    if "LOCAL_RANK" in os.environ:  # torchrun: a process a GPU
        if cuda:
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        if dist.get_rank() != 0:
            sys.stdout = open(os.devnull, "w")  # rank 0 alone prints
    elif args.fsdp:
        fail("--fsdp shards the models across processes: start them with torchrun --nproc-per-node N")
    seed = args.seed + rank_and_world()[0]
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(args.torch_deterministic)
    return device


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def checkpoint_to_resume(args):
    """With --resume-from, the run's last checkpoint, once the run's flags are checked against these; else None.
    Checked before any model loads; a resumed run takes the run's name."""
    if args.resume_from is None:
        return None
    path, world = args.resume_from, rank_and_world()[1]
    steps = sorted(glob.glob(os.path.join(path, "checkpoints", "step_" + "[0-9]" * 6)))  # whole ones
    if not steps or not os.path.exists(os.path.join(path, "args.json")):
        fail(f"--resume-from {path}: not a run's folder with a whole checkpoint (--save-every writes them)")
    with open(os.path.join(steps[-1], "trainer_state.json")) as f, open(os.path.join(path, "args.json")) as g:
        state, saved = json.load(f), json.load(g)
    keep = "num_steps log_every eval_every save_every keep_checkpoints resume_from track exp_name run_name".split()
    keep += ["wandb_project_name", "wandb_entity"]  # the flags a resumed run may change
    run = {"file": state["file"], "processes": state["world_size"], **{flag(k): v for k, v in saved.items()}}
    this = {"file": os.path.basename(__file__), "processes": world}
    this.update({flag(k): v for k, v in asdict(args).items() if k not in keep})
    differ = [f"{k} {v} (the run's: {run.get(k)})" for k, v in this.items() if run.get(k) != v]
    if differ:
        fail(f"--resume-from {path}: differs from the run: {', '.join(differ)}")
    if args.num_steps <= state["step"]:
        fail(f"--num-steps {args.num_steps}: the checkpoint is at step {state['step']}; ask for more steps")
    print(f"resuming {path} from {steps[-1]} (step {state['step']})")
    args.run_name = saved["run_name"]
    return steps[-1]


def make_output_dir(args, checkpoint):
    """The run's folder: a new one with args.json; resumed from checkpoint, the run's own, its metrics and samples cut
    back to the checkpoint's step (the resumed run logs the later steps again). With --track, the wandb run."""
    path = args.resume_from
    if checkpoint is None:
        path = os.path.join("runs", args.run_name) if args.output_dir is None else args.output_dir
        if os.path.exists(path):
            fail(f"--output-dir {path} already exists; choose a new folder")
    barrier()  # every process has checked before rank 0 writes
    try:
        if rank_and_world()[0] == 0 and checkpoint is None:
            os.makedirs(path)
            with open(os.path.join(path, "args.json"), "w") as f:
                json.dump(asdict(args), f, indent=2)
        if rank_and_world()[0] == 0 and checkpoint is not None:
            with open(os.path.join(checkpoint, "trainer_state.json")) as f:
                last = json.load(f)["step"]
            for name in ("metrics.jsonl", "samples.jsonl"):
                with open(os.path.join(path, name), "a+") as f:
                    f.seek(0)
                    lines = [line for line in f if line.endswith("}\n") and json.loads(line)["step"] <= last]
                    f.truncate(0)
                    f.writelines(lines)
    except OSError as e:
        fail(f"--output-dir {path}: cannot write there ({e.strerror}); choose a folder you can write to")
    if args.track and rank_and_world()[0] == 0:
        import wandb

        wandb.init(
            project=args.wandb_project_name, entity=args.wandb_entity, name=args.run_name, config=vars(args), dir=path
        )
    return path


def barrier():
    if dist.is_initialized():
        dist.barrier()


def load_tokenizer(path, trust_remote_code):
    tokenizer = from_pretrained(AutoTokenizer, path, trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def from_pretrained(cls, path, trust_remote_code, flag="--model-name-or-path", **kwargs):
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.exists(path)):
        fail(f"{flag} {path}: no such folder")
    try:
        return cls.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        fail(f"{flag} {path}: not a model folder, nor loadable from the hub ({type(e).__name__})")


def add_lora(model, args):
    """With --lora-r, the model with LoRA adapters (peft), which alone train (docs/training.md); else the model."""
    if not args.lora_r:
        return model
    import peft

    modules = args.lora_target_modules
    check_lora_targets(model, modules)
    targets = "all-linear" if modules == ["all-linear"] else modules
    config = peft.LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets
    )
    try:
        model = peft.get_peft_model(model, config)
    except ValueError as e:
        fail(f"--lora-target-modules {' '.join(modules)}: {str(e).splitlines()[0]}")
    head = model.get_output_embeddings()
    for module in model.modules():  # frozen: held in --dtype, as autocast would cast them at every token (gpu.md)
        if isinstance(module, torch.nn.Linear) and module is not head and not module.weight.requires_grad:
            module.to(model.compute_dtype)
    return model


def check_lora_targets(model, modules):
    """Stops if --lora-target-modules names the output layer, or an input embedding tied to it (docs/training.md)."""
    names = {module: name for name, module in model.named_modules()}
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    refused = {names[head]: "the output layer, whose weight the log-probs multiply without an adapter"}
    if head.weight is embedding.weight:
        refused[names[embedding]] = "tied to the output layer, which would keep no adapter"
    for name, why in refused.items():
        if any(name == m or name.endswith("." + m) for m in modules):
            fail(f"--lora-target-modules {' '.join(modules)}: {name} is {why}; leave it out")


def load_model(path, args, device, frozen=False, model=None):
    """The model (from path unless given) with float32 weights, computing under autocast in --dtype (docs/gpu.md)."""
    if model is None:
        model = from_pretrained(AutoModelForCausalLM, path, args.trust_remote_code, dtype=torch.float32)
    model.requires_grad_(not frozen)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # the policy that samples is the one trained
    if args.gradient_checkpointing:  # nothing recomputed is random: no random state to keep
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)  # < 5.24
        enable({"use_reentrant": False, "preserve_rng_state": False})
    model.compute_dtype = getattr(torch, args.dtype)  # setup() settled an auto --dtype
    if args.dtype != "float32":
        model.forward = torch.autocast(device.type, dtype=model.compute_dtype)(model.forward)
    return compile_layers(model.to(device), args.fsdp)  # on a GPU, its decoder layers compiled


def stop_token_ids(tokenizer, model):
    """Every id that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = model.generation_config.eos_token_id  # None, an id, or a list of ids
    if ids is None or isinstance(ids, int):
        ids = [ids]
    return sorted({tokenizer.eos_token_id, *ids} - {None})


def distribute(model, fsdp):
    """The model over the processes from rank 0's weights: DDP (a frozen one: a copy each), or FSDP2 with fsdp."""
    if not dist.is_initialized():
        return model
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    if fsdp:
        precision = MixedPrecisionPolicy(param_dtype=model.compute_dtype, reduce_dtype=torch.float32)
        for module in [*decoder_layers(model), model]:  # each decoder layer, then the rest
            fully_shard(module, mp_policy=precision)
        return model
    trained = any(p.requires_grad for p in model.parameters())
    return torch.nn.parallel.DistributedDataParallel(model) if trained else model


def reference_model(policy, args, device):
    """The frozen reference: with LoRA the policy itself (adapters_off switches its adapters off), else a copy."""
    if args.lora_r:
        return policy
    return distribute(load_model(args.model_name_or_path, args, device, frozen=True).eval(), args.fsdp)


def resume(checkpoint, models, optimizer, generators):
    """(the first step, the loop's state): (1, {}) for a new run, else the checkpoint's, its states put back."""
    float16 = any(getattr(unwrap(m), "compute_dtype", None) == torch.float16 for m in models.values())
    optimizer.scaler = torch.amp.GradScaler(enabled=float16)  # float16's loss scaler; off, a no-op (clipped_step)
    if checkpoint is None:
        return 1, {}
    modules, state = checkpoint_state(models, optimizer)  # what to load into
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, "state"))
    options = StateDictOptions(strict=False)  # the frozen weights stay as loaded
    set_state_dict(
        modules, optimizer, model_state_dict=state["models"], optim_state_dict=state["optimizer"], options=options
    )
    rng = torch.load(os.path.join(checkpoint, f"rng_{rank_and_world()[0]}.pt"))
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    torch.cuda.set_rng_state_all(rng["cuda"])
    sys.modules["numpy"].random.set_state(("MT19937", rng["numpy"][0].numpy(), *rng["numpy"][1:]))
    for generator, value in zip(generators, rng["generators"]):
        (generator.setstate if isinstance(generator, random.Random) else generator.set_state)(value)
    if rng.get("scaler"):  # none, or {} (a scaler off): a checkpoint from before the scaler, which starts anew
        optimizer.scaler.load_state_dict(rng["scaler"])
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    return state["step"] + 1, state["state"]


def checkpoint_state(models, optimizer):
    """(the models in a ModuleDict, the state a checkpoint keeps of them and of the optimizer): frozen weights left
    out, a tied one too (LoRA: the adapters alone; a resumed run loads the rest from --model-name-or-path)."""
    modules = torch.nn.ModuleDict({name: unwrap(model) for name, model in models.items()})
    frozen = {name for name, p in modules.named_parameters(remove_duplicate=False) if not p.requires_grad}
    model_state, optimizer_state = get_state_dict(modules, optimizer)
    return modules, {"models": {k: v for k, v in model_state.items() if k not in frozen}, "optimizer": optimizer_state}


def unwrap(model):  # the model inside a DDP wrapper (an FSDP2 model is its own)
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def lr_scheduler(optimizer, args, first_step):
    """--learning-rate x factor(steps done): --warmup-steps of linear warm-up, then --lr-schedule's decay (to 0)."""

    def factor(done):
        progress = max(0, done - args.warmup_steps) / max(1, args.num_steps - args.warmup_steps)
        decay = {"constant": 1, "linear": 1 - progress, "cosine": (1 + math.cos(math.pi * progress)) / 2}
        return min(1, (done + 1) / max(1, args.warmup_steps)) * decay[args.lr_schedule]

    for group in optimizer.param_groups:  # what LambdaLR scales (a checkpoint does not keep it)
        group["initial_lr"] = args.learning_rate
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=first_step - 2)


def evaluate(model, tokenizer, records, args, stop_ids, samples=None, k=0, pause=contextlib.nullcontext):
    """{eval/accuracy of greedy completions, and with k sampled per record eval/mean@k and eval/pass@k}, of all
    processes; pause(): a context in which no other thread draws random numbers (async_grpo.py's generator)."""
    records = process_share(records)
    texts = completion_texts(model, tokenizer, records, args, stop_ids)
    scores = [[reward_fn(t, r) for t, r in zip(texts, records)]]
    if samples is not None:
        samples += [
            {"kind": "eval", "prompt": r["prompt"], "completion": t, "answer": r["answer"], "reward": x}
            for r, t, x in zip(records[:4], texts, scores[0])
        ]
    if k:  # its own random numbers: training draws the same ones with or without --eval-samples
        group = [r for r in records for _ in range(k)]
        with pause(), torch.random.fork_rng([torch.cuda.current_device()] if torch.cuda.is_initialized() else []):
            texts = completion_texts(model, tokenizer, group, args, stop_ids, args.eval_temperature)
        sampled = torch.tensor([reward_fn(t, r) for t, r in zip(texts, group)]).view(-1, k)  # (records, K)
        scores += [sampled.mean(dim=1).tolist(), sampled.amax(dim=1).tolist()]
    totals = all_sum(torch.tensor([[sum(x), len(x)] for x in scores], dtype=torch.float64)).tolist()
    return {name: x / count for name, (x, count) in zip(["eval/accuracy", "eval/mean@k", "eval/pass@k"], totals)}


def process_share(items):
    """This process's held-out items: every N-th from its rank on, as many for each (a remainder is left out, said)."""
    rank, world = rank_and_world()
    if len(items) < world:
        fail(f"{len(items)} held-out records for {world} processes, which need one each: raise --num-eval")
    left_out = len(items) % world
    if left_out:
        print(f"note: the last {left_out} of {len(items)} held-out records are left out, to share among {world}")
    return items[: len(items) - left_out][rank::world]


@torch.no_grad()
def completion_texts(model, tokenizer, records, args, stop_ids, temperature=None):
    """The texts of the records' completions, greedy (or sampled at temperature)."""
    model.eval()
    texts, device = [], next(model.parameters()).device
    for i in range(0, len(records), 128):
        ids, mask = tokenize_prompts(tokenizer, [r["prompt"] for r in records[i : i + 128]], device, args)
        completion_ids = generate(model, tokenizer, ids, mask, args.max_new_tokens, temperature, stop_ids)
        texts += decode_completions(tokenizer, completion_ids, completion_mask(completion_ids, stop_ids))
    return texts


def all_sum(x, op=dist.ReduceOp.SUM):
    """The sum of tensor x over the processes, or op's reduction (every process calls it)."""
    if not dist.is_initialized():
        return x
    y = x.detach().to(f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu", copy=True)
    dist.all_reduce(y, op=op)
    return y.to(x.device)


def reduce_and_log(output_dir, step, metrics, samples=()):
    """Every process calls it: the step's metrics, averaged over the processes (an all-reduce); rank 0 writes them
    and the samples to their files, wandb and the console."""
    values = all_sum(torch.tensor([float(v) for v in metrics.values()], dtype=torch.float64)) / rank_and_world()[1]
    metrics = dict(zip(metrics, values.tolist()))
    if rank_and_world()[0] != 0:
        return
    for name, rows in (("metrics", [metrics]), ("samples", samples)):
        try:
            with open(os.path.join(output_dir, f"{name}.jsonl"), "a") as f:
                f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        except OSError as e:
            fail(f"--output-dir {output_dir}: cannot write its {name} ({e.strerror})")
    wandb = sys.modules.get("wandb")  # --track: imported, its run started by make_output_dir
    if wandb is not None and wandb.run is not None:
        columns = list(dict.fromkeys(k for s in samples for k in s))
        if samples:
            metrics = {**metrics, "samples": wandb.Table(columns, [[s.get(k) for k in columns] for s in samples])}
        wandb.log(metrics, step=step)
    shown = ["charts/reward", "losses/loss", "eval/loss", "eval/accuracy", "eval/pair_accuracy", "charts/step_time"]
    print(f"step {step:5d}  " + "  ".join(f"{k} {metrics[k]:.4f}" for k in shown if k in metrics), flush=True)
    if samples:
        print("  sample  " + "  ".join(f"{k} {repr(v)[:80]}" for k, v in samples[0].items()), flush=True)


class Timer:
    """A step's seconds: timer.lap("generation") ends a phase begun at the step's start or at the last lap."""

    def __init__(self, device, run_start):
        self.device, self.run_start, self.seconds = device, run_start, {}
        self.start = self.last = clock(device)

    def lap(self, name=None):
        now = clock(self.device)
        if name is not None:
            self.seconds[f"charts/{name}_time"] = now - self.last
        self.last = now

    def metrics(self, tokens):
        step = clock(self.device) - self.start
        times = {"charts/step_time": step, "charts/tokens_per_sec": tokens / step, **self.seconds}
        return {**times, "charts/elapsed_time": time.time() - self.run_start}


def clock(device):
    """Seconds, once this thread's CUDA stream has done its queued work."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


def tokenize_prompts(tokenizer, prompts, device, args, tools=None):
    """Left-padded ids and mask (B, P) of each prompt's last --max-prompt-length tokens, chat-templated if it can be
    (with the tools' descriptions, tool_grpo.py's)."""
    system = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
    if tokenizer.chat_template:
        chats = [p if isinstance(p, list) else [*system, {"role": "user", "content": p}] for p in prompts]
        prompts = [
            tokenizer.apply_chat_template(c, tools=tools, tokenize=False, add_generation_prompt=True) for c in chats
        ]
    elif system or any(isinstance(p, list) for p in prompts):
        what = "--system-prompt" if system else "conversational records (--dataset, --eval-dataset)"
        fail(f"{what} need a tokenizer with a chat template, and {args.model_name_or_path} has none")
    ids = tokenizer(prompts, add_special_tokens=not tokenizer.chat_template)["input_ids"]
    if args.max_prompt_length:
        ids = [i[-args.max_prompt_length :] for i in ids]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids], device=device)
    return input_ids, torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)


def completion_mask(completion_ids, stop_ids):
    """1 up to and including the first stop token: [[5, 7, EOS, PAD], [6, 6, 6, 6]] -> [[1, 1, 1, 0], [1, 1, 1, 1]]"""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device)).long()
    return (is_stop.cumsum(dim=1) - is_stop) == 0  # no stop token before this one


def decode_completions(tokenizer, completion_ids, mask):
    return [tokenizer.decode(ids[m], skip_special_tokens=True) for ids, m in zip(completion_ids, mask)]


def no_signal_note(step, rewards, group_size, signal):
    """signal + the groups of this step (of every process) whose rewards differ; at step 5, if none ever did, one
    line says that nothing can be learned, and why (docs/your_own_task.md). rewards (B,) group-contiguous."""
    if step <= 5:
        grouped = rewards.view(-1, group_size)  # (groups, G)
        signal += all_sum((grouped.amax(dim=1) > grouped.amin(dim=1)).sum()).item()
        if step == 5 and signal == 0:
            print(
                "note: in the first 5 steps every group of completions got equal rewards, so there is no learning"
                " signal; likely cause: reward_fn scores every completion alike on your records (see"
                " docs/your_own_task.md), or the task is too hard or too easy for this model within --max-new-tokens"
            )
    return signal


@torch.no_grad()
def batched_logprobs(model, input_ids, attention_mask, prompt_len, temperature, batch_size):
    """token_logprobs (B, T) without gradient, in batches of batch_size rows of like length; None for no model."""
    if model is None:
        return None
    model.eval()
    order = attention_mask.sum(dim=1).argsort(stable=True)
    logprobs = [
        token_logprobs(model, input_ids[b], attention_mask[b], prompt_len, temperature) for b in order.split(batch_size)
    ]
    return torch.cat(logprobs)[order.argsort()]  # in the batch's order again


def adapters_off(model):  # `with adapters_off(policy):` the policy without its LoRA adapters: the reference
    return getattr(unwrap(model), "disable_adapter", contextlib.nullcontext)()


def minibatches(attention_mask, minibatch_size, passes, generator):
    """Row blocks of `passes` shuffled passes over a batch (attention_mask), each in order of length: less padding."""
    lengths = attention_mask.sum(dim=1)
    for _ in range(passes):
        for minibatch in torch.randperm(len(lengths), generator=generator).to(lengths.device).split(minibatch_size):
            yield minibatch[lengths[minibatch].argsort(stable=True)]


def micro_batches(minibatch, size, models, token_mask=None):
    """(part, share) of each micro-batch (its indices, or its records), its gradients synced (DDP) at the last one only;
    weighed by share, they add up to the minibatch loss's: share of the sequences, or of the tokens of all processes."""
    parts = [minibatch[i : i + size] for i in range(0, len(minibatch), size)]
    for i, idx in enumerate(parts):
        share = len(idx) / len(minibatch)
        if token_mask is not None:
            share = token_mask[idx].sum() / (all_sum(token_mask[minibatch].sum()) / rank_and_world()[1])
        with gradient_sync(i == len(parts) - 1, *models):
            yield idx, share


def gradient_sync(last, *models):
    """`with gradient_sync(last, model):` under DDP, only a step's last micro-batch all-reduces the gradients."""
    stack = contextlib.ExitStack()
    for model in models:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
            stack.enter_context(model.no_sync())
    return stack


def token_logprobs(
    model, input_ids, attention_mask, prompt_len, temperature=1.0, with_entropy=False, chunk_values=2**26
):
    """Log-probs (B, T) of the completion tokens input_ids[:, prompt_len:], float32 (and entropies (B, T)).

    input_ids = [PAD, PAD, 4, 7, 13 | 5, 5, EOS]   left-padded prompt | completion (T = 3)
    attention = [0,   0,   1, 1, 1  | 1, 1, 1  ]   positions [0, 0, 0, 1, 2 | 3, 4, 5], as in generate()
    The state at prompt_len - 1 + t predicts token t; chunk_values logits at a time (docs/gpu.md).
    """
    length = input_ids.shape[1] - prompt_len
    input_ids, attention_mask, prompt_len, kept = attended(input_ids, attention_mask, prompt_len)
    if own_logits(model):  # its own logits, under autocast
        hidden = forward(model, input_ids, attention_mask, logits_to_keep=kept + 1).logits[:, :-1]  # (B, T', vocab)
        weight, bias, vocab, parts = None, None, hidden.shape[-1], None
    else:  # the output layer's weight and bias, multiplied below (head_product)
        hidden = hidden_states(model, input_ids, attention_mask)[:, -kept - 1 : -1]  # (B, T', d)
        head = unwrap(model).get_output_embeddings()
        weight, bias, vocab = head.weight, head.bias, head.weight.shape[0]
        parts = head_parts(model)  # made once for every chunk
    hidden, targets = hidden.flatten(0, 1), input_ids[:, prompt_len:].flatten()  # (B T, d or vocab), (B T,)

    def chunk(hidden, targets, weight, bias):  # log-probs (n,) and entropies (n,) at n positions
        logits = hidden.float()  # the model's own logits, or the decoder's states
        if weight is not None:
            logits = head_product(hidden, weight, bias, parts)
        logits = logits / temperature  # (n, vocab)
        logsumexp = torch.logsumexp(logits, dim=-1)
        entropy = None
        if with_entropy:
            entropy = logsumexp - (logits.softmax(-1) * logits).sum(-1)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - logsumexp, entropy

    span, chunks = max(1, chunk_values // vocab), []
    recompute = torch.is_grad_enabled() and len(targets) > span  # in the backward pass (one chunk: no need)
    for i in range(0, len(targets), span):
        part = hidden[i : i + span], targets[i : i + span], weight, bias
        if recompute:
            chunks.append(
                torch.utils.checkpoint.checkpoint(chunk, *part, use_reentrant=False, preserve_rng_state=False)
            )
        else:
            chunks.append(chunk(*part))
    cut = (0, length - kept)  # (B, T') then 0 on the columns cut off: (B, T)
    logprobs = torch.nn.functional.pad(torch.cat([c[0] for c in chunks]).view(-1, kept), cut)
    if with_entropy:
        return logprobs, torch.nn.functional.pad(torch.cat([c[1] for c in chunks]).view(-1, kept), cut)
    return logprobs


def attended(input_ids, attention_mask, prompt_len):
    """input_ids and attention_mask without the columns at either end that no row attends to (their log-probs: 0),
    prompt_len in them, and the completion positions kept; the positions, and so every kept log-prob, are the same."""
    first, last = attention_mask.any(dim=0).nonzero()[[0, -1], 0].tolist()  # reads the mask: once a forward pass
    first, end = min(first, prompt_len - 1), max(last + 1, prompt_len + 1)
    return input_ids[:, first:end], attention_mask[:, first:end], prompt_len - first, end - prompt_len


def own_logits(model):
    """Whether the model scales or caps its logits (Gemma 2's softcapping): then its own, not the layer's product."""
    config = unwrap(model).config.get_text_config()
    scaled = any(getattr(config, k, None) not in (None, 1) for k in ("logit_scale", "logits_scaling"))
    return scaled or getattr(config, "final_logit_softcapping", None) is not None


def forward(model, input_ids, attention_mask, **kwargs):
    """The model's output, with generate()'s positions and no KV cache (nobody would read it)."""
    positions = (attention_mask.cumsum(1) - 1).clamp(0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **kwargs)


def hidden_states(model, input_ids, attention_mask, rolled_on=("cuda",)):
    """The decoder's last hidden states (B, L, d), as the output layer (or a score head) takes them. On a GPU (on the
    devices rolled_on) each row runs rolled left to its first attended token, its padding after it: the causal mask
    alone is then exact while a row's attended tokens are one run, as here (flash attention, K and V read once)."""
    states, causal_lm = [], unwrap(model).get_output_embeddings() is not None
    hook = unwrap(model).get_decoder().register_forward_hook(lambda module, inputs, out: states.append(out[0]))
    logits, width = {"logits_to_keep": no_logits(input_ids)} if causal_lm else {}, input_ids.shape[1]
    try:
        if input_ids.device.type in rolled_on:
            roll = (torch.arange(width, device=input_ids.device) + attention_mask.argmax(dim=1, keepdim=True)) % width
            model(input_ids=input_ids.gather(1, roll), use_cache=False, **logits)  # positions 0, 1, ... in each row
            return torch.empty_like(states[0]).scatter(1, roll[..., None].expand_as(states[0]), states[0])  # back
        forward(model, input_ids, attention_mask, **logits)
    finally:
        hook.remove()
    return states[0]


def no_logits(input_ids):  # logits_to_keep for no position: the output layer's product is made in float32 by hand
    return torch.zeros(0, dtype=torch.long, device=input_ids.device)


def rows(tensor, idx):  # tensor[idx], or None (a run without a reference, or without an engine, has no log-probs)
    return None if tensor is None else tensor[idx]


def check_finite(loss, step, optimizer, cause="the rewards"):
    if torch.isfinite(loss):
        return
    if not optimizer.scaler.is_enabled() or optimizer.scaler.get_scale() < 1:  # float16 overflows even unscaled
        fail(f"step {step}: the loss is {loss.item()}; lower --learning-rate or check {cause} (float16: use bfloat16)")
    param = optimizer.param_groups[0]["params"][0]  # float16: its step skipped as for an overflow in the backward
    param.grad = torch.full_like(param, float("nan"))  # (clipped_step): backward adds to the NaN, DDP's mean keeps it


def clipped_step(optimizer, params, max_norm):
    """The optimizer's step on the gradients clipped to norm max_norm (returned). Under --dtype float16 (resume() makes
    optimizer.scaler) they are unscaled first; a step with one not finite is skipped, the scale lowered (GradScaler)."""
    optimizer.scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.scaler.step(optimizer)
    optimizer.scaler.update()
    return norm


def weighted_means(records, prefix=""):
    """{prefix + name: sum w x / sum w} of (stats, w) records: [({"kl": 1.0}, 1), ({"kl": 0.0}, 3)] -> {"kl": 0.25}"""
    sums, totals = {}, {}
    for stats, weight in records:
        for name, value in stats.items():
            sums[name] = sums.get(name, 0.0) + float(value) * float(weight)
            totals[name] = totals.get(name, 0.0) + float(weight)
    return {prefix + name: sums[name] / totals[name] for name in sums}


def rollout_samples(records, texts, rewards, advantages):
    """The first four rollouts of a step, for samples.jsonl: prompt, completion, answer, reward and advantage."""
    rows = zip(records[:4], texts, rewards.tolist(), advantages.tolist())
    return [
        {"kind": "rollout", "prompt": r["prompt"], "completion": t, "answer": r["answer"], "reward": x, "advantage": a}
        for r, t, x, a in rows
    ]


def save_checkpoint(args, output_dir, step, tokenizer, models, optimizer, generators, **loop_state):
    """Every --save-every steps, checkpoints/step_<step>/: each model, state/ (DCP), random and loop states."""
    if args.save_every == 0 or step % args.save_every != 0:
        return
    (rank, world), folder = rank_and_world(), os.path.join(output_dir, "checkpoints", f"step_{step:06d}")
    part = folder + ".partial"  # named once whole
    if rank == 0:
        shutil.rmtree(part, ignore_errors=True)
    barrier()
    dcp.save(checkpoint_state(models, optimizer)[1], checkpoint_id=f"{part}/state")
    for name, model in models.items():
        save(model, tokenizer, f"{part}/{name}", merged=False)  # LoRA: adapter/ alone
    _, keys, *rest = sys.modules["numpy"].random.get_state()  # torch loaded numpy; vLLM's CUDA sampler draws from it
    states = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all(),
        "numpy": [torch.from_numpy(keys), *rest],
        "generators": [g.getstate() if isinstance(g, random.Random) else g.get_state() for g in generators],
        "scaler": optimizer.scaler.state_dict(),
    }
    torch.save(states, f"{part}/rng_{rank}.pt")
    barrier()
    if rank == 0:
        with open(f"{part}/trainer_state.json", "w") as f:
            json.dump({"file": os.path.basename(__file__), "step": step, "world_size": world, "state": loop_state}, f)
        os.replace(part, folder)
        for old in sorted(glob.glob(os.path.join(output_dir, "checkpoints", "step_*[0-9]")))[: -args.keep_checkpoints]:
            shutil.rmtree(old)
    barrier()


def save(model, tokenizer, output_dir, merged=True):
    """The model and the tokenizer, loadable with from_pretrained (rank 0 writes); with LoRA the adapter alone in
    adapter/, and the model with it merged in unless merged=False."""
    model, weights = unwrap(model), None
    if isinstance(model, FSDPModule):
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)).items()
    try:
        if rank_and_world()[0] != 0:
            return
        if hasattr(model, "get_base_model"):  # LoRA
            model.save_pretrained(os.path.join(output_dir, "adapter"))
            if not merged:
                return
            model, weights = model.get_base_model(), merged_weights(model)
        state_dict = None
        if weights is not None:  # a tensor at a time to the CPU, a tied weight under one name
            names = {n.replace(".base_layer", "") for n, _ in [*model.named_parameters(), *model.named_buffers()]}
            state_dict = {name: tensor.cpu() for name, tensor in weights if name in names}
        model.save_pretrained(output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(output_dir)
    except OSError as e:
        fail(f"--output-dir {output_dir}: cannot save the model there ({e.strerror})")


@torch.no_grad()
def merged_weights(model):
    """(name, float32 tensor) of each weight, under the plain model's names; with LoRA merged, a layer at a time."""
    model = unwrap(model)
    if hasattr(model, "get_base_model"):  # LoRA
        model = model.get_base_model()
    adapted = {f"{n}.base_layer.weight": m for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        if name in adapted:  # a new tensor: the model's weight is never merged into and back (not exact)
            tensor = tensor + adapted[name].get_delta_weight("default")
        if tensor.is_floating_point():  # a frozen layer held in --dtype (add_lora)
            tensor = tensor.float()
        yield name.replace(".base_layer", ""), tensor


def end_processes():
    """Ends the wandb run; under torchrun the group, then the process (docs/distributed.md)."""
    wandb = sys.modules.get("wandb")  # --track
    if wandb is not None and wandb.run is not None:
        wandb.finish()
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def check_ranges(args, ranges):
    """Stops at the first flag outside its range: '> 0', '>= 2' or 'in [0, 0.5)', maybe with a reason."""
    for name, spec in ranges.items():
        x = getattr(args, name, None)
        if x is None:  # an optional flag left unset, or one this file lacks
            continue
        op, bounds = re.match(r"(>=|>|in) ([\[(].*?[\])]|\S+)", spec).groups()
        if op != "in":  # '> 0' is 'in (0, inf)', '>= 2' is 'in [2, inf)'
            bounds = f"{'[' if op == '>=' else '('}{bounds}, inf)"
        low, high = map(float, bounds[1:-1].split(","))
        above = x > low or (bounds[0] == "[" and x == low)
        below = x < high or (bounds[-1] == "]" and x == high)
        if not (math.isfinite(x) and above and below):  # nan and inf are in no range
            fail(f"{flag(name)} {x}: must be {'' if math.isfinite(x) else 'a finite number '}{spec}")


def check_lora(args):
    """Stops before anything loads if --lora-r cannot run: with --fsdp, or without peft."""
    if args.lora_r and args.fsdp:
        fail("--lora-r with --fsdp: LoRA runs under DDP (torchrun without --fsdp); its gradients are small to copy")
    if args.lora_r and importlib.util.find_spec("peft") is None:
        fail("--lora-r: LoRA needs the peft library: pip install peft")


def exact_div(a, b, what):
    """a // b; unless b divides a, the run stops, naming what to change."""
    if b <= 0 or a % b != 0:
        fail(f"{what}: {a} does not divide by {b}")
    return a // b


def fit_micro_batches(args, minibatch_size, what):
    """Makes --micro-batch-size no larger than a minibatch, which it must divide (or the run stops, naming what)."""
    args.micro_batch_size = min(args.micro_batch_size, minibatch_size)
    if minibatch_size % args.micro_batch_size != 0:
        fail(f"{what} by --micro-batch-size: {minibatch_size} does not divide by {args.micro_batch_size}")


# Why each piece is as it is, with its measurements: docs/gpu.md, docs/distributed.md, docs/outputs.md
def fail(message):
    raise SystemExit(f"error: {message}")


def read_jsonl(path, *schemas, flag="--dataset"):
    """The records of a JSONL file, each with the fields of a schema; a bad record stops the run naming its line."""
    if not os.path.isfile(path):
        fail(f"{flag} {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = [(f"{flag} {path}: line {n}", line) for n, line in enumerate(f, start=1) if line.strip()]
    records = []
    for at, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            fail(f"{at} is not valid JSON ({e.msg})")
        record = records[-1] if isinstance(records[-1], dict) else {}
        for k in next((s for s in schemas if set(s) <= set(record)), schemas[0]):
            if k not in record:
                fail(f"{at} has no field {k!r} (a record needs {' or '.join(' and '.join(s) for s in schemas)})")
            v = record[k]
            number = type(v) in (int, float) and math.isfinite(v)
            messages = isinstance(v, list) and len(v) > 0 and all(isinstance(m, dict) for m in v)
            chat = messages and all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)
            if k == "answer" and not (isinstance(v, str) or number):
                fail(f"{at}: field {k!r} holds {json.dumps(v)[:40]}; it needs text or a finite number")
            if k != "answer" and not (isinstance(v, str) or chat):
                fail(f"{at}: field {k!r} holds {json.dumps(v)[:40]}; it needs text or a list of role/content messages")
    if not records:
        fail(f"{flag} {path}: the file holds no records")
    return records


def flag(name):
    return "--" + name.replace("_", "-")


def load_hub_split(name, config, split, flag="--dataset"):
    if importlib.util.find_spec("datasets") is None:
        fail(f"{flag} {name}: a hub dataset needs the datasets library: pip install datasets")
    import datasets

    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:  # the library raises many kinds
        fail(f"{flag} {name}: could not load split {split!r} ({type(e).__name__}: {e})".splitlines()[0])


@torch.no_grad()
def generate(
    model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids, with_logprobs=False, switch=None
):
    """Completion ids (B, T), a token at a time into a static KV cache, each drawn at temperature (None: greedy) from
    the model's float32 logits, padded after each row's first stop token (with_logprobs: and each token's log-prob
    under softmax(logits / temperature), (B, T), 0 after the stop). Every process runs as many forward passes.
    switch(t, going), if given, is called between token t - 1 and token t, going() saying whether a row has not stopped
    (a look that waits for the device); True says that the weights changed (AReaL's interruption, async_grpo.py): the
    cache is filled again under the new weights from the prompts and the tokens drawn so far (refill), and goes on."""
    steps, device, size = max_new_tokens, prompt_ids.device, len(prompt_ids)
    if dist.is_initialized():  # as many tokens as the process that asks for the most (tool_grpo.py's turns)
        steps = int(all_sum(torch.tensor(max_new_tokens, device=device), dist.ReduceOp.MAX))
    step, compiled, every = decode_step, compiles(model), stop_check_every(device)
    if compiled:  # prompts in a few widths, every rollout in the shape of the model's one cache (rollout_cache)
        step = compiled_step(model)
        prompt_ids, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id, 64), left_pad(prompt_mask, 0, 64)
    width = prompt_ids.shape[1]
    cache, own = rollout_cache(model, size, width + steps, compiled), own_logits(model)
    rows, length = cache.rows, cache.length  # rows past the batch's: copies of its first prompt, stopped at once
    prompt_ids, prompt_mask = pad_rows(prompt_ids, rows), pad_rows(prompt_mask, rows)
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, length - width)], dim=1)  # (rows, length); causal on top
    position = prompt_mask.sum(dim=1, keepdim=True)  # (rows, 1): the first new token's
    inputs, weights = rollout_inputs(model, mask, cache), rollout_weights(model, compiled)
    positions = (prompt_mask.cumsum(1) - 1).clamp(0)  # (rows, P): the prompts'
    stops, heat = torch.tensor(stop_ids, device=device), heat_of(temperature, device, compiled)
    tokens, logprobs, done = [], [], torch.arange(rows, device=device) >= size
    with autocast(model), gathered(model), grouped_attention(model):
        u = uniform(rows, size, temperature, device)
        token, logprob = decode_step(model, prompt_ids, positions, inputs, own, weights, heat, u)  # the prefill
        for t in range(steps):
            tokens.append(torch.where(done, tokenizer.pad_token_id, token))
            logprobs.append(torch.where(done, 0.0, logprob))
            done = done | torch.isin(token, stops)
            if t + 1 == steps or ((t + 1) % every == 0 and all_sum((~done).sum()) == 0):
                break
            u = uniform(rows, size, temperature, device)
            if switch is not None and switch(t + 1, lambda: bool(all_sum((~done).sum()) > 0)):  # new weights
                weights, so_far = rollout_weights(model, compiled), torch.stack(tokens, dim=1)  # (rows, t + 1)
                ids, at = (prompt_ids, so_far), (positions, position)
                token, logprob = refill(model, cache, ids, at, inputs, own, weights, heat, u)
            else:
                with fast_algorithms(compiled):
                    token, logprob = step(model, tokens[-1][:, None], position + t, inputs, own, weights, heat, u)
    out = torch.stack(tokens, dim=1)[:size, :max_new_tokens]  # (B, T)
    stopped = torch.isin(out, stops)
    length = int(torch.where(stopped.any(1), stopped.int().argmax(1) + 1, out.shape[1]).max())  # the longest row's
    if with_logprobs:
        return out[:, :length], torch.stack(logprobs, dim=1)[:size, :length]
    return out[:, :length]


def decode_step(model, ids, positions, inputs, own, weights, heat, u):
    """The next token of each row (rows,) and its log-prob: drawn from the float32 logits after ids (next_logits) at
    temperature heat (a tensor; 0: greedy) with the uniform numbers u (rows, 1); compiled whole on a GPU (gpt-fast)."""
    logits = next_logits(model, ids, positions, inputs, own, weights)
    return draw(torch.nan_to_num(logits), heat, u)  # a diverged model still samples; the loss's check names it later


def refill(model, cache, ids, at, inputs, own, weights, heat, u):
    """After a switch to new weights: the cache emptied and filled again under them, with ids = (the prompts (B, P),
    the tokens so far (B, t)) at = (the prompts' positions, the first new token's (B, 1)): the prompts, then the
    tokens in chunks as wide as the prompts (no pass larger than the prefill). The next token and its log-prob."""
    (prompt_ids, so_far), (positions, first) = ids, at
    cache.reset()
    next_logits(model, prompt_ids, positions, inputs, own, weights)
    width = prompt_ids.shape[1]
    for start in range(0, so_far.shape[1], width):
        chunk = so_far[:, start : start + width]
        chunk_at = first + torch.arange(start, start + chunk.shape[1], device=chunk.device)
        if start + width >= so_far.shape[1]:
            return decode_step(model, chunk, chunk_at, inputs, own, weights, heat, u)
        next_logits(model, chunk, chunk_at, inputs, own, weights)


def next_logits(model, ids, positions, inputs, own, weights):
    """float32 logits (B, vocab) of the token after ids (B, n) at positions (B, n); inputs: the attention mask (B,
    cache length), 1 on the prompts' tokens and the new ones, and the cache, which keeps their keys and values
    (rollout_inputs); own: the model's own logits (own_logits), else its decoder's state times the output layer;
    weights: the decoder's, by name, to use in place of its own, and the output layer's parts (rollout_weights)."""
    causal_lm, inputs = unwrap(model), {"input_ids": ids, "position_ids": positions, **inputs}
    if own:
        return causal_lm(**inputs, logits_to_keep=1).logits[:, -1].float()
    if isinstance(causal_lm, FSDPModule):  # through the model's forward, whose hooks FSDP2 needs: the state on its way
        states = []
        hook = causal_lm.get_decoder().register_forward_hook(lambda module, args, out: states.append(out[0]))
        try:
            causal_lm(**inputs, logits_to_keep=no_logits(ids))
        finally:
            hook.remove()
        hidden = states[0][:, -1]
    elif weights:
        decoder = {name: w for name, w in weights.items() if name != "head"}
        hidden = torch.func.functional_call(causal_lm.get_decoder(), decoder, (), inputs).last_hidden_state[:, -1]
    else:
        hidden = causal_lm.get_decoder()(**inputs).last_hidden_state[:, -1]  # (B, d)
    head = causal_lm.get_output_embeddings()
    return head_product(hidden, head.weight, head.bias, weights.get("head"))


def compiles(model):
    """Whether the model runs compiled (the rollouts' step, load_model's layers): on a GPU, so that a token costs one
    launch of a CUDA graph (docs/gpu.md); not under FSDP2, whose hooks gather, nor on a CPU, which runs as it is, nor
    with torch's TORCH_COMPILE_DISABLE=1: all eager (the compiled step, whole, would not run)."""
    cuda = next(model.parameters()).device.type == "cuda" and os.environ.get("TORCH_COMPILE_DISABLE") != "1"
    return cuda and not any(isinstance(m, FSDPModule) for m in model.modules())


def decoder_layers(model):  # FSDP2's units, and the regional compile's
    return [m for m in model.modules() if model._no_split_modules and type(m).__name__ in model._no_split_modules]


def compile_layers(model, fsdp):
    """The model, on a GPU each decoder layer compiled for whole sequences, its elementwise work fused: one graph for
    every layer and width (regional compile, docs/gpu.md); not under --fsdp, whose hooks the call would trace."""
    if compiles(model) and not fsdp:
        for layer in decoder_layers(model):
            layer.compile(dynamic=True)
    return model


def stop_check_every(device):
    """Decoded tokens between two looks at whether every completion has stopped: 16 on a GPU (a look waits for the
    queued work), 1 on a CPU (the values are there already, and a token past the last stop costs a forward pass)."""
    if device.type == "cuda":
        return 16
    return 1


def compiled_step(model):
    """decode_step for one new token, compiled once a model (where compiles() says so)."""
    if "compiled_step" not in unwrap(model).__dict__:
        unwrap(model).get_input_embeddings()._forward_hooks.clear()  # checkpointing's requires_grad_ hooks: gpu.md
        unwrap(model).compiled_step = compile_step(decode_step)
    return unwrap(model).compiled_step


def compile_step(function):  # the one part only a GPU runs (the tests compile it for the CPU)
    return torch.compile(function, mode="reduce-overhead", fullgraph=True)


def left_pad(x, value, multiple):
    """x (B, P) padded on the left to a multiple of `multiple` columns."""
    return torch.nn.functional.pad(x, (-x.shape[1] % multiple, 0), value=value)


class RolloutCache(transformers.StaticCache):
    """transformers' static KV cache for `rows` sequences of `length` tokens, its keys and values stored in `dtype`
    (--dtype), as autocast's attention reads them, in half the memory, on every transformers (docs/gpu.md)."""

    def __init__(self, config, rows, length, dtype):
        super().__init__(config=config, max_cache_len=length)
        self.rows, self.length, self.store_dtype = rows, length, dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # a no-op where they are in that dtype already (to() returns the tensor itself)
        key_states, value_states = key_states.to(self.store_dtype), value_states.to(self.store_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def rollout_cache(model, rows, length, keep):
    """A RolloutCache for rows sequences of length tokens; with keep (a compiled step), the model's one cache, made
    again only for a larger shape (its length a multiple of 64), and every rollout run in its shape: one compile and
    one CUDA graph for evaluation's batches and training's, and one cache in memory (gpt-fast's way; docs/gpu.md)."""
    config, dtype = unwrap(model).config, getattr(unwrap(model), "compute_dtype", torch.float32)
    if not keep:
        return RolloutCache(config, rows, length, dtype)
    cache = unwrap(model).__dict__.pop("rollout_cache", None)  # freed before a larger one is filled
    rows, length = max(rows, getattr(cache, "rows", 0)), max(length + (-length % 64), getattr(cache, "length", 0))
    if cache is None or (cache.rows, cache.length) != (rows, length):
        cache = RolloutCache(config, rows, length, dtype)  # its tensors are made when the prefill fills them
    cache.reset()
    unwrap(model).rollout_cache = cache
    return cache


def pad_rows(x, rows):
    """x (B, P) with copies of its first row below it, up to `rows` rows."""
    if rows == len(x):
        return x
    return torch.cat([x, x[:1].expand(rows - len(x), -1)])


def rollout_inputs(model, mask, cache):
    """next_logits' inputs, named as the model's forward takes them: `cache` since transformers 5.24."""
    name = "past_key_values"
    if "cache" in inspect.signature(unwrap(model).get_decoder().forward).parameters:
        name = "cache"
    return {"attention_mask": mask, "use_cache": True, name: cache}


def rollout_weights(model, compiled):
    """For a compiled step in bfloat16 (or float16): the decoder's linear layers' weights and biases in it, by name,
    kept on the model (a CUDA graph reads them at one address): a copy made once a rollout of a float32 master, else
    the tensor itself; under "head" the output layer's weight's bfloat16 parts for head_product; else {} (gpu.md)."""
    dtype = getattr(unwrap(model), "compute_dtype", torch.float32)
    if not compiled or dtype == torch.float32:
        return {}
    weights = unwrap(model).__dict__.setdefault("rollout_weights", {})
    linears = [(name, m) for name, m in unwrap(model).get_decoder().named_modules() if isinstance(m, torch.nn.Linear)]
    for name, module in linears:
        for key, master in module.named_parameters(prefix=name, recurse=False):
            if master.dtype == dtype:  # held in it already: the tensor itself
                weights[key] = master
                continue
            if key not in weights:
                weights[key] = torch.empty_like(master, dtype=dtype)
                torch._dynamo.mark_static_address(weights[key])
            weights[key].copy_(master)
    head = unwrap(model).get_output_embeddings().weight.detach()
    if "head" not in weights:
        weights["head"] = tuple(torch.empty_like(head, dtype=torch.bfloat16) for _ in range(2))
        for part in weights["head"]:
            torch._dynamo.mark_static_address(part)
    for kept, part in zip(weights["head"], bf16_parts(head)):
        kept.copy_(part)
    return weights


def autocast(model):
    """torch.autocast in the model's --dtype, for a layer of it applied by hand."""
    dtype = getattr(unwrap(model), "compute_dtype", torch.float32)
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype, enabled=dtype != torch.float32)


@contextlib.contextmanager
def gathered(model):
    """The layers for a rollout: under FSDP2 every one's weights gathered once for the whole rollout, not for every
    token; a layer compiled for whole sequences (load_model) runs as it is, within the compiled step or a prefill."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    compiled = {m: m._compiled_call_impl for m in model.modules() if m._compiled_call_impl is not None}
    for module in sharded:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    for module in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, call in compiled.items():
            module._compiled_call_impl = call
        for module in sharded:  # then every layer but the root reshards after its forward again
            module.reshard()
            module.set_reshard_after_forward(module is not model, recurse=False)


@contextlib.contextmanager
def grouped_attention(model):
    """The rollout's attention through grouped_sdpa where the model's is transformers' SDPA over fewer key-value
    heads than query heads."""
    config = unwrap(model).config
    text = config.get_text_config()  # a multimodal model's decoder
    heads = text.num_attention_heads
    if config._attn_implementation != "sdpa" or getattr(text, "num_key_value_heads", heads) == heads:
        yield
        return
    transformers.AttentionInterface.register("grouped_sdpa", grouped_sdpa)
    transformers.AttentionMaskInterface.register("grouped_sdpa", transformers.AttentionMaskInterface()["sdpa"])
    config._attn_implementation = "grouped_sdpa"
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' SDPA attention, but for one new token over fewer key-value heads than query heads: the queries
    of a key-value head read it together, as a row of queries (query (B, heads, 1, d) -> (B, kv heads, groups, d))."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] > 1 or groups == 1:
        sdpa = transformers.AttentionInterface()["sdpa"]
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows, heads, _, dim = query.shape
    grouped = query.view(rows, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, 1, heads, value.shape[-1]), None  # (B, 1, heads, d), as transformers' is


@contextlib.contextmanager
def fast_algorithms(compiled):
    """For a compiled step, deterministic algorithms off in the main thread (with them on, each KV cache write is ATen's
    sort-based index_put) and inductor's own deterministic mode kept: the same results (docs/gpu.md). In another thread
    the process's setting stays: async_grpo.py's trainer computes beside its generator."""
    if not compiled:
        yield
        return
    before, main = torch.are_deterministic_algorithms_enabled(), threading.current_thread() is threading.main_thread()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(before and not main, warn_only=warn_only)  # inductor's mode with it: again below
    try:
        with torch._inductor.config.patch(deterministic=before):
            yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def heat_of(temperature, device, compiled):
    """draw()'s temperature: None for greedy in an eager step (the largest logit alone); else a tensor, 0 for greedy,
    so that one compiled step serves greedy and every temperature."""
    if temperature is not None:
        return torch.tensor(float(temperature), device=device)
    if compiled:
        return torch.zeros((), device=device)
    return None


def uniform(rows, size, temperature, device):
    """draw()'s uniform numbers (rows, 1), float64 as the sums they are set against: one a row of the batch's size
    (the padded rows repeat the first's), none drawn for greedy (0s), so that an evaluation takes none of training's."""
    if temperature is None:
        return torch.zeros(rows, 1, dtype=torch.float64, device=device)
    return pad_rows(torch.rand(size, 1, dtype=torch.float64, device=device), rows)


def draw(logits, heat, u):
    """A token a row (B,) from float32 logits (B, vocab), and its log-prob (B,) under softmax(logits / heat): the
    first token whose cumulative probability passes u (B, 1) of the total (first_past), one uniform number a row;
    greedy (heat None, or a tensor 0 in a compiled step): the largest logit, log-prob 0."""
    if heat is None:
        return logits.argmax(dim=-1), torch.zeros(len(logits), device=logits.device)
    greedy = heat == 0
    logprobs = (logits / torch.where(greedy, 1.0, heat)).log_softmax(dim=-1)  # (B, vocab)
    token = first_past(logprobs.exp(), u)  # (B, 1)
    logprob = logprobs.gather(1, token).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), token.squeeze(1)), torch.where(greedy, 0.0, logprob)


def first_past(probs, u, block=1024):
    """The first entry (B, 1) whose cumulative sum passes u (B, 1) of its row's total, probs (B, n) >= 0, found in two
    levels: the block of `block` entries whose sums pass it, then the entry in that block at the share of the block
    where u fell: float32 passes over the row, float64 sums that decide, none across the whole row (docs/gpu.md)."""
    rows, n = probs.shape
    blocks = torch.nn.functional.pad(probs, (0, -n % block)).view(rows, -1, block)  # (B, blocks, block)
    ends = blocks.sum(dim=-1).double().cumsum(dim=-1)  # (B, blocks): the sums up to each block's end
    at = u * ends[:, -1:]  # (B, 1)
    k = torch.searchsorted(ends, at, right=True).clamp_(max=ends.shape[1] - 1)  # (B, 1): the block it falls in
    start = torch.where(k > 0, ends.gather(1, (k - 1).clamp(min=0)), 0.0)  # (B, 1): the sum before that block
    share = (at - start) / (ends.gather(1, k) - start)  # (B, 1): where in the block, a fraction in [0, 1)
    within = blocks.gather(1, k[..., None].expand(rows, 1, block)).squeeze(1).double().cumsum(dim=-1)  # (B, block)
    j = torch.searchsorted(within, share * within[:, -1:], right=True).clamp_(max=block - 1)
    return (k * block + j).clamp_(max=n - 1)


def head_parts(model):
    """The output layer's weight's bfloat16 parts (bf16_parts) for head_product's tensor-core products, where the
    model computes in bfloat16 or float16 and compiles() (a GPU); else None: float32's product (docs/gpu.md)."""
    if not compiles(model) or getattr(unwrap(model), "compute_dtype", torch.float32) == torch.float32:
        return None
    return bf16_parts(unwrap(model).get_output_embeddings().weight.detach())


def head_product(hidden, weight, bias, parts=None):
    """float32 logits (n, vocab): the states hidden (n, d) times the output layer's weight (vocab, d), plus bias; with
    the weight's parts (head_parts), from bfloat16 tensor-core products (SplitProduct), else float32's product."""
    with torch.autocast(hidden.device.type, enabled=False):
        if parts is None:
            logits = torch.nn.functional.linear(hidden.float(), weight.float())
        else:
            logits = SplitProduct.apply(hidden.float(), weight, *parts)
        if bias is not None:
            logits = logits + bias.float()
        return logits


class SplitProduct(torch.autograd.Function):
    """hidden (n, d) times weight (vocab, d) transposed, given as its parts high + low (vocab, d), by split_product;
    hidden's gradient by split_product too, the weight's by the same three products in one (backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, high, low):
        ctx.save_for_backward(hidden, high, low)
        return split_product(hidden, high.T, low.T)

    @staticmethod
    def backward(ctx, grad):  # grad (n, vocab): hidden's is grad @ weight, the weight's grad.T @ hidden
        hidden, high, low = ctx.saved_tensors
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = split_product(grad, high, low)
        if ctx.needs_input_grad[1]:  # (vocab, d): the three products as one over the inner dimension stacked, summed
            g_high, g_low = bf16_parts(grad)  # by the tensor cores, with no (vocab, d) partial product to add
            h_high, h_low = bf16_parts(hidden)
            grad_weight = tensor_core_mm(torch.cat([g_high, g_low, g_high]).T, torch.cat([h_high, h_high, h_low]))
        return grad_hidden, grad_weight, None, None


def split_product(a, b_high, b_low):
    """a (n, k) times b (k, m) = b_high + b_low (bf16_parts), float32, from three bfloat16 products summed in float32
    (tensor_core_mm): a's high part times both of b's, a's low part times b's high part; float32's product to about
    2^-16 of the sum of the products' sizes (a's low part times b's, and each part's rounding, left out)."""
    a_high, a_low = bf16_parts(a)
    both = tensor_core_mm(torch.cat([a_high, a_low]), b_high)  # (2n, m): b's high part read once for both
    return both[: len(a)] + both[len(a) :] + tensor_core_mm(a_high, b_low)


def bf16_parts(x):
    """float32 x as two bfloat16 tensors high + low: x rounded to bfloat16, and the rest rounded (x to about 2^-16).
    high is rounded on x's bits (to nearest, ties to even), not by a cast and back: inside one compiled kernel
    inductor may keep the cast's value unrounded, and the low part would be 0."""
    bits = x.float().view(torch.int32)
    high = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)  # exact in bfloat16
    return high.bfloat16(), (x.float() - high).bfloat16()


def tensor_core_mm(a, b):  # a (n, k) @ b (k, m), bfloat16, summed and returned in float32: the one CUDA-only part
    return torch.mm(a, b, out_dtype=torch.float32)


def masked_mean(x, mask, dim=None):
    """Mean of x where mask is 1; masked positions never leak, even inf or nan."""
    x = torch.where(mask.bool(), x, 0.0)
    return x.sum() / mask.sum().clamp(min=1) if dim is None else x.sum(dim) / mask.sum(dim).clamp(min=1)


def parse_args():
    """The flags; with --resume-from, a flag left out takes the run's own value (its args.json)."""
    about = f"{__doc__.splitlines()[0]} See docs/{os.path.basename(__file__)[:-3]}.md; the algorithm's flags come last."
    args = tyro.cli(Args, description=about)
    if args.resume_from is None or not os.path.exists(os.path.join(args.resume_from, "args.json")):
        return args  # a new run, or a --resume-from that checkpoint_to_resume refuses
    with open(os.path.join(args.resume_from, "args.json")) as f:
        saved = {k: v for k, v in json.load(f).items() if k in Args.__dataclass_fields__}
    return tyro.cli(Args, description=about, default=Args(**saved))


if __name__ == "__main__":
    main(parse_args())
