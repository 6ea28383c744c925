"""A Bradley-Terry reward model, in one file: the scorer that RLHF's PPO optimises against.

A language model with a scalar head reads a prompt and a completion and gives one number, read at
the completion's last real token. It is trained on preference pairs so that the chosen completion
scores higher than the rejected one, under the Bradley-Terry model of preferences,
P(y_c > y_r | x) = sigmoid(r(x, y_c) - r(x, y_r)) (Ouyang et al. 2022, InstructGPT,
https://arxiv.org/abs/2203.02155, eq. 1; Bradley and Terry 1952):

    loss = -log sigmoid(r(x, y_c) - r(x, y_r) - m)        (mean over pairs; m = 0 unless a pair has a margin)

The model starts from the policy checkpoint with a new one-output head, so at step 0 the scores
are near-equal and the loss is near log 2. With no dataset the pairs come from the addition task as
InstructGPT collects its comparisons: K completions sampled from the starting policy per prompt,
every right one above every wrong one, and all pairs of a prompt in one element of a batch. See
docs/reward_model.md.

    python reward_model.py                           # bundled tiny model, addition pairs, CPU
    python reward_model.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --dataset my_pairs.jsonl \
        --max-prompt-length 512 --max-length 1024 --micro-batch-size 4 --learning-rate 1e-5 --num-steps 1000 \
        --num-eval 100 --gradient-checkpointing  # a real model on a GPU
"""

import itertools
import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Literal

import torch
import torch.distributed
import torch.distributed.checkpoint
import torch.utils.checkpoint
import transformers
import tyro
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # names the run: runs/<exp_name>__<seed>__<time>
    seed: int = 1  # seed of the experiment (data order, sampling, initialisation)
    torch_deterministic: bool = True  # `torch.use_deterministic_algorithms(True)` (`--no-torch-deterministic`: off)
    cuda: bool = True  # use CUDA when it is available (`--no-cuda` stays on the CPU)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """the compute dtype of the forward passes (trained weights stay float32): auto is float32 on the CPU, bfloat16
    on a GPU that has it; float16 is refused (it would need loss scaling)"""
    gradient_checkpointing: bool = False  # recompute activations in the backward pass to save memory
    fsdp: bool = False  # under torchrun: shard the models across the processes (FSDP2) instead of copying them (DDP)
    track: bool = False  # log metrics to Weights & Biases (`WANDB_MODE=offline` keeps them on disk)
    wandb_project_name: str = "onefile-rl"  # the wandb project
    wandb_entity: str | None = None  # the wandb entity (team or user)
    output_dir: str | None = None  # the run's folder (default runs/<run_name>); must not exist yet
    trust_remote_code: bool = False  # let transformers run code shipped with a hub model you trust
    log_every: int = 5  # write metrics and a console line every this many steps
    save_every: int = 0  # write a checkpoint into the run's folder every this many steps (0: none)
    keep_checkpoints: int = 2  # keep the newest this many checkpoints; older ones are deleted
    resume_from: str | None = None  # continue the run in this folder (from its last checkpoint, or this one)

    # Model and data
    model_name_or_path: str = "tiny-adder"  # the checkpoint the reward model starts from: a folder or a hub id
    dataset: str | None = None
    """None: pairs built from the addition task; a .jsonl file of prompt/chosen/rejected records (text, or
    TRL's conversational forms: docs/your_own_task.md); or a hub dataset name with those fields (needs `pip install
    datasets`)"""
    task: Literal["addition", "addition-question"] = "addition"
    """the built-in task when there is no --dataset: `addition` prompts `47+8=` (for the bundled model);
    `addition-question` asks `What is 47 + 8? Reply with the number only.` (for a chat model)"""
    dataset_config: str | None = None  # the hub dataset's configuration
    train_split: str = "train"  # the hub dataset's training split
    eval_split: str = "test"  # the hub dataset's held-out split (a .jsonl file: its last --num-eval records)
    num_eval: int = 500  # held-out prompts (the addition task) or pairs (a dataset)
    eval_every: int = 250  # evaluate every this many steps, and at 0
    max_new_tokens: int = 8  # the longest completion sampled for the pairs
    max_prompt_length: int | None = None
    """a longer prompt (its chat template included) keeps its last this many tokens; None: no limit"""
    max_length: int | None = None
    """a longer prompt + completion keeps this many tokens, the completion losing its end (EOS too); needs
    --max-prompt-length below it; None: no limit"""
    system_prompt: str | None = None  # a system message put before every plain-text prompt (needs a chat template)
    num_train_prompts: int = 9500  # addition prompts turned into training pairs (9500: all of them)
    pair_samples: int = 4  # completions sampled per addition prompt, to be judged right or wrong
    pair_temperature: float = 1.0  # the temperature those completions are sampled at
    chosen: Literal["answer", "sample", "sample-or-answer"] = "sample-or-answer"
    """the built-in pairs' chosen completion: the answer itself; or a right completion the policy sampled (in its
    own words; prompts where it sampled none give no pair); or such a completion, else the answer"""
    pairs: Literal["first", "all"] = "all"
    """the built-in pairs of a prompt: the first right against the first wrong completion; or every right one
    against every wrong one (InstructGPT's comparisons)"""

    # Optimisation
    num_steps: int = 3000  # optimizer steps
    learning_rate: float = 3e-4  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 32  # prompts (with all their pairs) per forward/backward pass; accumulation fills a batch

    # Algorithm specific arguments
    batch_size: int = 32  # prompts per optimizer step, each with all its pairs (a dataset's record: one pair)

    # to be filled in at runtime (not flags: the command line cannot set them)
    run_name: tyro.conf.Suppress[str] = ""  # exp_name__seed__time


# ---- ALGO LOGIC: the reward model's score and the Bradley-Terry loss -----------------------------
def last_token_scores(model, input_ids, attention_mask):
    """The score (B,) at each sequence's last real token: the last 1 of the attention mask.

    input_ids = [[PAD, 4, 7, 13, 5, EOS, PAD],    left-padded prompt, right-padded completion
    attention = [[0,   1, 1, 1,  1, 1,   0  ]]    -> the score is read at index 5, the EOS
    The mask, not the pad id, finds the token, so a pad id equal to the EOS id cannot move it.
    """
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T), as for the policy
    hidden = decoder_states(model, input_ids, attention_mask, position_ids)  # (B, T, hidden)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (attention_mask * positions).argmax(dim=1)  # (B,) the index of the last real token
    with autocast(model):  # the score head in the compute dtype, as the decoder ran
        scores = unwrap(model).score(hidden[torch.arange(len(last), device=last.device), last])  # (B, 1)
    return scores.squeeze(-1).float()  # (B,)


def bradley_terry_loss(chosen_scores, rejected_scores, margin=None):
    """-log sigmoid(r_c - r_r - m), the mean over pairs; all arguments (B,), margin optional.

    Equal scores give log 2. Stats: the share of pairs scored the right way round (a tie counts
    half) and the mean of r_c - r_r.
    """
    diff = chosen_scores - rejected_scores  # (B,)
    losses = -torch.nn.functional.logsigmoid(diff if margin is None else diff - margin)
    return losses.mean(), {"accuracy": pair_accuracy(diff.detach()), "margin": diff.detach().mean()}


def main(args):
    check_ranges(args, {**COMMON_RANGES, "max_length": ">= 2", "num_train_prompts": "> 0", "pair_samples": "> 0",
                        "pair_temperature": "> 0", "batch_size": "> 0"})
    if args.max_length is not None and (args.max_prompt_length is None or args.max_prompt_length >= args.max_length):
        fail(f"--max-length {args.max_length} needs --max-prompt-length below it (the prompt's share of it)")
    args.run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    device = setup(args)
    rank, world = rank_and_world()
    batch_size = per_process(args.batch_size, "--batch-size")  # this process's prompts of each batch
    args.micro_batch_size = min(args.micro_batch_size, batch_size)  # a micro-batch is at most all this process has
    exact_div(batch_size, args.micro_batch_size, "--batch-size (per process) by --micro-batch-size")
    output_dir = make_output_dir(args)  # before any model is loaded: a folder that cannot be made stops the run now

    # the pairs, made once at the start (the built-in task: the negatives sampled from the starting policy)
    tokenizer = load_tokenizer(args.model_name_or_path, args)
    train_pairs, eval_pairs = load_preferences(args, tokenizer, device)
    if args.dataset is not None:  # with --max-prompt-length and --max-length: what they cut
        report_truncation(tokenizer, train_pairs + eval_pairs, args, ("chosen", "rejected"))
    if not train_pairs or not eval_pairs:
        fail(f"no preference pairs to {'train' if not train_pairs else 'evaluate'} on; check --dataset")
    # the reward model: the same checkpoint with a new head of one output
    model = load_scorer(args.model_name_or_path, args, device, "the reward model", tokenizer)
    model = distribute(model, args)  # under torchrun: DDP, or FSDP2 with --fsdp (the new head: rank 0's)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    logger = Logger(args, output_dir)
    data_rng = random.Random(args.seed)
    print(f"{args.run_name}: {len(train_pairs)} training pairs, {len(eval_pairs)} held out, device {device}")

    def scores(tokens):
        """Scores of chosen (B,) and rejected (B,), through one forward pass.

        tokens: pair_batch's ids (2B, P + T), attention mask, prompt length and completion mask (2B, T).
        """
        input_ids, attention_mask, _, _ = tokens
        return last_token_scores(model, input_ids, attention_mask).chunk(2)

    @torch.no_grad()
    def eval_metrics():
        """Held-out pair accuracy, and a few held-out pairs with their scores, for samples.jsonl."""
        model.eval()
        pairs = share_of(eval_pairs)  # this process's share of the held-out pairs
        scored = [scores(pair_batch(tokenizer, pairs[i : i + args.micro_batch_size], device, args))
                  for i in range(0, len(pairs), args.micro_batch_size)]  # (chosen (b,), rejected (b,)) each
        chosen, rejected = (torch.cat(s) for s in zip(*scored))
        samples = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"], "chosen_score": c,
                    "rejected_score": r} for p, c, r in zip(pairs[:4], chosen.tolist(), rejected.tolist())]
        return {"eval/pair_accuracy": all_sum(pair_accuracy(chosen - rejected)).item() / world}, samples  # equal shares

    # a prompt's pairs stay together, one element of a batch (InstructGPT: this keeps the reward model from
    # over-fitting to the many comparisons that share a completion); consecutive pairs of one prompt are a group
    groups = [list(group) for _, group in itertools.groupby(train_pairs, key=lambda pair: pair["prompt"])]
    start = time.time()
    # a new run starts at 1; --resume-from puts back its checkpoint's weights and states, and goes on after it
    first_step, _ = resume(args, {"model": model}, optimizer, [data_rng])
    if first_step == 1:
        logger.log(0, *eval_metrics())
    for step in range(first_step, args.num_steps + 1):
        step_start = clock(device)
        batch = data_rng.choices(groups, k=args.batch_size)[rank * batch_size : (rank + 1) * batch_size]
        num_pairs = all_sum(torch.tensor(float(sum(map(len, batch))), device=device)) / world  # the processes' mean
        model.train()
        optimizer.zero_grad()
        step_stats, num_tokens = [], 0
        for i in range(0, batch_size, args.micro_batch_size):  # the same number of passes in every process
            pairs = [pair for group in batch[i : i + args.micro_batch_size] for pair in group]
            tokens = pair_batch(tokenizer, pairs, device, args)
            with gradient_sync(i + args.micro_batch_size >= batch_size, model):  # one all-reduce per optimizer step
                chosen, rejected = scores(tokens)  # chosen and rejected through one forward pass
                num_tokens += tokens[-1].sum().item()  # completion tokens of the 2b sequences
                margin = (torch.tensor([float(p["margin"]) for p in pairs], device=device) if "margin" in pairs[0]
                          else None)
                loss, stats = bradley_terry_loss(chosen, rejected, margin)
                if not torch.isfinite(loss):
                    fail(f"step {step}: the loss is {loss.item()}; lower --learning-rate or check the data")
                (loss * len(pairs) / num_pairs).backward()  # the micro-batches add up to the batch's pair mean
            step_stats.append({"loss": loss.detach(), **stats})
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()

        step_time = clock(device) - step_start
        evaluate_now = step % args.eval_every == 0 or step == args.num_steps
        if step % args.log_every == 0 or evaluate_now:
            metrics = {f"losses/{k}": torch.stack([s[k] for s in step_stats]).mean().item() for k in step_stats[0]}
            metrics.update({"charts/learning_rate": optimizer.param_groups[0]["lr"],
                            "losses/grad_norm": grad_norm.item(), "charts/step_time": step_time,
                            "charts/tokens_per_sec": num_tokens / step_time,
                            "charts/elapsed_time": time.time() - start})
            samples = []
            if evaluate_now:
                held_out, samples = eval_metrics()
                metrics.update(held_out)
            logger.log(step, metrics, samples)
        # every --save-every steps
        save_checkpoint(args, output_dir, step, tokenizer, {"model": model}, optimizer, [data_rng])

    save(model, tokenizer, output_dir)
    logger.close()
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")
    end_processes()


# ---- Helpers that only some of the files need: each is kept equal to its copy in the other files that have it ----
def load_scorer(path, args, device, what, tokenizer, flag="--model-name-or-path", frozen=False):
    """A sequence classifier with one output (a reward or value model) from `path`.

    On a language model's checkpoint the score head is new, as it should be: one line says so instead of
    transformers' load report. A report that lists any other weight, missing or unexpected, still shows. The
    tokenizer's pad id goes into the config: transformers' own pooling stops without one (Qwen2.5's configs have
    none), though the files read the score at the last token of the attention mask, not by the pad id.
    """
    held = []
    hold = held.append  # a logging filter that returns None keeps the record from the handlers
    report_logger = logging.getLogger("transformers.modeling_utils")
    report_logger.addFilter(hold)
    try:
        model = load_model(path, args, device, AutoModelForSequenceClassification, flag, frozen, num_labels=1)
    finally:
        report_logger.removeFilter(hold)
    head = {f"score.{name}" for name, _ in model.score.named_parameters()}
    for record in held:
        text = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())  # without the terminal's colours
        keys = re.findall(r"^(\S+)\s*\|", text, flags=re.M)[1:]  # the report's table: the first column, past "Key"
        if "LOAD REPORT" in text and keys and set(keys) <= head:
            print(f"{what}: a new score head on {path}, which has none (as expected for a language model)")
        else:
            report_logger.handle(record)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def completion_batch(tokenizer, prompts, completions, device, max_prompt_length=None, max_length=None):
    """Prompt (left-padded) then completion + EOS (right-padded): ids (B, P + T), mask (B, T). A prompt keeps its
    last max_prompt_length tokens, and a completion the tokens that fit in max_length with its prompt.

    prompts = ["1+2=", "10+20="], completions = ["3", "30"]
    input_ids = [[PAD, PAD, 1, +, 2, = | 3, EOS, PAD],       completion_mask = [[1, 1, 0],
                 [1,   0,   +, 2, 0, = | 3, 0,   EOS]]                          [1, 1, 1]]
    """
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device, max_prompt_length)  # (B, P)
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in completions]
    if max_length is not None:  # cut from the end: a completion cut short loses its EOS too
        ids = [c[: max_length - n] for c, n in zip(ids, prompt_mask.sum(dim=1).tolist())]
    length = max(len(c) for c in ids)
    completion_ids = torch.tensor([c + [tokenizer.pad_token_id] * (length - len(c)) for c in ids], device=device)
    mask = torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in ids], device=device)  # (B, T)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + T)
    return input_ids, torch.cat([prompt_mask, mask], dim=1), prompt_ids.shape[1], mask


@torch.no_grad()
def addition_pairs(policy, tokenizer, records, samples, max_new_tokens, device, temperature=1.0, chosen="answer",
                   pairs="first", chunk=64):
    """Hard negatives: per prompt, `samples` completions from the policy, judged by the task's verifier.

    {"prompt": "47+8=", "chosen": "55", "rejected": "54", "answer": "55"}: rejected is a wrong completion
    the policy really produced. chosen is the answer ("answer"); or a right completion the policy sampled
    ("sample": "47 + 8 = 55" from a chat model that writes its sums out; a prompt it never got right gives
    no pair); or such a completion where there is one and the answer where there is none ("sample-or-answer").
    pairs="first": one pair per prompt, the first chosen against the first wrong completion. pairs="all":
    every distinct chosen against every distinct wrong completion (InstructGPT's comparisons: right above
    wrong; two right or two wrong completions are a tie and give none), one prompt's pairs next to each other.
    A prompt gives no pair when the policy got it right every time.
    """
    policy.eval()
    stop_ids = stop_token_ids(tokenizer, unwrap(policy))
    records, out = share_of(records), []  # under torchrun: this process's share, put together below
    for i in range(0, len(records), chunk):
        part = records[i : i + chunk]
        prompts = [r["prompt"] for r in part for _ in range(samples)]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device)
        completion_ids = generate(policy, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids)
        texts = decode_completions(tokenizer, completion_ids, completion_mask(completion_ids, stop_ids))
        for j, r in enumerate(part):
            sampled = list(dict.fromkeys(t.strip() for t in texts[j * samples : (j + 1) * samples]))  # distinct
            wrong = [t for t in sampled if t and not reward_fn(t, r)]
            right = [t for t in sampled if reward_fn(t, r)] if chosen != "answer" else []
            right = right or ([r["answer"]] if chosen != "sample" else [])
            if pairs == "first":
                right, wrong = right[:1], wrong[:1]
            out += [{"prompt": r["prompt"], "chosen": c, "rejected": w, "answer": r["answer"]}
                    for c in right for w in wrong]
    if torch.distributed.is_initialized():  # every process gets every process's pairs, in rank order
        shares = [None] * rank_and_world()[1]
        torch.distributed.all_gather_object(shares, out)
        out = [pair for share in shares for pair in share]
    return out


def load_preferences(args, tokenizer, device, policy=None):
    """(train, eval) lists of {'prompt', 'chosen', 'rejected'} pairs; the built-in task's also hold 'answer'.

    The built-in pairs' negatives are sampled from `policy`, the starting policy (loaded here when not given). A
    file's or hub dataset's records may be conversational (preference_pair).
    """
    if args.dataset is None:
        policy = policy or load_model(args.model_name_or_path, args, device, frozen=True)
        # held-out prompts never appear in training
        train, held_out = chat_prompts(tokenizer, args, *addition_task(args.num_eval, args.task))
        return [addition_pairs(policy, tokenizer, records, args.pair_samples, args.max_new_tokens, device,
                               args.pair_temperature, args.chosen, args.pairs)
                for records in (train[: args.num_train_prompts], held_out)]
    if args.dataset.endswith(".jsonl"):
        records = read_jsonl(args.dataset, ("prompt", "chosen", "rejected"), ("chosen", "rejected"))
        if len(records) <= args.num_eval:
            fail(f"--dataset {args.dataset}: {len(records)} records, but --num-eval {args.num_eval} are held out")
        train, held_out = records[: -args.num_eval], records[-args.num_eval :]
    else:
        train = load_hub_split(args.dataset, args.dataset_config, args.train_split)
        held_out = load_hub_split(args.dataset, args.dataset_config, args.eval_split)[: args.num_eval]
    return chat_prompts(tokenizer, args, *([preference_pair(r, args.dataset) for r in rs] for rs in (train, held_out)))


def preference_pair(record, dataset):
    """{'prompt', 'chosen', 'rejected'} (and the record's other fields) with the completions as text, from a record
    in any of the forms TRL reads: text completions after a prompt; conversational completions, each one assistant
    message or the whole conversation (prompt messages first); or, with no 'prompt', two whole conversations whose
    common beginning is the prompt.

    {"chosen": [user "2+2?", assistant "4"], "rejected": [user "2+2?", assistant "5"]}
      -> {"prompt": [user "2+2?"], "chosen": "4", "rejected": "5"}
    """
    chosen, rejected = record["chosen"], record["rejected"]
    prompt = record.get("prompt")
    if prompt is None:  # the implicit prompt: the messages both conversations begin with
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            fail(f"--dataset {dataset}: a record with text completions needs a 'prompt' field")
        common = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        prompt = chosen[:common]
    start = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

    def reply(completion):
        if isinstance(completion, str):
            return completion
        rest = completion[len(start) :] if completion[: len(start)] == start else completion
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            fail(f"--dataset {dataset}: a conversational completion must be one assistant message after the prompt")
        return rest[0]["content"]

    return {**record, "prompt": prompt, "chosen": reply(chosen), "rejected": reply(rejected)}


def pair_batch(tokenizer, pairs, device, args):
    """Chosen then rejected, one sequence each, in one batch: rows i and i + len(pairs) share a prompt (cut to
    --max-prompt-length and --max-length)."""
    prompts = [p["prompt"] for p in pairs] * 2
    completions = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    return completion_batch(tokenizer, prompts, completions, device, args.max_prompt_length, args.max_length)


def pair_accuracy(margins):
    """Share of pairs whose chosen completion scores higher than the rejected one; a tie counts half."""
    return ((margins > 0).float() + 0.5 * (margins == 0).float()).mean()


# ==== Everything below this line is the same in every file, byte for byte (tests/test_shared.py checks it) ====
# ---- Errors and the flags' ranges ---------------------------------------------------------------
def fail(message):
    """Stop with a one-line error and exit status 1."""
    raise SystemExit(f"error: {message}")


def exact_div(a, b, what):
    """a // b, or a one-line error that names the flags to change when b does not divide a."""
    if b <= 0 or a % b != 0:
        fail(f"{what}: {a} does not divide by {b}; change one of these flags")
    return a // b


# the valid range of the numeric flags that every file has; each file adds its own (check_ranges)
COMMON_RANGES = {"seed": "in [0, 4294967295]", "log_every": "> 0", "num_eval": "> 0", "eval_every": "> 0",
                 "max_new_tokens": "> 0", "num_steps": "> 0", "learning_rate": "> 0", "weight_decay": ">= 0",
                 "max_grad_norm": "> 0", "micro_batch_size": "> 0", "max_prompt_length": "> 0",
                 "save_every": ">= 0", "keep_checkpoints": "> 0"}


def check_ranges(args, ranges):
    """Stops at the first flag outside its range, before anything is loaded or written; NaN and infinity
    are in no range. A range reads '> 0', '>= 2' or 'in [0, 0.5)', and may go on with a reason in words."""
    for name, spec in ranges.items():
        value = getattr(args, name)
        if value is None:  # an optional flag left unset (no limit)
            continue
        op, bounds = re.match(r"(>=|>|in) ([\[(][^\])]*[\])]|\S+)", spec).groups()
        if op == "in":
            low, high = (float(b) for b in bounds[1:-1].split(","))
            ok = ((low <= value if bounds[0] == "[" else low < value)
                  and (value <= high if bounds[-1] == "]" else value < high))
        else:
            ok = value >= float(bounds) if op == ">=" else value > float(bounds)
        if not (math.isfinite(value) and ok):
            finite = "" if math.isfinite(value) else "a finite number "
            fail(f"--{name.replace('_', '-')} {value}: must be {finite}{spec}")


# ---- The task and its reward --------------------------------------------------------------------
TASKS = {"addition": "{a}+{b}=",  # for the bundled character-level model
         "addition-question": "What is {a} + {b}? Reply with the number only."}  # for a chat model


def addition_task(num_eval, task="addition", max_operand=99):
    """The built-in task: a + b -> 'a+b' for 0 <= a, b <= max_operand, the prompt written as TASKS[task].

    All pairs are shuffled with a fixed seed and the first `num_eval` are held out, so the
    held-out set is the same for every run (and both tasks) and never overlaps the training prompts.
    """
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(0).shuffle(pairs)
    records = [{"prompt": TASKS[task].format(a=a, b=b), "answer": str(a + b)} for a, b in pairs]
    return records[num_eval:], records[:num_eval]


NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text):
    """The last number written in `text`, as a float ('1,234.5' -> 1234.5), or None."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def normalized(text):
    """Lower case, runs of white space as one space, without surrounding punctuation: ' Paris.' -> 'paris'."""
    return " ".join(text.lower().split()).strip(" .,;:!?\"'`*()[]{}")


def reward_fn(completion, record):
    """The reward of one completion: a float. Replace it to train on your own task (docs/your_own_task.md).

    completion: the sampled text, decoded without special tokens, up to its first stop token.
    record: the record its prompt came from: 'prompt', 'answer' and any other field of your data.
    An answer with a number in it: 1.0 when the last number of the completion equals the answer's, else 0.0 (a
    whole-number match: '5' scores 0 for '55', and so does '555'). Any other answer: 1.0 when the normalised
    completion is the normalised answer or ends with it as whole words ('The capital is Paris.' for 'Paris').
    """
    answer = str(record["answer"])
    if last_number(answer) is None:  # a text answer
        text, expected = normalized(completion), normalized(answer)
        return float(bool(expected) and (text == expected or text.endswith(" " + expected)))
    value = last_number(completion)
    return float(value is not None and value == last_number(answer))


# ---- Data ---------------------------------------------------------------------------------------
def is_conversation(value):
    """A list of {"role": ..., "content": ...} messages with text in both: a field in the conversational form."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def read_jsonl(path, *schemas):
    """The records of a JSONL file, each holding every field of one of `schemas` as text or as a list of messages
    (an answer may also be a number, not messages); a bad file stops the run with its line."""
    if not os.path.isfile(path):
        fail(f"--dataset {path}: no such file")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"--dataset {path}: line {number} is not valid JSON ({e.msg})")
            schema = next((s for s in schemas if isinstance(record, dict) and all(k in record for k in s)), None)
            if schema is None:
                missing = next(k for k in schemas[0] if not isinstance(record, dict) or k not in record)
                needs = " or ".join(" and ".join(schema) for schema in schemas)
                fail(f"--dataset {path}: line {number} has no field {missing!r} (each record needs {needs})")
            for k in schema:
                value = record[k]
                number_ok = k == "answer" and type(value) in (int, float) and math.isfinite(value)
                if not (isinstance(value, str) or number_ok or (k != "answer" and is_conversation(value))):
                    needs = "text or a finite number" if k == "answer" else "text or a list of role/content messages"
                    fail(f"--dataset {path}: line {number}: field {k!r} holds {json.dumps(value)[:40]}, "
                         f"where it needs {needs}")
            records.append(record)
    if not records:
        fail(f"--dataset {path}: the file holds no records")
    return records


def report_truncation(tokenizer, records, args, completion_keys=()):
    """One console line on what the length limits cut: the prompts longer than --max-prompt-length (they lose
    their first tokens) and, where a file has --max-length, the records whose prompt and completion (each of
    completion_keys) come to more (the completion loses its end). Nothing when no limit is set."""
    max_length = getattr(args, "max_length", None)
    if args.max_prompt_length is None and max_length is None:
        return
    cut_prompts = cut_completions = 0
    for i in range(0, len(records), 256):
        chunk = records[i : i + 256]
        prompt_lengths = tokenize_prompts(tokenizer, [r["prompt"] for r in chunk], "cpu")[1].sum(dim=1).tolist()
        for record, length in zip(chunk, prompt_lengths):
            cut_prompts += args.max_prompt_length is not None and length > args.max_prompt_length
            kept = min(length, args.max_prompt_length or length)
            cut_completions += max_length is not None and any(
                kept + len(tokenizer(str(record[k]), add_special_tokens=False)["input_ids"]) + 1 > max_length
                for k in completion_keys)
    line = f"--max-prompt-length {args.max_prompt_length}: {cut_prompts} of {len(records)} prompts cut"
    if max_length is not None:
        line += f"; --max-length {max_length}: {cut_completions} of {len(records)} records' completions cut"
    print(line)


def chat_prompts(tokenizer, args, *record_lists):
    """Each list of records with --system-prompt put before every plain-text prompt (a system message, then the
    prompt as the user's); a prompt that is already a list of messages goes through the chat template as given.
    Either needs a chat template: a tokenizer without one stops the run with a one-line error."""
    records = [r for rs in record_lists for r in rs]
    conversational = any(isinstance(r["prompt"], list) for r in records)
    if (conversational or args.system_prompt is not None) and not tokenizer.chat_template:
        what = f"--dataset {args.dataset}: conversational records" if conversational else "--system-prompt"
        fail(f"{what} need a tokenizer with a chat template, and {args.model_name_or_path or 'the new model'} has none")
    if args.system_prompt is None:
        return list(record_lists)
    system = {"role": "system", "content": args.system_prompt}
    return [[{**r, "prompt": [system, {"role": "user", "content": r["prompt"]}]} if isinstance(r["prompt"], str) else r
             for r in rs] for rs in record_lists]


def load_hub_split(name, config, split):
    try:
        import datasets
    except ImportError:
        fail(f"--dataset {name}: loading a hub dataset needs the datasets library: pip install datasets")
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:  # the datasets library raises many kinds; name the flag and the cause
        fail(f"--dataset {name}: could not load split {split!r} ({type(e).__name__}: {e})".splitlines()[0])


# ---- Model, tokenisation, generation and log-probs ----------------------------------------------
def from_pretrained(cls, path, args, flag="--model-name-or-path", **kwargs):
    """cls.from_pretrained(path), stopping with a one-line error when path is neither a folder nor a hub id."""
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.exists(path)):
        fail(f"{flag} {path}: no such folder")
    try:
        return cls.from_pretrained(path, trust_remote_code=args.trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        fail(f"{flag} {path}: not a model folder, and not loadable from the hub ({type(e).__name__}); "
             "the bundled model loads when you run from the repository root")


def compute_dtype(args, device):
    """The dtype the forward passes run in (--dtype); a one-line error for one that cannot train here."""
    if args.dtype == "float16":
        fail("--dtype float16: float16 training needs loss scaling, which these files leave out; use bfloat16")
    has_bfloat16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if args.dtype == "bfloat16" and not has_bfloat16:
        fail("--dtype bfloat16: this GPU has no bfloat16; use --dtype float32")
    bfloat16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda" and has_bfloat16)
    return torch.bfloat16 if bfloat16 else torch.float32


def load_model(path, args, device, model_class=AutoModelForCausalLM, flag="--model-name-or-path", frozen=False,
               **kwargs):
    """A model with float32 weights whose forward passes run in the compute dtype (--dtype), under torch.autocast.

    A model that is trained keeps float32 weights, and so float32 gradients and optimizer state: bfloat16 keeps 8
    bits of mantissa, and an AdamW step of 1e-6 on a weight of 0.02 would round back to the same weight. A frozen
    model (a reference, a reward model) is held the same way, so that it computes as the policy does: at step 0 their
    log-probs agree (docs/gpu.md). Dropout is off, so that the policy that samples is the one trained.
    """
    dtype = compute_dtype(args, device)
    model = from_pretrained(model_class, path, args, flag, dtype=torch.float32, **kwargs)
    model.requires_grad_(not frozen)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if args.gradient_checkpointing:  # only in train mode: generation keeps its KV cache. Nothing recomputed is random
        # (no dropout), so no random state is saved and put back around it (that rewinds another thread's draws)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                          "preserve_rng_state": False})
    return autocast_forward(model, device, dtype).to(device)


def autocast_forward(model, device, dtype):
    """The model, its forward pass (and so generate()'s) run under torch.autocast(dtype) unless dtype is float32."""
    model.compute_dtype = dtype  # for the layers applied by hand (output layer, score head): see autocast()
    if dtype != torch.float32:
        model.forward = torch.autocast(device.type, dtype=dtype)(model.forward)
    return model


def autocast(model):
    """torch.autocast in the model's compute dtype, for a layer of the model that a file applies by hand (none for
    a model that load_model did not make)."""
    dtype = getattr(unwrap(model), "compute_dtype", torch.float32)
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype, enabled=dtype != torch.float32)


def load_tokenizer(path, args):
    tokenizer = from_pretrained(AutoTokenizer, path, args)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer, model):
    """Every id that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted(set(ids) | {tokenizer.eos_token_id})


def tokenize_prompts(tokenizer, prompts, device, max_length=None):
    """Left-padded prompt ids and mask, (B, P). With a chat template, a text prompt is one user message and a list of
    messages goes through it as given, with the generation prompt added. A prompt of more than max_length tokens
    (--max-prompt-length) keeps its last max_length: its end is what a completion follows.

    prompts = ["1+2=", "10+20="]  ->  ids = [[PAD, PAD, 1, +, 2, =], [1, 0, +, 2, 0, =]], mask = [[0, 0, 1, 1, 1, 1],
                                                                                                [1, 1, 1, 1, 1, 1]]
    """
    if tokenizer.chat_template:
        conversations = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompts)["input_ids"]
    ids = [i[-max_length:] if max_length is not None else i for i in ids]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids], device=device)
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
    return input_ids, mask


@torch.no_grad()
def generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature, stop_ids, processors=()):
    """Completion ids (B, T), T <= max_new_tokens; `temperature=None` decodes greedily. `processors`: logits
    processors that see each step's logits before the temperature divides them (async_grpo.py's SampledLogprobs).

    Sampling is plain temperature sampling (no top-k, top-p or repetition penalty, whatever the
    model's own generation config says), so the tokens come from exactly the distribution that
    sequence_logprobs scores.
    """
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                              repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1,
                              remove_invalid_values=True)  # a diverged model reaches the NaN check
    if temperature is None:
        config.do_sample = False
    else:
        config.do_sample, config.temperature, config.top_k, config.top_p = True, temperature, 0, 1.0
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if sharded:  # FSDP: gather each layer once for the whole rollout, not again for every new token
        model.set_reshard_after_forward(False)
    try:  # one autocast over the whole rollout: each weight is cast to the compute dtype once, not at every token
        with autocast(model):
            out = unwrap(model).generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                                         logits_processor=transformers.LogitsProcessorList(processors),
                                         synced_gpus=torch.distributed.is_initialized())  # FSDP: every process
    finally:
        for module in sharded:  # then free the gathered layers, and go back to FSDP's own setting: every layer
            module.reshard()  # reshards after its forward, the root does not (its weights serve the loss next)
            module.set_reshard_after_forward(module is not model, recurse=False)
    return out[:, prompt_ids.shape[1] :]


def completion_mask(completion_ids, stop_ids):
    """1 for the completion's tokens up to and including its first stop token, 0 after it.

    completion_ids = [[5, 7, EOS, PAD],     -> mask = [[1, 1, 1, 0],
                      [6, 6, 6,   6  ]]                [1, 1, 1, 1]]   (no EOS: truncated)
    The padding that generate writes after EOS may be EOS itself; only the first one counts.
    """
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device)).long()  # (B, T)
    return (is_stop.cumsum(dim=1) - is_stop) == 0  # no stop token strictly before this one


def decode_completions(tokenizer, completion_ids, mask):
    return [tokenizer.decode(ids[m], skip_special_tokens=True) for ids, m in zip(completion_ids, mask)]


def linear_output_layer(model):
    """The model's output layer when its logits are that linear layer of the decoder's last hidden state.

    None when the head is not one nn.Linear, or when the model changes the logits after it (Gemma 2's
    soft-capping, Cohere's and Granite's scaling: their configs say so); sequence_logprobs then reads
    the model's own logits.
    """
    head = model.get_output_embeddings()
    config = model.config.get_text_config()
    changed = getattr(config, "final_logit_softcapping", None) is not None or any(
        getattr(config, name, None) not in (None, 1) for name in ("logit_scale", "logits_scaling", "output_multiplier"))
    return head if isinstance(head, torch.nn.Linear) and not changed else None


def token_logprobs(hidden, weight, bias, targets, temperature, with_entropy):
    """Log-probs (n,) of the targets (n,) at n positions, float32, and their entropies (n,) if asked.

    hidden (n, d) is the decoder's last hidden state, weight (vocab, d) and bias the output layer's, multiplied in
    float32 (logits rounded to bfloat16 would move a log-prob by up to 0.1); with weight None, hidden holds the
    logits (n, vocab) themselves.
    """
    if weight is not None:
        with torch.autocast(hidden.device.type, enabled=False):
            hidden = torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    logits = hidden.float() / temperature  # (n, vocab)
    logsumexp = torch.logsumexp(logits, dim=-1)  # (n,)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - logsumexp
    entropy = logsumexp - (logits.softmax(dim=-1) * logits).sum(dim=-1) if with_entropy else None
    return logprobs, entropy


def decoder_states(model, input_ids, attention_mask, position_ids):
    """The decoder's last hidden state (B, L, d), caught on its way through the model's own forward pass.

    The model's forward pass is where a DDP or FSDP wrapper does its work (FSDP gathers the weights there),
    so the hidden states are taken from it rather than from a call to the decoder alone. The model's own
    output is not used: a causal LM computes its logits at one position only.
    """
    states = []
    hook = unwrap(model).get_decoder().register_forward_hook(lambda module, inputs, out: states.append(out[0]))
    causal_lm = unwrap(model).get_output_embeddings() is not None
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
              **({"logits_to_keep": 1} if causal_lm else {}))
    finally:
        hook.remove()
    return states[0]


def sequence_logprobs(model, input_ids, attention_mask, prompt_len, temperature=1.0, with_entropy=False,
                      chunk_values=2**26):
    """Log-probs (B, T) of the completion tokens input_ids[:, prompt_len:], float32.

    input_ids = [PAD, PAD, 4, 7, 13 | 5, 5, EOS]   left-padded prompt | completion (T = 3)
    attention = [0,   0,   1, 1, 1  | 1, 1, 1  ]
    positions = [0,   0,   0, 1, 2  | 3, 4, 5  ]   from the mask, as generate() computes them
    The hidden state at position prompt_len - 1 + t predicts completion token t. Only those B x T
    states go through the output layer in float32, a chunk of positions at a time (at most chunk_values
    logits, 256 MB); divided by the sampling temperature, the logits give the distribution the
    token was sampled from: logsumexp over the vocabulary minus the chosen token's logit. No
    (B, T, vocab) tensor is built. With gradient, each chunk runs under torch.utils.checkpoint: its
    logits are freed once its log-probs are computed and recomputed in the backward pass, one chunk at
    a time, so neither pass ever holds more than one chunk's logits and their gradient.
    with_entropy: also return each position's entropy (B, T), logsumexp(z) - sum_v p_v z_v.
    """
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P + T)
    completion_len = input_ids.shape[1] - prompt_len
    head = linear_output_layer(unwrap(model))
    if head is not None:
        hidden = decoder_states(model, input_ids, attention_mask, position_ids)[:, prompt_len - 1 : -1]  # (B, T, d)
        weight, bias = head.weight, head.bias
    else:  # the logits are more than a linear layer: the model computes them, all of them at once
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                       logits_to_keep=completion_len + 1).logits[:, :-1]  # (B, T, vocab)
        weight = bias = None
    targets = input_ids[:, prompt_len:].reshape(-1)  # (B T,)
    hidden = hidden.reshape(len(targets), hidden.shape[-1])  # (B T, d)
    vocab_size = hidden.shape[-1] if weight is None else weight.shape[0]
    rows = max(1, chunk_values // vocab_size)
    chunks = []
    for i in range(0, len(targets), rows):
        inputs = (hidden[i : i + rows], weight, bias, targets[i : i + rows], temperature, with_entropy)
        if torch.is_grad_enabled() and len(targets) > rows:  # with one chunk, recomputing would save nothing
            chunks.append(torch.utils.checkpoint.checkpoint(token_logprobs, *inputs, use_reentrant=False,
                                                            preserve_rng_state=False))  # nothing random in it
        else:
            chunks.append(token_logprobs(*inputs))
    logprobs = torch.cat([c[0] for c in chunks]).view(-1, completion_len)  # (B, T)
    if not with_entropy:
        return logprobs
    return logprobs, torch.cat([c[1] for c in chunks]).view(-1, completion_len)  # (B, T), (B, T)


@torch.no_grad()
def batched_logprobs(model, input_ids, attention_mask, prompt_len, temperature, batch_size):
    """sequence_logprobs without gradient, batch_size rows per forward pass (old and reference)."""
    model.eval()
    return torch.cat([sequence_logprobs(model, input_ids[i : i + batch_size], attention_mask[i : i + batch_size],
                                        prompt_len, temperature) for i in range(0, len(input_ids), batch_size)])


def masked_mean(x, mask, dim=None):
    """Mean of x over positions where mask is 1; masked positions never leak, even inf or nan."""
    x = torch.where(mask.bool(), x, 0.0)
    if dim is None:
        return x.sum() / mask.sum().clamp(min=1)
    return x.sum(dim) / mask.sum(dim).clamp(min=1)


def weighted_means(records):
    """{name: sum_i w_i x_i / sum_i w_i}: a step's statistics from its micro-batches' (statistics, w_i) records.

    A token mean weighed by its micro-batch's token count gives the token mean of the whole step, where a plain
    mean of the micro-batches' means counts a short micro-batch's tokens more:
    [({"kl": 1.0}, 1), ({"kl": 0.0}, 3)] -> {"kl": 0.25}   (the plain mean: 0.5)
    """
    sums, totals = {}, {}
    for stats, weight in records:
        for name, value in stats.items():
            sums[name] = sums.get(name, 0.0) + float(value) * float(weight)
            totals[name] = totals.get(name, 0.0) + float(weight)
    return {name: sums[name] / totals[name] for name in sums}


@torch.no_grad()
def greedy_completions(model, tokenizer, records, max_new_tokens, stop_ids, device, max_prompt_length=None,
                       batch_size=128):
    """This process's share of the held-out records, batch_size at a time, with their greedy completions: yields
    (records, prompt ids (b, P), prompt mask (b, P), completion ids (b, T), completion mask (b, T)).

    Under torchrun each process takes every N-th record (a remainder of fewer than N records is left out, so that
    every process runs as many batches); the caller adds up its totals over the processes.
    """
    model.eval()
    records = share_of(records)
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [r["prompt"] for r in chunk], device, max_prompt_length)
        completion_ids = generate(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, None, stop_ids)
        yield chunk, prompt_ids, prompt_mask, completion_ids, completion_mask(completion_ids, stop_ids)


def evaluate(model, tokenizer, records, max_new_tokens, stop_ids, device, max_prompt_length=None, samples=None):
    """Greedy accuracy on held-out records: the mean reward of greedy completions (of all processes). A list given
    as samples gets this process's first 4 records as {prompt, completion, answer, reward} (for samples.jsonl)."""
    total = count = 0.0
    for chunk, _, _, completion_ids, mask in greedy_completions(model, tokenizer, records, max_new_tokens, stop_ids,
                                                                device, max_prompt_length):
        texts = decode_completions(tokenizer, completion_ids, mask)
        rewards = [reward_fn(t, r) for t, r in zip(texts, chunk)]
        if samples is not None and count == 0:
            samples += [{"prompt": r["prompt"], "completion": t, "answer": r["answer"], "reward": reward}
                        for r, t, reward in zip(chunk[:4], texts, rewards)]
        total += sum(rewards)
        count += len(chunk)
    right, count = all_sum(torch.tensor([total, count], dtype=torch.float64)).tolist()  # of all processes
    return right / count


# ---- Logging and saving -------------------------------------------------------------------------
def clock(device):
    """Seconds on a monotonic clock, once this thread's CUDA stream has finished the work queued on it (CUDA runs
    asynchronously: without the wait, a phase's time would show up in the next one)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # not the whole device: another thread's stream runs on
    return time.perf_counter()


class Logger:
    """Writes every logged step to metrics.jsonl, to wandb with --track, and a console line.

    Under torchrun every process calls log() with its own metrics; rank 0 writes their mean.
    """

    def __init__(self, args, output_dir):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.wandb = None
        if args.track and rank_and_world()[0] == 0:
            import wandb

            self.wandb = wandb
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=args.run_name,
                       config=vars(args), dir=output_dir)

    def log(self, step, metrics, samples=()):
        """samples: a few held-out records with the model's completions (rank 0's), for samples.jsonl."""
        rank, world = rank_and_world()
        values = all_sum(torch.tensor([float(v) for v in metrics.values()], dtype=torch.float64)) / world
        metrics = dict(zip(metrics, values.tolist()))
        if rank != 0:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
            if samples:
                with open(os.path.join(os.path.dirname(self.path), "samples.jsonl"), "a") as f:
                    f.writelines(json.dumps({"step": step, **row}) + "\n" for row in samples)
        except OSError as e:
            fail(f"--output-dir {os.path.dirname(self.path)}: cannot write its metrics ({e.strerror or e})")
        if self.wandb is not None:
            columns = list(samples[0]) if samples else []
            rows = [[row.get(c) for c in columns] for row in samples]
            tables = {"samples": self.wandb.Table(columns=columns, data=rows)} if samples else {}
            self.wandb.log({**metrics, **tables}, step=step)
        shown = ["charts/reward", "losses/loss", "eval/loss", "eval/accuracy", "eval/pair_accuracy", "charts/step_time"]
        print(f"step {step:5d}  " + "  ".join(f"{k} {metrics[k]:.4f}" for k in shown if k in metrics), flush=True)
        if samples:  # one of them, shortened
            print("  sample  " + "  ".join(f"{k} {v if isinstance(v, float) else repr(v)[:80]}"
                                           for k, v in samples[0].items()), flush=True)

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


def make_output_dir(args):
    """The run's new folder with its args.json, made before any model is loaded; a one-line error if it cannot be.
    With --resume-from: the folder of the run it continues (resume_dir)."""
    if args.resume_from is not None:
        return resume_dir(args)
    path = args.output_dir or os.path.join("runs", args.run_name)
    if os.path.exists(path):
        fail(f"--output-dir {path} already exists; a run never overwrites another, choose a new folder")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every process has looked before rank 0 makes it
    if rank_and_world()[0] == 0:
        try:
            os.makedirs(path)
            with open(os.path.join(path, "args.json"), "w") as f:
                json.dump(asdict(args), f, indent=2)
        except OSError as e:
            fail(f"--output-dir {path}: cannot create it ({e.strerror or e}); choose a folder you can write to")
    return path


def save(model, tokenizer, output_dir):
    """The whole model and the tokenizer, loadable with from_pretrained, written by rank 0.

    Under FSDP each process holds a shard: every process hands its shards in, and rank 0 gets the full weights.
    """
    state_dict = None
    if isinstance(model, FSDPModule):
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # a tied weight (input and output embedding) under its first name only, as save_pretrained writes it
        names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        state_dict = {name: tensor for name, tensor in state_dict.items() if name in names}
    if rank_and_world()[0] == 0:
        try:
            unwrap(model).save_pretrained(output_dir, state_dict=state_dict)
            tokenizer.save_pretrained(output_dir)
        except OSError as e:
            fail(f"--output-dir {output_dir}: cannot save the model there ({e.strerror or e})")


# ---- Checkpoints: --save-every writes them, --resume-from continues a run from one ------------------
# run/checkpoints/step_000040/ holds the trained models (each loadable with from_pretrained, in a folder of its
# name), state/ (their weights and the optimizer's state, written by torch.distributed.checkpoint: each process
# writes its own shards, so FSDP gathers nothing), rng_<rank>.pt (each process's random states) and
# trainer_state.json (the file, the step, the number of processes and the loop's own state), written last.
RESUME_MAY_CHANGE = {"num_steps", "log_every", "eval_every", "save_every", "keep_checkpoints", "resume_from",
                     "output_dir", "track", "wandb_project_name", "wandb_entity", "exp_name", "run_name"}


def complete_checkpoints(run_dir):
    """{step: folder} of the run's whole checkpoints (a folder is renamed into place only once it is whole)."""
    root = os.path.join(run_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return {int(n[len("step_"):]): os.path.join(root, n) for n in names if re.fullmatch(r"step_\d+", n)}


def run_folder(path):
    """The run that --resume-from PATH names: PATH itself, or the run whose checkpoints/ folder holds PATH."""
    path = os.path.normpath(path)
    return os.path.dirname(os.path.dirname(path)) if os.path.basename(os.path.dirname(path)) == "checkpoints" else path


def find_checkpoint(path):
    """(the run's folder, the checkpoint to resume from, its trainer_state) for --resume-from, or a one-line error."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        fail(f"--resume-from {path}: no such folder; give a run's folder or one of its checkpoints")
    if run_folder(path) != path:  # one checkpoint of a run
        run_dir, checkpoint = run_folder(path), path
    else:
        run_dir, steps = path, complete_checkpoints(path)
        if not os.path.exists(os.path.join(run_dir, "args.json")):
            fail(f"--resume-from {path}: not a run's folder (no args.json) nor one of its checkpoints")
        if not steps:
            fail(f"--resume-from {path}: the run has no complete checkpoint (a run writes them with --save-every)")
        checkpoint = steps[max(steps)]
    rank_files = [f"rng_{r}.pt" for r in range(rank_and_world()[1])]
    needed = ["trainer_state.json", os.path.join("state", ".metadata"), *rank_files]
    missing = [name for name in needed if not os.path.exists(os.path.join(checkpoint, name))]
    if missing or not re.fullmatch(r"step_\d+", os.path.basename(checkpoint)):
        fail(f"--resume-from {checkpoint}: an incomplete checkpoint (its save was cut short"
             + (f": no {missing[0]}" if missing else "") + "); resume from the run's folder, which takes its last "
             "complete checkpoint")
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    this = os.path.basename(__file__)
    if state["file"] != this:
        fail(f"--resume-from {checkpoint}: a checkpoint of {state['file']}, not of {this}; resume it with that file")
    if state["world_size"] != rank_and_world()[1]:
        fail(f"--resume-from {checkpoint}: written by {state['world_size']} processes, resumed by "
             f"{rank_and_world()[1]}; start as many (torchrun --nproc-per-node {state['world_size']})")
    later = [s for s in complete_checkpoints(run_dir) if s > state["step"]]
    if later:
        fail(f"--resume-from {checkpoint}: the run has a later checkpoint (step {max(later)}), which resuming from "
             "here would overwrite; resume from the run's folder, or delete the later checkpoints first")
    return run_dir, checkpoint, state


def resume_dir(args):
    """The folder of the run that --resume-from continues, checked before anything in it changes: the same file,
    number of processes and flags (but those of RESUME_MAY_CHANGE). Then its metrics.jsonl and samples.jsonl keep
    the lines up to the checkpoint's step; the later ones, which the resumed run writes again, move to
    metrics.discarded.jsonl and samples.discarded.jsonl."""
    run_dir, checkpoint, state = find_checkpoint(args.resume_from)
    with open(os.path.join(run_dir, "args.json")) as f:
        saved, given = json.load(f), asdict(args)
    differ = [k for k in sorted(set(saved) | set(given)) if k not in RESUME_MAY_CHANGE and saved.get(k) != given.get(k)]
    if differ:
        fail(f"--resume-from {run_dir}: flags differ from the run's args.json: " + ", ".join(
            f"--{k.replace('_', '-')} {given.get(k)} (the run's: {saved.get(k)})" for k in differ))
    if args.output_dir is not None and os.path.abspath(args.output_dir) != os.path.abspath(run_dir):
        fail(f"--output-dir {args.output_dir}: a resumed run stays in its own folder ({run_dir}); leave it out")
    if args.num_steps <= state["step"]:
        fail(f"--num-steps {args.num_steps}: the checkpoint is at step {state['step']}; ask for more steps")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every process has checked before rank 0 changes the folder
    if rank_and_world()[0] == 0:
        for name in ("metrics", "samples"):
            path = os.path.join(run_dir, f"{name}.jsonl")
            lines = open(path).readlines() if os.path.exists(path) else []
            after = [logged_step(line) > state["step"] for line in lines]
            with open(os.path.join(run_dir, f"{name}.discarded.jsonl"), "a") as f:
                f.writelines(line if line.endswith("\n") else line + "\n" for line, later in zip(lines, after) if later)
            with open(path, "w") as f:
                f.writelines(line for line, later in zip(lines, after) if not later)
        for name in os.listdir(os.path.join(run_dir, "checkpoints")):  # the parts of a save cut short
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(run_dir, "checkpoints", name))
    args.run_name = saved["run_name"]
    print(f"resuming {run_dir} from {checkpoint} (step {state['step']})")
    return run_dir


def logged_step(line):
    """The step of a line of metrics.jsonl or samples.jsonl; a line that a crash cut short counts as after any."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def random_states(generators):
    """The random states of Python, torch (CUDA too), numpy (vLLM's CUDA sampler seeds from it) and `generators`."""
    states = {"python": random.getstate(), "torch": torch.get_rng_state(),
              "generators": [g.getstate() if isinstance(g, random.Random) else g.get_state() for g in generators]}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # imported by transformers; these files do not import it themselves
        name, keys, *rest = sys.modules["numpy"].random.get_state()
        states["numpy"] = [name, torch.from_numpy(keys), *rest]
    return states


def set_random_states(states, generators):
    """Put back what random_states saved."""
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if torch.cuda.is_available() and "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states and "numpy" in sys.modules:
        name, keys, *rest = states["numpy"]
        sys.modules["numpy"].random.set_state((name, keys.numpy(), *rest))
    for generator, value in zip(generators, states["generators"]):
        generator.setstate(value) if isinstance(generator, random.Random) else generator.set_state(value)


def save_checkpoint(args, output_dir, step, tokenizer, models, optimizer, generators, **loop_state):
    """Every --save-every steps: a checkpoint of `models` ({name: model}), the optimizer, the random states of this
    process, of torch and of `generators` (random.Random or torch.Generator), and loop_state (JSON), in a folder
    that gets its name once all is written; then only the newest --keep-checkpoints stay."""
    if args.save_every == 0 or step % args.save_every != 0:
        return
    rank, world = rank_and_world()
    root = os.path.join(output_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    partial = final + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    model_state, optimizer_state = get_state_dict(torch.nn.ModuleDict(models), optimizer)
    torch.distributed.checkpoint.save({"models": model_state, "optimizer": optimizer_state},
                                      checkpoint_id=os.path.join(partial, "state"))
    for name, model in models.items():
        save(model, tokenizer, os.path.join(partial, name))
    torch.save(random_states(generators), os.path.join(partial, f"rng_{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every process has written its part
    if rank == 0:
        with open(os.path.join(partial, "trainer_state.json"), "w") as f:
            json.dump({"file": os.path.basename(__file__), "step": step, "world_size": world,
                       "state": loop_state}, f, indent=2)
        os.replace(partial, final)
        steps = complete_checkpoints(output_dir)
        for old in sorted(steps)[: -args.keep_checkpoints]:
            shutil.rmtree(steps[old])
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def resume(args, models, optimizer, generators):
    """(the first step to run, the loop state saved with the checkpoint): (1, {}) for a new run. With
    --resume-from, the checkpoint's weights, optimizer state and random states are put back first."""
    if args.resume_from is None:
        return 1, {}
    _, checkpoint, state = find_checkpoint(args.resume_from)
    model_state, optimizer_state = get_state_dict(torch.nn.ModuleDict(models), optimizer)  # what to load into
    saved = {"models": model_state, "optimizer": optimizer_state}
    torch.distributed.checkpoint.load(saved, checkpoint_id=os.path.join(checkpoint, "state"))
    set_state_dict(torch.nn.ModuleDict(models), optimizer, model_state_dict=saved["models"],
                   optim_state_dict=saved["optimizer"])
    set_random_states(torch.load(os.path.join(checkpoint, f"rng_{rank_and_world()[0]}.pt")), generators)
    return state["step"] + 1, state["state"]


def setup(args):
    """Seed everything, quiet the library's progress bars, join the other processes under torchrun, and pick the
    device. Each process gets seed + rank (its own samples); one process without torchrun is rank 0."""
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts
    cuda = torch.cuda.is_available() and args.cuda
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # one GPU per process on each machine
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        torch.distributed.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        if torch.distributed.get_rank() != 0:
            sys.stdout = open(os.devnull, "w")  # rank 0 alone prints; errors still reach stderr
    elif args.fsdp:
        fail("--fsdp shards the models across processes: start them with torchrun --nproc-per-node N")
    rank = rank_and_world()[0]
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.use_deterministic_algorithms(args.torch_deterministic)  # an op with no deterministic kernel stops the run
    compute_dtype(args, device)  # a --dtype that cannot train here stops the run now
    if getattr(args, "vllm", False):  # the files that sample have --vllm; a missing vLLM stops the run now
        try:
            import vllm  # noqa: F401
        except ImportError:
            fail("--vllm: vLLM is not installed; install requirements-vllm.txt (CUDA) or requirements-vllm-cpu.txt "
                 "(CPU) in a virtual environment of their own (README: Fast rollouts with vLLM)")
    return device


# ---- Many processes: torchrun (DDP or FSDP2) ----------------------------------------------------
# `python file.py` is one process, and every helper here then does nothing. `torchrun --nproc-per-node N
# file.py` starts N processes: each takes its share of every batch, the gradients are averaged over them,
# and rank 0 alone prints, logs and saves. The batch flags always mean the whole batch of all processes.
def rank_and_world():
    """(this process's rank, the number of processes): (0, 1) without torchrun."""
    if not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def per_process(n, flag):
    """Each process's share of n, the value of a batch flag, or a one-line error when it does not divide."""
    world = rank_and_world()[1]
    if n % world != 0:
        fail(f"{flag} {n} does not divide among {world} processes: use a multiple of {world}")
    return n // world


def share_of(items):
    """This process's items: every N-th one, from its rank on (a remainder of fewer than N is left out)."""
    rank, world = rank_and_world()
    return items[: len(items) - len(items) % world][rank::world]


def all_sum(x):
    """The sum of tensor x over the processes (x itself in one process)."""
    if not torch.distributed.is_initialized():
        return x
    nccl = torch.distributed.get_backend() == "nccl"
    y = x.detach().to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu", copy=True)
    torch.distributed.all_reduce(y)
    return y.to(x.device)


def end_processes():
    """Under torchrun: once every process is done, the group goes and this process exits at once, with status 0.

    A process whose work is done and written can still abort in the C++ destructors that run as the interpreter
    exits (SIGABRT, "terminate called without an active exception", with no Python frame and no other Python
    thread left), and torchrun then reports the whole run as failed: 1 of 40 two-process runs (reward_model.py,
    cispo.py --fsdp) without destroying the group, 2 of 77 cispo.py --fsdp runs with the group destroyed first.
    So the group goes, the output is flushed, and the process leaves without that teardown (os._exit). Without
    torchrun this does nothing.
    """
    if not torch.distributed.is_initialized():
        return
    torch.distributed.barrier()  # every process is done before the group goes
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def distribute(model, args):
    """The model spread over the processes; unchanged in one process.

    Default (DDP): each process keeps a whole copy, and the backward pass averages the gradients over the
    processes. --fsdp (FSDP2): the parameters of each decoder layer, then the rest, are split across the
    processes and gathered for the forward and backward passes one layer at a time, in the compute dtype; the
    gradients are averaged in float32 and split the same way, onto float32 shards. Either way every process
    starts from rank 0's weights. A frozen model under DDP is a plain copy in each process.
    """
    if not torch.distributed.is_initialized():
        return model
    for tensor in model.state_dict().values():
        torch.distributed.broadcast(tensor, src=0)
    if args.fsdp:
        precision = MixedPrecisionPolicy(param_dtype=model.compute_dtype, reduce_dtype=torch.float32)
        for module in model.modules():
            if type(module).__name__ in (model._no_split_modules or []):  # transformers' name for a decoder layer
                fully_shard(module, mp_policy=precision)
        fully_shard(model, mp_policy=precision)
        if model.can_generate():
            register_fsdp_forward_method(model, "generate")  # generate() gathers the layers as forward() does
        return model
    if not any(p.requires_grad for p in model.parameters()):
        return model
    return torch.nn.parallel.DistributedDataParallel(model)


def unwrap(model):
    """The transformers model inside a DDP wrapper (an FSDP2 model is its own wrapper)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def gradient_sync(last, *models):
    """Under DDP, the micro-batches of an optimizer step average their gradients over the processes once, in the
    last one's backward pass: the others run (forward and backward) under no_sync() and add up their gradients
    locally. Use it as `with gradient_sync(last, model):`. FSDP2 and one process: it does nothing."""
    stack = contextlib.ExitStack()
    for model in models:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
            stack.enter_context(model.no_sync())
    return stack


def parse_args():
    """The command line's flags; with --resume-from, a flag left out takes the run's own value (its args.json)."""
    args = sys.argv[1:]
    if "vllm" not in {field.name for field in fields(Args)} and any(a.startswith("--vllm") for a in args):
        fail(f"--vllm: {os.path.basename(__file__)} has no vLLM engine; the files that do (grpo.py, rloo.py, gspo.py, "
             "cispo.py, ppo.py) take --vllm")
    given = [a.split("=", 1)[1] if "=" in a else args[i + 1] if i + 1 < len(args) else ""
             for i, a in enumerate(args) if a.split("=", 1)[0] in ("--resume-from", "--resume_from")]
    path = run_folder(given[-1]) if given and given[-1] else None
    if path is None or not os.path.exists(os.path.join(path, "args.json")):
        return tyro.cli(Args)  # a new run; or a --resume-from that make_output_dir will say is wrong
    with open(os.path.join(path, "args.json")) as f:
        saved = json.load(f)
    known = {field.name for field in fields(Args)} - {"output_dir"}  # (another file's args.json has others)
    return tyro.cli(Args, default=Args(**{k: v for k, v in saved.items() if k in known}))


if __name__ == "__main__":
    main(parse_args())
