"""Supervised fine-tuning (SFT), in one file: the first stage of the RLHF pipeline.

The model learns to continue each prompt with its reference completion by minimising the
cross-entropy of the completion tokens only; the prompt and the padding carry no loss:

    loss = -1/sum_i |y_i| sum_i sum_t log pi(y_it | x_i, y_i<t)

With no flags, this file builds the project's bundled starting policy from nothing: a tiny
Llama-architecture model (from a config) and a character-level tokenizer (saved as a real
Hugging Face tokenizer), trained briefly on the built-in addition task. It is stopped early on
purpose, so that its held-out greedy accuracy leaves room for reinforcement learning to show.
`--model-name-or-path` starts from any causal LM instead, and `--dataset` takes a JSONL file of
prompt/completion records. See docs/sft.md; scale/sft.py is this file with what scale needs
(torchrun, LoRA, resume, conversational records).

    python sft.py                                 # the bundled model's recipe, on the CPU
    python sft.py --output-dir tiny-adder-again   # ...into a folder of your choice (tiny-adder/ is the bundled one)
    python sft.py --model-name-or-path Qwen/Qwen2.5-0.5B --dataset my_sft_data.jsonl --num-steps 1000 \
        --batch-size 16 --micro-batch-size 4 --learning-rate 1e-5 --num-eval 100  # on a GPU
"""

import json
import math
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import transformers
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast


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
    model_name_or_path: str | None = None  # a local folder or a hub id; None builds the tiny model from a config
    dataset: str | None = None  # a .jsonl of prompt/completion records (text)
    task: Literal["addition", "addition-question", "chain", "tool", "guess"] = "addition"  # without --dataset: `47+8=`,
    # as a question, or `7+3-2+5=` answered step by step, `7+3=10 10-2=8 8+5=13` (process_grpo.py's start), `347*86=`
    # answered with a calculator's call or without (tool_grpo.py's start: docs/tool_grpo.md), or games of guess the
    # number played at random inside the answers' interval (env_grpo.py's start: docs/env_grpo.md)
    num_eval: int = 500  # held-out records: the task's first, or a .jsonl's last
    eval_every: int = 100  # held-out loss (and greedy accuracy) every this many steps, and at 0
    max_new_tokens: int = 8  # the longest completion generated when evaluating

    # Optimisation
    num_steps: int = 300  # optimizer steps
    learning_rate: float = 1e-3  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 64  # sequences per forward/backward pass

    # Algorithm specific arguments
    batch_size: int = 64  # sequences per optimizer step
    hidden_size: int = 128  # the tiny model's width (only when it is built from a config)
    num_layers: int = 2  # the tiny model's transformer blocks
    num_heads: int = 4  # the tiny model's attention heads
    extra_tokens: list[str] | None = None  # the tiny model's tokens beyond `0123456789+-= ` (None: its --task's)
    num_train: int = 50000  # the built-in --task's training records


# ---- ALGO LOGIC: the tiny model and the loss of SFT
def build_tiny_model(args):
    """A character-level tokenizer and a small randomly initialised Llama, for the addition task.

    The tokenizer is a tokenizer.json written here (one token per character, decoded without
    spaces), so it is a real Hugging Face tokenizer that AutoTokenizer loads offline.
    """
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    extra = TASK_TOKENS.get(args.task, []) if args.extra_tokens is None else args.extra_tokens
    vocab = {token: i for i, token in enumerate(specials + list("0123456789+-= ") + extra)}
    words = [t for t in extra if len(t) > 1]  # matched whole, before the text is split into characters
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": None,
        "post_processor": None,
        "added_tokens": [
            {
                "id": vocab[t],
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": t in specials,
            }
            for t in specials + words
        ],
        "pre_tokenizer": {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated", "invert": False},
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            json.dump(spec, f)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(folder, "tokenizer.json"),
            pad_token="<pad>",
            bos_token="<bos>",
            eos_token="<eos>",
            unk_token="<unk>",
        )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
    )
    return tokenizer, AutoModelForCausalLM.from_config(config)


def sft_loss(logprobs, mask):
    """Cross-entropy of the completion tokens: -sum(log pi * mask) / sum(mask). logprobs, mask: (B, T)."""
    return -masked_mean(logprobs, mask)


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

    # the model: built from a config (the default), or loaded from a folder or the hub
    if args.model_name_or_path is None:
        tokenizer, model = tiny_model(args, device)
    else:
        tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
        model = load_model(args.model_name_or_path, args, device)
    stop_ids = stop_token_ids(tokenizer, model)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    # the data: the addition task's answers as completions, or prompt/completion records
    train_records, eval_records = load_sft_data(args)
    data_rng = random.Random(args.seed)
    print(f"{output_dir}: {num_params} parameters, {len(train_records)} training records, device {device}")
    start = time.time()
    log(output_dir, 0, *held_out_metrics(model, tokenizer, eval_records, args, stop_ids))
    for step in range(1, args.num_steps + 1):
        step_start = time.time()
        # 1. a batch of demonstrations: each prompt (left-padded) then its completion and EOS (right-padded)
        batch = data_rng.choices(train_records, k=args.batch_size)
        model.train()
        optimizer.zero_grad()
        prompts, completions = [r["prompt"] for r in batch], [r["completion"] for r in batch]
        input_ids, attention_mask, prompt_len, mask = completion_batch(tokenizer, prompts, completions, device)
        # 2. the cross-entropy of the completion tokens; the micro-batches add up to the token mean of the batch,
        # each weighed by its share of the batch's tokens
        batch_loss = 0.0
        for i in torch.arange(args.batch_size).split(args.micro_batch_size):
            logprobs = token_logprobs(model, input_ids[i], attention_mask[i], prompt_len)  # (b, T)
            loss = sft_loss(logprobs, mask[i])
            share = mask[i].sum() / mask.sum()
            (loss * share).backward()
            batch_loss += loss.item() * share.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()

        # 3. log, and evaluate on the held-out records
        evaluate_now = step % args.eval_every == 0 or step == args.num_steps
        if step % args.log_every == 0 or evaluate_now:
            step_time = time.time() - step_start
            metrics = {
                "losses/loss": batch_loss,
                "losses/grad_norm": grad_norm,
                "charts/step_time": step_time,
                "charts/tokens_per_sec": mask.sum() / step_time,
                "charts/elapsed_time": time.time() - start,
            }
            samples = []
            if evaluate_now:
                held_out, samples = held_out_metrics(model, tokenizer, eval_records, args, stop_ids)
                metrics.update(held_out)
            log(output_dir, step, metrics, samples)

    save(model, tokenizer, output_dir)
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")


# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares ====
def check_args(args):
    """Stops at a flag outside its range, or at batch sizes that do not divide, before anything loads."""
    check_ranges(args, batch_size="> 0", hidden_size="> 0", num_layers="> 0", num_heads="> 0", num_train="> 0")
    if args.model_name_or_path is None:
        exact_div(args.hidden_size, args.num_heads, "--hidden-size by --num-heads")
    if args.extra_tokens is not None:  # each new to the tiny model's vocabulary, and given once
        taken = {"<pad>", "<bos>", "<eos>", "<unk>", "", *"0123456789+-= "}
        if taken & set(args.extra_tokens) or len(set(args.extra_tokens)) < len(args.extra_tokens):
            fail(f"--extra-tokens {' '.join(args.extra_tokens)}: each must be new to the vocabulary, and given once")
    exact_div(args.batch_size, min(args.micro_batch_size, args.batch_size), "--batch-size by --micro-batch-size")


def tiny_model(args, device):
    """build_tiny_model's tokenizer and model, the model saved and loaded again so that load_model prepares it as it
    prepares any (float32 weights, dropout off, --dtype, --gradient-checkpointing)."""
    tokenizer, model = build_tiny_model(args)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return tokenizer, load_model(folder, args, device)


def load_sft_data(args):
    """(train, held-out) records {'prompt', 'completion'}: a built-in task's (its held-out records keep their 'answer'),
    or --dataset's records (its last --num-eval held out)."""
    if args.dataset is None and args.task == "chain":  # the steps are the completion
        train_records, eval_records = chain_task(args.num_eval, args.num_train)
        train_records = [{"prompt": r["prompt"], "completion": r["steps"]} for r in train_records]
        eval_records = [{**r, "completion": r["steps"]} for r in eval_records]
    elif args.dataset is None and args.task == "tool":  # every other record calls the calculator, the rest answer
        train_records, eval_records = multiplication_task(args.num_eval, args.num_train)
        completions = [r["trace"] if i % 2 == 0 else r["answer"] for i, r in enumerate(train_records)]
        train_records = [{"prompt": r["prompt"], "completion": c} for r, c in zip(train_records, completions)]
        eval_records = [{**r, "completion": r["trace"]} for r in eval_records]
    elif args.dataset is None and args.task == "guess":  # a game's transcript is the completion
        train_records, eval_records = guess_task(args.num_eval, args.num_train)
    elif args.dataset is None:
        train_records, eval_records = addition_task(args.num_eval, args.task)
        train_records = [{"prompt": r["prompt"], "completion": r["answer"]} for r in train_records[: args.num_train]]
    else:  # its last --num-eval, not trained on
        records = read_jsonl(args.dataset, ("prompt", "completion"))
        if len(records) <= args.num_eval:
            fail(f"--dataset {args.dataset}: {len(records)} records, but --num-eval {args.num_eval} are held out")
        train_records, eval_records = records[: -args.num_eval], records[-args.num_eval :]
    return train_records, eval_records


def chain_task(num_eval, num_train=50000):
    """(train, held-out) records of a number below 100 and three digits added or subtracted in turn, held out alike
    in every run, a step an equation: {"prompt": "47+8-3+5=", "answer": "57", "steps": "47+8=55 55-3=52 52+5=57"}."""
    rng, records, seen = random.Random(0), [], set()
    while len(records) < num_eval + num_train:
        numbers, ops = (
            [rng.randrange(100), *[rng.randrange(10) for _ in range(3)]],
            [rng.choice("+-") for _ in range(3)],
        )
        prompt = "".join(f"{n}{op}" for n, op in zip(numbers, (*ops, "=")))
        if prompt in seen:
            continue
        seen.add(prompt)
        value, steps = numbers[0], []
        for op, n in zip(ops, numbers[1:]):
            result = value + n if op == "+" else value - n
            steps.append(f"{value}{op}{n}={result}")
            value = result
        records.append({"prompt": prompt, "answer": str(value), "steps": " ".join(steps)})
    return records[num_eval:], records[:num_eval]


def multiplication_task(num_eval, num_train=50000):
    """(train, held-out) records of a 3-digit number times a 2-digit one, held out alike in every run, with the trace
    of a calculator's call: {"prompt": "347*86=", "answer": "29842",
    "trace": "<call>347*86</call><result>29842</result>29842"}."""
    rng, records, seen = random.Random(0), [], set()
    while len(records) < num_eval + num_train:
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        trace = f"<call>{a}*{b}</call><result>{a * b}</result>{a * b}"
        records.append({"prompt": f"{a}*{b}=", "answer": str(a * b), "trace": trace})
    return records[num_eval:], records[:num_eval]


def guess_task(num_eval, num_train=50000, high=31, max_guesses=5):
    """(train, held-out) games of guess the number (env_grpo.py's), each played by a guesser that picks at random
    inside the interval the answers leave, as its transcript: after the prompt "?", each guess and EOS, then the
    answer "+" (the secret is higher), "-" (lower) or "=" (right), for at most max_guesses guesses:
    {"prompt": "?", "completion": "32<eos>+48<eos>-40<eos>-35<eos>+37<eos>="}, the same in every run."""
    rng, records = random.Random(0), []
    while len(records) < num_eval + num_train:
        secret, low, top, transcript = rng.randint(1, high), 1, high, ""
        for _ in range(max_guesses):
            guess = rng.randint(low, top)
            if guess < secret:
                low, answer = guess + 1, "+"
            elif guess > secret:
                top, answer = guess - 1, "-"
            else:
                answer = "="
            transcript += f"{guess}<eos>{answer}"
            if answer == "=":
                break
        records.append({"prompt": "?", "completion": transcript})
    return records[num_eval:], records[:num_eval]


@torch.no_grad()
def held_out_metrics(model, tokenizer, eval_records, args, stop_ids):
    """Held-out loss, and greedy accuracy where the records have answers (the built-in tasks); and a few held-out
    prompts with the model's greedy completion (and the answer and its reward, or the record's completion)."""
    model.eval()
    device, losses = next(model.parameters()).device, []
    for i in range(0, len(eval_records), args.micro_batch_size):
        chunk = eval_records[i : i + args.micro_batch_size]
        targets = [r.get("completion", r.get("answer")) for r in chunk]  # the addition task: the answer
        prompts = [r["prompt"] for r in chunk]
        input_ids, attention_mask, prompt_len, mask = completion_batch(tokenizer, prompts, targets, device)
        logprobs = token_logprobs(model, input_ids, attention_mask, prompt_len)  # (b, T)
        losses.append(sft_loss(logprobs, mask) * len(chunk))
    metrics, samples = {"eval/loss": torch.stack(losses).sum() / len(eval_records)}, []
    if "answer" in eval_records[0]:
        metrics.update(evaluate(model, tokenizer, eval_records, args, stop_ids, samples))
    else:  # nothing to score: the model's completion beside the record's
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [r["prompt"] for r in eval_records[:4]], device)
        completion_ids = generate(model, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, None, stop_ids)
        texts = decode_completions(tokenizer, completion_ids, completion_mask(completion_ids, stop_ids))
        samples = [
            {"prompt": r["prompt"], "completion": t, "reference": r["completion"]} for r, t in zip(eval_records, texts)
        ]
    return metrics, samples


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


TASK_TOKENS = {"tool": ["*", "<call>", "</call>", "<result>", "</result>"], "guess": ["?"]}  # beyond the digits


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
