"""Many processes: every file under `torchrun --nproc-per-node 2` on the CPU (gloo), with DDP and with FSDP2.

The check that matters is that N processes make the same update as one process on the same global batch:
the saved parameters of a 2-process run equal those of a 1-process run with the same flags (float32
rounding apart: the two sum their gradients in another order). Both run through HARNESS, which makes
two changes so that the check can see every error of scale. The optimizer is plain SGD (with the flags'
learning rate and weight decay) and clipping is off: AdamW's first steps move each weight by about the
learning rate whatever the gradient's size, so a gradient that is off by a factor would go unseen. And
the sampled completions are fixed: each process samples with its own seed, so the online files' runs
would otherwise train on different rollouts.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import FIXTURES, ROOT, RUN_MAIN, read_metrics, run_script
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo import sequence_logprobs
from test_scripts import SMALL, offline

# runs a script as `python script ...` does, with SGD for AdamW, and with sampled completions that depend on
# the step and on the row's place in the whole batch, never on which process holds the row or on its random
# numbers: right answers and wrong ones of one to three digits (the bundled task). Greedy decoding (the
# evaluation) is the model's own.
HARNESS = """
import os, runpy, sys, zlib
import torch, transformers
torch.optim.AdamW = lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(REPOSITORY, "tiny-adder"))
sample = transformers.GenerationMixin.generate
calls = [0]

def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
    if not generation_config.do_sample:
        return sample(self, input_ids=input_ids, attention_mask=attention_mask,
                      generation_config=generation_config, **kwargs)
    calls[0] += 1
    first = int(os.environ.get("RANK", 0)) * len(input_ids)  # this process's first row in the whole batch
    rows = []
    for i, prompt in enumerate(tokenizer.batch_decode(input_ids, skip_special_tokens=True)):
        a, b = map(int, prompt.rstrip("=").split("+"))
        h = zlib.crc32(f"{calls[0]} {first + i}".encode())
        rows.append(tokenizer(str(max(0, a + b + h % 5 - 2)), add_special_tokens=False)["input_ids"]
                    + [tokenizer.eos_token_id])
    length = max(len(r) for r in rows)
    rows = [r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows]
    return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)

transformers.GenerationMixin.generate = generate
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
HARNESS = HARNESS.replace("REPOSITORY", repr(ROOT))  # the bundled tokenizer, wherever pytest started


def torchrun(*argv, nproc=2, expect_ok=True, timeout=600):
    """`torchrun --standalone --nproc-per-node nproc *argv` (a free port), offline; output on failure."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *argv]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def assert_same_update(one, two, start, what):
    """Runs one and two moved every parameter from the model folder `start` alike: in each tensor the two
    differ by at most 1/1000 of that tensor's own largest change, plus a few float32 roundings of its values
    (the two sum their gradients in another order, far below that), so a gradient off by 1% in any tensor is
    caught, however little the tensor moves. A tensor the start lacks (a new score head) is held to 1/1000 of
    the largest change of all."""
    x, y = (load_file(os.path.join(path, "model.safetensors")) for path in (one, two))
    begin = load_file(os.path.join(start, "model.safetensors"))
    assert x.keys() == y.keys()
    largest = max((x[k] - begin[k]).abs().max().item() for k in x if k in begin)
    assert largest > 1e-4, f"{what}: the updates hardly moved the model ({largest})"
    for name in x:
        if name in begin:
            change = (x[name] - begin[name]).abs().max().item()
            rounding = 4 * torch.finfo(torch.float32).eps * begin[name].abs().max().item()
            tolerance = 1e-3 * change + rounding
        else:
            tolerance = 1e-3 * largest
        torch.testing.assert_close(y[name], x[name], rtol=0, atol=tolerance, msg=f"{what}: {name}")


OFFLINE = {
    "sft.py": ["--num-steps", "3", "--batch-size", "8", "--micro-batch-size", "2", "--num-eval", "20"],
    "dpo.py": ["--num-steps", "3", "--batch-size", "4", "--micro-batch-size", "1", "--num-eval", "2",
               "--dataset", os.path.join(FIXTURES, "pairs_tiny.jsonl")],
    # a prompt's pairs are one element of a batch: 1 to 3 pairs, so the processes hold different numbers of pairs
    "reward_model.py": ["--num-steps", "3", "--batch-size", "4", "--micro-batch-size", "1", "--num-eval", "2",
                        "--dataset", os.path.join(FIXTURES, "pairs_grouped.jsonl")],
}
SGD = ["--learning-rate", "0.1", "--max-grad-norm", "1e9"]  # SGD's step, no clipping (HARNESS)


@pytest.mark.parametrize("script", list(OFFLINE))
def test_two_processes_make_the_update_of_one(script, chat_model_dir, tmp_path):
    """sft.py, dpo.py, reward_model.py: after 3 steps, 1 process = 2 processes with DDP = 2 with FSDP2."""
    # preference pairs in words need a BPE tokenizer; sft.py learns the bundled task
    start = os.path.join(ROOT, "tiny-adder") if script == "sft.py" else chat_model_dir
    flags = OFFLINE[script] + SGD + ["--eval-every", "3", "--log-every", "1", "--model-name-or-path", start]
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    run_script(str(harness), script, *flags, "--output-dir", str(tmp_path / "one"))
    torchrun(str(harness), script, *flags, "--output-dir", str(tmp_path / "ddp"))
    torchrun(str(harness), script, *flags, "--fsdp", "--output-dir", str(tmp_path / "fsdp"))
    assert_same_update(tmp_path / "one", tmp_path / "ddp", start, "DDP")
    assert_same_update(tmp_path / "one", tmp_path / "fsdp", start, "FSDP2")
    one, ddp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ddp")
    assert [m["step"] for m in ddp] == [m["step"] for m in one]  # rank 0 alone wrote, once a step
    # the logged loss is the mean over the processes, which here is the loss of the whole batch
    assert ddp[-1]["losses/loss"] == pytest.approx(one[-1]["losses/loss"], rel=1e-4)
    assert os.listdir(tmp_path / "ddp").count("metrics.jsonl") == 1 and os.path.exists(tmp_path / "ddp" / "args.json")


ONLINE = [
    ("grpo.py", ["--loss-agg", "seq-mean-token-mean", "--num-iterations", "2"]),
    ("grpo.py", ["--loss-agg", "token-mean"]),  # (seq-mean-token-sum-norm weighs micro-batches as seq-mean-token-mean)
    ("rloo.py", []),
    ("gspo.py", ["--num-minibatches", "1"]),
    ("cispo.py", ["--num-minibatches", "1"]),
    ("ppo.py", ["--num-minibatches", "1", "--micro-batch-size", "2"]),
]


@pytest.mark.parametrize("script, flags", ONLINE, ids=[f"{s[:-3]}{'-' + f[1] if f[:1] == ['--loss-agg'] else ''}"
                                                       for s, f in ONLINE])
def test_two_processes_make_the_update_of_one_on_the_same_rollouts(script, flags, tmp_path):
    """Every way the online files normalise over the batch (GRPO's three loss aggregations, CISPO's and
    PPO's token means, PPO's advantage whitening) gives the same update from 1 process and from 2, with DDP
    and, for every file but grpo.py (test_fsdp_online_run_saves_the_full_model_it_trained), with FSDP2 (ppo.py
    shards its four models)."""
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    flags = ["--num-steps", "2", "--prompts-per-step", "8", "--group-size", "4", "--micro-batch-size", "4",
             "--num-eval", "20", "--eval-every", "2", "--log-every", "1", *SGD, *flags]
    if script == "ppo.py":
        flags.remove("--group-size")
        flags.remove("4")
    run_script(str(harness), script, *flags, "--output-dir", str(tmp_path / "one"))
    torchrun(str(harness), script, *flags, "--output-dir", str(tmp_path / "two"))
    assert_same_update(tmp_path / "one", tmp_path / "two", os.path.join(ROOT, "tiny-adder"), script)
    if script != "grpo.py":
        torchrun(str(harness), script, *flags, "--fsdp", "--output-dir", str(tmp_path / "fsdp"))
        assert_same_update(tmp_path / "one", tmp_path / "fsdp", os.path.join(ROOT, "tiny-adder"), f"{script} FSDP2")


def test_fsdp_online_run_saves_the_full_model_it_trained(tmp_path):
    """GRPO under FSDP2 with the same rollouts: the update of one process, and the saved model, loaded with
    from_pretrained, gives the log-probs that the sharded model in memory gave."""
    harness, check_harness = tmp_path / "harness.py", tmp_path / "check_harness.py"
    harness.write_text(HARNESS)
    # after the run, both processes score a batch with the sharded policy; rank 0 compares with the saved one
    check_harness.write_text(HARNESS.replace('runpy.run_path(sys.argv[0], run_name="__main__")', RUN_MAIN + """
destroy, leave = torch.distributed.destroy_process_group, os._exit
torch.distributed.destroy_process_group = lambda: None  # keep the group for the check below
os._exit = lambda status: None  # and the process (end_processes)
run = run_main(sys.argv[0])
input_ids = torch.randint(4, len(tokenizer), (4, 9))
mask = torch.ones_like(input_ids)
with torch.no_grad():
    in_memory = run["sequence_logprobs"](run["policy"], input_ids, mask, 5)
if torch.distributed.get_rank() == 0:
    saved = transformers.AutoModelForCausalLM.from_pretrained(run["output_dir"])
    with torch.no_grad():
        loaded = run["sequence_logprobs"](saved, input_ids, mask, 5)
    torch.save({"in_memory": in_memory, "loaded": loaded}, os.path.join(run["output_dir"], "check.pt"))
torch.distributed.barrier()
destroy()  # then leave as end_processes does (without the exit-time teardown, which can abort)
sys.stdout.flush()
leave(0)
"""))
    flags = ["--num-steps", "2", "--prompts-per-step", "8", "--group-size", "4", "--micro-batch-size", "4",
             "--num-eval", "20", "--eval-every", "2", *SGD, "--loss-agg", "token-mean"]
    run_script(str(harness), "grpo.py", *flags, "--output-dir", str(tmp_path / "one"))
    torchrun(str(check_harness), "grpo.py", *flags, "--fsdp", "--output-dir", str(tmp_path / "fsdp"))
    assert_same_update(tmp_path / "one", tmp_path / "fsdp", os.path.join(ROOT, "tiny-adder"), "FSDP2")
    check = torch.load(tmp_path / "fsdp" / "check.pt")
    torch.testing.assert_close(check["loaded"], check["in_memory"], atol=1e-5, rtol=1e-5)
    # and a model that was not trained gives other log-probs: the check can fail
    start = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "tiny-adder"))
    input_ids = torch.randint(4, 18, (4, 9))
    assert not torch.allclose(sequence_logprobs(start, input_ids, torch.ones_like(input_ids), 5),
                              sequence_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp"), input_ids,
                                                torch.ones_like(input_ids), 5), atol=1e-4)


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_two_processes_learn(script, tmp_path):
    """A short 2-process run from the bundled model raises held-out accuracy clearly, as one process does. (GRPO,
    and PPO with its four models; rloo, gspo and cispo make the update of one process on the same rollouts, above,
    and learn in one process, test_scripts.)"""
    out = tmp_path / "run"
    steps = "20" if script == "ppo.py" else "30"  # the default flags otherwise, as in test_scripts' test_learns
    torchrun(script, "--num-steps", steps, "--eval-every", steps, "--output-dir", str(out))
    metrics = read_metrics(out)
    before, after = metrics[0]["eval/accuracy"], metrics[-1]["eval/accuracy"]
    assert after >= before + 0.10, f"held-out accuracy {before:.3f} -> {after:.3f}"
    with open(out / "args.json") as f:
        assert json.load(f)["seed"] == 1


@pytest.mark.parametrize("script, flags, message", [
    ("grpo.py", ["--prompts-per-step", "3"], "--prompts-per-step among the processes: 3 does not divide by 2"),
    ("ppo.py", ["--prompts-per-step", "5"], "--prompts-per-step among the processes: 5 does not divide by 2"),
    ("dpo.py", ["--batch-size", "7", "--micro-batch-size", "1"],
     "--batch-size among the processes: 7 does not divide by 2"),
])
def test_a_batch_that_does_not_split_among_the_processes_says_so(script, flags, message, tmp_path):
    proc = torchrun(script, *flags, "--output-dir", str(tmp_path / "o"), expect_ok=False)
    assert proc.returncode != 0
    # both processes stop, each with the line; the two may land in one pipe at once, so read them as a stream
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    errors = re.findall(r"error: .*? does not divide by \d+", "\n".join(lines))
    assert errors and all(e == f"error: {message}" for e in errors), proc.stderr[-3000:]
    assert "".join(lines) == "".join(errors), proc.stderr[-3000:]  # and nothing else on those lines
    assert not os.path.exists(tmp_path / "o")


def test_fsdp_without_torchrun_says_how_to_start_it(tmp_path):
    proc = run_script("grpo.py", "--fsdp", "--output-dir", str(tmp_path / "o"), expect_ok=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("error: --fsdp") and "torchrun --nproc-per-node" in last


def readme_torchrun_commands():
    """Every `torchrun ...` line of the bash blocks of the README and docs/distributed.md, each once."""
    blocks = []
    for page in ("README.md", os.path.join("docs", "distributed.md")):
        with open(os.path.join(ROOT, page)) as f:
            blocks += re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
    return list(dict.fromkeys(line.strip() for block in blocks for line in block.splitlines()
                              if line.strip().startswith("torchrun ")))


@pytest.mark.parametrize("command", readme_torchrun_commands())
def test_readme_torchrun_command(command, chat_model_dir, tmp_path):
    """The README's torchrun lines, on 2 CPU processes: the hub model and dataset become offline stand-ins,
    the machine flags become --standalone (one machine), and the sizes become small."""
    argv = offline(shlex.split(command)[1:], chat_model_dir)
    argv = [chat_model_dir if a == "Qwen/Qwen2.5-7B-Instruct" else a for a in argv]
    launcher = ("--nnodes", "--node-rank", "--nproc-per-node", "--master-addr", "--master-port")
    script = next(a for a in argv if a.endswith(".py"))
    assert all(a in launcher for a in argv[: argv.index(script)] if a.startswith("--")), command
    flags = argv[argv.index(script) + 1 :]
    out = tmp_path / "run"
    torchrun(script, *flags, *SMALL[script], "--output-dir", str(out))
    metrics = read_metrics(out)
    assert metrics[0]["step"] == 0 and metrics[-1]["step"] == 2
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0


# under torchrun with --fsdp: counts FSDP2's all-gathers during one generate() of 4 and of 16 new tokens, and compares
# the sampled tokens with those of the same weights unsharded, on each process, for the same seed
COUNT_GATHERS = """
import json, os, sys, torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
sys.path.insert(0, REPOSITORY)
import grpo

gathers = [0]
gather = _fsdp_param_group.foreach_all_gather

def counted(*args, **kwargs):
    gathers[0] += 1
    return gather(*args, **kwargs)

_fsdp_param_group.foreach_all_gather = counted
model_dir, out = sys.argv[1], sys.argv[2]
args = grpo.Args(fsdp=True, model_name_or_path=model_dir)
device = grpo.setup(args)
tokenizer = grpo.load_tokenizer(model_dir, args)
whole = grpo.load_model(model_dir, args, device)
sharded = grpo.distribute(grpo.load_model(model_dir, args, device), args)
prompt_ids, prompt_mask = grpo.tokenize_prompts(tokenizer, ["What is 2 + 3?", "Name a colour."], device, args)
never = [len(tokenizer) + 7]  # no id ends a completion: every rollout writes all its tokens
result = {}
for n in (4, 16):
    gathers[0] = 0
    torch.manual_seed(5)
    tokens = grpo.generate(sharded, tokenizer, prompt_ids, prompt_mask, n, 1.0, never)
    result[n] = {"gathers": gathers[0], "length": tokens.shape[1]}
    torch.manual_seed(5)
    result[n]["same_tokens"] = torch.equal(tokens, grpo.generate(whole, tokenizer, prompt_ids, prompt_mask, n, 1.0, never))
rank = torch.distributed.get_rank()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
grpo.end_processes()  # as the scripts leave: the interpreter's exit-time teardown can abort a torchrun process
""".replace("REPOSITORY", repr(ROOT))


def test_fsdp_generation_gathers_each_layer_once_per_rollout(chat_model_dir, tmp_path):
    """With --fsdp, generate() keeps the gathered layers for the whole rollout: the same number of all-gathers for
    4 new tokens as for 16 (one per decoder layer and one for the rest), and the tokens of the unsharded model."""
    script = tmp_path / "count_gathers.py"
    script.write_text(COUNT_GATHERS)
    torchrun(str(script), chat_model_dir, str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["4"]["length"] == 4 and result["16"]["length"] == 16
        assert result["4"]["gathers"] == result["16"]["gathers"] == 3, result  # 2 decoder layers and the root
        assert result["4"]["same_tokens"] and result["16"]["same_tokens"], result


# counts, in each process, the all-reduces that DDP's backward passes make (one a gradient bucket), with DDP's own
# all-reduce still doing the work
COUNT_HARNESS = """
import json, os, runpy, sys
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

calls = [0]
wrap = torch.nn.parallel.DistributedDataParallel.__init__

def counting_init(self, *args, **kwargs):
    wrap(self, *args, **kwargs)

    def hook(state, bucket):
        calls[0] += 1
        with open(os.path.join(count_dir, f"allreduces{os.environ['RANK']}.json"), "w") as f:
            json.dump(calls[0], f)
        return allreduce_hook(None, bucket)

    self.register_comm_hook(None, hook)

torch.nn.parallel.DistributedDataParallel.__init__ = counting_init
count_dir, sys.argv = sys.argv[1], sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gradient_accumulation_all_reduces_once_per_optimizer_step(tmp_path):
    """Under DDP the micro-batches of an optimizer step add up their gradients locally (no_sync) and all-reduce
    once: 4 micro-batches a step make as many all-reduces as 1 micro-batch a step (without no_sync: 4 times as
    many). The updates stay those of one process (test_two_processes_make_the_update_of_one...)."""
    harness = tmp_path / "count.py"
    harness.write_text(COUNT_HARNESS)
    counts = {}
    for micro in ("2", "8"):  # each process: 8 completions a step, in 4 micro-batches or in 1
        out = tmp_path / f"micro{micro}"
        os.makedirs(out)
        torchrun(str(harness), str(out), "grpo.py", "--num-steps", "2", "--prompts-per-step", "4", "--group-size",
                 "4", "--micro-batch-size", micro, "--num-eval", "4", "--eval-every", "2", "--output-dir",
                 str(out / "run"))
        counts[micro] = [json.loads((out / f"allreduces{rank}.json").read_text()) for rank in (0, 1)]
    assert counts["2"] == counts["8"] and counts["8"][0] >= 2, counts  # 2 optimizer steps, >= 1 bucket each


# a torchrun entry that records, per process, when the process group is destroyed, and whether the interpreter's
# own exit-time teardown runs after the script (an atexit handler registered before it writes a file if it does)
EXIT_CHECK = """
import atexit, os, runpy, sys
import torch.distributed
out, rank = sys.argv[1], os.environ["RANK"]
atexit.register(lambda: open(os.path.join(out, f"teardown_{rank}"), "w").close())
destroy = torch.distributed.destroy_process_group

def recorded_destroy(*args, **kwargs):
    destroy(*args, **kwargs)
    open(os.path.join(out, f"destroyed_{rank}"), "w").close()

torch.distributed.destroy_process_group = recorded_destroy
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_finished_process_leaves_without_the_teardown_that_can_abort_it(tmp_path):
    """A finished two-process run exits 0 on both processes having destroyed the group and skipped the exit-time
    teardown, in which a done process aborted (SIGABRT) about once in 20 to 40 runs (end_processes). The abort
    itself is too rare for a test to catch in a few runs; this catches the fix going away."""
    harness, marks = tmp_path / "exit_check.py", tmp_path / "marks"
    harness.write_text(EXIT_CHECK)
    marks.mkdir()
    proc = torchrun(str(harness), str(marks), "sft.py", "--num-steps", "1", "--batch-size", "4", "--micro-batch-size",
                    "2", "--num-eval", "4", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0 and os.path.exists(tmp_path / "run" / "model.safetensors")
    assert sorted(os.listdir(marks)) == ["destroyed_0", "destroyed_1"]
