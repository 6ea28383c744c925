#!/bin/bash
# The GPU check a session runs first when it has a device (DEVELOPERS.md): one script, each command's output in $OUT,
# its parts sized to the device tool's calls (at most 10 minutes each, 15 minutes of device time in all).
#
#   here:  bash benchmarks/gpu_check.sh prepare   what a call carries (64 MiB at most): wheels/ (tyro and its
#          dependencies; TRL and datasets for --trl: gpu_wheels.sh) and smollm2-tokenizer/ (SmolLM2's tokenizer alone,
#          from SmolLM2-135M-Instruct/, which benchmarks/smollm2.py builds); git ignores both
#   run:   bash benchmarks/gpu_check.sh 1, then 2, then 3   on the device, a call each (OUT is set there), carrying
#          wheels and smollm2-tokenizer:
#          1 answers first, in at most 7 minutes of limits: scale/grpo.py's default run for 30 steps (does the whole
#            GPU path run, does accuracy rise, what rollout/logprob_diff reads), the README's GPU step for 3 steps
#            (its metrics kept in $OUT/readme), the profile of one rollout and one update under the step's setup()
#          2 the plain grpo.py's 30 steps, scale/grpo.py in float16, under torchrun with --fsdp (one process: the
#            process group and FSDP2 on CUDA), the learning tests of both tiers
#          3 the decode loop's check step by step, then the step against TRL's at equal work
#          OUT=/tmp/check bash benchmarks/gpu_check.sh 1 --small    on a CPU: part 1 at a small shape
#   CAP=S  cuts every step's limit to S seconds (the test that a step cut short keeps what it printed)
#
# Python's output is unbuffered, so a step a timeout stops keeps what it printed. Then copy $OUT into
# benchmarks/gpu_runs/<date>-<device>/ with the wheels' list and a README (gpu_runs/README.md).
set -u
PART=${1:?give the part: prepare, 1, 2 or 3}
if [ "$PART" = prepare ]; then
    set -e
    bash benchmarks/gpu_wheels.sh
    python benchmarks/smollm2.py
    rm -rf smollm2-tokenizer
    python -c "from transformers import AutoTokenizer as T; T.from_pretrained('SmolLM2-135M-Instruct').save_pretrained('smollm2-tokenizer')"
    du -sh wheels smollm2-tokenizer
    exit 0
fi
OUT=${OUT:?set OUT to the folder the logs go to}
SMALL=${2:-}
export PYTHONUNBUFFERED=1
TOKENIZER=""
if [ -d smollm2-tokenizer ]; then TOKENIZER="--tokenizer smollm2-tokenizer"; fi
STEPS=30
CHECK=""
if [ -n "$SMALL" ]; then STEPS=2 CHECK="--batch 4 --max-new-tokens 4"; fi  # the suite's size (test_gpu_paths.py)
mkdir -p "$OUT"
if [ -d wheels ]; then
    python -m pip install --no-index --no-deps -q wheels/*.whl > "$OUT/install.log" 2>&1
    python -m pip list > "$OUT/wheels.txt" 2>&1
fi
step() {  # step NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, and how it ended
    local name=$1 seconds=$2
    shift 2
    if [ -n "${CAP:-}" ] && [ "$CAP" -lt "$seconds" ]; then seconds=$CAP; fi
    local start=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/steps.log"
}
summary() {  # summary NAME: a run's held-out accuracy first and last, and its mean rollout/logprob_diff
    python - "$OUT/$1/metrics.jsonl" << 'EOF' 2>&1 | tee -a "$OUT/steps.log"
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError as e:
    sys.exit(f"  no metrics: {e}")
accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
diff = [r["rollout/logprob_diff"] for r in rows if "rollout/logprob_diff" in r]
print(f"  held-out accuracy {accuracy[0]:.3f} -> {accuracy[-1]:.3f}" if accuracy else "  no held-out accuracy")
if diff:
    print(f"  rollout/logprob_diff mean {sum(diff) / len(diff):.2e} over {len(diff)} steps")
EOF
}
if [ "$PART" = 1 ]; then
    step default 120 python scale/grpo.py --num-steps $STEPS --eval-every 10 --log-every 1 --output-dir "$OUT/default"
    summary default
    step readme 180 python benchmarks/gpu_benchmark.py --steps 3 --out "$OUT/readme" $TOKENIZER $SMALL
    rm -f "$OUT/readme/model.safetensors"  # a random model's weights (2 GB at the README's shape): not evidence
    step profile 120 python benchmarks/gpu_benchmark.py --profile $TOKENIZER $SMALL
    exit 0
fi
if [ "$PART" = 2 ]; then
    step plain 60 python grpo.py --num-steps $STEPS --eval-every 10 --output-dir "$OUT/plain"
    summary plain
    # --dtype float16 with its loss scaler, never run on a GPU before: the default task, 150 steps
    step float16 150 python scale/grpo.py --dtype float16 --num-steps 150 --output-dir "$OUT/float16"
    summary float16
    # torchrun's path on one GPU: NCCL's process group, FSDP2's sharded (here whole) models and their gathers
    step torchrun 90 torchrun --standalone --nproc-per-node 1 scale/grpo.py --fsdp --num-steps $STEPS --eval-every 10 \
        --output-dir "$OUT/torchrun"
    summary torchrun
    # the learning tests on CUDA (every plain file's, ten scale files'): the files pick CUDA and bfloat16 themselves
    step learns 240 python -m pytest -q -p no:cacheprovider tests/test_scripts.py tests/test_plain.py -k "learns"
fi
if [ "$PART" = 3 ]; then
    step check 150 python benchmarks/gpu_benchmark.py --check $TOKENIZER $SMALL $CHECK
fi
if [ "$PART" = 3 ] && python -c "import trl" 2> /dev/null; then
    TRL=--trl
    if python -c "import vllm" 2> /dev/null; then TRL="--trl --trl-vllm"; fi
    step trl 420 python benchmarks/gpu_benchmark.py $TRL $TOKENIZER $SMALL
fi
