"""Shared test helpers: run a script as a user does, read its metrics, and build tiny models offline."""

import contextlib
import importlib.util
import io
import json
import os
import runpy
import subprocess
import sys
import traceback
import zipfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, ROOT)
OFFLINE = {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
os.environ.update(OFFLINE)  # before transformers is imported: the runs in this process are offline too
# ATEN_CPU_CAPABILITY (the kernels of an older CPU kind, .ci/run's second pass): inductor's C++ kernels are made for
# that kind too, and its cache does not tell them apart (a kernel cached by a run of another kind fails, "returned a
# result with an exception set"): a cache of its own for each kind
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{os.environ['ATEN_CPU_CAPABILITY']}"
# the files run_script runs in this process: the plain tier's always, the scale tier's where vLLM is not installed (its
# engine starts a process group, and a run ends its process when there is one)
ALGORITHMS = [
    "grpo.py",
    "rloo.py",
    "gspo.py",
    "cispo.py",
    "ppo.py",
    "dpo.py",
    "reward_model.py",
    "sft.py",
    "process_grpo.py",
    "tool_grpo.py",
    "env_grpo.py",
    "dapo.py",
    "distill.py",
    "async_grpo.py",
]
PLAIN = [name for name in ALGORITHMS if os.path.exists(os.path.join(ROOT, name))]  # the top level: the plain tier
IN_PROCESS = set(PLAIN) | (set() if importlib.util.find_spec("vllm") else {f"scale/{name}" for name in ALGORITHMS})


def pytest_configure(config):
    """pytest.ini runs the suite on every core (pytest-xdist, -n auto): each worker's torch, and the processes its
    tests start, get the worker's share of the cores (threads beyond the cores make every worker wait on the
    others)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# the modules whose tests start torchrun (the longest of the tests outside a group): handed out first, so that the
# run does not end on one of them on one worker while the other worker has nothing left to do
FIRST = ("test_torchrun", "test_resume")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """--dist loadgroup (pytest.ini): the tests that take the same module-scoped fixture (a benchmark's runs, a
    harness process) go to one worker, which makes it once; a parametrized one makes a group a parameter. xdist
    hands out the groups first (the most tests first), then the other tests in this order: FIRST's, then the rest."""
    items.sort(key=lambda item: item.module.__name__ not in FIRST)  # stable: each keeps its place among its kind
    for item in items:
        info, params = item._fixtureinfo, getattr(getattr(item, "callspec", None), "params", {})
        groups = [
            f"{item.module.__name__}.{name}" + (f"-{params[name]}" if name in params else "")  # no "]": xdist
            for name in info.argnames  # reads a group's name after the last "@" that follows the last "]"
            if info.name2fixturedefs.get(name) and info.name2fixturedefs[name][-1].scope == "module"
        ]
        assert len(groups) <= 1, f"{item.nodeid} takes two module-scoped fixtures: give them one group"
        if groups:
            item.add_marker(pytest.mark.xdist_group(groups[0]))


def run_script(*argv, cwd=ROOT, expect_ok=True, timeout=900, env=None, subprocess_only=False):
    """`python *argv`, offline (and with `env` added): an algorithm file in this process (run_here), which spares
    the interpreter's and torch's start-up; anything else, or a run with an env of its own, in a subprocess. Fails
    the test with the output when it fails."""
    if argv[0] in IN_PROCESS and not env and not subprocess_only:
        proc = run_here(argv, cwd)
    else:
        proc = subprocess.run(
            [sys.executable, *argv],
            cwd=cwd,
            env=dict(os.environ, **OFFLINE, **(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def run_here(argv, cwd=ROOT):
    """`python *argv` in this process, as the interpreter runs it: the script as __main__ with argv, its output
    captured, a SystemExit's message printed as Python prints it (status 1), any other exception as a traceback
    (status 1). The global settings a run changes are put back."""
    out, err, status = io.StringIO(), io.StringIO(), 0
    saved = sys.argv, os.getcwd(), torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    # torch.compile's caches start empty, as in a new process: every compiled module's call is one code object, with
    # one recompile limit for all, so a file run after others would run its compiled layers eagerly, silently
    torch._dynamo.reset()
    sys.argv = list(argv)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        err.write("" if e.code is None or isinstance(e.code, int) else f"{e.code}\n")
    except Exception:
        status = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv = saved[0]
        os.chdir(saved[1])
        torch.use_deterministic_algorithms(saved[2])
        torch.set_num_threads(saved[3])
    return subprocess.CompletedProcess([sys.executable, *argv], status, out.getvalue(), err.getvalue())


# for a harness script: runs a file's main() as `python file ...` does, and returns the file's functions and main's
# variables (the models, the output folder) as they are when main reaches its last call, end_processes()
RUN_MAIN = """
import runpy, sys


def run_main(script):
    module = runpy.run_path(script, run_name="harness")  # defines everything; main() is not called
    main, caught = module["main"], {}
    end_processes = main.__globals__["end_processes"]

    def catch_and_end():
        caught.update(sys._getframe(1).f_locals)
        end_processes()

    main.__globals__["end_processes"] = catch_and_end
    main(module["tyro"].cli(module["Args"]))
    return {**main.__globals__, **caught}
"""


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ChatML, and tools in the format of Qwen2.5's template (written here): the tools' descriptions in a system turn, a
# call in <tool_call> tags, a tool's result in <tool_response> tags in a user turn; without tools, plain ChatML
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A random tiny Qwen2 with a byte-level BPE tokenizer that has a ChatML template (with tools: TOOL_TEMPLATE),
    built offline.

    Its generation config stops on two ids (<|im_end|> and <|endoftext|>), as Qwen's instruct models do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    with open(os.path.join(FIXTURES, "gsm8k_tiny.jsonl")) as f:
        corpus = [json.loads(line)["question"] + " " + json.loads(line)["answer"] for line in f]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(
        corpus * 4,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids(specials)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=ids[2],
        pad_token_id=ids[0],
        bos_token_id=ids[0],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = [ids[2], ids[0]]
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def real_chat_templates(tmp_path_factory):
    """{file name: text} of real models' chat templates, as TRL's wheel ships them (trl/chat_templates/, each the
    template of the model its name gives), fetched from PyPI with pip (no model hub; the package is not installed)."""
    folder = tmp_path_factory.mktemp("trl_wheel")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
    subprocess.run([*command, "-d", str(folder), "trl==1.16.0"], check=True, capture_output=True, timeout=300)
    (wheel,) = folder.glob("trl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("trl/chat_templates/") and n.endswith(".jinja")]
        return {os.path.basename(n): z.read(n).decode() for n in names}


REAL_MODEL = os.path.join(ROOT, "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def real_model_dir():
    """SmolLM2-135M-Instruct as a standard model folder, made by benchmarks/smollm2.py (PyPI, no model hub).

    Built once into the repository's ignored SmolLM2-135M-Instruct/, which the benchmark uses too.
    """
    run_script("benchmarks/smollm2.py", "--out", REAL_MODEL)
    return REAL_MODEL
