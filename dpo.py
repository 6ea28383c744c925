"""Direct Preference Optimization (DPO), in one file.

DPO trains the policy on preference pairs (a prompt x, a chosen completion y_c and a rejected one
y_r) without a reward model and without rollouts: the log-ratio of the policy to a frozen
reference is an implicit reward, and the Bradley-Terry likelihood of the preferences under that
reward is maximised (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290, eq. 7):

    loss = -log sigmoid(beta (log pi(y_c|x)/pi_ref(y_c|x) - log pi(y_r|x)/pi_ref(y_r|x)))

with log pi(y|x) summed over the completion's tokens only. `--loss-type ipo` gives IPO's squared
loss (Azar et al. 2023) and `hinge` SLiC's (Zhao et al. 2023); `--label-smoothing` gives
conservative DPO. With no dataset, the pairs come from the addition task: `rejected` is a wrong
answer the starting policy itself samples, `chosen` the right one. See docs/dpo.md; scale/dpo.py is
this file with what scale needs (torchrun, LoRA, resume, conversational records).

    python dpo.py                                    # bundled tiny model, addition pairs, CPU
    python dpo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --dataset my_pairs.jsonl --micro-batch-size 4 \
        --learning-rate 5e-7 --beta 0.1 --num-steps 1000 --num-eval 100 --gradient-checkpointing  # on a GPU
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
    model_name_or_path: str = "tiny-adder"  # the starting policy, also the frozen reference: a folder or a hub id
    dataset: str | None = None  # a .jsonl of prompt/chosen/rejected records (text), or a hub dataset
    task: Literal["addition", "addition-question"] = "addition"  # without --dataset: `47+8=`, or as a question
    dataset_config: str | None = None  # the hub dataset's configuration
    train_split: str = "train"  # the hub dataset's training split
    eval_split: str = "test"  # the hub dataset's held-out split
    num_eval: int = 500  # held-out records: the hub split's first, or a .jsonl's last
    eval_every: int = 25  # held-out pair accuracy (and addition's greedy accuracy) every this many steps, and at 0
    max_new_tokens: int = 8  # the longest completion, in tokens, sampled for the pairs or when evaluating
    num_train_prompts: int = 9500  # addition prompts turned into training pairs (9500: all of them)
    pair_samples: int = 4  # completions sampled per addition prompt, to be judged right or wrong
    pair_temperature: float = 1.0  # the temperature those completions are sampled at
    chosen: Literal["answer", "sample", "sample-or-answer"] = "answer"
    """an addition pair's chosen completion: the answer; a right sample (none: no pair); or a right sample, else
    the answer"""
    pairs: Literal["first", "all"] = "first"
    """an addition prompt's pairs: its first right against its first wrong completion, or every right one against
    every wrong one (InstructGPT's comparisons)"""

    # Optimisation
    num_steps: int = 100  # optimizer steps
    learning_rate: float = 5e-5  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    max_grad_norm: float = 1.0  # clip the gradient's global norm to this
    micro_batch_size: int = 32  # pairs per forward/backward pass

    # Algorithm specific arguments
    batch_size: int = 32  # preference pairs per optimizer step
    beta: float = 1.0  # strength of the implicit KL constraint to the reference (the paper: 0.1 to 5)
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"  # DPO's loss, IPO's, or SLiC's hinge
    label_smoothing: float = 0.0  # conservative DPO: the share of pairs assumed to be mislabelled (sigmoid only)


# ---- ALGO LOGIC: DPO's sequence log-probs and loss
def completion_logps(model, input_ids, attention_mask, prompt_len, mask):
    """log pi(y|x) (B,): the completion's token log-probs summed, never the prompt's or the padding's."""
    return torch.where(mask.bool(), token_logprobs(model, input_ids, attention_mask, prompt_len), 0.0).sum(dim=1)


def dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    beta=0.1,
    loss_type="sigmoid",
    label_smoothing=0.0,
    tie_tolerance=0.0,
):
    """The DPO loss (or IPO's, or SLiC's hinge) of a batch of pairs, to be minimised; all arguments (B,).

    h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r))
    sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps = label_smoothing)
    ipo:     (h - 1 / (2 beta))^2
    hinge:   max(0, 1 - beta h)
    When the policy equals the reference, h = 0 and the sigmoid loss is log 2 for any beta.
    Stats: the implicit rewards beta (log pi - log pi_ref) of chosen and rejected, their margin,
    and the share of pairs whose margin is positive (a tie, |h| <= tie_tolerance, counts half).
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        logsigmoid = torch.nn.functional.logsigmoid
        losses = -(1 - label_smoothing) * logsigmoid(beta * h) - label_smoothing * logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    margins = chosen_rewards - rejected_rewards
    ranked = torch.where(h.detach().abs() <= tie_tolerance, 0.0, margins)  # within rounding of 0: a tie
    return losses.mean(), {
        "chosen_reward": chosen_rewards.mean(),
        "rejected_reward": rejected_rewards.mean(),
        "margin": margins.mean(),
        "accuracy": pair_accuracy(ranked),
    }


def rounding_tolerance(completion_mask):
    """The largest |h| float rounding alone makes, per pair (B,): sqrt(eps N), eps float32's, N the pair's tokens.

    At step 0 the policy is the reference and h = 0 in exact arithmetic, but the two copies' sums may differ in
    their last bits (docs/dpo.md). completion_mask: pair_batch's (2B, T), chosen rows then rejected rows.
    """
    num_tokens = completion_mask.sum(dim=1).view(2, -1).sum(dim=0)  # (B,)
    return (torch.finfo(torch.float32).eps * num_tokens).sqrt()


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

    # the policy and its frozen copy, the reference
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    policy = load_model(args.model_name_or_path, args, device)
    stop_ids = stop_token_ids(tokenizer, policy)
    ref_policy = load_model(args.model_name_or_path, args, device, frozen=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    # the pairs, made once at the start (without --dataset: sampled from the starting policy, not trained yet)
    train_pairs, eval_pairs = load_preferences(args, tokenizer, policy, stop_ids)
    eval_records = addition_task(args.num_eval, args.task)[1] if args.dataset is None else []  # with answers
    if not train_pairs or not eval_pairs:
        fail(f"no preference pairs to {'train' if not train_pairs else 'evaluate'} on; check --dataset")
    data_rng = random.Random(args.seed)
    print(f"{output_dir}: {len(train_pairs)} training pairs, {len(eval_pairs)} held out, device {device}")
    start = time.time()
    log(output_dir, 0, *held_out_metrics(policy, ref_policy, tokenizer, eval_pairs, eval_records, args, stop_ids))
    for step in range(1, args.num_steps + 1):
        step_start = time.time()
        # 1. a batch of pairs, in micro-batches that add up to one optimizer step
        batch = data_rng.choices(train_pairs, k=args.batch_size)
        policy.train()
        optimizer.zero_grad()
        step_stats, num_tokens = [], 0
        for i in range(0, args.batch_size, args.micro_batch_size):
            pairs = batch[i : i + args.micro_batch_size]
            tokens = pair_batch(tokenizer, pairs, device)  # tokenised once, for both models
            num_tokens += tokens[-1].sum()  # completion tokens of the 2b sequences
            # 2. the reference's log-probs, constants; the policy's, chosen and rejected through one forward pass
            with torch.no_grad():
                ref_chosen, ref_rejected = completion_logps(ref_policy, *tokens).chunk(2)  # (b,), (b,)
            chosen, rejected = completion_logps(policy, *tokens).chunk(2)  # (b,), (b,)
            # 3. the loss, its gradient weighed so that the micro-batches add up to the batch's mean
            tolerance = rounding_tolerance(tokens[-1])
            loss, stats = dpo_loss(
                chosen, rejected, ref_chosen, ref_rejected, args.beta, args.loss_type, args.label_smoothing, tolerance
            )
            (loss * len(pairs) / args.batch_size).backward()
            step_stats.append(({"loss": loss.detach(), **stats}, 1))
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
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
                held_out, samples = held_out_metrics(
                    policy, ref_policy, tokenizer, eval_pairs, eval_records, args, stop_ids
                )
            log(output_dir, step, {**metrics, **held_out}, samples)

    save(policy, tokenizer, output_dir)
    print(f"saved to {output_dir} in {time.time() - start:.0f} s")


# ==== The algorithm ends here. Below: machinery, this file's own, then (second banner) the part every file shares ====
def check_args(args):
    """Stops at a flag outside its range, or at batch sizes that do not divide, before anything loads."""
    ranges = dict(num_train_prompts="> 0", pair_samples="> 0", pair_temperature="> 0", batch_size="> 0", beta="> 0")
    check_ranges(args, **ranges)
    if not 0 <= args.label_smoothing < 0.5:  # at 0.5 the chosen and the rejected weigh alike: nothing to learn
        fail(f"--label-smoothing {args.label_smoothing}: must be in [0, 0.5)")
    exact_div(args.batch_size, min(args.micro_batch_size, args.batch_size), "--batch-size by --micro-batch-size")


def load_preferences(args, tokenizer, policy, stop_ids):
    """(train, held-out) lists of {'prompt', 'chosen', 'rejected'} pairs: --dataset's records, or addition pairs (with
    'answer') whose negatives the starting policy samples."""
    if args.dataset is None:
        train, held_out = addition_task(args.num_eval, args.task)  # held-out prompts never appear in training
        train_pairs = addition_pairs(policy, tokenizer, train[: args.num_train_prompts], args, stop_ids)
        eval_pairs = addition_pairs(policy, tokenizer, held_out, args, stop_ids)
    elif args.dataset.endswith(".jsonl"):  # its last --num-eval, not trained on
        records = read_jsonl(args.dataset, ("prompt", "chosen", "rejected"))
        if len(records) <= args.num_eval:
            fail(f"--dataset {args.dataset}: {len(records)} records, but --num-eval {args.num_eval} are held out")
        train_pairs, eval_pairs = records[: -args.num_eval], records[-args.num_eval :]
    else:  # the hub dataset's --train-split, and its --eval-split's first --num-eval
        train_pairs = hub_pairs(args.dataset, args.dataset_config, args.train_split)
        eval_pairs = hub_pairs(args.dataset, args.dataset_config, args.eval_split)[: args.num_eval]
    return train_pairs, eval_pairs


def hub_pairs(name, config, split):
    """A hub dataset split's records, each with a text 'prompt', 'chosen' and 'rejected' (messages: scale/dpo.py)."""
    records = load_hub_split(name, config, split)
    for n, record in enumerate(records):
        if not all(isinstance(record.get(k), str) for k in ("prompt", "chosen", "rejected")):
            fail(f"--dataset {name}: record {n} of split {split!r} lacks a text 'prompt', 'chosen' or 'rejected'")
    return records


@torch.no_grad()
def addition_pairs(policy, tokenizer, records, args, stop_ids, chunk=64):
    """Hard negatives: per prompt, --pair-samples completions of the policy, judged by reward_fn; a pair is a right
    one (chosen) above a wrong one the policy really produced (rejected). --chosen: the answer; a right sample (a
    prompt never got right gives no pair); or a right sample, else the answer. --pairs: the first chosen against the
    first wrong, or every distinct chosen against every distinct wrong (InstructGPT's comparisons), a prompt's pairs
    next to each other; a prompt always answered right gives none.
    {"prompt": "47+8=", "chosen": "55", "rejected": "54", "answer": "55"}"""
    policy.eval()
    device, num_samples, pairs = next(policy.parameters()).device, args.pair_samples, []
    for i in range(0, len(records), chunk):
        part = records[i : i + chunk]
        prompt_ids, prompt_mask = tokenize_prompts(
            tokenizer, [r["prompt"] for r in part for _ in range(num_samples)], device
        )
        completion_ids = generate(
            policy, tokenizer, prompt_ids, prompt_mask, args.max_new_tokens, args.pair_temperature, stop_ids
        )
        texts = decode_completions(tokenizer, completion_ids, completion_mask(completion_ids, stop_ids))
        for j, r in enumerate(part):
            sampled = list(dict.fromkeys(t.strip() for t in texts[j * num_samples : (j + 1) * num_samples]))  # distinct
            wrong = [t for t in sampled if t and not reward_fn(t, r)]
            right = [t for t in sampled if reward_fn(t, r)] if args.chosen != "answer" else []
            if not right and args.chosen != "sample":
                right = [r["answer"]]
            if args.pairs == "first":
                right, wrong = right[:1], wrong[:1]
            pairs += [
                {"prompt": r["prompt"], "chosen": c, "rejected": w, "answer": r["answer"]} for c in right for w in wrong
            ]
    return pairs


@torch.no_grad()
def held_out_metrics(policy, ref_policy, tokenizer, eval_pairs, eval_records, args, stop_ids):
    """Held-out pair accuracy of the implicit reward, the task's greedy accuracy (eval_records: the addition task's),
    and for samples.jsonl a few held-out pairs with their margins beta * h, and greedy completions."""
    policy.eval()
    device, margins = next(policy.parameters()).device, []
    for i in range(0, len(eval_pairs), args.micro_batch_size):
        tokens = pair_batch(tokenizer, eval_pairs[i : i + args.micro_batch_size], device)
        policy_chosen, policy_rejected = completion_logps(policy, *tokens).chunk(2)
        ref_chosen, ref_rejected = completion_logps(ref_policy, *tokens).chunk(2)
        h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # (b,)
        tie = h.abs() <= rounding_tolerance(tokens[-1])  # at step 0, every pair
        margins.append(torch.where(tie, 0.0, args.beta * h))
    margins = torch.cat(margins)
    metrics = {"eval/pair_accuracy": pair_accuracy(margins)}
    samples = [
        {"kind": "pair", "prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"], "margin": m}
        for p, m in zip(eval_pairs[:4], margins.tolist())
    ]
    if eval_records:
        metrics.update(evaluate(policy, tokenizer, eval_records, args, stop_ids, samples))
    return metrics, samples


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
