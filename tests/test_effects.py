"""benchmarks/effects.py: the papers' effects in miniature (docs/effects.md). Its exact parts against numbers worked by
hand; every row's --quick form run once, in this process."""

import inspect
import json
import math
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

from scale import grpo

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import effects  # noqa: E402


def test_a_wrong_completions_tokens_are_pushed_down_less_as_it_grows_under_grpo_and_alike_under_dr_grpo():
    """A group of two, a right completion of 3 tokens (A = +1) and a wrong one of L (A = -1), the ratio 1, no KL:
    seq-mean-token-mean's loss is 1/2 sum_i 1/|o_i| sum_t -A_i r_it, so each wrong token's d loss / d log pi is 1/(2L)
    and the completion's 1/2 whatever its length; Dr. GRPO's divides by 16 (the longest completion) instead of |o_i|:
    1/32 a token, L/32 for the completion."""
    for length in (3, 6, 12):
        assert effects.token_weights("seq-mean-token-mean", wrong_length=length) == pytest.approx(
            (1 / (2 * length), 0.5)
        )
        dr = effects.token_weights("seq-mean-token-sum-norm", wrong_length=length)
        assert dr == pytest.approx((1 / 32, length / 32))


def test_the_kl_estimators_on_a_two_token_vocabulary():
    """pi = [1/2, 1/2], ref = [1/4, 3/4]: KL(pi || ref) = 1/2 log 2 + 1/2 log(2/3) = 1/2 log(4/3). Token 0: r = 1/2,
    k1 = log 2, k2 = (log 2)^2 / 2, k3 = 1/2 - 1 + log 2. Token 1: r = 3/2, k1 = -log(3/2) < 0, k3 = 1/2 - log(3/2).
    Over the two (each drawn half the time) k1 and k3 average to the exact KL, k2 above it."""
    logp = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64).log()
    logq = torch.tensor([[0.25, 0.75], [0.25, 0.75]], dtype=torch.float64).log()
    exact, k = effects.kl_estimates(logp, logq, torch.tensor([0, 1]))
    assert exact.tolist() == pytest.approx([0.5 * math.log(4 / 3)] * 2)
    assert k["k1"].tolist() == pytest.approx([math.log(2), -math.log(1.5)])
    assert k["k2"].tolist() == pytest.approx([math.log(2) ** 2 / 2, math.log(1.5) ** 2 / 2])
    assert k["k3"].tolist() == pytest.approx([math.log(2) - 0.5, 0.5 - math.log(1.5)])
    assert k["k1"].mean().item() == pytest.approx(0.5 * math.log(4 / 3))
    assert k["k3"].mean().item() == pytest.approx(0.5 * math.log(4 / 3))
    assert k["k2"].mean().item() > 0.5 * math.log(4 / 3) + 0.01


SENTINEL = 1e6  # a padded position holds this; it must not reach the loss or the gradient


@pytest.mark.parametrize(
    "estimator, values, grad",
    [
        # d = (ln 2, -ln 2); d d / d logp = -1, times beta / |o| = 0.1 / 2
        ("k1", [-math.log(2), math.log(2)], [0.05, 0.05]),  # -d: +1 a token, whatever the reference says
        ("k2", [math.log(2) ** 2 / 2] * 2, [-0.05 * math.log(2), 0.05 * math.log(2)]),  # d^2/2: -d
        ("k3", [1 - math.log(2), math.log(2) - 0.5], [-0.05, 0.025]),  # e^d - d - 1: 1 - e^d
    ],
)
def test_each_kl_estimator_by_hand_as_grpo_pys_penalty(estimator, values, grad):
    """Each estimate at d = +-ln 2, and grpo.py's loss with it as the KL penalty (kl_penalty: the loss's k3 line
    replaced, as the row trains it): the logged KL and the gradient, worked by hand; the k3 patch is the loss itself."""
    logprobs = torch.tensor([[-1.0, -1.0, SENTINEL]], requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2), -1.0 - math.log(2), -SENTINEL]])
    mask = torch.tensor([[1, 1, 0]])
    d = torch.tensor([math.log(2), -math.log(2)])
    assert effects.kl_estimate(d, estimator).tolist() == pytest.approx(values, abs=1e-6)
    loss, stats = effects.kl_penalty(estimator)(logprobs, logprobs.detach(), ref, torch.zeros(1), mask, beta=0.1)
    assert stats["kl"].item() == pytest.approx(sum(values) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([grad + [0.0]]))


def test_reward_noise_becomes_a_whole_advantage_only_where_the_rewards_are_scaled():
    """noisy_rewards: grpo.py's main() with one line changed, the rewards + N(0, 0.01^2) from the run's shuffle
    generator into the advantage. Groups of 4 whose answers agree (rewards 1, 1, 1, 1): no signal; that expression
    gives advantages whose std within the group is std / (std + 1e-4), about 1, once divided by the group's std, and
    about 0.01 if not."""
    ours, theirs = (inspect.getsource(f).splitlines() for f in (grpo.main, effects.noisy_rewards(0.01)))
    changed = [b for a, b in zip(ours, theirs) if a != b]
    assert len(ours) == len(theirs) and len(changed) == 1, changed
    noise = re.fullmatch(r" +advantages = group_advantages\((rewards \+ .*), args.group_size, .*", changed[0]).group(1)
    rewards, shuffle_gen = torch.ones(4000), torch.Generator().manual_seed(0)
    noised = eval(noise, {"torch": torch}, {"rewards": rewards, "shuffle_gen": shuffle_gen})  # the patch's own words
    assert (noised - rewards).std().item() == pytest.approx(0.01, rel=0.05) and abs((noised - rewards).mean()) < 1e-3
    scaled = grpo.group_advantages(noised, 4).view(-1, 4).std(dim=1)
    plain = grpo.group_advantages(noised, 4, scale=False).view(-1, 4).std(dim=1)
    assert scaled.mean().item() == pytest.approx(0.99, abs=0.01) and plain.mean().item() < 0.015
    with pytest.raises(AssertionError):  # a line the function does not hold
        effects.patched(grpo.main, "no such line", "")


@pytest.mark.long
def test_every_rows_quick_form(tmp_path):
    """The suite's form of `python benchmarks/effects.py`: 1 seed, 2 steps a run, 64 held-out prompts."""
    settings = sys.argv, torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    results = effects.main(["--quick", "--runs-dir", str(tmp_path), "--figure", str(tmp_path / "lengths.png")])
    assert (sys.argv, torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()) == settings  # put back
    assert list(results) == list(effects.ROWS)
    tasks = results["length-bias"]["curves"]
    assert set(tasks) == {"spaced", "trailing", "give-up"}
    for curves in tasks.values():
        assert set(curves) == {"grpo", "dr-grpo"} and all(sorted(c) == [0, 1, 2] for c in curves.values())
        for right, wrong, share, gave_up, share_gave_up in (v for c in curves.values() for v in c.values()):
            assert 1 <= right <= 12 and 1 <= wrong <= 12 and 0 < share < 1  # a stop token included, at most 12
            assert 0 <= share_gave_up < 1 and (math.isnan(gave_up) if share_gave_up == 0 else 2 <= gave_up <= 12)
        assert curves["grpo"][0] == pytest.approx(curves["dr-grpo"][0], nan_ok=True)  # the fine-tuned model's samples
    patterns = {"spaced": r" {0,4}[0-9]+", "trailing": r"[0-9]+ {0,4}", "give-up": r"([0-9]+|=) {0,4}"}
    for task, pattern in patterns.items():  # the answer read alike
        completions = [json.loads(line)["completion"] for line in open(tmp_path / f"{task}.jsonl")]
        assert all(re.fullmatch(pattern, c) for c in completions)
        assert {len(c) - len(c.strip()) for c in completions} == {0, 1, 2, 3, 4}
    read = {task: [json.loads(line)["completion"] for line in open(tmp_path / f"{task}.jsonl")] for task in patterns}
    spaces = [t[len(t.rstrip()) :] for t in read["trailing"]]
    gave_up = [c == effects.MARK + s for c, s in zip(read["give-up"], spaces)]  # the same spaces
    assert all(g or c == t for g, c, t in zip(gave_up, read["give-up"], read["trailing"]))  # else the same answer
    assert abs(sum(gave_up) / len(gave_up) - effects.GIVE_UP) < 0.03  # a third of the answers replaced by the mark
    assert os.path.getsize(tmp_path / "lengths.png") > 0
    # rewards [1 + d, 1, 1, 1]: deviations 3d/4 and -d/4, the group's std d/2; scaled by d/2 + 1e-4, or not
    std = results["std-amplification"]
    assert std["1.0"]["scaled"][:2] == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001])
    assert std["0.001"]["scaled"][:2] == pytest.approx([1.25, -0.25 / 0.6], rel=1e-3)  # 1.001 in float32
    assert std["0.001"]["plain"][:2] == pytest.approx([0.75e-3, -0.25e-3], rel=1e-3)
    learning = std["learning"]
    assert set(learning) == {"scaled", "unscaled", "scaled, noise", "unscaled, noise"}
    assert all(0 < r["accuracy"][0] < 1 and 0 < r["groups with signal"][0] <= 1 for r in learning.values())
    pairs = std["pairs"]  # groups of 2: more of them tie than groups of 8 do
    assert (
        set(pairs) == set(learning)
        and pairs["scaled"]["groups with signal"][0] < learning["scaled"]["groups with signal"][0]
    )
    kl = results["kl-estimators"]
    assert set(kl) == {"step 1", "final", "as a loss"}
    # no reward signal: only the KL penalty trains. k2's and k3's gradients vanish where pi = ref (the start), so the
    # policy stays the bundled model; k1's is the score function, zero only on average, and the policy drifts
    as_loss = kl.pop("as a loss")
    [(k1_kl, k1_entropy)], [(k3_kl, k3_entropy)] = as_loss["k1"], as_loss["k3"]
    assert k1_kl > 1e-3 and as_loss["k2"][0][0] < k1_kl / 100 and k3_kl < k1_kl / 100
    assert k3_entropy == pytest.approx(as_loss["start entropy"], abs=1e-3) and k1_entropy != k3_entropy
    # sampled at 0.7 and scored at 1: k3's gradient is still 0 at pi = ref, k1's still is not
    [(k1_hot, _)], [(k3_hot, _)] = as_loss["k1, sampled at 0.7"], as_loss["k3, sampled at 0.7"]
    assert k1_hot > 1e-3 and k3_hot < k1_hot / 100
    for policy in kl.values():
        assert policy["tokens"] > 64 and policy["exact"] > 0
        assert policy["k1"]["negative"] > 0 and policy["k2"]["negative"] == policy["k3"]["negative"] == 0
    clipped = results["cispo-clipped"]
    assert clipped["scale/grpo.py"]["clip_frac_max"][0] > 0  # the later passes move the ratio past the clip
    assert all(0 <= f <= 1 for name, row in clipped.items() if name != "scale/dapo.py" for f in row["clip_frac"])
    assert (
        clipped["scale/dapo.py"]["learning_rate"] == 5e-5 and clipped["scale/dapo.py"]["rollouts_sampled"][0] >= 2 * 256
    )
    # the files' defaults: 300 steps of 32 prompts x 8 completions (rloo.py), of 128 prompts x 1 (ppo.py)
    ppo_rloo = results["rloo-vs-ppo"]
    assert (ppo_rloo["rloo"]["rollouts"], ppo_rloo["ppo"]["rollouts"]) == (76_800, 38_400)
    assert 0 < ppo_rloo["ppo"]["accuracy"] < 100 and ppo_rloo["rloo"]["seconds"] > 0
    assert ppo_rloo["rloo k=2"]["rollouts"] == 2 * 128 and 0 < ppo_rloo["rloo k=2"]["accuracy"][0] < 1
    mismatch = results["sampler-mismatch"]  # sampled at 0.7 or 1.5, scored at 1: the logged mismatch is far from 0
    assert set(mismatch) == {"matched"} | {f"{t} {m}" for t in (0.7, 1.5) for m in ("none", "token-tis", "icepop")}
    assert all(mismatch[f"{t} none"]["logprob_diff"][0] > 0.01 for t in (0.7, 1.5))
    assert mismatch["0.7 token-tis"]["is_weight"][0] != 1.0 and mismatch["0.7 none"]["is_weight"] == [1.0]
    areal = results["areal-staleness"]
    assert set(areal) >= {"sync", "eta4", "eta4-coupled", "lr 1e-3 sync", "lr 1e-3 eta16", "lr 1e-3 eta16-coupled"}
    # the second step trains on version 0's rollouts from version 1: pi_prox / pi_behav moves off 1, unless coupled
    assert areal["lr 1e-3 eta16"]["behav_weight"][0] != pytest.approx(1, abs=1e-3)
    assert areal["lr 1e-3 eta16-coupled"]["behav_weight"] == [1.0]  # w = 1: the clip centred on pi_behav
    assert areal["lr 1e-3 sync"]["behav_weight"][0] == pytest.approx(1, abs=1e-3)  # no lag: rounding only


def test_a_run_is_read_again_only_with_the_same_flags_and_data(tmp_path):
    """train() runs a command once and reads its folder after; a data set the flags name, written again with other
    records, makes it another run (the length rows write theirs before each fine-tuning)."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n' * 40)
    flags = ["--model-name-or-path", os.path.join(ROOT, "tiny-adder"), "--dataset", str(data), "--num-steps", "1"]
    flags += ["--num-eval", "4", "--eval-every", "1"]
    args, metrics = SimpleNamespace(runs_dir=str(tmp_path)), tmp_path / "sft-1" / "metrics.jsonl"
    effects.train(args, "scale/sft.py", flags, "sft", 1)
    first = metrics.stat().st_mtime_ns
    effects.train(args, "scale/sft.py", flags, "sft", 1)
    assert metrics.stat().st_mtime_ns == first  # read again
    data.write_text('{"prompt": "1+1=", "completion": "3"}\n' * 40)
    effects.train(args, "scale/sft.py", flags, "sft", 1)
    assert metrics.stat().st_mtime_ns != first  # run again, in a fresh folder
