"""Proximal Policy Optimization (PPO) for RLHF, in one file.

InstructGPT's recipe (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155, after Ziegler et al. 2019 and
Stiennon et al. 2020): sample one completion per prompt, score it (the task's verifier, or reward_model.py's
model), and reward each token with a KL penalty to the frozen reference, plus the score on the last. A critic's
values and GAE give advantages; the policy and the critic take PPO's clipped losses (Schulman et al. 2017,
https://arxiv.org/abs/1707.06347) for several epochs:

    r_t = -beta (log pi_old(y_t) - log pi_ref(y_t)) + [t = last] score,   A = GAE(r, V_old),   R = A + V_old
    L_policy = mean_t max(-A_t rho_t, -A_t clip(rho_t, 1-eps, 1+eps)),   rho_t = pi(y_t) / pi_old(y_t)
    L_value = 0.5 mean_t max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2),   loss = L_policy + vf_coef L_value

With a reward model the score is shifted so that the starting policy's samples score 0 on average, and beta
follows Ziegler et al.'s controller towards a target KL. No entropy bonus; whitened advantages. See docs/ppo.md;
scale/ppo.py is this file with what scale needs (its own decode loop, torchrun, vLLM, LoRA, resume).

    python ppo.py                                    # bundled tiny model, addition task, CPU
    python sft.py --output-dir runs/sft              # the RLHF pipeline: SFT, a reward model, PPO against it
    python reward_model.py --model-name-or-path runs/sft --output-dir runs/rm
    python ppo.py --model-name-or-path runs/sft --reward-model-path runs/rm --output-dir runs/ppo
    python ppo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --dataset-config main \
        --max-new-tokens 512 --prompts-per-step 64 --micro-batch-size 8 --learning-rate 1e-6 --num-eval 200 \
        --eval-every 50 --gradient-checkpointing  # on a GPU
"""

import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig


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
    model_name_or_path: str = "tiny-adder"  # the starting policy: a local folder or a hub id
    reward_model_path: str | None = None
    """reward_model.py's model: the reward, and the critic's start (unset: the task's verifier)"""
    dataset: str | None = None
    """a .jsonl of prompt/answer (or question/answer) records, answers optional with a reward model; or a hub dataset"""
    task: Literal["addition", "addition-question"] = "addition"  # without --dataset: `47+8=`, or as a question
    dataset_config: str | None = None  # the hub dataset's configuration (GSM8K: `main`)
    train_split: str = "train"  # the hub dataset's training split
    eval_split: str = "test"  # the hub dataset's held-out split
    num_eval: int = 500  # held-out records: the hub split's first, or a .jsonl's last
    eval_every: int = 25  # evaluate on the held-out prompts every this many steps, and at 0
    max_new_tokens: int = 8  # the longest completion, in tokens

    # Optimisation
    num_steps: int = 300  # training steps (each: one batch of rollouts, then its updates)
    learning_rate: float | None = None  # AdamW's learning rate; unset: 1e-4, or 3e-5 with --reward-model-path
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 32  # sequences per forward/backward pass

    # Algorithm specific arguments
    prompts_per_step: int = 128  # prompts per batch of rollouts, one completion each
    temperature: float = 1.0  # sampling temperature; log-probs are computed at the same temperature
    ppo_epochs: int = 2  # passes over each batch of rollouts
    num_minibatches: int = 4  # optimizer steps per pass
    beta: float = 0.05  # weight of the per-token KL penalty in the reward (with --kl-target: its start)
    kl_target: float | None = None
    """beta adapts to keep the KL per completion near this (0: fixed beta); unset: 0, or 0.5 with --reward-model-path"""
    kl_horizon: int = 1000  # the KL controller's horizon, in completions: the larger, the slower beta moves
    normalize_reward: bool = True  # with a reward model: subtract the mean score of the first batch (InstructGPT)
    clip_eps: float = 0.2  # the policy ratio is clipped to [1 - clip_eps, 1 + clip_eps]
    clip_value: float = 0.2  # the value is clipped to [V_old - clip_value, V_old + clip_value]
    vf_coef: float = 0.1  # weight of the value loss
    gamma: float = 1.0  # discount over tokens
    lam: float = 0.95  # GAE's lambda
    missing_eos_penalty: float = 1.0  # with a reward model: subtracted from the score of a completion without EOS


# ---- ALGO LOGIC: values, rewards, GAE and PPO's two losses
def last_token_scores(model, input_ids, attention_mask):
    """The score (B,) at each sequence's last real token: the last 1 of the attention mask.

    input_ids = [[PAD, 4, 7, 13, 5, EOS, PAD],    left-padded prompt, right-padded completion
    attention = [[0,   1, 1, 1,  1, 1,   0  ]]    -> the score is read at index 5, the EOS
    The mask, not the pad id, finds the token, so a pad id equal to the EOS id cannot move it.
    """
    hidden = hidden_states(model, input_ids, attention_mask)  # (B, T, hidden), positions as for the policy
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (attention_mask * positions).argmax(dim=1)  # (B,) the index of the last real token
    return score_head(model, hidden[torch.arange(len(last), device=last.device), last])  # (B,)


def token_values(value_model, input_ids, attention_mask, prompt_len):
    """V(s_t) (B, T) for each completion token t: the value head on the hidden state that predicts token t."""
    hidden = hidden_states(value_model, input_ids, attention_mask)  # (B, P + T, hidden)
    return score_head(value_model, hidden[:, prompt_len - 1 : -1])  # (B, T)


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, beta):
    """Per-token rewards (B, T): -beta (logprobs - ref_logprobs) on every completion token, the score added
    on the last real one; 0 on padding. scores (B,); logprobs, ref_logprobs, mask (B, T).

    mask = [[1, 1, 1, 0]], scores = [1.0], kl = [[.1, .2, .3, x]] -> [[-.1b, -.2b, 1 - .3b, 0]]  (b = beta)
    """
    rewards = torch.where(mask.bool(), -beta * (logprobs - ref_logprobs), 0.0)  # (B, T)
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(dim=1)  # (B,) the last real token
    return rewards + torch.nn.functional.one_hot(last, mask.shape[1]) * scores[:, None]


def gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation: (advantages, returns = A + V), (B, T), 0 at padding.

    delta_t = r_t + gamma V_(t+1) - V_t,  A_t = delta_t + gamma lam A_(t+1),  with V and A = 0 after the
    last real token (never a bootstrap from padding)
    """
    m = mask.bool()
    rewards, values = torch.where(m, rewards, 0.0), torch.where(m, values, 0.0)
    next_advantage = next_value = torch.zeros_like(values[:, 0])
    advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(m[:, t], delta + gamma * lam * next_advantage, 0.0)
        next_value = values[:, t]
        advantages.append(next_advantage)
    advantages = torch.stack(advantages[::-1], dim=1)  # (B, T)
    return advantages, torch.where(m, advantages + values, 0.0)


def whiten(x, mask, eps=1e-8):
    """(x - mean) / std over the positions where mask is 1 (unbiased std), of every process; 0 elsewhere."""
    m = mask.bool()
    n, total = all_sum(torch.stack([m.sum().to(x.dtype), torch.where(m, x, 0.0).sum()]))
    mean = total / n.clamp(min=1)
    var = all_sum(torch.where(m, (x - mean) ** 2, 0.0).sum()) / (n - 1).clamp(min=1)
    return torch.where(m, (x - mean) * torch.rsqrt(var + eps), 0.0)


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps):
    """PPO's clipped policy loss, the mean over real tokens; logprobs carries the gradient; all (B, T).

    l_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps)),  rho_t = exp(logprobs_t - old_logprobs_t)
    """
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, 0.0)  # padding never reaches exp()
    ratio = torch.exp(log_ratio)
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss = masked_mean(torch.max(unclipped, clipped), m)
    return loss, {
        "clip_frac": masked_mean((clipped > unclipped).float(), m).detach(),
        "approx_kl": masked_mean((ratio - 1) - log_ratio, m).detach(),
    }


def ppo_value_loss(values, old_values, returns, mask, clip_value):
    """0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), the mean over real tokens; all (B, T)."""
    m = mask.bool()
    clipped_values = old_values + (values - old_values).clamp(-clip_value, clip_value)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_error, clipped_error), m)
    return loss, {"value_clip_frac": masked_mean((clipped_error > unclipped_error).float(), m).detach()}


def adaptive_kl_coef(beta, kl, target, num_completions, horizon):
    """Ziegler et al. 2019's proportional controller: the next beta after a batch whose mean KL was `kl`.

    e = clip(kl / target - 1, -0.2, 0.2),   beta <- beta (1 + e n / horizon),   n = completions in the batch
    beta = 0.1, kl = 12, target = 6, n = 100, horizon = 1000 -> e = 0.2 (clipped) -> 0.1 * 1.02 = 0.102
    """
    error = min(max(kl / target - 1, -0.2), 0.2)
    return beta * (1 + error * num_completions / horizon)


def explained_variance(returns, values, mask):
    """1 - Var(returns - values) / Var(returns) over the completion tokens (B, T): the share of the returns' variance
    that the critic's values explain (1: all of it; 0: no more than their mean does)."""
    residual = returns - values  # (B, T)
    unexplained = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return 1 - unexplained / masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)


# ---- The task and its reward: what a user edits for a task of their own (docs/your_own_task.md)
def addition_task(num_eval, task="addition"):
    """(train, held-out) records of a + b for 0 <= a, b <= 99, held out alike in every run."""
    prompts = {"addition": "{a}+{b}=", "addition-question": "What is {a} + {b}? Reply with the number only."}
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(0).shuffle(pairs)
    records = [{"prompt": prompts[task].format(a=a, b=b), "answer": str(a + b)} for a, b in pairs]
    return records[num_eval:], records[:num_eval]


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


def prompt_answer(record):
    """The record with a 'prompt' and an 'answer' (text or None), from prompt/answer or question/answer (GSM8K:
    the answer after '####'); other fields stay, for reward_fn."""
    answer = None if record.get("answer") is None else str(record["answer"])
    if "question" not in record:
        return {**record, "answer": answer}
    answer = None if answer is None else answer.split("####")[-1].strip()
    return {**record, "prompt": record["question"], "answer": answer}


def main(args):
    check_args(args)
    device = setup(args)
    output_dir = make_output_dir(args)
    learned = args.reward_model_path is not None  # a learned reward is exploitable: smaller steps, the KL held
    learning_rate, kl_target = reward_defaults(args)  # where unset, the defaults of the verifier or of a reward model

    # four models: the policy, its frozen reference, the reward (a model, or the verifier) and the critic
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    policy = load_model(args.model_name_or_path, args, device)
    stop_ids = stop_token_ids(tokenizer, policy)
    ref_policy = load_model(args.model_name_or_path, args, device, frozen=True)
    reward_model = None  # the verifier, reward_fn
    if learned:
        reward_model = load_scorer(
            args.reward_model_path, args, device, "the reward model", tokenizer, "--reward-model-path", frozen=True
        )
    value_model = load_value_model(args, device, tokenizer)
    params = [*policy.parameters(), *value_model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=args.weight_decay)
    train_records, eval_records = load_task(args)  # a reward model needs prompts only
    answers = all(r["answer"] is not None for r in train_records + eval_records)  # else no verifier, no accuracy
    data_rng, shuffle_gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    batch_size = args.prompts_per_step
    beta = args.beta  # it moves when kl_target > 0
    reward_bias = 0.0  # with a reward model (--normalize-reward): its first batch's mean score
    print(f"{output_dir}: {len(train_records)} training prompts, {len(eval_records)} held out, device {device}")
    start, samples = time.time(), []  # samples: a few held-out prompts with their completions, for samples.jsonl
    metrics = held_out_metrics(policy, reward_model, tokenizer, eval_records, args, stop_ids, answers, samples)
    log(output_dir, 0, metrics, samples)
    for step in range(1, args.num_steps + 1):
        step_start = time.time()
        # 1. rollouts: one completion per prompt from pi_old
        batch = data_rng.choices(train_records, k=args.prompts_per_step)
        policy.eval()
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [r["prompt"] for r in batch], device)  # (B, P)
        completion_ids = generate(
            policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, args.temperature, stop_ids
        )
        mask = completion_mask(completion_ids, stop_ids)  # (B, T): up to and including the first EOS
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + T)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
        prompt_len = prompt_ids.shape[1]

        # 2. score each completion: the verifier, or the reward model at the last real token
        texts = decode_completions(tokenizer, completion_ids, mask)
        if learned:
            scores = reward_model_scores(reward_model, tokenizer, [r["prompt"] for r in batch], texts)  # (B,)
            if step == 1 and args.normalize_reward:  # the starting policy's mean score is 0 from now on
                reward_bias = scores.mean().item()
            has_eos = torch.isin(completion_ids, torch.tensor(stop_ids, device=device)).any(dim=1)  # (B,)
            scores = scores - reward_bias - torch.where(has_eos, 0.0, args.missing_eos_penalty)
        else:
            scores = torch.tensor([reward_fn(t, r) for t, r in zip(texts, batch)], device=device)  # (B,)

        # 3. once per batch, without gradient: log-probs of pi_old and pi_ref, and the critic's values less the
        # reward's bias (a critic that starts as the reward model then predicts the normalised score)
        old_logprobs = batched_logprobs(
            policy, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
        )  # (B, T)
        ref_logprobs = batched_logprobs(
            ref_policy, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
        )  # (B, T)
        old_values = (
            batched_values(value_model, input_ids, attention_mask, prompt_len, args.micro_batch_size) - reward_bias
        )

        # 4. per-token rewards, GAE, returns (before whitening), whitened advantages; all (B, T)
        rewards = kl_penalized_rewards(scores, old_logprobs, ref_logprobs, mask, beta)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
        advantages = whiten(advantages, mask)

        # 5. ppo_epochs passes over the batch, each num_minibatches optimizer steps on both losses (token means: a
        # micro-batch weighs its share of the minibatch's tokens)
        policy.train()
        value_model.train()
        step_stats, grad_norms = [], []
        passes = [torch.randperm(batch_size, generator=shuffle_gen) for _ in range(args.ppo_epochs)]
        for minibatch in torch.cat(passes).split(batch_size // args.num_minibatches):
            optimizer.zero_grad()
            for i in minibatch.split(args.micro_batch_size):
                ids, att, m = input_ids[i], attention_mask[i], mask[i]
                logprobs, entropy = token_logprobs(policy, ids, att, prompt_len, args.temperature, with_entropy=True)
                values = token_values(value_model, ids, att, prompt_len) - reward_bias  # (b, T)
                pg_loss, pg_stats = ppo_policy_loss(logprobs, old_logprobs[i], advantages[i], m, args.clip_eps)
                vf_loss, vf_stats = ppo_value_loss(values, old_values[i], returns[i], m, args.clip_value)
                loss = pg_loss + args.vf_coef * vf_loss
                share = m.sum() / mask[minibatch].sum()
                (loss * share).backward()
                stats = {"loss": loss, "policy_loss": pg_loss, "value_loss": vf_loss, **pg_stats, **vf_stats}
                stats["entropy"] = masked_mean(entropy, m)  # the stats as numbers, without their graph:
                step_stats.append(({k: v.detach() for k, v in stats.items()}, m.sum()))  # token means, by tokens
            grad_norms.append(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
            optimizer.step()

        # 6. the adaptive KL coefficient for the next batch, from this batch's KL per completion
        kl = torch.where(mask, old_logprobs - ref_logprobs, 0.0).sum(dim=1)  # (B,)
        kl_coef = beta
        if kl_target > 0:
            beta = adaptive_kl_coef(beta, kl.mean().item(), kl_target, batch_size, args.kl_horizon)

        # 7. log, and evaluate on the held-out prompts
        evaluate_now = step % args.eval_every == 0 or step == args.num_steps
        if step % args.log_every == 0 or evaluate_now:
            grad_norm = torch.stack(grad_norms).mean().item()  # the mean over the optimizer steps, once they are done
            step_time = time.time() - step_start
            metrics = {
                **weighted_means(step_stats, "losses/"),
                "charts/score": scores.mean(),
                "losses/kl": kl.mean(),
                "charts/non_score_reward": (-kl_coef * kl).mean(),
                "charts/kl_coef": kl_coef,
                "losses/explained_variance": explained_variance(returns, old_values, mask),
                "charts/completion_length": mask.sum(dim=1).float().mean(),
                "losses/grad_norm": grad_norm,
                "charts/step_time": step_time,
                "charts/tokens_per_sec": mask.sum() / step_time,
                "charts/elapsed_time": time.time() - start,
            }
            if answers:  # the verifier's mean reward (with a reward model: beside its score)
                metrics["charts/reward"] = torch.tensor([reward_fn(t, r) for t, r in zip(texts, batch)]).mean()
            samples = rollout_samples(batch, texts, scores, masked_mean(advantages, mask, dim=1))  # token means
            if evaluate_now:
                metrics.update(
                    held_out_metrics(policy, reward_model, tokenizer, eval_records, args, stop_ids, answers, samples)
                )
            log(output_dir, step, metrics, samples)

    save(policy, tokenizer, output_dir)
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")


# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares ====
def check_args(args):
    """Stops at a flag outside its range, or at batch sizes that do not divide, before anything loads."""
    learning_rate, kl_target = reward_defaults(args)
    ranges = dict(prompts_per_step="> 0", temperature="> 0", ppo_epochs="> 0", num_minibatches="> 0", beta=">= 0")
    ranges.update(kl_horizon="> 0", kl_target=">= 0 (0: a fixed beta)", clip_value=">= 0")
    ranges.update(vf_coef=">= 0", gamma="in [0, 1]", lam="in [0, 1]", missing_eos_penalty=">= 0")
    check_ranges(replace(args, learning_rate=learning_rate, kl_target=kl_target), **ranges)
    if not 0 < args.clip_eps <= 1:  # a range open at one end, which check_ranges does not take
        fail(f"--clip-eps {args.clip_eps}: must be in (0, 1]")
    minibatch = exact_div(args.prompts_per_step, args.num_minibatches, "--prompts-per-step")
    exact_div(minibatch, args.micro_batch_size, "a minibatch (--prompts-per-step / --num-minibatches)")


def reward_defaults(args):
    """(learning rate, KL target): the flags, or where unset the defaults of the reward: 1e-4 and 0 (a fixed beta)
    with the verifier; 3e-5 and 0.5 with a reward model, which larger steps and a free KL let the policy exploit
    (docs/ppo.md)."""
    learned = args.reward_model_path is not None
    learning_rate = args.learning_rate
    if learning_rate is None:
        learning_rate = 3e-5 if learned else 1e-4
    kl_target = args.kl_target
    if kl_target is None:
        kl_target = 0.5 if learned else 0.0
    return learning_rate, kl_target


def load_scorer(path, args, device, what, tokenizer, flag="--model-name-or-path", frozen=False):
    """A sequence classifier with one output (a reward or value model), made as load_model makes a policy: float32
    weights, dropout off, its decoder under autocast; a new score head is said in one line."""
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.exists(path)):
        fail(f"{flag} {path}: no such folder")
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # our line, not transformers' load report
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            trust_remote_code=args.trust_remote_code,
            num_labels=1,
            dtype=torch.float32,
            output_loading_info=True,
        )
    except (OSError, ValueError) as e:
        fail(f"{flag} {path}: not a model folder, nor loadable from the hub ({type(e).__name__})")
    finally:
        transformers.logging.set_verbosity(level)
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if missing and all(k.startswith("score.") for k in missing) and not unexpected:
        print(f"{what}: a new score head on {path}, which has none (as expected for a language model)")
    elif missing or unexpected:
        print(f"{what} from {path}: missing weights {missing}, unexpected weights {unexpected}")
    model.config.pad_token_id = tokenizer.pad_token_id  # transformers' own pooling needs one
    model.requires_grad_(not frozen)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if args.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)  # < 5.24
        enable({"use_reentrant": False, "preserve_rng_state": False})  # no dropout to replay; no thread's draw rewound
    if args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda"):
        decoder = model.get_decoder()
        decoder.forward = torch.autocast(device.type, dtype=torch.bfloat16)(decoder.forward)
    return model.to(device)


def load_value_model(args, device, tokenizer):
    """The critic: the reward model with its head, or the policy's start with a new head at zero (V = 0 everywhere)."""
    if args.reward_model_path is not None:
        return load_scorer(args.reward_model_path, args, device, "the value model", tokenizer, "--reward-model-path")
    value_model = load_scorer(args.model_name_or_path, args, device, "the value model", tokenizer)
    torch.nn.init.zeros_(value_model.score.weight)
    return value_model


def hidden_states(model, input_ids, attention_mask):
    """The decoder's last hidden states (B, L, d), at generate()'s positions: what a score head reads."""
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model.get_decoder()(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    return out.last_hidden_state


def score_head(model, hidden):
    """The score head's one output (...,) on hidden states (..., d), in float32 like the policy's output layer."""
    return model.score(hidden.float()).squeeze(-1)


def all_sum(x):  # whiten's sum over the processes: here one (scale/ppo.py's sums over torchrun's)
    return x


def load_task(args):
    """(train, held-out) records with a 'prompt' and an 'answer': the bundled task's, a .jsonl's or a hub dataset's;
    with a reward model a record needs no answer (then None)."""
    if args.dataset is None:
        return addition_task(args.num_eval, args.task)
    if args.dataset.endswith(".jsonl"):
        needed = ("answer",) if args.reward_model_path is None else ()
        records = [prompt_answer(r) for r in read_jsonl(args.dataset, ("prompt", *needed), ("question", *needed))]
        if len(records) <= args.num_eval:
            fail(f"--dataset {args.dataset}: {len(records)} records, but --num-eval {args.num_eval} are held out")
        return records[: -args.num_eval], records[-args.num_eval :]
    train = load_hub_split(args.dataset, args.dataset_config, args.train_split)
    held_out = load_hub_split(args.dataset, args.dataset_config, args.eval_split)[: args.num_eval]
    return [prompt_answer(r) for r in train], [prompt_answer(r) for r in held_out]


@torch.no_grad()
def held_out_metrics(policy, reward_model, tokenizer, records, args, stop_ids, answers, samples):
    """The verifier's greedy accuracy on the held-out prompts (evaluate); with a reward model (not None) its mean raw
    score of the greedy completions, eval/score, and the accuracy where the records have answers."""
    if reward_model is None:
        return evaluate(policy, tokenizer, records, args, stop_ids, samples)
    policy.eval()
    texts, scores, device = [], [], next(policy.parameters()).device
    for i in range(0, len(records), 128):
        prompts = [r["prompt"] for r in records[i : i + 128]]
        ids, mask = tokenize_prompts(tokenizer, prompts, device)
        completion_ids = generate(policy, tokenizer, ids, mask, args.max_new_tokens, None, stop_ids)
        texts += decode_completions(tokenizer, completion_ids, completion_mask(completion_ids, stop_ids))
        scores += reward_model_scores(reward_model, tokenizer, prompts, texts[i:]).tolist()
    metrics = {"eval/score": sum(scores) / len(scores)}
    for r, t, s in zip(records[:4], texts, scores):
        verified = {"answer": r["answer"], "reward": reward_fn(t, r)} if answers else {}
        samples.append({"kind": "eval", "prompt": r["prompt"], "completion": t, "score": s, **verified})
    if answers:
        metrics["eval/accuracy"] = sum(reward_fn(t, r) for t, r in zip(texts, records)) / len(records)
    return metrics


@torch.no_grad()
def reward_model_scores(reward_model, tokenizer, prompts, completions):
    """The reward model's scores (B,) of the texts, read as reward_model.py trains it: completion_batch's prompt,
    the text re-tokenised, then EOS (whichever stop id ended the sampled ids)."""
    input_ids, attention_mask, _, _ = completion_batch(tokenizer, prompts, completions, reward_model.device)
    return last_token_scores(reward_model, input_ids, attention_mask)


def completion_batch(tokenizer, prompts, completions, device):
    """Prompt (left-padded) then completion + EOS (right-padded): ids and attention mask (B, P + T), P, and the
    completion mask (B, T).

    prompts = ["1+2=", "10+20="], completions = ["3", "30"]
    input_ids = [[PAD, PAD, 1, +, 2, = | 3, EOS, PAD],       completion_mask = [[1, 1, 0],
                 [1,   0,   +, 2, 0, = | 3, 0,   EOS]]                          [1, 1, 1]]
    """
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device)  # (B, P)
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in completions]
    width = max(len(c) for c in ids)
    completion_ids = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in ids], device=device)
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in ids], device=device)  # (B, T)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + T)
    return input_ids, torch.cat([prompt_mask, mask], dim=1), prompt_ids.shape[1], mask


@torch.no_grad()
def batched_values(value_model, input_ids, attention_mask, prompt_len, batch_size):
    """token_values (B, T) in batches of batch_size, without gradient."""
    value_model.eval()
    batches = torch.arange(len(input_ids)).split(batch_size)
    return torch.cat([token_values(value_model, input_ids[b], attention_mask[b], prompt_len) for b in batches])


def rollout_samples(records, texts, scores, advantages):
    """The first four rollouts of a step, for samples.jsonl: prompt, completion, answer, score (as reward) and the
    advantage's token mean."""
    rows = zip(records[:4], texts, scores.tolist(), advantages.tolist())
    keys = ("kind", "prompt", "completion", "answer", "reward", "advantage")
    return [dict(zip(keys, ("rollout", r["prompt"], t, r["answer"], x, a))) for r, t, x, a in rows]


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
