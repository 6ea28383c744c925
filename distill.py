"""On-policy distillation (GKD; Thinking Machines' on-policy distillation), in one file.

The student samples one completion a prompt from its current policy; a frozen teacher that shares its tokenizer
scores every prefix the student reached, and the student is moved toward the teacher there: no reward is trained on,
no value model. The default loss is, at each sampled prefix, the generalized Jensen-Shannon divergence over the whole
vocabulary at beta = 0, the forward KL (Agarwal et al. 2024, GKD, https://arxiv.org/abs/2306.13649, eq. 1), S = pi:

    loss = aggregate over tokens of JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M),   M = beta T + (1 - beta) S
    beta = 0 (the default): KL(T || S), the forward KL;  beta = 1: KL(S || T), the reverse KL, exact at each prefix

`--loss reverse-kl` is the sampled form instead (Thinking Machines 2025, On-Policy Distillation): PPO's clipped
surrogate over the sampled tokens, each token's advantage A_t = log pi_T(o_t) - log pi_old(o_t), the reverse KL's
sampled estimate at its prefix, negated. Where this file departs from the references: no KL to a reference model (the
teacher is the anchor); the teacher's log-probs at --temperature, as the student's (TRL's way); `--loss-agg` as
grpo.py's. See docs/distill.md; scale/distill.py is this file with what scale needs (its own decode loop, torchrun,
vLLM, LoRA, resume).

    python distill.py                                # bundled student, tiny-teacher/ as teacher, addition task, CPU
    python distill.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --teacher-path Qwen/Qwen2.5-1.5B-Instruct \
        --dataset openai/gsm8k --dataset-config main --max-new-tokens 512 --prompts-per-step 128 \
        --micro-batch-size 8 --learning-rate 1e-6 --num-eval 200 --eval-every 50 --gradient-checkpointing  # a GPU
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
    model_name_or_path: str = "tiny-adder"  # the starting policy: a local folder or a hub id
    dataset: str | None = None  # a .jsonl of prompt/answer (or question/answer) records, or a hub dataset
    task: Literal["addition", "addition-question"] = "addition"  # without --dataset: `47+8=`, or as a question
    dataset_config: str | None = None  # the hub dataset's configuration (GSM8K: `main`)
    train_split: str = "train"  # the hub dataset's training split
    eval_split: str = "test"  # the hub dataset's held-out split
    num_eval: int = 500  # held-out records: the hub split's first, or a .jsonl's last
    eval_every: int = 25  # greedy accuracy on the held-out prompts every this many steps, and at 0
    max_new_tokens: int = 8  # the longest completion, in tokens

    # Optimisation
    num_steps: int = 300  # training steps (each: one batch of rollouts, then its updates)
    learning_rate: float = 1e-4  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 64  # sequences per forward/backward pass

    # Algorithm specific arguments
    prompts_per_step: int = 256  # prompts per batch of rollouts, one completion each
    temperature: float = 1.0  # sampling temperature; log-probs are computed at the same temperature
    num_iterations: int = 1  # passes over each batch of rollouts (GRPO's mu)
    num_minibatches: int = 1  # optimizer steps per pass over a batch of rollouts
    teacher_path: str = "tiny-teacher"  # the frozen teacher: a local folder or a hub id, with the student's tokenizer
    loss: Literal["jsd", "reverse-kl"] = "jsd"
    """the generalized JSD over the vocabulary, or the policy gradient with A_t = log pi_T(o_t) - log pi_old(o_t)"""
    jsd_beta: float = 0.0  # --loss jsd: M = beta T + (1 - beta) S; 0 the forward KL(T || S), 1 the reverse (TRL's beta)
    clip_eps_low: float = 0.2  # the ratio is clipped below at 1 - clip_eps_low (--loss reverse-kl)
    clip_eps_high: float = 0.2  # the ratio is clipped above at 1 + clip_eps_high (--loss reverse-kl)
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """how token losses are averaged: GRPO's, DAPO's, or Dr. GRPO's (docs/grpo.md), with either --loss"""


# ---- ALGO LOGIC: on-policy distillation's losses and advantage
def generalized_jsd(logits, teacher_logits, beta=0.5):
    """The generalized Jensen-Shannon divergence between S = softmax(logits) and T = softmax(teacher_logits) at each
    prefix, in nats (GKD eq. 1; TRL's generalized_jsd_loss, its terms summed over the vocabulary):
        JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M),   M = beta T + (1 - beta) S
        beta = 0: KL(T || S) (forward);  beta = 1: KL(S || T) (reverse)
    logits (..., vocab) carries the gradient, teacher_logits (..., vocab) is a constant; both divided by the
    temperature already. Returns (...): (B, T) of (B, T, vocab), (n,) of (n, vocab).
    S = [0.5, 0.5], T = [0.9, 0.1] -> beta 0: 0.3681, 0.5: 0.1017, 1: 0.5108 (tests/test_distill.py works them out)
    """
    s, t = logits.log_softmax(dim=-1), teacher_logits.log_softmax(dim=-1)  # (..., vocab) each
    if beta == 0:
        return (t.exp() * (t - s)).sum(dim=-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(dim=-1)
    m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))  # log M
    return beta * (t.exp() * (t - m)).sum(dim=-1) + (1 - beta) * (s.exp() * (s - m)).sum(dim=-1)


def jsd_loss(jsd, reverse_kl, mask, loss_agg="seq-mean-token-mean", max_completion_length=None):
    """--loss jsd's loss: jsd (B, T), the generalized JSD at each sampled prefix (generalized_jsd, by token_jsd),
    averaged as loss_agg says (aggregate); reverse_kl (B, T), the exact reverse KL there (no gradient), goes to the
    stats as its mean over the tokens. mask (B, T) marks completion tokens."""
    stats = {"reverse_kl_exact": masked_mean(reverse_kl, mask.bool()).detach()}
    return aggregate(jsd, mask, loss_agg, max_completion_length), stats


def teacher_advantages(teacher_logprobs, old_logprobs, mask):
    """A_t = log pi_T(o_t) - log pi_old(o_t): the reverse KL's sampled estimate at token t's prefix, negated; no
    reward and no discount (a token gets its own term only), as tinker-cookbook's incorporate_kl_penalty.

    teacher_logprobs, old_logprobs, mask: (B, T). A constant (no gradient), 0 on padding.
    teacher = log [0.25, 0.5], old = log [0.5, 0.25] -> A = [-0.693, 0.693]: the teacher's likelier token goes up
    """
    m = mask.bool()
    return torch.where(m, teacher_logprobs - old_logprobs, 0.0).detach()  # (B, T)


def pg_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    loss_agg="seq-mean-token-mean",
    max_completion_length=None,
):
    """--loss reverse-kl's loss: PPO's clipped surrogate over the sampled tokens (grpo.py's grpo_loss without its KL
    term), to be minimised.

    logprobs (B, T) carries the gradient; old_logprobs and advantages (B, T) (teacher_advantages) are constants;
    mask (B, T) marks completion tokens. Per token, averaged as loss_agg says (aggregate):
        l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),   r_t = exp(logprobs_t - old_logprobs_t)
    """
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, 0.0)  # padding never reaches exp()
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = torch.where(m, advantages, 0.0)  # (B, T), 0 on padding
    clipped_ratio = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)  # (B, T)
    stats = {}
    loss = aggregate(per_token, m, loss_agg, max_completion_length)
    # a token is clipped when the clipped branch wins the min and so gives no gradient
    clipped = ((ratio < 1 - clip_eps_low) & (adv < 0)) | ((ratio > 1 + clip_eps_high) & (adv > 0))
    stats["clip_frac"] = masked_mean(clipped.float(), m).detach()
    stats["ratio"] = masked_mean(ratio, m).detach()
    return loss, stats


def aggregate(per_token, mask, loss_agg="seq-mean-token-mean", max_completion_length=None):
    """The loss from per-token losses (B, T) over the completion tokens, mask (B, T), as loss_agg says:
    "seq-mean-token-mean"     1/B sum_i 1/|o_i| sum_t l_it   (GRPO's)
    "token-mean"              1/sum_i |o_i| sum_i sum_t l_it (DAPO's; TRL's distillation "batchmean")
    "seq-mean-token-sum-norm" 1/B sum_i sum_t l_it / max_completion_length (Dr. GRPO's)
    """
    m = mask.bool()
    if loss_agg == "seq-mean-token-mean":
        return masked_mean(per_token, m, dim=1).mean()
    if loss_agg == "token-mean":
        return masked_mean(per_token, m)
    if loss_agg == "seq-mean-token-sum-norm":
        return (torch.where(m, per_token, 0.0).sum(dim=1) / max_completion_length).mean()
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


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

    # the student (the policy), and the frozen teacher, which must share its tokenizer
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    policy = load_model(args.model_name_or_path, args, device)
    stop_ids = stop_token_ids(tokenizer, policy)
    teacher = load_teacher(args, device, tokenizer, policy, stop_ids)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    train_records, eval_records = load_task(args)
    data_rng, shuffle_gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    batch_size = args.prompts_per_step
    print(f"{output_dir}: {len(train_records)} training prompts, {len(eval_records)} held out, device {device}")
    loss_args = dict(clip_eps_low=args.clip_eps_low, clip_eps_high=args.clip_eps_high)
    loss_args.update(loss_agg=args.loss_agg, max_completion_length=args.max_new_tokens)  # pg_loss's constants
    start, samples = time.time(), []  # samples: a few held-out prompts with their completions, for samples.jsonl
    metrics = evaluate(policy, tokenizer, eval_records, args, stop_ids, samples)
    teacher_accuracy = evaluate(teacher, tokenizer, eval_records, args, stop_ids, [])["eval/accuracy"]  # the goal
    log(output_dir, 0, {**metrics, "eval/teacher_accuracy": teacher_accuracy}, samples)
    for step in range(1, args.num_steps + 1):
        step_start = time.time()
        # 1. rollouts: one completion per prompt from the student's pi_old (distillation compares none with another)
        prompts = data_rng.choices(train_records, k=args.prompts_per_step)
        policy.eval()
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [r["prompt"] for r in prompts], device)  # (B, P)
        completion_ids = generate(
            policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, args.temperature, stop_ids
        )
        mask = completion_mask(completion_ids, stop_ids)  # (B, T): up to and including the first EOS
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + T)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
        prompt_len = prompt_ids.shape[1]
        texts = decode_completions(tokenizer, completion_ids, mask)  # for the logged reward and samples

        # 2. with --loss reverse-kl, the teacher scores every sampled token, once per batch, without gradient:
        # log pi_T(o_t) (B, T); with --loss jsd it scores every prefix over the whole vocabulary in step 3. With one
        # update per batch, pi_old is the policy being updated: its log-probs are the new ones, detached.
        one_update = args.num_iterations == 1 and args.num_minibatches == 1
        if args.loss == "reverse-kl":
            teacher_logprobs = batched_logprobs(
                teacher, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
            )
        if args.loss == "reverse-kl" and not one_update:
            old_logprobs = batched_logprobs(
                policy, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
            )

        # 3. num_iterations passes over the batch, each num_minibatches optimizer steps. A micro-batch's JSD at each
        # prefix; or with --loss reverse-kl its advantages A_t = log pi_T(o_t) - log pi_old(o_t) and clipped
        # surrogate. Its loss weighs its share of the minibatch's completions, or with DAPO's token mean, of its tokens
        policy.train()
        step_stats, grad_norms = [], []
        sampled_kl = torch.zeros_like(mask, dtype=torch.float32)  # (B, T): log pi_old(o_t) - log pi_T(o_t), logged
        passes = [torch.randperm(batch_size, generator=shuffle_gen) for _ in range(args.num_iterations)]
        for minibatch in torch.cat(passes).split(batch_size // args.num_minibatches):
            optimizer.zero_grad()
            for i in minibatch.split(args.micro_batch_size):
                if args.loss == "jsd":  # over the whole vocabulary: no ratio, no clipping (token_jsd)
                    jsd, sampled, reverse_kl = token_jsd(
                        policy, teacher, input_ids[i], attention_mask[i], prompt_len, args.temperature, args.jsd_beta
                    )
                    loss, stats = jsd_loss(jsd, reverse_kl, mask[i], args.loss_agg, args.max_new_tokens)
                else:
                    logprobs = token_logprobs(policy, input_ids[i], attention_mask[i], prompt_len, args.temperature)
                    old = logprobs.detach() if one_update else old_logprobs[i]
                    advantages = teacher_advantages(teacher_logprobs[i], old, mask[i])  # (b, T)
                    loss, stats = pg_loss(logprobs, old, advantages, mask[i], **loss_args)
                    sampled = -advantages
                sampled_kl[i] = sampled
                share = len(i) / len(minibatch)
                if args.loss_agg == "token-mean":
                    share = mask[i].sum() / mask[minibatch].sum()
                (loss * share).backward()
                # the loss as the optimizer weighed it; the token means (clip_frac, ratio, reverse_kl_exact) by tokens
                step_stats += [({"loss": loss.detach()}, share), (stats, mask[i].sum())]
            grad_norms.append(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
            optimizer.step()

        # 4. log, with the task's reward of the rollouts (logged only: the teacher is the signal), and evaluate
        evaluate_now = step % args.eval_every == 0 or step == args.num_steps
        if step % args.log_every == 0 or evaluate_now:
            grad_norm = torch.stack(grad_norms).mean().item()  # the mean over the optimizer steps, once they are done
            step_time = time.time() - step_start
            rewards = torch.tensor([reward_fn(t, r) for t, r in zip(texts, prompts)], device=device)  # (B,)
            stopped = torch.isin(completion_ids, torch.tensor(stop_ids, device=device)).any(dim=1)  # (B,)
            metrics = {
                **weighted_means(step_stats, "losses/"),
                "losses/reverse_kl": masked_mean(sampled_kl, mask),  # its sampled estimate, over the tokens
                "charts/reward": rewards.mean(),
                "charts/completion_length": mask.sum(dim=1).float().mean(),
                "charts/stopped": stopped.float().mean(),  # completions that ended with a stop token
                "losses/grad_norm": grad_norm,
                "charts/step_time": step_time,
                "charts/tokens_per_sec": mask.sum() / step_time,
                "charts/elapsed_time": time.time() - start,
            }
            samples = rollout_samples(prompts, texts, rewards, -masked_mean(sampled_kl, mask, dim=1))  # the mean A_t
            if evaluate_now:
                metrics.update(evaluate(policy, tokenizer, eval_records, args, stop_ids, samples))
            log(output_dir, step, metrics, samples)

    save(policy, tokenizer, output_dir)
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")


# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares ====
def check_args(args):
    """Stops at a flag outside its range, or at batch sizes that do not divide, before anything loads."""
    ranges = dict(prompts_per_step="> 0", temperature="> 0", num_iterations="> 0", num_minibatches="> 0")
    check_ranges(args, jsd_beta="in [0, 1]", clip_eps_low="in [0, 1]", clip_eps_high=">= 0", **ranges)
    minibatch = exact_div(args.prompts_per_step, args.num_minibatches, "--prompts-per-step")
    exact_div(minibatch, args.micro_batch_size, "a minibatch (--prompts-per-step / --num-minibatches)")


def load_teacher(args, device, tokenizer, policy, stop_ids):
    """The frozen teacher of --teacher-path, its weights float32 and computing in --dtype as the policy does; stops
    before training where it cannot score the student's tokens: another tokenizer (its size, or a probe text split
    otherwise), or an output layer smaller than the student's. A teacher whose stop tokens are not the student's
    scores the student's like any other token, and the student learns to stop late or never (or at once): a note
    names them."""
    path = args.teacher_path
    teacher_tokenizer = as_teacher(load_tokenizer, path, args.trust_remote_code)
    if len(teacher_tokenizer) != len(tokenizer):
        fail(
            f"--teacher-path {path}: its tokenizer has {len(teacher_tokenizer)} tokens, the student's "
            f"{len(tokenizer)}; the teacher must share --model-name-or-path's tokenizer"
        )
    probe = "Distil: 12+345=357, then stop.\n\tÜber 東京 🙂 <|im_end|></s>"
    if teacher_tokenizer(probe)["input_ids"] != tokenizer(probe)["input_ids"]:
        fail(
            f"--teacher-path {path}: its tokenizer splits a probe text otherwise than the student's; the teacher "
            "must share --model-name-or-path's tokenizer"
        )
    teacher = as_teacher(load_model, path, args, device, frozen=True).eval()
    rows, student_rows = (m.get_output_embeddings().weight.shape[0] for m in (teacher, policy))
    if rows < student_rows:
        fail(
            f"--teacher-path {path}: its output layer scores {rows} tokens, the student's {student_rows}; give a "
            "teacher that scores every token the student can sample"
        )
    teacher_stops = stop_token_ids(teacher_tokenizer, teacher)
    if teacher_stops != stop_ids:
        print(
            f"note: the teacher's stop tokens {teacher_stops} are not the student's {stop_ids}; the teacher scores "
            "the student's like any other token, and the student's length may drift (charts/completion_length, "
            "charts/stopped)"
        )
    return teacher


def as_teacher(load, path, *args, **kwargs):
    """load(path, ...), its one-line error naming --teacher-path (the shared loaders name --model-name-or-path)."""
    try:
        return load(path, *args, **kwargs)
    except SystemExit as e:
        fail(f"--teacher-path {path}: {str(e).split(': ', 2)[-1]}")


def load_task(args):
    """(train, held-out) records with a 'prompt' and an 'answer': the bundled task's, a .jsonl's or a hub dataset's."""
    if args.dataset is None:
        return addition_task(args.num_eval, args.task)
    if args.dataset.endswith(".jsonl"):
        records = [prompt_answer(r) for r in read_jsonl(args.dataset, ("prompt", "answer"), ("question", "answer"))]
        if len(records) <= args.num_eval:
            fail(f"--dataset {args.dataset}: {len(records)} records, but --num-eval {args.num_eval} are held out")
        return records[: -args.num_eval], records[-args.num_eval :]
    train = load_hub_split(args.dataset, args.dataset_config, args.train_split)
    held_out = load_hub_split(args.dataset, args.dataset_config, args.eval_split)[: args.num_eval]
    return [prompt_answer(r) for r in train], [prompt_answer(r) for r in held_out]


def token_jsd(policy, teacher, input_ids, attention_mask, prompt_len, temperature, beta):
    """At each completion token's prefix, (B, T) each: generalized_jsd between the policy's and the teacher's
    next-token distributions at temperature, with gradient; and without gradient the reverse KL's sampled estimate
    log pi(o_t) - log pi_T(o_t) and the reverse KL itself, the sum over the vocabulary of pi log(pi / pi_T). A
    teacher's output layer larger than the student's (padding rows: Qwen2.5-7B's against 0.5B's) is cut to the
    student's rows."""
    logits = completion_logits(policy, input_ids, attention_mask, prompt_len, temperature)  # (B, T, vocab)
    with torch.no_grad():
        teacher_logits = completion_logits(teacher, input_ids, attention_mask, prompt_len, temperature)
        teacher_logits = teacher_logits[..., : logits.shape[-1]]  # (B, T, vocab)
        log_ratio = logits.log_softmax(dim=-1) - teacher_logits.log_softmax(dim=-1)  # log pi - log pi_T
        sampled = log_ratio.gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)  # at the sampled tokens
        reverse_kl = generalized_jsd(logits, teacher_logits, 1.0)
    return generalized_jsd(logits, teacher_logits, beta), sampled, reverse_kl


def completion_logits(model, input_ids, attention_mask, prompt_len, temperature):
    """The logits (B, T, vocab) that predict the completion tokens input_ids[:, prompt_len:], float32, divided by the
    temperature; the positions as token_logprobs makes them."""
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    kept = input_ids.shape[1] - prompt_len + 1
    logits = model(input_ids, attention_mask=attention_mask, position_ids=positions, logits_to_keep=kept).logits
    return logits[:, :-1].float() / temperature


def rollout_samples(records, texts, rewards, advantages):
    """The first four rollouts of a step, for samples.jsonl: prompt, completion, answer, reward and advantage."""
    rows = zip(records[:4], texts, rewards.tolist(), advantages.tolist())
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
