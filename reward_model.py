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
docs/reward_model.md; scale/reward_model.py is this file with what scale needs (torchrun, LoRA,
resume, conversational records, long-record cuts).

    python reward_model.py                           # bundled tiny model, addition pairs, CPU
    python reward_model.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --dataset my_pairs.jsonl \
        --micro-batch-size 4 --learning-rate 1e-5 --num-steps 1000 --num-eval 100 \
        --gradient-checkpointing  # a real model on a GPU
"""

import itertools
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
    model_name_or_path: str = "tiny-adder"  # the checkpoint the reward model starts from: a folder or a hub id
    dataset: str | None = None  # a .jsonl of prompt/chosen/rejected text records, or a hub dataset
    task: Literal["addition", "addition-question"] = "addition"  # without --dataset: `47+8=`, or as a question
    dataset_config: str | None = None  # the hub dataset's configuration
    train_split: str = "train"  # the hub dataset's training split
    eval_split: str = "test"  # the hub dataset's held-out split
    num_eval: int = 500  # held-out records: the hub split's first, or a .jsonl's last
    eval_every: int = 250  # held-out pair accuracy every this many steps, and at 0
    max_new_tokens: int = 8  # the longest completion sampled for the addition pairs, in tokens
    num_train_prompts: int = 9500  # addition prompts turned into training pairs (9500: all of them)
    pair_samples: int = 4  # completions sampled per addition prompt, to be judged right or wrong
    pair_temperature: float = 1.0  # the temperature those completions are sampled at
    chosen: Literal["answer", "sample", "sample-or-answer"] = "sample-or-answer"
    """an addition pair's chosen completion: the answer; a right sample (none: no pair); or a right sample, else
    the answer"""
    pairs: Literal["first", "all"] = "all"
    """an addition prompt's pairs: its first right against its first wrong completion, or every right one against
    every wrong one (InstructGPT's comparisons)"""

    # Optimisation
    num_steps: int = 3000  # optimizer steps
    learning_rate: float = 3e-4  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 32  # prompts (each with all its pairs) per forward/backward pass

    # Algorithm specific arguments
    batch_size: int = 32  # prompts per optimizer step, each with all its pairs


# ---- ALGO LOGIC: the reward model's score and the Bradley-Terry loss
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


def bradley_terry_loss(chosen_scores, rejected_scores, margin=None):
    """-log sigmoid(r_c - r_r - m), the mean over pairs; all arguments (B,), margin optional.

    Equal scores give log 2. Stats: the share of pairs scored the right way round (a tie counts
    half) and the mean of r_c - r_r.
    """
    diff = chosen_scores - rejected_scores  # (B,)
    losses = -torch.nn.functional.logsigmoid(diff if margin is None else diff - margin)
    return losses.mean(), {"accuracy": pair_accuracy(diff.detach()), "margin": diff.detach().mean()}


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


def main(args):
    check_args(args)
    device = setup(args)
    output_dir = make_output_dir(args)

    # the pairs, made once at the start (without --dataset: the negatives sampled from the starting policy)
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    train_pairs, eval_pairs = load_preferences(args, tokenizer, device)
    if not train_pairs or not eval_pairs:
        fail(f"no preference pairs to {'train' if not train_pairs else 'evaluate'} on; check --dataset")
    # the reward model: the same checkpoint with a new head of one output
    model = load_scorer(args.model_name_or_path, args, device, "the reward model", tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    # a prompt's pairs stay together, one element of a batch (InstructGPT: this keeps the reward model from
    # over-fitting to the many comparisons that share a completion); consecutive pairs of one prompt are a group
    groups = [list(group) for _, group in itertools.groupby(train_pairs, key=lambda pair: pair["prompt"])]
    data_rng = random.Random(args.seed)
    print(f"{output_dir}: {len(train_pairs)} training pairs, {len(eval_pairs)} held out, device {device}")
    start = time.time()
    log(output_dir, 0, *held_out_metrics(model, tokenizer, eval_pairs, args))
    for step in range(1, args.num_steps + 1):
        step_start = time.time()
        # 1. a batch of prompts, each with all its pairs
        batch = data_rng.choices(groups, k=args.batch_size)
        num_pairs = sum(map(len, batch))
        model.train()
        optimizer.zero_grad()
        step_stats, num_tokens = [], 0
        for j in range(0, len(batch), args.micro_batch_size):
            pairs = [pair for group in batch[j : j + args.micro_batch_size] for pair in group]
            input_ids, attention_mask, _, mask = pair_batch(tokenizer, pairs, device)
            num_tokens += mask.sum()  # completion tokens of the 2b sequences
            # 2. the scores of chosen (b,) and rejected (b,), through one forward pass
            chosen, rejected = last_token_scores(model, input_ids, attention_mask).chunk(2)
            margin = None  # m, when the data gives each pair one
            if "margin" in pairs[0]:
                margin = torch.tensor([float(p["margin"]) for p in pairs], device=device)  # (b,)
            # 3. the loss, weighed so that the micro-batches add up to the batch's mean over pairs
            loss, stats = bradley_terry_loss(chosen, rejected, margin)
            (loss * len(pairs) / num_pairs).backward()
            step_stats.append(({"loss": loss.detach(), **stats}, len(pairs)))  # means over the batch's pairs
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()

        # 4. log, and evaluate on the held-out pairs
        evaluate_now = step % args.eval_every == 0 or step == args.num_steps
        if step % args.log_every == 0 or evaluate_now:
            step_time = time.time() - step_start
            metrics = {
                **weighted_means(step_stats, "losses/"),
                "losses/grad_norm": grad_norm,
                "charts/step_time": step_time,
                "charts/tokens_per_sec": num_tokens / step_time,
                "charts/elapsed_time": time.time() - start,
            }
            held_out, samples = {}, []
            if evaluate_now:
                held_out, samples = held_out_metrics(model, tokenizer, eval_pairs, args)
            log(output_dir, step, {**metrics, **held_out}, samples)

    save(model, tokenizer, output_dir)
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")


# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares ====
def check_args(args):
    """Stops at a flag outside its range, or at batch sizes that do not divide, before anything loads."""
    check_ranges(args, num_train_prompts="> 0", pair_samples="> 0", pair_temperature="> 0", batch_size="> 0")
    exact_div(args.batch_size, args.micro_batch_size, "--batch-size")


def load_preferences(args, tokenizer, device):
    """(train, held-out) lists of {'prompt', 'chosen', 'rejected'} text pairs: --dataset's records, or addition pairs
    (with 'answer') whose negatives the starting policy samples."""
    if args.dataset is None:
        policy = load_model(args.model_name_or_path, args, device, frozen=True)
        train, held_out = addition_task(args.num_eval, args.task)  # held-out prompts never appear in training
        return [
            addition_pairs(policy, tokenizer, records, device, args)
            for records in (train[: args.num_train_prompts], held_out)
        ]
    if args.dataset.endswith(".jsonl"):
        records = read_jsonl(args.dataset, ("prompt", "chosen", "rejected"))
        if len(records) <= args.num_eval:
            fail(f"--dataset {args.dataset}: {len(records)} records, but --num-eval {args.num_eval} are held out")
        return records[: -args.num_eval], records[-args.num_eval :]
    train = load_hub_split(args.dataset, args.dataset_config, args.train_split)
    held_out = load_hub_split(args.dataset, args.dataset_config, args.eval_split)[: args.num_eval]
    return [text_pairs(records, f"--dataset {args.dataset}") for records in (train, held_out)]


def text_pairs(records, source):
    """The records, if each has text 'prompt', 'chosen' and 'rejected' fields; else a one-line error."""
    for n, record in enumerate(records):
        if not all(isinstance(record.get(k), str) for k in ("prompt", "chosen", "rejected")):
            fail(
                f"{source}: record {n} needs text fields prompt, chosen and rejected (scale/reward_model.py takes chat)"
            )
    return records


@torch.no_grad()
def addition_pairs(policy, tokenizer, records, device, args, chunk=64):
    """Hard negatives: per prompt, --pair-samples completions of the policy, judged by reward_fn; a pair is a right
    one (chosen) above a wrong one the policy really produced (rejected). --chosen: the answer; a right sample (a
    prompt never got right gives no pair); or a right sample, else the answer. --pairs: the first chosen against the
    first wrong, or every distinct chosen against every distinct wrong (InstructGPT's comparisons), a prompt's pairs
    next to each other; a prompt always answered right gives none.
    {"prompt": "47+8=", "chosen": "55", "rejected": "54", "answer": "55"}"""
    policy.eval()
    stop_ids, samples, out = stop_token_ids(tokenizer, policy), args.pair_samples, []
    for i in range(0, len(records), chunk):
        part = records[i : i + chunk]
        prompt_ids, prompt_mask = tokenize_prompts(
            tokenizer, [r["prompt"] for r in part for _ in range(samples)], device
        )
        completion_ids = generate(
            policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, args.pair_temperature, stop_ids
        )
        texts = decode_completions(tokenizer, completion_ids, completion_mask(completion_ids, stop_ids))
        for j, r in enumerate(part):
            sampled = list(dict.fromkeys(t.strip() for t in texts[j * samples : (j + 1) * samples]))  # distinct
            wrong = [t for t in sampled if t and not reward_fn(t, r)]
            right = [t for t in sampled if reward_fn(t, r)] if args.chosen != "answer" else []
            if not right and args.chosen != "sample":
                right = [r["answer"]]
            if args.pairs == "first":
                right, wrong = right[:1], wrong[:1]
            out += [
                {"prompt": r["prompt"], "chosen": c, "rejected": w, "answer": r["answer"]} for c in right for w in wrong
            ]
    return out


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


def hidden_states(model, input_ids, attention_mask):
    """The decoder's last hidden states (B, L, d), at generate()'s positions: what a score head reads."""
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model.get_decoder()(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    return out.last_hidden_state


def score_head(model, hidden):
    """The score head's one output (...,) on hidden states (..., d), in float32 like the policy's output layer."""
    return model.score(hidden.float()).squeeze(-1)


@torch.no_grad()
def held_out_metrics(model, tokenizer, eval_pairs, args):
    """Held-out pair accuracy, and a few held-out pairs with their scores, for samples.jsonl."""
    model.eval()
    scores, device = [], next(model.parameters()).device
    for i in range(0, len(eval_pairs), args.micro_batch_size):
        input_ids, attention_mask, _, _ = pair_batch(tokenizer, eval_pairs[i : i + args.micro_batch_size], device)
        scores.append(last_token_scores(model, input_ids, attention_mask).view(2, -1))  # (2, b): chosen, rejected
    chosen, rejected = torch.cat(scores, dim=1)  # (n,), (n,)
    keys = ("prompt", "chosen", "rejected", "chosen_score", "rejected_score")
    rows = zip(eval_pairs[:4], chosen.tolist(), rejected.tolist())
    samples = [dict(zip(keys, (p["prompt"], p["chosen"], p["rejected"], c, r))) for p, c, r in rows]
    return {"eval/pair_accuracy": pair_accuracy(chosen - rejected)}, samples


def pair_accuracy(margins):
    """Share of pairs whose chosen completion scores higher than the rejected one; a tie counts half."""
    return ((margins > 0).float() + 0.5 * (margins == 0).float()).mean()


def pair_batch(tokenizer, pairs, device):
    """completion_batch of the chosen, then the rejected completions: rows i and i + len(pairs) share a prompt."""
    completions = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    return completion_batch(tokenizer, [p["prompt"] for p in pairs] * 2, completions, device)


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
