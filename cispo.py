"""Clipped Importance Sampling Policy Optimization (CISPO), in one file.

GRPO's rollouts and group-normalised advantages, with a REINFORCE-style loss whose importance
weight is clipped and stopped from carrying gradient: a token whose ratio leaves the clip range
keeps its gradient, only scaled by the clipped weight, where PPO and GRPO would drop it
(MiniMax 2025, MiniMax-M1, https://arxiv.org/abs/2506.13585, section 3):

    loss = -1/sum_i |o_i| sum_i sum_t sg(clip(r_it, 1-eps_low, 1+eps_high)) A_i log pi(o_it)
    r_it = pi(o_it) / pi_old(o_it),   A_i = (R_i - mean(R)) / std(R),   sg = stop gradient

As in the paper: no KL term, no effective lower bound on the weight (`--clip-eps-low` 1.0 clips
at 0, and a ratio is never negative), the token-level mean over the batch, and several optimizer
steps per batch of rollouts. `--clip-eps-high` 0.2 is verl's CISPO recipe's (the paper gives no
value). Where this file departs from it: the std gets eps=1e-4 added. See docs/cispo.md;
scale/cispo.py is this file with what scale needs (its own decode loop, torchrun, vLLM, LoRA, resume).

    python cispo.py                                  # bundled tiny model, addition task, CPU
    python cispo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k \
        --dataset-config main --max-new-tokens 512 --prompts-per-step 16 --micro-batch-size 8 \
        --learning-rate 1e-6 --num-eval 200 --eval-every 50 --gradient-checkpointing  # a real model on a GPU
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
    learning_rate: float = 5e-5  # AdamW's learning rate (1e-4 ended lower: docs/cispo.md)
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 64  # sequences per forward/backward pass

    # Algorithm specific arguments
    prompts_per_step: int = 32  # prompts per batch of rollouts
    group_size: int = 8  # completions sampled per prompt (G in the paper)
    temperature: float = 1.0  # sampling temperature; log-probs are computed at the same temperature
    num_iterations: int = 1  # passes over each batch of rollouts (the paper's mu)
    num_minibatches: int = 4  # optimizer steps per pass over a batch of rollouts
    clip_eps_low: float = 1.0  # the weight is clipped below at 1 - clip_eps_low (1.0: no lower bound)
    clip_eps_high: float = 0.2  # the weight is clipped above at 1 + clip_eps_high
    scale_rewards: bool = True  # divide by the group's std (`--no-scale-rewards`: Dr. GRPO)


# ---- ALGO LOGIC: CISPO's advantage and loss
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


def cispo_loss(logprobs, old_logprobs, advantages, mask, clip_eps_low, clip_eps_high):
    """CISPO's loss: the clipped, stop-gradient importance weight times A times log pi, token mean.

    logprobs (B, T) carries the gradient; old_logprobs (B, T) and advantages (B,), or (B, T) with an advantage for
    every token (scale/cispo.py's rollout correction), are constants; mask (B, T) marks completion tokens.
        w_it = sg(clip(exp(logprobs_it - old_logprobs_it), 1 - eps_low, 1 + eps_high))
        loss = -1/sum_i |o_i| sum_i sum_t w_it A_i logprobs_it
    d loss / d logprobs_it = -w_it A_i / sum_i |o_i|, also where the ratio is clipped.
    """
    m = mask.bool()
    ratio = torch.exp(torch.where(m, logprobs - old_logprobs, 0.0))  # (B, T), padding never reaches exp()
    weight = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high).detach()  # sg(clip(r))
    adv = advantages.reshape(len(advantages), -1)  # (B, 1): A_i, or (B, T): A_it
    loss = masked_mean(-weight * adv * logprobs, m)  # 1/sum_i |o_i| sum_i sum_t
    clipped = (ratio < 1 - clip_eps_low) | (ratio > 1 + clip_eps_high)  # weight clipped, gradient kept
    return loss, {"clip_frac": masked_mean(clipped.float(), m).detach(), "ratio": masked_mean(ratio, m).detach()}


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

    # the policy; CISPO has no KL term, so no reference model
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    policy = load_model(args.model_name_or_path, args, device)
    stop_ids = stop_token_ids(tokenizer, policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    train_records, eval_records = load_task(args)
    data_rng, shuffle_gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    batch_size = args.prompts_per_step * args.group_size
    print(f"{output_dir}: {len(train_records)} training prompts, {len(eval_records)} held out, device {device}")
    start, samples = time.time(), []  # samples: a few held-out prompts with their completions, for samples.jsonl
    log(output_dir, 0, evaluate(policy, tokenizer, eval_records, args, stop_ids, samples), samples)
    for step in range(1, args.num_steps + 1):
        step_start = time.time()
        # 1. rollouts: G completions per prompt from pi_old, group-contiguous (prompt 0 G times, then prompt 1...)
        prompts = data_rng.choices(train_records, k=args.prompts_per_step)
        group = [r for r in prompts for _ in range(args.group_size)]
        policy.eval()
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [r["prompt"] for r in group], device)  # (B, P)
        completion_ids = generate(
            policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, args.temperature, stop_ids
        )
        mask = completion_mask(completion_ids, stop_ids)  # (B, T): up to and including the first EOS
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + T)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
        prompt_len = prompt_ids.shape[1]

        # 2. reward each completion, and normalise the rewards within each group
        texts = decode_completions(tokenizer, completion_ids, mask)
        rewards = torch.tensor([reward_fn(t, r) for t, r in zip(texts, group)], device=device)  # (B,)
        advantages = group_advantages(rewards, args.group_size, scale=args.scale_rewards)  # (B,)

        # 3. log-probs of pi_old, once per batch, without gradient. With one update per batch, pi_old is the policy
        # being updated: its log-probs are the new ones, detached, and need no pass here.
        one_update = args.num_iterations == 1 and args.num_minibatches == 1
        if not one_update:
            old_logprobs = batched_logprobs(
                policy, input_ids, attention_mask, prompt_len, args.temperature, args.micro_batch_size
            )

        # 4. num_iterations passes over the batch, each num_minibatches optimizer steps; a micro-batch's loss weighs
        # its share of the minibatch's tokens (the loss is a token mean)
        policy.train()
        step_stats, grad_norms = [], []
        passes = [torch.randperm(batch_size, generator=shuffle_gen) for _ in range(args.num_iterations)]
        for minibatch in torch.cat(passes).split(batch_size // args.num_minibatches):
            optimizer.zero_grad()
            for i in minibatch.split(args.micro_batch_size):
                logprobs = token_logprobs(policy, input_ids[i], attention_mask[i], prompt_len, args.temperature)
                old = logprobs.detach() if one_update else old_logprobs[i]
                loss, stats = cispo_loss(logprobs, old, advantages[i], mask[i], args.clip_eps_low, args.clip_eps_high)
                share = mask[i].sum() / mask[minibatch].sum()
                (loss * share).backward()
                # the loss as the optimizer weighed it; the token means (clip_frac, ratio) by tokens
                step_stats += [({"loss": loss.detach()}, share), (stats, mask[i].sum())]
            grad_norms.append(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
            optimizer.step()

        # 5. log, and evaluate on the held-out prompts
        evaluate_now = step % args.eval_every == 0 or step == args.num_steps
        if step % args.log_every == 0 or evaluate_now:
            grad_norm = torch.stack(grad_norms).mean().item()  # the mean over the optimizer steps, once they are done
            step_time = time.time() - step_start
            metrics = {
                **weighted_means(step_stats, "losses/"),
                "charts/reward": rewards.mean(),
                "charts/reward_std": rewards.std(),
                "charts/zero_std_groups": (rewards.view(-1, args.group_size).std(dim=1) == 0).float().mean(),
                "charts/completion_length": mask.sum(dim=1).float().mean(),
                "losses/grad_norm": grad_norm,
                "charts/step_time": step_time,
                "charts/tokens_per_sec": mask.sum() / step_time,
                "charts/elapsed_time": time.time() - start,
            }
            samples = rollout_samples(group, texts, rewards, advantages)
            if evaluate_now:
                metrics.update(evaluate(policy, tokenizer, eval_records, args, stop_ids, samples))
            log(output_dir, step, metrics, samples)

    save(policy, tokenizer, output_dir)
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")


# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares ====
def check_args(args):
    """Stops at a flag outside its range, or at batch sizes that do not divide, before anything loads."""
    ranges = dict(prompts_per_step="> 0", group_size=">= 2 (CISPO compares the completions of a group)")
    ranges.update(temperature="> 0", num_iterations="> 0", num_minibatches="> 0")
    check_ranges(args, clip_eps_low="in [0, 1]", clip_eps_high=">= 0", **ranges)
    minibatch = exact_div(
        args.prompts_per_step * args.group_size, args.num_minibatches, "--prompts-per-step x --group-size"
    )
    exact_div(minibatch, args.micro_batch_size, "a minibatch (--prompts-per-step x --group-size / --num-minibatches)")


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
