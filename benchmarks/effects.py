"""The papers' headline effects in miniature, one row an effect (docs/effects.md): what each change in the files was
made for, on the bundled task and the CPU.

    python benchmarks/effects.py                               # every row: 3 seeds where a row trains, 100 runs
    python benchmarks/effects.py --rows length-bias kl-estimators
    python benchmarks/effects.py --quick --runs-dir /tmp/effects   # the suite's form: 1 seed, 2 steps a run

Rows (docs/effects.md gives each claim, its source and what was seen):
    length-bias        grpo.py's default objective against Dr. GRPO's: the gradient a wrong completion's tokens get as
                       it grows, exactly, and the length of right and of wrong completions sampled over training, on
                       tasks whose answers 0 to 4 spaces precede or follow, or follow a mark that gives up (the
                       bundled model fine-tuned to write them)
    std-amplification  what dividing by the group's standard deviation does to rewards that differ by a little, and
                       to learning when every reward carries noise of 0.01 (noisy_rewards)
    kl-estimators      k1, k2 and k3 against the exact KL of a policy to the bundled model after 1, 5, 25 and 150 steps;
                       then each as grpo.py's KL penalty (kl_penalty) with a reward without signal (no_signal),
                       sampled at the temperature it is scored at, and (k1, k3) sampled at 0.7 and scored at 1
    cispo-clipped      the share of tokens PPO's clip (grpo.py) and CISPO's leave without gradient, 4 passes a batch
    rloo-vs-ppo        the three-seed runs of docs/results.md, read per rollout and per second
    areal-staleness    docs/async_grpo.md's runs: the decoupled objective against the coupled one as staleness grows;
                       then both at eta 16 and ten times the learning rate, against synchronous training at that rate
    sampler-mismatch   grpo.py's rollouts sampled at temperature 0.7, and at 1.5, while the loss takes pi_old at 1
                       (mismatched), with --rollout-correction none, token-tis and icepop, against the matched default

Runs go to --runs-dir, each in its own folder, run in this process as `python FILE.py FLAGS` runs it; a folder whose
run finished with the same flags and the same data (the .jsonl files they name) is read again, not run. grpo.py has
no flag for the rows' knobs (noise on the rewards, another KL estimator, no reward signal, a sampler at another
temperature): nobody trains with them, so each is a patch of the grpo module a row runs, made here (docs/reading.md,
"Flags and knobs").
"""

import argparse
import contextlib
import dataclasses
import hashlib
import inspect
import json
import linecache
import math
import os
import random
import re
import runpy
import shutil
import statistics
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from scale import grpo  # noqa: E402  (the loss, the advantage and the sampler the rows look into)

ROWS = (
    "length-bias",
    "std-amplification",
    "kl-estimators",
    "cispo-clipped",
    "rloo-vs-ppo",
    "areal-staleness",
    "sampler-mismatch",
)
DR_GRPO = ["--loss-agg", "seq-mean-token-sum-norm", "--no-scale-rewards"]
SAMPLED = 500  # the held-out prompts (a default run's): one completion each, for the lengths and the KL estimators
SPACES, ROOM = 4, 12  # the length-bias tasks: 0 to 4 spaces before or after an answer; completions of 12 tokens
SPACED = ("spaced", "trailing", "give-up")  # the spaces before the answer, after it, or after a mark that gives up
GIVE_UP, MARK = 1 / 3, "="  # the give-up task's share of completions that give up, and their mark (no number: reward 0)
NOISE = 0.01  # the std-amplification row's noise on the rewards
MISMATCH = 0.7  # the kl-estimators row's sampling temperature where it scores at 1 (and the sampler-mismatch row's)
FLATTER = 1.5  # the sampler-mismatch row's other sampling temperature: flatter than the loss's


def train(args, file, flags, name, seed, in_module=False):
    """The run's metrics (a list of records): `python FILE --seed S FLAGS --output-dir RUNS/NAME-S`, run here (with
    in_module, grpo.py's main in the module imported above, which a row may patch)."""
    out = os.path.join(args.runs_dir, f"{name}-{seed}")
    argv = [*flags, "--seed", str(seed), "--output-dir", out]
    # the record of a finished run: its flags, and the content of the .jsonl files they name (a data set written
    # again with other records is another run)
    record = argv + [hashlib.sha256(open(a, "rb").read()).hexdigest() for a in argv if a.endswith(".jsonl")]
    done = os.path.join(out, "effects_argv.json")
    if not (os.path.exists(done) and json.load(open(done)) == record):
        shutil.rmtree(out, ignore_errors=True)  # another run's, or one that did not finish
        print(f"python {file} {' '.join(argv)}", flush=True)
        saved = sys.argv, torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
        sys.argv = [os.path.join(ROOT, file), *argv]
        try:
            if in_module:
                grpo.main(grpo.parse_args())
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
        finally:  # the global settings a run changes, put back for the next run (and the caller)
            sys.argv = saved[0]
            torch.use_deterministic_algorithms(saved[1])
            torch.set_num_threads(saved[2])
        with open(done, "w") as f:
            json.dump(record, f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def steps_flags(args, full_steps):
    """The runs' flags and how often they evaluate (and the length-bias runs save): 6 times a run, or each of --quick's
    2 steps on 64 held-out prompts."""
    if args.quick:
        return ["--num-steps", "2", "--eval-every", "1", "--log-every", "1", "--num-eval", "64"], 1
    return ["--num-steps", str(full_steps), "--eval-every", str(full_steps // 6), "--log-every", "1"], full_steps // 6


def last(metrics, key):
    return [m[key] for m in metrics if key in m][-1]


def spread(values, digits=1, scale=1.0):
    """'mean ± std' of the values that are numbers (a length of no completion is nan), 'none' if none is."""
    values = [v * scale for v in values if not math.isnan(v)]
    if not values:
        return "none"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def held_out(num):
    """(the bundled tokenizer, the first `num` held-out records, their prompts' ids and mask)."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    _, records = grpo.addition_task(num)
    ids, mask = grpo.tokenize_prompts(tokenizer, [r["prompt"] for r in records], "cpu", grpo.Args())
    return tokenizer, records, ids, mask


def sample(folder, tokenizer, ids, mask, max_new_tokens=grpo.Args().max_new_tokens):
    """(the model in folder, one completion a prompt at temperature 1 from it, the mask of its tokens up to and
    including the stop token), seed 0."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.compute_dtype = torch.float32
    stop_ids = grpo.stop_token_ids(tokenizer, model)
    torch.manual_seed(0)
    completions = grpo.generate(model, tokenizer, ids, mask, max_new_tokens, 1.0, stop_ids)
    return model, completions, grpo.completion_mask(completions, stop_ids)


def sample_lengths(folder, prompts):
    """(mean length of the right completions, of the wrong ones, share right, mean length of those that give up with
    MARK, their share) of the model in folder, sampled on prompts = held_out(num) (tokens up to and including the
    stop token, at most ROOM); nan for a mean of none."""
    tokenizer, records, ids, mask = prompts
    _, completions, keep = sample(folder, tokenizer, ids, mask, ROOM)
    texts = grpo.decode_completions(tokenizer, completions, keep)
    right = torch.tensor([grpo.reward_fn(t, r) == 1.0 for t, r in zip(texts, records)])
    gave_up = torch.tensor([t.strip().startswith(MARK) for t in texts])
    lengths = keep.sum(dim=1).float()
    shares = right.float().mean().item(), gave_up.float().mean().item()
    return (
        lengths[right].mean().item(),
        lengths[~right].mean().item(),
        shares[0],
        lengths[gave_up].mean().item(),
        shares[1],
    )


def token_weights(loss_agg, right_length=3, wrong_length=12, max_completion_length=16):
    """d loss / d log pi of each token of a wrong completion (A = -1) grouped with a right one (A = +1), the ratio 1
    and no KL: positive, the token is pushed down. Returns (a token's weight, the completion's total)."""
    length = max(right_length, wrong_length)
    logprobs = torch.zeros(2, length, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, length)
    mask[0, :right_length], mask[1, :wrong_length] = 1, 1
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = grpo.grpo_loss(
        logprobs, logprobs.detach(), None, advantages, mask, beta=0.0, loss_agg=loss_agg,
        max_completion_length=max_completion_length,
    )  # fmt: skip
    loss.backward()
    return logprobs.grad[1, 0].item(), logprobs.grad[1].sum().item()


def length_bias(args):
    result = {"per_token": {}}
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        for wrong in (3, 6, 12):
            per_token, total = token_weights(agg, wrong_length=wrong)
            result["per_token"][f"{agg} {wrong}"] = [per_token, total]
            print(f"  {agg}: a wrong completion of {wrong} tokens: {per_token:.4f} a token, {total:.4f} in all")
    flags, every = steps_flags(args, 150)
    flags += ["--save-every", str(every), "--keep-checkpoints", "100"]
    curves, prompts = {}, held_out(args.sampled)
    for task in SPACED:
        start = spaced_model(args, task)
        for name, extra in (("grpo", []), ("dr-grpo", DR_GRPO)):
            for seed in args.seeds:
                run = [*flags, "--model-name-or-path", start, "--max-new-tokens", str(ROOM), *extra]
                train(args, "scale/grpo.py", run, f"{task}-{name}", seed)
                folder = os.path.join(args.runs_dir, f"{task}-{name}-{seed}", "checkpoints")
                points = [(0, start)]
                points += [(int(step[5:]), os.path.join(folder, step, "policy")) for step in sorted(os.listdir(folder))]
                for step, path in points:
                    curves.setdefault(task, {}).setdefault(name, {}).setdefault(step, [])
                    curves[task][name][step].append(sample_lengths(path, prompts))
    result["curves"] = {
        task: {
            name: {step: [statistics.mean(v[i] for v in runs) for i in range(5)] for step, runs in by_step.items()}
            for name, by_step in by_name.items()
        }
        for task, by_name in curves.items()
    }
    for task, by_name in curves.items():
        for name, by_step in by_name.items():
            for step, runs in sorted(by_step.items()):
                right, wrong, share, given_up, share_given_up = ([v[i] for v in runs] for i in range(5))
                print(
                    f"  {task} {name} step {step}: right {spread(right, 2)} tokens, wrong {spread(wrong, 2)}, "
                    f"{spread(share, 2)}"
                    + (
                        f"; gave up {spread(given_up, 2)} tokens, {spread(share_given_up, 2)}"
                        if task == "give-up"
                        else ""
                    )
                )
    if args.figure:
        plot_lengths(curves, args.figure)
    return result


def spaced_model(args, task):
    """The folder of the bundled model fine-tuned (sft.py, 200 steps) on the bundled task's training records with 0
    to SPACES spaces, drawn at random, before each answer (task "spaced") or after it ("trailing"): a completion that
    can grow without changing its answer (reward_fn reads the last number). Before, the length is chosen before the
    answer; after, once the answer is written. "give-up": after it, but a GIVE_UP share of the answers is MARK
    (reward 0 whatever follows; '?' is no token of the bundled tokenizer's): the spaces after it know the completion
    failed. sft.py holds out the file's last records; grpo.py's are the task's."""
    os.makedirs(args.runs_dir, exist_ok=True)
    path = os.path.join(args.runs_dir, f"{task}.jsonl")
    rng, gives_up, records = random.Random(0), random.Random(1), grpo.addition_task(SAMPLED)[0]
    with open(path, "w") as f:
        for r in records:
            spaces = " " * rng.randint(0, SPACES)
            completion = spaces + r["answer"] if task == "spaced" else r["answer"] + spaces
            if task == "give-up" and gives_up.random() < GIVE_UP:
                completion = MARK + spaces
            f.write(json.dumps({"prompt": r["prompt"], "completion": completion}) + "\n")
    steps = "2" if args.quick else "200"
    flags = ["--model-name-or-path", os.path.join(ROOT, "tiny-adder"), "--dataset", path, "--num-steps", steps]
    flags += ["--eval-every", steps, "--num-eval", "64", "--learning-rate", "3e-4", "--max-new-tokens", str(ROOM)]
    train(args, "scale/sft.py", flags, f"{task}-sft", 1)
    return os.path.join(args.runs_dir, f"{task}-sft-1")


def plot_lengths(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SPACED), figsize=(14, 3.6), sharey=True)
    for ax, task in zip(axes, SPACED):
        for name, color in (("grpo", "tab:blue"), ("dr-grpo", "tab:orange")):
            steps = sorted(curves[task][name])
            for i, (kind, style) in enumerate((("right", "-"), ("wrong", "--"))):
                ys = [statistics.mean(v[i] for v in curves[task][name][s]) for s in steps]
                label = f"{'GRPO (seq-mean-token-mean)' if name == 'grpo' else 'Dr. GRPO'}: {kind}"
                ax.plot(steps, ys, style, color=color, label=label)
        where = {
            "spaced": "before the answer",
            "trailing": "after the answer",
            "give-up": f"after the answer or a '{MARK}'",
        }
        ax.set_title(f"0-{SPACES} spaces {where[task]}", fontsize=10)
        if task == "give-up":  # the completions that gave up, the ones whose spaces know they failed
            for name, color in (("grpo", "tab:blue"), ("dr-grpo", "tab:orange")):
                steps = sorted(curves[task][name])
                ys = [statistics.mean(v[3] for v in curves[task][name][s]) for s in steps]
                ax.plot(steps, ys, ":", color=color, label=f"{'GRPO' if name == 'grpo' else 'Dr. GRPO'}: gave up")
        ax.set_xlabel("step")
        ax.set_ylim(0, ROOM)  # the room a completion has
    axes[0].set_ylabel("mean completion length (tokens)")
    axes[0].legend(fontsize=8)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def default_grpo(args, seed):
    """scale/grpo.py's default run of 150 steps: the std row's and the sampler row's baseline."""
    return train(args, "scale/grpo.py", steps_flags(args, 150)[0], "grpo", seed)


def std_amplification(args):
    """Advantages of a group of 4 whose rewards differ by delta, with and without the division by the group's std;
    then grpo.py's held-out accuracy with and without the division, each with and without noise on the rewards."""
    result = {}
    for delta in (1.0, 0.1, 0.01, 0.001):
        rewards = torch.tensor([1.0 + delta, 1.0, 1.0, 1.0])
        scaled = grpo.group_advantages(rewards, 4).tolist()
        plain = grpo.group_advantages(rewards, 4, scale=False).tolist()
        result[str(delta)] = {"scaled": scaled, "plain": plain}
        print(
            f"  rewards differ by {delta}: scaled {scaled[0]:.3f}, {scaled[1]:.3f}; "
            f"plain {plain[0]:.4f}, {plain[1]:.4f}"
        )
    flags, _ = steps_flags(args, 150)
    result["learning"] = {}
    for name in ("scaled", "scaled, noise", "unscaled", "unscaled, noise"):
        extra = ["--no-scale-rewards"] if name.startswith("unscaled") else []
        folder = f"std-{name.replace(', ', '-')}"
        if name == "scaled":
            runs = [default_grpo(args, seed) for seed in args.seeds]
        elif "noise" in name:
            with patching(main=noisy_rewards(NOISE)):
                runs = [
                    train(args, "scale/grpo.py", flags + extra, folder, seed, in_module=True) for seed in args.seeds
                ]
        else:
            runs = [train(args, "scale/grpo.py", flags + extra, folder, seed) for seed in args.seeds]
        result["learning"][name] = std_row(name, runs)
    pairs = ["--group-size", "2", "--prompts-per-step", "128"]  # most groups tie: the division meets noise alone
    result["pairs"] = {}
    for name in ("scaled", "scaled, noise", "unscaled", "unscaled, noise"):
        extra = pairs + (["--no-scale-rewards"] if name.startswith("unscaled") else [])
        folder = f"std-pairs-{name.replace(', ', '-')}"
        with patching(main=noisy_rewards(NOISE)) if "noise" in name else contextlib.nullcontext():
            runs = [train(args, "scale/grpo.py", flags + extra, folder, seed, in_module=True) for seed in args.seeds]
        result["pairs"][name] = std_row(f"groups of 2, {name}", runs)
    return result


def std_row(name, runs):
    """The held-out accuracy at the runs' end and the share of groups whose rewards differ, printed and returned."""
    accuracy = [last(run, "eval/accuracy") for run in runs]
    signal = [statistics.mean(1 - m["charts/zero_std_groups"] for m in run if "charts/reward" in m) for run in runs]
    print(
        f"  {name}: held-out accuracy {spread(accuracy, 1, 100)}% after {len(runs[0]) - 1} steps "
        f"({spread(signal, 1, 100)}% of groups with rewards that differ)"
    )
    return {"accuracy": accuracy, "groups with signal": signal}


def kl_estimates(logp, logq, tokens):
    """The exact KL(pi || ref) at each position (N,) from log pi and log ref (N, vocab), and Schulman's estimators of it
    from the sampled tokens (N,), x ~ pi, r = ref(x) / pi(x): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r
    (kl_estimate). p = [1/2, 1/2], ref = [1/4, 3/4]: exact 0.5 log(4/3) = 0.1438; x = 0: k1 0.6931, k2 0.2402, k3
    0.1931."""
    exact = (logp.exp() * (logp - logq)).sum(-1)
    log_r = (logq - logp).gather(-1, tokens[:, None]).squeeze(-1)
    return exact, {name: kl_estimate(log_r, name) for name in KL_ESTIMATES}


def against_reference(folder, reference, tokenizer, ids, mask):
    """(exact KL(pi || ref) at each sampled position, the estimators there, pi's entropy there): one completion a
    prompt at temperature 1 from the model in folder (pi); ref: the bundled model."""
    policy, completions, keep = sample(folder, tokenizer, ids, mask)
    sequences = torch.cat([ids, completions], dim=1)
    attention = torch.cat([mask, keep.long()], dim=1)
    with torch.no_grad():
        logp, logq = (
            grpo.forward(m, sequences, attention).logits[:, ids.shape[1] - 1 : -1].double().log_softmax(-1)
            for m in (policy, reference)
        )
    exact, estimates = kl_estimates(logp[keep], logq[keep], completions[keep])
    return exact, estimates, -(logp.exp() * logp).sum(-1)[keep]


def kl_estimators(args):
    """k1, k2, k3 of KL(pi || ref) at tokens sampled from pi, against the exact KL at the same positions, for the
    policies of grpo.py's default run of the first seed (run again here, saved after every step) after steps 1, 5 and
    25, from near the reference outwards (Schulman's claim of a lower variance is for nearby distributions), and at its
    end; ref: the bundled model. The bias's standard error is the estimator's std over the square root of the tokens.
    Then each estimator as grpo.py's KL penalty under a reward without signal, sampled at the temperature it is scored
    at, and (k1, k3) sampled at MISMATCH, scored at 1."""
    flags, every = steps_flags(args, 150)
    saved = [*flags, "--save-every", "1", "--keep-checkpoints", "1000"]
    train(args, "scale/grpo.py", saved, "grpo-each-step", 1)
    run, last_step = os.path.join(args.runs_dir, "grpo-each-step-1"), int(flags[1])
    policies = {
        f"step {s}": os.path.join(run, "checkpoints", f"step_{s:06d}", "policy")
        for s in sorted({1, 5, every})
        if s < last_step
    }
    policies["final"] = run
    reference = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "tiny-adder")).eval()
    tokenizer, _, ids, mask = held_out(args.sampled)
    prompts, result = (tokenizer, ids, mask), {}
    for label, folder in policies.items():
        exact, estimates, _ = against_reference(folder, reference, *prompts)
        result[label] = {"tokens": len(exact), "exact": exact.mean().item()}
        print(f"  {label}: {len(exact)} sampled tokens; the exact KL: mean {exact.mean():.5f}, std {exact.std():.5f}")
        for name, k in estimates.items():
            row = {
                "mean": k.mean().item(),
                "bias": (k.mean() - exact.mean()).item(),
                "se": (k.std() / len(k) ** 0.5).item(),
                "std": k.std().item(),
                "negative": (k < 0).double().mean().item(),
            }
            result[label][name] = row
            print(
                f"    {name}: mean {row['mean']:.5f} (bias {row['bias']:+.5f}, standard error {row['se']:.5f}), "
                f"std {row['std']:.5f}, {row['negative']:.1%} negative"
            )
    entropy = against_reference(os.path.join(ROOT, "tiny-adder"), reference, *prompts)[2].mean().item()
    print(f"  the bundled model: entropy {entropy:.4f} nats a sampled token")
    result["as a loss"] = {"start entropy": entropy}
    flags, _ = steps_flags(args, 150)
    for name, temperature in (("k1", None), ("k2", None), ("k3", None), ("k1", MISMATCH), ("k3", MISMATCH)):
        label, ends = name if temperature is None else f"{name}, sampled at {temperature}", []
        for seed in args.seeds:
            run = f"no-signal-{name}" if temperature is None else f"no-signal-{name}-t{temperature}"
            with no_signal(temperature), patching(grpo_loss=kl_penalty(name)):
                train(args, "scale/grpo.py", flags, run, seed, in_module=True)
            exact, _, entropy = against_reference(os.path.join(args.runs_dir, f"{run}-{seed}"), reference, *prompts)
            ends.append((exact.mean().item(), entropy.mean().item()))
        result["as a loss"][label] = ends
        kl, entropy = ([e[i] for e in ends] for i in range(2))
        print(
            f"  {label} as the KL penalty, no reward signal: KL to the reference {spread(kl, 4)}, "
            f"entropy {spread(entropy, 4)}"
        )
    return result


# Schulman's estimates of KL(pi || ref) from d = log ref - log pi at a token sampled from pi (Approximating KL
# Divergence, 2020): k1 unbiased, negative where ref is the likelier; k2 >= 0 but biased; k3 unbiased and >= 0, the
# one grpo.py's loss computes (its gradient vanishes where pi = ref; k1's is the score function whatever ref says)
KL_ESTIMATES = {"k1": "-d", "k2": "d**2 / 2", "k3": "torch.exp(d) - d - 1"}
KL_LINE = "        kl = torch.exp(d) - d - 1  # k3 >= 0, its gradient flows through logprobs\n"  # grpo_loss's


def kl_estimate(d, name):
    """KL_ESTIMATES[name] at d (a tensor). d = log 2: k1 -0.6931, k2 0.2402, k3 0.3069."""
    return eval(KL_ESTIMATES[name], {"torch": torch, "d": d})  # the expression grpo_loss takes in kl_penalty


def patched(function, line, replacement):
    """scale/grpo.py's `function` with the one line `line` of its source replaced, made in the grpo module's
    namespace: a knob that only this benchmark needs, so grpo.py has no flag for it (docs/reading.md, "Flags and
    knobs")."""
    source = inspect.getsource(function)
    assert source.count(line) == 1, (function.__name__, line)
    source, name, made = source.replace(line, replacement), f"<grpo.{function.__name__}, patched>", {}
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)  # its tracebacks, its source
    exec(compile(source, name, "exec"), vars(grpo), made)
    return made[function.__name__]


def kl_penalty(name):
    """scale/grpo.py's loss with the KL penalty's estimate KL_ESTIMATES[name] in place of its k3 (the same arithmetic
    as a --kl-estimator flag of grpo.py would)."""
    return patched(grpo.grpo_loss, KL_LINE, f"        kl = {KL_ESTIMATES[name]}\n")


def noisy_rewards(scale):
    """scale/grpo.py's main() with N(0, scale^2) added to each reward before its advantage, drawn from the run's shuffle
    generator; the metrics keep the task's rewards (the same draws as grpo.py's --reward-noise of e482211)."""
    line = "advantages = group_advantages(rewards, args.group_size, scale=args.scale_rewards)"
    noised = f"rewards + {scale!r} * torch.randn(rewards.shape, generator=shuffle_gen).to(rewards.device)"
    return patched(grpo.main, line, line.replace("(rewards,", f"({noised},"))


@contextlib.contextmanager
def patching(**functions):
    """grpo.NAME = function for each, inside; put back after."""
    saved = {name: getattr(grpo, name) for name in functions}
    vars(grpo).update(functions)
    try:
        yield
    finally:
        vars(grpo).update(saved)


def sampled_at(temperature):
    """scale/grpo.py's sample(), drawing its rollouts at `temperature` (and returning their log-probs there) whatever
    --temperature the loss scores them at, as a sampler set apart from the loss may; None: grpo.py's own."""
    original = grpo.sample
    if temperature is None:
        return original

    def sample(policy, engine, tokenizer, prompt_ids, prompt_mask, args, stop_ids):
        args = dataclasses.replace(args, temperature=temperature)
        return original(policy, engine, tokenizer, prompt_ids, prompt_mask, args, stop_ids)

    return sample


def no_signal(temperature=None):
    """Inside: every reward of grpo.py is 0 (no signal: every advantage is 0, only the KL penalty trains), and with a
    temperature grpo.py samples its rollouts at it (sampled_at). grpo.py has a flag for neither (it samples and scores
    at --temperature); the row patches the module it runs."""
    return patching(reward_fn=lambda completion, record: 0.0, sample=sampled_at(temperature))


def cispo_clipped(args):
    """grpo.py and cispo.py with 4 passes over each batch: the share of tokens PPO's clip leaves without gradient
    (grpo.py's clip_frac) against CISPO's (none: its clip_frac counts weights clipped, gradient kept)."""
    flags, _ = steps_flags(args, 150)
    flags += ["--num-iterations", "4"]
    result = {}
    for file in ("scale/grpo.py", "scale/cispo.py"):
        runs = [train(args, file, flags, f"passes4-{file[:-3]}", seed) for seed in args.seeds]
        clipped = [statistics.mean(m["losses/clip_frac"] for m in run if "losses/clip_frac" in m) for run in runs]
        peak = [max(m["losses/clip_frac"] for m in run if "losses/clip_frac" in m) for run in runs]
        accuracy = [last(run, "eval/accuracy") for run in runs]
        result[file] = {"clip_frac": clipped, "clip_frac_max": peak, "accuracy": accuracy}
        print(
            f"  {file}: clipped tokens {spread(clipped, 2, 100)}% on average (max {spread(peak, 2, 100)}%), "
            f"held-out accuracy {spread(accuracy, 1, 100)}%"
        )
    # the paper's comparison: DAPO at CISPO's learning rate and beta (0), both 4 passes a batch
    from scale import cispo

    rate = cispo.Args().learning_rate
    runs = [
        train(args, "scale/dapo.py", flags + ["--learning-rate", str(rate)], "passes4-dapo", seed)
        for seed in args.seeds
    ]
    accuracy = [last(run, "eval/accuracy") for run in runs]
    sampled = [last(run, "charts/rollouts_sampled") for run in runs]  # dynamic sampling draws more than it trains on
    result["scale/dapo.py"] = {"accuracy": accuracy, "learning_rate": rate, "rollouts_sampled": sampled}
    print(
        f"  dapo.py at cispo.py's learning rate ({rate}) and beta (0): held-out accuracy {spread(accuracy, 1, 100)}%, "
        f"{spread(sampled, 0)} rollouts sampled"
    )
    return result


def results_row(path, name):
    """The cells of docs/*.md's table row `| name | ...`."""
    with open(os.path.join(ROOT, "docs", path)) as f:
        line = next(line for line in f if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def mean_of(cell, index=-1):
    """The mean of a 'a ± b' (or 'x ± y → a ± b') cell."""
    return float(re.findall(r"(-?[0-9.]+) ± ", cell)[index])


def rloo_vs_ppo(args):
    """docs/results.md's rloo and ppo rows per rollout (steps x completions a step, from each file's defaults) and per
    second of wall time."""
    from scale import ppo, rloo

    result = {}
    for name, module in (("rloo", rloo), ("ppo", ppo)):
        a = module.Args()
        rollouts = a.num_steps * a.prompts_per_step * getattr(a, "group_size", 1)
        cells = results_row("results.md", name)
        accuracy, seconds = mean_of(cells[1]), mean_of(cells[4])
        result[name] = {"rollouts": rollouts, "accuracy": accuracy, "seconds": seconds}
        print(f"  {name}: {accuracy}% held-out after {rollouts:,} rollouts in {seconds:.0f} s")
    # the paper's k = 2 at PPO's rollouts a step (128): 64 prompts x 2, as many steps as ppo.py's default
    flags, _ = steps_flags(args, ppo.Args().num_steps)
    flags += ["--group-size", "2", "--prompts-per-step", "64"]
    runs = [train(args, "scale/rloo.py", flags, "rloo-k2", seed) for seed in args.seeds]
    accuracy, seconds = [last(run, "eval/accuracy") for run in runs], [last(run, "charts/elapsed_time") for run in runs]
    steps = int(flags[flags.index("--num-steps") + 1])
    result["rloo k=2"] = {"rollouts": steps * 128, "accuracy": accuracy, "seconds": seconds}
    print(
        f"  rloo.py, 64 prompts x 2: {spread(accuracy, 1, 100)}% held-out after {steps * 128:,} rollouts in "
        f"{spread(seconds, 0)} s"
    )
    return result


def areal_staleness(args):
    """docs/async_grpo.md's rows at each staleness bound, decoupled against coupled; then async_grpo.py at eta 16 and
    learning rate 1e-3 (ten times its default), decoupled and coupled, against eta 0 at that rate."""
    result = {}
    for row in ("sync", "eta1", "eta1-coupled", "eta2", "eta2-coupled", "eta4", "eta4-coupled"):
        cells = results_row("async_grpo.md", row)
        result[row] = mean_of(cells[1])
        print(f"  {row}: held-out accuracy {cells[1]}")
    flags, _ = steps_flags(args, 150)
    flags += ["--learning-rate", "1e-3"]
    for name, extra in (("sync", ["0"]), ("eta16", ["16"]), ("eta16-coupled", ["16", "--no-decoupled"])):
        runs = [
            train(args, "scale/async_grpo.py", flags + ["--max-staleness", *extra], f"lr1e-3-{name}", s)
            for s in args.seeds
        ]
        accuracy = [last(run, "eval/accuracy") for run in runs]
        weight = [statistics.mean(m["losses/behav_weight"] for m in run if "losses/behav_weight" in m) for run in runs]
        clipped = [statistics.mean(m["losses/clip_frac"] for m in run if "losses/clip_frac" in m) for run in runs]
        result[f"lr 1e-3 {name}"] = {"accuracy": accuracy, "behav_weight": weight, "clip_frac": clipped}
        print(
            f"  lr 1e-3, {name}: held-out accuracy {spread(accuracy, 1, 100)}%, pi_prox / pi_behav "
            f"{spread(weight, 4)} on average, clipped tokens {spread(clipped, 2, 100)}%"
        )
    return result


def sampler_mismatch(args):
    """grpo.py with its sampler at MISMATCH and its loss at 1, uncorrected and with two corrections, against the
    matched default: held-out accuracy, the mismatch (mean |log r| and the share of tokens beyond a ratio of 2) and
    the weights the correction gave."""
    flags, _ = steps_flags(args, 150)
    result = {"matched": std_row("matched (the default)", [default_grpo(args, seed) for seed in args.seeds])}
    for temperature, name in ((MISMATCH, "mismatch"), (FLATTER, "mismatch15")):
        for mode in ("none", "token-tis", "icepop"):
            with patching(sample=sampled_at(temperature)):
                runs = [
                    train(args, "scale/grpo.py", flags + ["--rollout-correction", mode], f"{name}-{mode}", seed, True)
                    for seed in args.seeds
                ]
            accuracy = [last(run, "eval/accuracy") for run in runs]
            mean = lambda key: [statistics.mean(m[key] for m in run if key in m) for run in runs]  # noqa: E731
            diff, beyond = mean("rollout/logprob_diff"), mean("rollout/beyond_2")
            weights = mean("rollout/is_weight") if mode != "none" else [1.0] * len(runs)
            record = {"accuracy": accuracy, "logprob_diff": diff, "beyond_2": beyond, "is_weight": weights}
            result[f"{temperature} {mode}"] = record
            print(
                f"  sampled at {temperature}, --rollout-correction {mode}: held-out accuracy "
                f"{spread(accuracy, 1, 100)}%, |log r| {spread(diff, 3)}, beyond 2 {spread(beyond, 1, 100)}%, "
                f"weight {spread(weights, 3)}"
            )
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 steps a run, 64 held-out prompts")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "effects"))
    parser.add_argument("--figure", help="length-bias: write the lengths over training to this PNG file")
    parser.add_argument("--json", help="write every row's numbers to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds = args.seeds[:1]
    args.sampled = 64 if args.quick else SAMPLED
    results = {}
    for row in args.rows:
        print(row, flush=True)
        results[row] = globals()[row.replace("-", "_")](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
