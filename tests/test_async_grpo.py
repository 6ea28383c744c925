"""async_grpo.py: the decoupled objective against numbers worked out by hand, eta 0 against grpo.py, the staleness
bound and learning at eta 2, and the flags it refuses."""

import math
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, run_script
from test_resume import assert_same_records, untimed

from async_grpo import behaviour_weights, decoupled_loss
from scale.async_grpo import version_metrics

L = math.log
PAD = 1e4  # a large sentinel at the padded positions: it must reach neither the loss nor the gradient


def hand_worked_batch():
    """Two completions, eps 0.2, cap 2; the second line of each is pi_theta, the policy being trained.

    completion 0, A = +1, three tokens and a pad:
      t0  prox 0.5  behav 0.5  w = 1               pi 0.75  u = 1.5 > 1.2: clipped, term min(1.5, 1.2) = 1.2
      t1  prox 0.4  behav 0.8  w = 0.5             pi 0.2   u = 0.5 < 0.8, but A > 0: min(0.5, 0.8) = 0.5
      t2  prox 0.6  behav 0.2  w = 3 > 2: left out  pi 0.6   u = 1
      l = -[1 * 1.2, 0.5 * 0.5, 0] = [-1.2, -0.25, 0]; its mean over 3 tokens -1.45 / 3 = -0.483333
    completion 1, A = -1, two tokens and two pads:
      t0  prox 0.6  behav 0.4  w = 1.5             pi 0.36  u = 0.6 < 0.8 and A < 0: clipped, min(-0.6, -0.8) = -0.8
      t1  prox 0.5  behav 0.5  w = 1               pi 0.55  u = 1.1: min(-1.1, -1.1) = -1.1
      l = -[1.5 * -0.8, 1 * -1.1] = [1.2, 1.1]; its mean 1.15
    loss (seq-mean-token-mean) = (-0.483333 + 1.15) / 2 = 0.333333
    """
    prox = torch.tensor([[L(0.5), L(0.4), L(0.6), -PAD], [L(0.6), L(0.5), -PAD, -PAD]])
    behav = torch.tensor([[L(0.5), L(0.8), L(0.2), PAD], [L(0.4), L(0.5), PAD, PAD]])
    logprobs = torch.tensor([[L(0.75), L(0.2), L(0.6), PAD], [L(0.36), L(0.55), PAD, PAD]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return logprobs, prox, behav, torch.tensor([1.0, -1.0]), mask


def test_decoupled_loss_value_and_gradient_by_hand():
    logprobs, prox, behav, advantages, mask = hand_worked_batch()
    loss, stats = decoupled_loss(
        logprobs, prox, behav, None, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.2, beta=0.0, behav_imp_cap=2.0
    )
    assert loss.item() == pytest.approx(1 / 3, rel=1e-5)
    loss.backward()
    # d loss / d log pi_t = 1/B 1/|o_i| * (-w_t u_t A) where the term is not clipped (and the token not left out):
    # completion 0, t1: 1/2 * 1/3 * -(0.5 * 0.5 * 1) = -0.0416667; completion 1, t1: 1/2 * 1/2 * -(1 * 1.1 * -1) = 0.275
    expected = torch.tensor([[0.0, -0.25 / 6, 0.0, 0.0], [0.0, 0.275, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected, atol=1e-6), logprobs.grad
    # the weights' mean over the 5 tokens (1 + 0.5 + 0 + 1.5 + 1) / 5 = 0.8, one of 5 left out, two of 5 clipped
    assert stats["behav_weight"].item() == pytest.approx(0.8, rel=1e-6)
    assert stats["behav_capped"].item() == pytest.approx(0.2, rel=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(0.4, rel=1e-6)


def test_the_coupled_objective_centres_the_clip_on_the_behaviour_policy():
    """--no-decoupled passes pi_behav as pi_prox: w = 1 and u = pi / pi_behav.
    completion 0, A = +1: u = [0.75/0.5, 0.2/0.8, 0.6/0.2] = [1.5, 0.25, 3] -> terms [1.2, 0.25, 1.2], mean -2.65/3
    completion 1, A = -1: u = [0.36/0.4, 0.55/0.5] = [0.9, 1.1] -> l = [0.9, 1.1], mean 1.0
    loss = (-0.883333 + 1.0) / 2 = 0.058333"""
    logprobs, _, behav, advantages, mask = hand_worked_batch()
    loss, stats = decoupled_loss(logprobs, behav, behav, None, advantages, mask, beta=0.0, behav_imp_cap=2.0)
    assert loss.item() == pytest.approx(0.35 / 6, rel=1e-5)
    assert stats["behav_weight"].item() == 1.0 and stats["behav_capped"].item() == 0.0


def test_behaviour_weights_by_hand():
    """The docstring's example: w = [1, 0.5, 0 (6 > 5: left out)], a padded position 0."""
    prox = torch.tensor([[L(0.5), L(0.3), L(0.6), -PAD]])
    behav = torch.tensor([[L(0.5), L(0.6), L(0.1), PAD]])
    weights, stats = behaviour_weights(prox, behav, torch.tensor([[1, 1, 1, 0]]), cap=5.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 0.5, 0.0, 0.0]]), atol=1e-6)
    assert stats["behav_weight"].item() == pytest.approx(0.5, rel=1e-6)
    assert stats["behav_capped"].item() == pytest.approx(1 / 3, rel=1e-6)
    # |log w| = [0, log 2, log 6]: their mean, and 1 of 3 beyond [1/2, 2] (w = 1/2 itself is not)
    assert stats["behav_logprob_diff"].item() == pytest.approx(math.log(12) / 3, rel=1e-6)
    assert stats["behav_beyond_2"].item() == pytest.approx(1 / 3, rel=1e-6)


RL = ["--prompts-per-step", "8", "--group-size", "4", "--num-eval", "50", "--log-every", "1", "--eval-every", "2"]


def test_eta_0_is_grpo(tmp_path):
    """With --max-staleness 0 the generator samples batch k with version k - 1, the policy about to be trained: no
    lag, every weight 1 to rounding (the generator's recorded log-probs against the trainer's), and the run is
    grpo.py's. grpo.py is the reference, not an eta-0 run of this file,
    because it is the synchronous algorithm written independently of the generator: the same seed gives the same
    metrics (their shared keys; float rounding aside), with two passes per batch so that pi_prox is recomputed. Up to
    the first update: after it the two models' weights may differ in the last bits (the weights w are 1 to rounding),
    and a later draw near an edge may then go either way."""
    flags = RL + ["--num-steps", "4", "--num-iterations", "2"]
    run_script("scale/async_grpo.py", *flags, "--max-staleness", "0", "--output-dir", str(tmp_path / "async"))
    run_script("scale/grpo.py", *flags, "--output-dir", str(tmp_path / "grpo"))
    asynchronous, synchronous = read_metrics(str(tmp_path / "async")), read_metrics(str(tmp_path / "grpo"))
    # grpo.py's sampler against its pi_old (rollout/): this file weighs its generator's log-probs instead (behav_)
    synchronous = [{k: v for k, v in m.items() if not k.startswith("rollout/")} for m in synchronous]
    steps = [m for m in asynchronous if m["step"] > 0]
    assert len(steps) == 4 and all(m["charts/staleness_max"] == 0 and m["charts/staleness"] == 0 for m in steps)
    assert all(
        m["losses/behav_weight"] == pytest.approx(1.0, abs=1e-5) and m["losses/behav_capped"] == 0.0 for m in steps
    )
    assert all(m["losses/behav_logprob_diff"] < 1e-4 and m["losses/behav_beyond_2"] == 0 for m in steps)
    shared = [{k: v for k, v in m.items() if k in s} for m, s in zip(untimed(asynchronous), untimed(synchronous))]
    assert_same_records(shared[:2], untimed(synchronous)[:2])  # evaluation at step 0, then step 1
    assert len(shared[1]) >= 10  # rewards, losses, accuracy ...
    # with interruption too: at eta 0 a batch starts with the newest version there is, and never switches
    interrupted = str(tmp_path / "interrupted")
    run_script(
        "scale/async_grpo.py", *flags, "--max-staleness", "0", "--interrupt-every", "1", "--output-dir", interrupted
    )
    steps = [m for m in read_metrics(interrupted) if m["step"] > 0]
    assert all(m["charts/switches"] == 0 and m["charts/token_share_lag0"] == 1 for m in steps)
    shared = [
        {k: v for k, v in m.items() if k in s} for m, s in zip(untimed(read_metrics(interrupted)), untimed(synchronous))
    ]
    assert_same_records(shared[:2], untimed(synchronous)[:2])


def test_eta_2_stays_within_its_staleness_and_learns(tmp_path):
    """40 steps at eta 2 from the bundled model: from step 3 on every batch is exactly 2 versions old (the generator
    ran ahead as far as it may), none more; the decoupled weights stay near 1; held-out accuracy rises by 20 points."""
    out = str(tmp_path / "run")
    run_script(
        "scale/async_grpo.py",
        "--max-staleness",
        "2",
        "--num-steps",
        "40",
        "--log-every",
        "1",
        "--eval-every",
        "40",
        "--output-dir",
        out,
    )
    steps = [m for m in read_metrics(out) if m["step"] > 0]
    assert [m["charts/staleness_max"] for m in steps] == [0, 1] + [2] * 38
    assert all(m["charts/staleness"] == min(m["step"] - 1, 2) for m in steps)
    assert all(0.9 < m["losses/behav_weight"] < 1.1 for m in steps)
    accuracy = [m["eval/accuracy"] for m in read_metrics(out) if "eval/accuracy" in m]
    assert accuracy[-1] >= accuracy[0] + 0.20, accuracy


def test_the_behaviour_weight_is_the_samplers_at_every_lag(tmp_path):
    """One rule: pi_behav is the log-prob the generator recorded, at lag 0 as at lag 1 or more (as AReaL does). In
    bfloat16 the generator's copy is held in bfloat16 while the trainer runs float32 masters under autocast, so at
    eta 0 the weight pi_prox / pi_behav carries that mismatch: not 1, but near it. (A rule that set pi_behav to
    pi_prox at lag 0 logged exactly 1.0 there, and the mismatch only from lag 1 on.)"""
    out = str(tmp_path / "run")
    run_script(
        "scale/async_grpo.py",
        "--max-staleness",
        "0",
        "--dtype",
        "bfloat16",
        "--num-steps",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--num-eval",
        "4",
        "--log-every",
        "1",
        "--output-dir",
        out,
    )
    weights = [m["losses/behav_weight"] for m in read_metrics(out) if m["step"] > 0]
    assert len(weights) == 2 and all(1e-4 < abs(w - 1) < 0.1 for w in weights), weights


def test_same_seed_same_metrics_with_activation_checkpointing(tmp_path):
    """The issue's command (8 steps; 16 prompts a step, half the default, to keep the suite short), twice: at eta 2
    with --gradient-checkpointing the trainer's recomputations no longer rewind the generator's random numbers (they
    did, and the runs parted from the 4th logged step)."""
    flags = [
        "--max-staleness",
        "2",
        "--gradient-checkpointing",
        "--micro-batch-size",
        "16",
        "--prompts-per-step",
        "16",
        "--num-steps",
        "8",
        "--log-every",
        "1",
        "--num-eval",
        "50",
    ]
    for name in ("a", "b"):
        run_script("scale/async_grpo.py", *flags, "--output-dir", str(tmp_path / name))
    a, b = (untimed(read_metrics(str(tmp_path / name))) for name in ("a", "b"))
    assert len(a) == 9
    assert_same_records(a, b)


def test_version_metrics_by_hand():
    """Batch of step 6 started by version 3, switched to 4 after 2 tokens and to 5 after 4; completions of 6 and 3
    tokens: versions 3 3 4 4 5 5 and 3 3 4, lags 2 2 1 1 0 0 and 2 2 1: lag 2 for 4 tokens of 9, 1 for 3, 0 for
    2; mean lag (4 * 2 + 3) / 9 = 11 / 9; 3 and 2 versions in a completion; 2 switches."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    metrics = version_metrics(3, [[2, 4], [4, 5]], mask, 6)
    expected = {
        "charts/token_share_lag0": 2 / 9,
        "charts/token_share_lag1": 3 / 9,
        "charts/token_share_lag2": 4 / 9,
        "charts/token_staleness": 11 / 9,
        "charts/versions_per_completion": 2.5,
        "charts/versions_per_completion_max": 3.0,
        "charts/switches": 2.0,
    }
    assert {k: float(v) for k, v in metrics.items()} == pytest.approx(expected, abs=1e-6)


def test_interrupted_rollouts_take_each_tokens_log_prob_from_the_version_that_sampled_it():
    """The generator with --interrupt-every 1 at eta 1 and a stand-in trainer: batch 2 starts with version 0 and,
    after its first token, waits for version 1 (published later, with other weights), loads it and goes on. Its
    first tokens' behaviour log-probs are version 0's, the later ones version 1's, each equal to a fresh forward
    pass of that version over the same prefix; batch 1, which no newer version may reach (its step trains version
    0), never switches."""
    from scale import async_grpo

    args = async_grpo.Args(dtype="float32", num_steps=3, max_staleness=1, interrupt_every=1, cuda=False)
    args.prompts_per_step, args.group_size = 4, 2
    device = torch.device("cpu")
    tokenizer = async_grpo.load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    versions = [async_grpo.load_model(args.model_name_or_path, args, device, frozen=True) for _ in range(2)]
    with torch.no_grad():
        for weight in versions[1].parameters():
            weight.add_(0.02 * torch.randn_like(weight))
    stop_ids = async_grpo.stop_token_ids(tokenizer, versions[0])
    records = async_grpo.addition_task(10)[0][:50]
    torch.manual_seed(3)
    generator = async_grpo.Generator(versions[0], tokenizer, records, stop_ids, random.Random(3), args, device, 0)
    batches = [generator.take()]
    generator.publish(1, versions[1])  # the trainer, after step 1
    batches.append(generator.take())
    assert batches[0][5] == 0 and batches[0][7] == [] and batches[1][5] == 0 and batches[1][7] == [[1, 1]]
    _, prompt_ids, prompt_mask, completion_ids, behav, *_ = batches[1]
    mask = async_grpo.completion_mask(completion_ids, stop_ids)
    ids, attention = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask.long()], 1)
    with torch.no_grad():
        fresh = [async_grpo.token_logprobs(v, ids, attention, prompt_ids.shape[1], 1.0) for v in versions]
    assert mask[:, 1:].sum() > 0
    for version, tokens in ((0, slice(0, 1)), (1, slice(1, None))):
        m = mask[:, tokens].bool()
        torch.testing.assert_close(behav[:, tokens][m], fresh[version][:, tokens][m], atol=1e-5, rtol=0)
    assert (fresh[0][:, 1:][mask[:, 1:].bool()] - behav[:, 1:][mask[:, 1:].bool()]).abs().max() > 1e-3


def test_same_seed_same_run_with_interruption(tmp_path):
    """--interrupt-every 2 at eta 2, twice with the same seed: the same metrics (the switches fall on tokens the
    schedule fixes, whatever the threads' timing), with switches made and tokens of more than one version."""
    flags = RL + ["--max-staleness", "2", "--interrupt-every", "2", "--num-steps", "6"]
    for name in ("a", "b"):
        run_script("scale/async_grpo.py", *flags, "--output-dir", str(tmp_path / name))
    a, b = (untimed(read_metrics(str(tmp_path / name))) for name in ("a", "b"))
    assert len(a) == 7
    assert_same_records(a, b)
    assert (
        sum(m["charts/switches"] for m in a[1:]) > 0 and max(m["charts/versions_per_completion_max"] for m in a[1:]) > 1
    )


def test_publish_copies_the_weights_only_once_the_generator_took_the_last_ones():
    """At most one copy waits beside the generator's own: publish waits, then copies (it copied first, and a second
    copy could wait beside the one not yet taken)."""
    import threading

    from scale.async_grpo import Generator

    copies = []
    policy = torch.nn.Module()  # a model whose state_dict counts its calls
    policy.state_dict = lambda: copies.append(1) or {"w": torch.ones(2)}
    generator = Generator.__new__(Generator)
    generator.args = SimpleNamespace(max_staleness=0, num_steps=10, interrupt_every=0)
    generator.next_batch = 3  # batches 3 to 10 are still to sample
    generator.model = SimpleNamespace(state_dict=lambda: {"w": torch.zeros(2)})
    generator.device, generator.lock, generator.error = torch.device("cpu"), threading.Condition(), None
    generator.waiting = (1, {"w": torch.zeros(2)})  # version 1, not yet taken
    thread = threading.Thread(target=generator.publish, args=(2, policy), daemon=True)
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive() and copies == []  # waiting, and nothing copied
    with generator.lock:
        generator.waiting = None  # the generator takes version 1
        generator.lock.notify_all()
    thread.join(timeout=10)
    assert not thread.is_alive() and copies == [1] and generator.waiting[0] == 2


def test_no_switch_once_every_row_has_stopped():
    """On a GPU the loop looks at the stop every 16 tokens, so a switch may fall due after every row has stopped: the
    generator then neither waits for the trainer nor counts a switch; while a row goes on, it switches."""
    import threading

    from scale.async_grpo import Generator

    generator = Generator.__new__(Generator)
    generator.args = SimpleNamespace(interrupt_every=2)
    generator.version, generator.lock, generator.pausing = 0, threading.Condition(), False
    loaded = []
    generator.load_versions = lambda version: loaded.append(version) or setattr(generator, "version", version)
    switches = []
    assert not generator.switch(3, 0, switches, 2, lambda: False)  # due (version 1), but nothing left to sample
    assert loaded == [] and switches == []
    assert generator.switch(3, 0, switches, 2, lambda: True)
    assert loaded == [1] and switches == [[2, 1]]
    calls = []
    assert not generator.switch(3, 0, switches, 3, lambda: calls.append(1) or True)  # not due: no look at the stop
    assert calls == []


@pytest.mark.parametrize("pause", ["generator.paused", "none"])
def test_the_generator_draws_nothing_while_evaluate_samples(pause, monkeypatch):
    """evaluate()'s sampled completions run inside torch.random.fork_rng, which puts torch's generator back when it
    closes, and the generator thread samples from that same generator. A stand-in generator whose first batch waits
    until the fork is open or it is asked to pause makes the overlap happen every time: with the pause that main()
    passes, its draws are the seed's first three numbers; without one (the code before), its first draw is made
    inside the fork, rewound, and drawn again by the next batch."""
    import contextlib
    import threading
    import time

    from scale import async_grpo

    fork_open, drawn_inside, evaluated = threading.Event(), threading.Event(), threading.Event()
    generator = None

    def stand_in_sample(self, batch):  # a batch of one random number, drawn as generate() would draw its tokens
        if self.next_batch > 1:  # the later batches once evaluate() has returned
            evaluated.wait(timeout=30)
        deadline = time.monotonic() + 30
        while self.next_batch == 1 and not (fork_open.is_set() or self.pausing) and time.monotonic() < deadline:
            time.sleep(0.001)
        value = torch.rand(1).item()
        if fork_open.is_set():
            drawn_inside.set()
        return [value]

    def stand_in_completions(model, tokenizer, records, args, stop_ids, temperature=None):
        if temperature is not None:  # the sampled ones, inside the fork
            fork_open.set()
            deadline = time.monotonic() + 30
            while not (drawn_inside.is_set() or generator.pausing and not generator.sampling):
                assert time.monotonic() < deadline, "the generator neither drew nor paused"
                time.sleep(0.001)
            torch.rand(8)  # evaluate's own samples draw too
            fork_open.clear()
        return ["0"] * len(records)

    monkeypatch.setattr(async_grpo.Generator, "sample", stand_in_sample)
    monkeypatch.setattr(async_grpo, "completion_texts", stand_in_completions)
    args = async_grpo.Args(dtype="float32", num_steps=3, max_staleness=5, eval_samples=2, cuda=False)
    device = torch.device("cpu")
    tokenizer = async_grpo.load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    policy = async_grpo.load_model(args.model_name_or_path, args, device)
    torch.manual_seed(7)
    expected = torch.rand(3).tolist()
    torch.manual_seed(7)
    generator = async_grpo.Generator(policy, tokenizer, [], [2], None, args, device, version=0)
    records = [{"prompt": "1+1=", "answer": "2"}] * 4
    pause = generator.paused if pause == "generator.paused" else contextlib.nullcontext
    metrics = async_grpo.evaluate(policy, tokenizer, records, args, [2], k=args.eval_samples, pause=pause)
    evaluated.set()
    assert metrics["eval/pass@k"] == 0.0
    drawn = [generator.take()[0] for _ in range(3)]
    if pause is not contextlib.nullcontext:
        assert not drawn_inside.is_set() and drawn == expected
    else:  # the check can fail: without the pause, the first draw falls inside the fork and is drawn twice
        assert drawn_inside.is_set() and drawn == [expected[0], expected[0], expected[1]]


# a negative --max-staleness and a --behav-imp-cap below 1: tests/test_flags.py, with every numeric flag's edges
@pytest.mark.parametrize(
    "flags, env, message",
    [
        (["--no-decoupled", "--behav-imp-cap", "3"], {}, "--behav-imp-cap 3.0 with --no-decoupled: the cap limits"),
        ([], {"LOCAL_RANK": "0"}, "torchrun: async_grpo.py runs on one process"),
        (["--interrupt-every", "2", "--save-every", "5"], {}, "--interrupt-every 2 with --save-every 5: a checkpoint"),
        (["--interrupt-every", "8"], {}, "--interrupt-every 8 with --max-new-tokens 8: a rollout would never reach"),
    ],
)
def test_bad_input_is_one_line(flags, env, message, tmp_path):
    out = tmp_path / "run"
    proc = run_script("scale/async_grpo.py", *flags, "--output-dir", str(out), env=env, expect_ok=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.long
def test_the_async_benchmark_writes_its_table_and_figure_from_the_runs(tmp_path):
    """benchmarks/async_benchmark.py, one row for 2 steps: its page gets the results block with that row, whose
    cells are the run's own numbers, and the figure; the page's text outside the markers stays."""
    out = tmp_path / "out"
    out.mkdir()
    page = out / "async_grpo.md"
    marks = ("<!-- results: written by benchmarks/async_benchmark.py -->", "<!-- end of results -->")
    page.write_text(f"# kept\n\n{marks[0]}\nold\n{marks[1]}\nkept too\n")
    run_script(
        "benchmarks/async_benchmark.py",
        "--seeds",
        "1",
        "--rows",
        "eta1",
        "--num-steps",
        "2",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--out-dir",
        str(out),
    )
    text = page.read_text()
    assert text.startswith("# kept\n\n" + marks[0]) and text.endswith(marks[1] + "\nkept too\n") and "old" not in text
    (row,) = [line for line in text.splitlines() if line.startswith("| eta1 ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    metrics = read_metrics(str(tmp_path / "runs" / "eta1__1"))
    accuracy = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert cells[1] == f"{100 * accuracy[0]:.1f} → {100 * accuracy[-1]:.1f}"
    assert cells[2] == "1.00 / 1"  # step 2, the one logged step, trains on version 0: one version old
    assert (out / "async_grpo.png").stat().st_size > 10_000
    bad = run_script("benchmarks/async_benchmark.py", "--rows", "eta3", expect_ok=False)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: --rows eta3: no such row")


def test_a_gpu_run_on_a_torch_before_2_14_stops_with_one_line(monkeypatch):
    """Before torch 2.14 FX's tracing flag is one for the process: while one thread compiles, a compiled call in the
    other raises (seen on torch 2.11 with benchmarks/as_on_a_gpu.py: the trainer's evaluation, while the generator
    compiled its step). So where the policy runs compiled (a GPU), the generator stops the run before it loads
    anything, with one line naming the ways out; with torch 2.14, or nothing compiled, it goes on (to its loading,
    which these stand-in arguments fail)."""
    from torch.torch_version import TorchVersion

    from scale import async_grpo

    def generator(version, compiled):
        with monkeypatch.context() as m:
            m.setattr(async_grpo, "compiles", lambda model: compiled)
            m.setattr(torch, "__version__", TorchVersion(version))
            async_grpo.Generator(None, None, [], [], None, None, None, 0)

    stop = r"^error: torch 2\.13\.0 on a GPU: .*; install torch>=2\.14 \(requirements\.txt\), or set "
    stop += "TORCH_COMPILE_DISABLE=1$"
    with pytest.raises(SystemExit, match=stop):
        generator("2.13.0", compiled=True)
    for version, compiled in (("2.14.0", True), ("2.13.0", False)):
        with pytest.raises(AttributeError, match="model_name_or_path"):
            generator(version, compiled)
