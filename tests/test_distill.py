"""distill.py: its advantage and losses against numbers worked out by hand (and TRL's generalized_jsd_loss where TRL
is installed), which gradient each estimates, the chunked whole-vocabulary pass against the models' own logits, a bad
--teacher-path, and short runs of both losses."""

import json
import math
import os

import pytest
import torch
from conftest import ROOT, read_metrics, run_here, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from distill import aggregate, generalized_jsd, pg_loss, teacher_advantages
from scale.distill import last_states, token_jsd

SENTINEL = 1e6  # a padded position holds this; it must not reach the loss, the stats or the gradient
L = math.log


def test_teacher_advantages_by_hand():
    """A_t = log pi_T - log pi_old on completion tokens, 0 on padding, and a constant."""
    teacher = torch.tensor([[L(0.25), L(0.5), -SENTINEL]], requires_grad=True)
    old = torch.tensor([[L(0.5), L(0.25), SENTINEL]])
    advantages = teacher_advantages(teacher, old, torch.tensor([[1, 1, 0]]))
    # log(0.25 / 0.5) = -log 2, log(0.5 / 0.25) = log 2: the token the teacher likes more than the student goes up
    torch.testing.assert_close(advantages, torch.tensor([[-L(2), L(2), 0.0]]))
    assert not advantages.requires_grad


def two_rows():
    """Two completions of two tokens, the first padded to three with a sentinel; eps_low = eps_high = 0.2.

    old     = log [[0.5, 0.25, pad], [0.2, 0.4, 0.3]]    teacher = log [[0.25, 0.5, pad], [0.4, 0.1, 0.3]]
    A = teacher - old: [[-log 2, log 2, 0], [log 2, -log 4, 0]]   (row 1's last token: A = 0)
    ratios r:          [[0.5,    1.1, pad], [1.5,   0.85,  1.0]]
    """
    old = torch.tensor([[L(0.5), L(0.25), SENTINEL], [L(0.2), L(0.4), L(0.3)]])
    teacher = torch.tensor([[L(0.25), L(0.5), -SENTINEL], [L(0.4), L(0.1), L(0.3)]])
    ratio = torch.tensor([[0.5, 1.1, 1.0], [1.5, 0.85, 1.0]])
    logprobs = old + ratio.log()
    logprobs[0, 2] = -SENTINEL
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logprobs.requires_grad_(True), old, teacher, mask


# per-token losses -min(r A, clip(r, 0.8, 1.2) A):
#   row 0: A = -log 2, r 0.5 -> min(-0.5 log 2, -0.8 log 2) = -0.8 log 2 -> +0.8 log 2 (clipped: no gradient)
#          A = +log 2, r 1.1 -> 1.1 log 2 inside the range                -> -1.1 log 2 (gradient -1.1 log 2)
#   row 1: A = +log 2, r 1.5 -> min(1.5 log 2, 1.2 log 2) = 1.2 log 2   -> -1.2 log 2 (clipped: no gradient)
#          A = -log 4, r 0.85 -> -0.85 log 4 inside the range              -> +0.85 log 4 (gradient +0.85 log 4)
#          A = 0                                                            -> 0
ROW0 = [0.8 * L(2), -1.1 * L(2)]
ROW1 = [-1.2 * L(2), 0.85 * L(4), 0.0]


@pytest.mark.parametrize(
    "loss_agg, expected, grad",
    [
        (
            "seq-mean-token-mean",
            (sum(ROW0) / 2 + sum(ROW1) / 3) / 2,
            [[0, -1.1 * L(2) / 4, 0], [0, 0.85 * L(4) / 6, 0]],
        ),
        ("token-mean", (sum(ROW0) + sum(ROW1)) / 5, [[0, -1.1 * L(2) / 5, 0], [0, 0.85 * L(4) / 5, 0]]),
        (
            "seq-mean-token-sum-norm",
            (sum(ROW0) / 4 + sum(ROW1) / 4) / 2,
            [[0, -1.1 * L(2) / 8, 0], [0, 0.85 * L(4) / 8, 0]],
        ),
    ],
)
def test_pg_loss_by_hand(loss_agg, expected, grad):
    """The value, the gradient (the clipped tokens and the padded sentinel get none) and the stats; the gradient of
    an unclipped token is -r A / (its normaliser)."""
    logprobs, old, teacher, mask = two_rows()
    advantages = teacher_advantages(teacher, old, mask)
    loss, stats = pg_loss(logprobs, old, advantages, mask, 0.2, 0.2, loss_agg, max_completion_length=4)
    torch.testing.assert_close(loss, torch.tensor(expected))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad))
    torch.testing.assert_close(stats["clip_frac"], torch.tensor(2 / 5))  # row 0's first, row 1's first
    torch.testing.assert_close(stats["ratio"], torch.tensor((0.5 + 1.1 + 1.5 + 0.85 + 1.0) / 5))


def test_aggregate_by_hand():
    per_token = torch.tensor([[1.0, 2.0, SENTINEL], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    torch.testing.assert_close(aggregate(per_token, mask, "seq-mean-token-mean"), torch.tensor((1.5 + 4.0) / 2))
    torch.testing.assert_close(aggregate(per_token, mask, "token-mean"), torch.tensor(15.0 / 5))
    torch.testing.assert_close(
        aggregate(per_token, mask, "seq-mean-token-sum-norm", 4), torch.tensor((3 / 4 + 12 / 4) / 2)
    )


# S = [0.5, 0.5], T = [0.9, 0.1] (two-entry vocabulary); M = beta T + (1 - beta) S
#   beta 0:   KL(T || S) = 0.9 log(0.9 / 0.5) + 0.1 log(0.1 / 0.5)                              = 0.368064
#   beta 1:   KL(S || T) = 0.5 log(0.5 / 0.9) + 0.5 log(0.5 / 0.1)                              = 0.510826
#   beta 0.5: M = [0.7, 0.3]:   0.5 (0.9 log(0.9/0.7) + 0.1 log(0.1/0.3))
#                             + 0.5 (0.5 log(0.5/0.7) + 0.5 log(0.5/0.3))  = 0.5 * 0.116322 + 0.5 * 0.087177 = 0.101750
#   beta 0.9: M = [0.86, 0.14]: 0.9 (0.9 log(0.9/0.86) + 0.1 log(0.1/0.14))
#                             + 0.1 (0.5 log(0.5/0.86) + 0.5 log(0.5/0.14)) = 0.9 * 0.007268 + 0.1 * 0.365321 = 0.043074
HAND = {
    0.0: 0.9 * L(0.9 / 0.5) + 0.1 * L(0.1 / 0.5),
    1.0: 0.5 * L(0.5 / 0.9) + 0.5 * L(0.5 / 0.1),
    0.5: 0.5 * (0.9 * L(0.9 / 0.7) + 0.1 * L(0.1 / 0.3)) + 0.5 * (0.5 * L(0.5 / 0.7) + 0.5 * L(0.5 / 0.3)),
    0.9: 0.9 * (0.9 * L(0.9 / 0.86) + 0.1 * L(0.1 / 0.14)) + 0.1 * (0.5 * L(0.5 / 0.86) + 0.5 * L(0.5 / 0.14)),
}


@pytest.mark.parametrize("beta", sorted(HAND))
def test_generalized_jsd_on_a_two_entry_vocabulary_by_hand(beta):
    """The logits are any whose softmax is S and T (a shift changes nothing); the second row swaps T's entries."""
    logits = torch.tensor([[3.0, 3.0], [-1.0, -1.0]])
    teacher_logits = torch.tensor([[L(0.9), L(0.1)], [L(0.1) + 5, L(0.9) + 5]])
    jsd = generalized_jsd(logits, teacher_logits, beta)
    torch.testing.assert_close(jsd, torch.tensor([HAND[beta], HAND[beta]]))  # S is symmetric: the same divergence
    assert abs(HAND[0.5] - 0.101750) < 1e-6 and abs(HAND[0.9] - 0.043074) < 1e-6  # the comment's arithmetic


def test_the_gradient_of_each_end_by_hand():
    """S = softmax(z) = [0.5, 0.5], T = [0.9, 0.1]. Forward KL(T || S) = -sum T log S + const: its gradient in z is
    S - T = [-0.4, 0.4]. Reverse KL(S || T): dKL/dz_j = S_j (log S_j - log T_j - KL) = 0.5 (log(0.5/0.9) - 0.510826)
    and 0.5 (log 5 - 0.510826) = [-0.549306, 0.549306] (both sides +-0.5 log 3)."""
    teacher_logits = torch.tensor([[L(0.9), L(0.1)]])
    for beta, expected in ((0.0, [-0.4, 0.4]), (1.0, [-0.5 * L(3), 0.5 * L(3)])):
        logits = torch.zeros(1, 2, requires_grad=True)
        generalized_jsd(logits, teacher_logits, beta).sum().backward()
        torch.testing.assert_close(logits.grad, torch.tensor([expected]))
        assert teacher_logits.grad is None


def test_the_sampled_loss_estimates_the_reverse_kl_gradient_and_k3_the_forward():
    """At one prefix of a 4-entry vocabulary, the expectation over the sampled token o ~ S (summed exactly, weight
    S(o)) of the gradient of --loss reverse-kl's loss at ratio 1 is the gradient of KL(S || T) (the docstring's
    claim); the k3 estimate exp(d) - d - 1, d = log T(o) - log S(o), back-propagated directly (verl with
    use_policy_gradient false, its YAML's default) has the gradient of KL(T || S) instead, and the two differ."""
    torch.manual_seed(0)
    z, teacher_logits = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    s, t = z.log_softmax(-1)[0], teacher_logits.log_softmax(-1)[0]
    weights, mask = s.exp().detach(), torch.ones(1, 1)
    pg, k3 = 0, 0
    for o in range(4):
        logprob = s[o].view(1, 1)
        advantage = teacher_advantages(t[o].view(1, 1), logprob.detach(), mask)
        pg = pg + weights[o] * pg_loss(logprob, logprob.detach(), advantage, mask)[0]
        d = t[o] - s[o]
        k3 = k3 + weights[o] * (torch.exp(d) - d - 1)
    pg_grad, k3_grad = torch.autograd.grad(pg, z, retain_graph=True)[0], torch.autograd.grad(k3, z)[0]
    reverse = torch.autograd.grad(generalized_jsd(z, teacher_logits, 1.0).sum(), z)[0]
    forward = torch.autograd.grad(generalized_jsd(z, teacher_logits, 0.0).sum(), z)[0]
    torch.testing.assert_close(pg_grad, reverse)
    torch.testing.assert_close(k3_grad, forward)
    torch.testing.assert_close(forward, (s.exp() - t.exp()).detach().view(1, 4))  # S - T, by hand
    assert (pg_grad - k3_grad).abs().max() > 0.05


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_matches_trl(beta):
    """TRL's generalized_jsd_loss (trl.experimental.gkd, 1.16), reduction "none" summed over the vocabulary, on
    random logits at temperature 2 (both files divide the logits by it: here the caller does)."""
    gkd = pytest.importorskip("trl.experimental.gkd")
    torch.manual_seed(1)
    student, teacher = torch.randn(2, 5, 11) * 3, torch.randn(2, 5, 11) * 3
    expected = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, beta=beta, temperature=2.0, reduction="none")
    ours = generalized_jsd(student.view(-1, 11) / 2, teacher.view(-1, 11) / 2, beta)
    torch.testing.assert_close(ours, expected.sum(-1).view(-1))


def tiny_llama(hidden_size, vocab_size, seed):
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float()


def test_token_jsd_equals_the_models_own_logits_in_any_chunks():
    """A student (d 32, 18 tokens) and a wider teacher (d 48) whose output layer has 6 padding rows more: per token,
    the JSD, the sampled reverse-KL estimate and the exact reverse KL equal those of the models' own full logits
    (the teacher's cut to the student's 18); 0 on the last column, which no row attends to; chunks of 3 positions
    give the values and the student's gradient of one chunk."""
    student, teacher = tiny_llama(32, 18, 0), tiny_llama(48, 24, 1).eval()
    for model in (student, teacher):
        model.compute_dtype = torch.float32
    # left-padded prompts of 3 and 2 tokens, completions of 3 and 2 tokens (the second stopped), a column nobody attends
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 2, 0], [0, 5, 6, 10, 2, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]])
    prompt_len, mask = 3, attention_mask[:, 3:]
    states = last_states(teacher, input_ids, attention_mask, prompt_len, batch_size=1)  # (2, 4, 48)
    assert states.shape == (2, 4, 48) and not states.requires_grad

    positions = (attention_mask.cumsum(1) - 1).clamp(0)
    logits = student(input_ids, attention_mask=attention_mask, position_ids=positions).logits[:, 2:-1] / 0.7
    with torch.no_grad():
        teacher_logits = teacher(input_ids, attention_mask=attention_mask, position_ids=positions).logits[:, 2:-1]
    teacher_logits = teacher_logits[..., :18] / 0.7
    expected = generalized_jsd(logits.flatten(0, 1), teacher_logits.flatten(0, 1), 0.3).view(2, 4)
    targets = input_ids[:, 3:, None]
    s, t = logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    sampled = (s.gather(-1, targets) - t.gather(-1, targets)).squeeze(-1)
    exact = (s.exp() * (s - t)).sum(-1)
    (expected * mask).sum().backward()
    grads = [p.grad.clone() for p in student.parameters()]

    for chunk_values in (18 * 3, 2**24):
        student.zero_grad()
        jsd, sampled_kl, reverse_kl, logprobs = token_jsd(
            student, teacher, states, input_ids, attention_mask, prompt_len, 0.7, 0.3, chunk_values=chunk_values
        )
        m = mask.bool()
        torch.testing.assert_close(jsd[m], expected[m])
        torch.testing.assert_close(sampled_kl[m], sampled[m].detach())
        torch.testing.assert_close(reverse_kl[m], exact[m].detach())
        torch.testing.assert_close(logprobs[m], s.gather(-1, targets).squeeze(-1)[m].detach())  # the mismatch's pi_old
        assert (jsd[:, 3] == 0).all() and (reverse_kl[:, 3] == 0).all()  # the column cut off
        assert not any(x.requires_grad for x in (sampled_kl, reverse_kl, logprobs))
        (jsd * mask).sum().backward()
        for p, g in zip(student.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
        assert all(p.grad is None for p in teacher.parameters())


def test_token_jsd_keeps_no_logits_beyond_one_chunk_for_the_backward_pass():
    """What autograd keeps for the backward pass (token_logprobs' test in test_shared.py): with 3 positions a chunk,
    the tensors over the 300-token vocabulary other than the weights add up to at most one chunk's logits, since each
    chunk is computed again in the backward pass; the JSD of the models' full logits keeps all 10 positions'."""
    student, teacher = tiny_llama(32, 300, 0), tiny_llama(32, 300, 1).requires_grad_(False)
    input_ids, attention_mask = torch.randint(3, 300, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    states = last_states(teacher, input_ids, attention_mask, 4, batch_size=2)
    weights = {p.untyped_storage().data_ptr() for p in [*student.parameters(), *teacher.parameters()]}

    def saved_vocabulary_values(compute):
        sizes = [0]

        def pack(tensor):  # logits, or anything else over the vocabulary that is not the weights themselves
            is_weight = tensor.untyped_storage().data_ptr() in weights
            if tensor.shape and tensor.shape[-1] == 300 and tensor.dtype.is_floating_point and not is_weight:
                sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            jsd = compute()
        jsd.sum().backward()
        return sum(sizes)

    def plain():
        logits = student(input_ids, attention_mask=attention_mask).logits[:, 3:-1].flatten(0, 1)
        with torch.no_grad():
            teacher_logits = teacher(input_ids, attention_mask=attention_mask).logits[:, 3:-1].flatten(0, 1)
        return generalized_jsd(logits, teacher_logits, 0.5)

    chunked = saved_vocabulary_values(
        lambda: token_jsd(student, teacher, states, input_ids, attention_mask, 4, 1.0, 0.5, chunk_values=3 * 300)[0]
    )
    assert saved_vocabulary_values(plain) >= 10 * 300  # the check sees the logits when they are kept
    assert chunked <= 3 * 300


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """{name: a model folder}: a student (the bundled model with noise: worse at the task than the bundled model, the
    teacher), and teachers that cannot teach it: another vocabulary size, another split of a text, a smaller output
    layer; and one that stops on one more token than the student (and has noise of its own)."""
    folder, start = tmp_path_factory.mktemp("teachers"), os.path.join(ROOT, "tiny-adder")
    paths = {name: str(folder / name) for name in ("student", "vocabulary", "split", "small_head", "stops")}
    for name, path in paths.items():
        model, tokenizer = AutoModelForCausalLM.from_pretrained(start), AutoTokenizer.from_pretrained(start)
        if name in ("student", "stops"):
            generator = torch.Generator().manual_seed({"student": 0, "stops": 1}[name])
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 0.02)
        if name == "vocabulary":
            tokenizer.add_tokens(["<extra>"])
        if name == "small_head":
            model.resize_token_embeddings(17)
        if name == "stops":
            model.generation_config.eos_token_id = [2, 17]  # and the space
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    with open(os.path.join(start, "tokenizer.json")) as f:  # the same size, but '1' and '2' swapped
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    with open(os.path.join(paths["split"], "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    paths["missing"] = str(folder / "no_such_teacher")
    return paths


SMALL = ["--num-steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--micro-batch-size", "2"]
SMALL += ["--num-eval", "4", "--eval-every", "2", "--log-every", "1", "--max-new-tokens", "6"]


@pytest.mark.parametrize(
    "teacher, says",
    [
        ("missing", "no such folder"),
        ("vocabulary", "its tokenizer has 19 tokens, the student's 18; the teacher must share --model-name-or-path's"),
        ("split", "its tokenizer splits a probe text otherwise than the student's; the teacher must share"),
        ("small_head", "its output layer scores 17 tokens, the student's 18; give a teacher that scores every token"),
    ],
)
def test_a_bad_teacher_stops_before_training_with_one_line(teacher, says, teachers, tmp_path):
    out = tmp_path / "run"
    proc = run_script(
        "scale/distill.py", "--teacher-path", teachers[teacher], *SMALL, "--output-dir", str(out), expect_ok=False
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --teacher-path {teachers[teacher]}: ") and says in last, last
    assert not (out / "metrics.jsonl").exists()  # nothing trained, not even evaluated


@pytest.mark.parametrize("loss", ["reverse-kl", "jsd"])
def test_both_losses_run_and_log_the_teacher(loss, teachers, tmp_path):
    """Two steps from the bundled model, taught by a teacher that stops on one more token: a note names the stop
    tokens; the teacher's accuracy is logged once, at step 0; every step logs the sampled reverse KL, the stop share
    and the teacher pass's time (and, with --loss jsd, the exact reverse KL)."""
    out = tmp_path / "run"
    proc = run_script(
        "scale/distill.py", "--teacher-path", teachers["stops"], "--loss", loss, *SMALL, "--output-dir", str(out)
    )
    assert "note: the teacher's stop tokens [2, 17] are not the student's [2]" in proc.stdout
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert 0 <= metrics[0]["eval/teacher_accuracy"] <= 1 and all("eval/teacher_accuracy" not in m for m in metrics[1:])
    for m in metrics[1:]:
        assert m["charts/teacher_time"] > 0 and 0 <= m["charts/stopped"] <= 1 and math.isfinite(m["losses/reverse_kl"])
        assert ("losses/reverse_kl_exact" in m) == (loss == "jsd") and ("losses/clip_frac" in m) == (loss != "jsd")
    assert all(m["losses/reverse_kl"] != 0 for m in metrics[1:])  # the teacher is another model
    if loss == "jsd":  # KL(pi || pi_T) > 0 exactly
        assert all(m["losses/reverse_kl_exact"] > 0 for m in metrics[1:])
    rollouts = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if '"rollout"' in line]
    assert rollouts and all(math.isfinite(r["advantage"]) for r in rollouts)


def test_distillation_moves_the_student_toward_the_teacher(teachers, tmp_path):
    """From the bundled model with noise, taught by the bundled model (better at the task): in 20 steps held-out
    accuracy climbs toward the teacher's, and the sampled reverse KL falls."""
    out = tmp_path / "run"
    flags = ["--teacher-path", "tiny-adder", "--num-steps", "20", "--num-eval", "100", "--eval-every", "20"]
    run_script("scale/distill.py", "--model-name-or-path", teachers["student"], *flags, "--output-dir", str(out))
    metrics = read_metrics(out)
    (before, after), teacher = (metrics[i]["eval/accuracy"] for i in (0, -1)), metrics[0]["eval/teacher_accuracy"]
    assert teacher >= before + 0.1, (before, teacher)
    assert after >= before + 0.1, f"held-out accuracy {before:.3f} -> {after:.3f} (the teacher's {teacher:.3f})"
    kl = [m["losses/reverse_kl"] for m in metrics[1:]]  # steps 5, 10, 15, 20
    assert kl[-1] < 0.7 * kl[0], kl


def test_the_benchmark_reads_its_targets_by_hand():
    """benchmarks/distill_benchmark.py's cells from evaluations worked by hand: the first evaluation at or above the
    target, the mean over the seeds that reached it and how many did, the shared steps thinned to powers of two."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import distill_benchmark as b

    evals = [(0, 30.0, 0.0), (25, 80.0, 10.0), (50, 93.0, 20.0), (75, 91.0, 30.0)]
    assert b.first_reaching(evals, 92.0) == (50, 20.0) and b.first_reaching(evals, 95.0) is None
    assert b.reached([], 3) == "not reached (0/3)"
    assert b.reached([50, 100], 3) == "75 ± 35 (2/3 seeds)"  # the std over the seeds that reached it
    runs = [[{"step": s, "eval/accuracy": 0.5} for s in range(0, 301, 25)]]
    assert b.equal_steps({"grpo": [(runs[0], 1.0)], "distill": [(runs[0][:9], 1.0)]}) == [25, 50, 100, 200]


@pytest.mark.long
def test_the_benchmark_writes_its_table_from_the_runs(tmp_path):
    """benchmarks/distill_benchmark.py, grpo.py's and distill.py's rows for 2 small steps of seed 1: each row's
    accuracy is its run's, the teacher's accuracy names the target, the figure is written."""
    small = "--num-steps 2 --prompts-per-step 4 --num-eval 16 --eval-every 1 --log-every 1"
    args = ["--seeds", "1", "--rows", "grpo", "distill", f"--flags={small}", "--out-dir", str(tmp_path)]
    proc = run_here(["benchmarks/distill_benchmark.py", *args, "--runs-dir", str(tmp_path / "runs")])
    assert proc.returncode == 0, proc.stderr[-2000:]  # in this process: its runs are its subprocesses
    page = (tmp_path / "distill.md").read_text()
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in page.splitlines() if line.startswith("| ")}
    grpo, distill = read_metrics(tmp_path / "runs" / "grpo__1"), read_metrics(tmp_path / "runs" / "distill__1")
    for name, metrics in (("grpo", grpo), ("distill", distill)):
        first, last = (100 * metrics[i]["eval/accuracy"] for i in (0, -1))
        assert rows[name][1] == f"{first:.1f} → {last:.1f}", rows[name]
    teacher = 100 * distill[0]["eval/teacher_accuracy"]
    assert f"scores {teacher:.1f}% on the held-out prompts, so the target is {0.95 * teacher:.1f}%" in page
    assert rows["grpo"][-1] == "— |" and rows["distill"][-1] in {"0/1 |", "1/1 |"}
    assert "## On-policy distillation against GRPO" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "distill.png").stat().st_size > 0


@pytest.mark.long
def test_the_chain_rows_quick_form(tmp_path):
    """benchmarks/distill_chain.py's suite form: a teacher of 2 steps more, each row 2 steps of 8 completions, 16
    held-out chain prompts. Both rows start from the same student on the same prompts (the same accuracy at step 0);
    the off-policy row trains on the teacher's samples of training prompts; the block names both rows."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import distill_chain

    results = distill_chain.main(["--quick", "--seeds", "1", "--runs-dir", str(tmp_path), "--out-dir", str(tmp_path)])
    assert set(results["rows"]) == {"on-policy", "off-policy"}
    curves = {name: runs[0][0] for name, runs in results["rows"].items()}
    assert all([s for s, _ in c] == [0, 1, 2] and all(0 <= a <= 100 for _, a in c) for c in curves.values())
    assert curves["on-policy"][0] == curves["off-policy"][0] and results["student"] == curves["on-policy"][0][1]
    samples = [json.loads(line) for line in open(tmp_path / "teacher_samples_1_16.jsonl")]
    train = {json.loads(line)["prompt"] for line in open(tmp_path / "chain_train.jsonl")}
    assert len(samples) == 2 * 8 and all(s["prompt"] in train and s["completion"] for s in samples)
    page = (tmp_path / "distill.md").read_text()
    assert page.count("| on-policy |") == 1 and page.count("| off-policy |") == 1
