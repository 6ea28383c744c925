"""The sampler's policy against the trainer's (issue 76): rollout_correction's weights and statistics worked by hand,
the flag in every file that samples, and the decode loop's own log-probs reaching it."""

import importlib
import importlib.util
import math

import pytest
import torch
import tyro
from conftest import read_metrics, run_script

from scale import grpo

SAMPLING = [f"scale.{name}" for name in ("grpo", "rloo", "gspo", "cispo", "dapo", "distill", "ppo", "process_grpo")]


def rows():
    """Two rows and cap 2. Row 1 (4 tokens): r = [1, 0.6, 10, 0.25], g = (0.6 * 10 * 0.25)^(1/4) = 1.5^(1/4) = 1.1067.
    Row 2 (2 tokens, then a padded one whose log-probs are wild): r = [5, 5], g = 5."""
    old = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.5, 0.5, 1.0, 1.0]]).log()
    rollout = torch.tensor([[0.5, 0.5, 0.01, 0.4], [0.1, 0.1, 1e-30, 1.0]]).log()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    return old, rollout, mask


G = 1.5**0.25
EXPECTED = {  # the weights, row by row (padding: 0)
    "token-tis": [[1, 0.6, 2, 0.25], [2, 2, 0, 0]],
    "token-mis": [[1, 0.6, 0, 0.25], [0, 0, 0, 0]],
    "seq-tis": [[G] * 4, [2, 2, 0, 0]],
    "seq-mis": [[G] * 4, [0, 0, 0, 0]],
    "icepop": [[1, 0.6, 0, 0], [0, 0, 0, 0]],
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_each_correction_weighs_the_tokens_as_worked_out_by_hand(mode):
    weights, stats = grpo.rollout_correction(*rows(), mode, 2.0)
    torch.testing.assert_close(weights, torch.tensor(EXPECTED[mode]), atol=1e-5, rtol=0)
    # the statistics over the 6 tokens: |log r| = 0, log(5/3), log 10, log 4, log 5, log 5; beyond [1/2, 2]: 4 of 6
    diff = (math.log(5 / 3) + math.log(10) + math.log(4) + 2 * math.log(5)) / 6
    assert stats["logprob_diff"].item() == pytest.approx(diff, rel=1e-5)
    assert stats["beyond_2"].item() == pytest.approx(4 / 6)
    assert stats["is_weight"].item() == pytest.approx(sum(map(sum, EXPECTED[mode])) / 6, rel=1e-5)
    capped = {"token-tis": 3, "token-mis": 3, "seq-tis": 2, "seq-mis": 2, "icepop": 4}[mode]
    assert stats["is_capped"].item() == pytest.approx(capped / 6)


def test_no_correction_gives_no_weights_but_measures_the_mismatch():
    weights, stats = grpo.rollout_correction(*rows(), "none", 2.0)
    assert weights is None and set(stats) == {"logprob_diff", "beyond_2"} and stats["beyond_2"] == pytest.approx(4 / 6)
    same = torch.tensor([[-1.0, -2.0]])  # the sampler's log-probs are pi_old's: nothing to measure
    _, stats = grpo.rollout_correction(same, same, torch.ones(1, 2), "none", 2.0)
    assert stats["logprob_diff"] == 0 and stats["beyond_2"] == 0


def test_every_sampling_file_offers_the_corrections_with_the_same_default(monkeypatch):
    """The same function in every file that samples (tests/test_shared.py holds the text equal), the same choices,
    auto by default, which check_args settles (in check_vllm): token-tis where vLLM samples, none where the file's
    own decode loop does; a mode given stays."""
    for name in SAMPLING:
        module = importlib.import_module(name)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if vLLM were installed
        assert module.Args().rollout_correction == "auto" and module.Args().rollout_cap == 2.0, name
        for vllm, mode, settled in ((False, "auto", "none"), (True, "auto", "token-tis"), (True, "icepop", "icepop")):
            sampled_loss = {"loss": "reverse-kl"} if name == "scale.distill" else {}  # distill's jsd weighs no token
            args = module.Args(vllm=vllm, rollout_correction=mode, **sampled_loss)
            module.check_args(args)
            assert args.rollout_correction == settled, name


def test_the_help_names_the_flag_and_its_default(capsys):
    """Each sampling file's --help (tyro's, in this process) names the flag, its choices and its default."""
    for name in SAMPLING:
        with pytest.raises(SystemExit):
            tyro.cli(importlib.import_module(name).Args, args=["--help"])
        flat = " ".join(line.strip("│ ") for line in capsys.readouterr().out.splitlines())  # tyro's box, joined
        correction = flat[flat.index("--rollout-correction") :]
        assert "{auto,none,token-tis,token-mis,seq-tis,seq-mis,icepop}" in correction, name
        assert "(default: auto)" in correction[: correction.index("--rollout-cap")], name
        assert "(default: 2.0)" in correction[correction.index("--rollout-cap") :], name
    with pytest.raises(SystemExit):  # tool_grpo.py has no --vllm, so no auto: none, its own decode loop
        tyro.cli(importlib.import_module("scale.tool_grpo").Args, args=["--help"])
    flat = " ".join(line.strip("│ ") for line in capsys.readouterr().out.splitlines())
    correction = flat[flat.index("--rollout-correction") :]
    assert "{none,token-tis,token-mis,seq-tis,seq-mis,icepop}" in correction
    assert "(default: none)" in correction[: correction.index("--rollout-cap")]


@pytest.mark.parametrize("name", ["scale/grpo.py", "scale/ppo.py", "scale/tool_grpo.py"])
def test_a_run_measures_its_own_decode_loops_mismatch(name, tmp_path):
    """The decode loop returns each sampled token's log-prob, and the loss takes pi_old from the training forward
    pass: on this CPU, in float32, the two are the same computation to rounding (docs/gpu.md: 1e-5), so the logged
    mismatch is that small, no token is beyond a ratio of 2, and token-tis weighs every token 1 to that rounding.
    tool_grpo.py's rollouts are turns of the decode loop with the tool's tokens between them: it measures the
    policy's tokens alone, also where the tool's carry loss (--no-mask-tool-tokens, with none), and refuses a
    correction there, which would weigh them 0."""
    small = ["--num-steps", "2", "--prompts-per-step", "4", "--num-eval", "8", "--log-every", "1"]
    tool = name == "scale/tool_grpo.py"
    for mode in ("none" if tool else "auto", "token-tis"):
        out = tmp_path / mode
        ablation = ["--no-mask-tool-tokens"] * (tool and mode == "none")
        run_script(name, *small, *ablation, "--rollout-correction", mode, "--output-dir", str(out))
        steps = [m for m in read_metrics(out) if "rollout/logprob_diff" in m]
        assert len(steps) == 2 and all(m["charts/tool_tokens"] > 0 for m in steps if tool), name
        assert all(m["rollout/logprob_diff"] < 1e-4 and m["rollout/beyond_2"] == 0 for m in steps), steps
        if mode == "token-tis":
            assert all(abs(m["rollout/is_weight"] - 1) < 1e-4 for m in steps), steps
        else:  # none, or auto without --vllm: none, so no weights
            assert not any("rollout/is_weight" in m for m in steps), steps
    if tool:
        tool_grpo = importlib.import_module("scale.tool_grpo")
        with pytest.raises(SystemExit, match="--rollout-correction icepop weighs tool tokens 0 under --no-mask"):
            tool_grpo.check_args(tool_grpo.Args(mask_tool_tokens=False, rollout_correction="icepop"))


def test_distillation_over_the_vocabulary_measures_the_mismatch_and_refuses_a_correction(tmp_path):
    """scale/distill.py's default loss (jsd) samples no token for its loss, so it weighs none; it still logs its
    rollouts' mismatch to the student's log-probs, and a correction asked for with it stops the run in one line."""
    small = ["--num-steps", "2", "--prompts-per-step", "8", "--num-eval", "8", "--log-every", "1"]
    out = tmp_path / "run"
    run_script("scale/distill.py", *small, "--output-dir", str(out))
    steps = [m for m in read_metrics(out) if m["step"] > 0]
    assert len(steps) == 2 and all(m["rollout/logprob_diff"] < 1e-4 and m["rollout/beyond_2"] == 0 for m in steps)
    assert not any("rollout/is_weight" in m for m in steps), steps
    refused = run_script(
        "scale/distill.py",
        *small,
        "--rollout-correction",
        "icepop",
        "--output-dir",
        str(tmp_path / "no"),
        expect_ok=False,
    )
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: --rollout-correction:"), lines
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("mode, threshold", [("token-tis", 2.0), ("token-mis", "1e-9_2.0"), ("icepop", "0.5_2.0")])
def test_the_token_corrections_weigh_as_verls_do(mode, threshold):
    """verl's rollout_corr_helper (0.9.1; not a requirement here: skipped without it) on the same rows: its token
    level with a cap truncates as token-tis does, and with a band "lo_hi" zeroes the tokens outside it, as icepop does
    and, with a lower end too small to act, as token-mis does. Its sequence level weighs a row by the product of its
    ratios, not their geometric mean (docs/mismatch.md), so it is not compared. TRL computes its modes inside
    GRPOTrainer, with no function to call."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    old, rollout, mask = rows()
    theirs, _ = helper.compute_rollout_correction_weights(
        old - rollout, mask.float(), rollout_is="token", rollout_is_threshold=threshold
    )
    ours, _ = grpo.rollout_correction(old, rollout, mask, mode, 2.0)
    torch.testing.assert_close(ours, theirs.float(), atol=1e-6, rtol=0)
