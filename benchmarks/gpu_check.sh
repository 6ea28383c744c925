#!/bin/bash
# The GPU check a session runs first when it has a device (DEVELOPERS.md; issue 74): one script, each command's output
# in $OUT, sized to fit one call of the device tool (at most 10 minutes) with time left to run it again.
#
#   carry: wheels/ (tyro and its dependencies; trl 1.16 and datasets for --trl) and SmolLM2-135M-Instruct/
#   (benchmarks/smollm2.py builds its tokenizer); vLLM for --trl-vllm is too large to carry (docs/gpu.md)
#   run:   bash benchmarks/gpu_check.sh 1, then 2, then 3   on the device, a call each (each within the tool's 10
#          minutes; OUT is set there): 1 the check and the profile, 2 the step against TRL's, 3 grpo.py in float16
#          and the learning tests (each file's first step compiles its decoder layers and its decode step). In that
#          order of need: the limits add up to 1,650 s against a session's 900 s of device time, so a part whose
#          steps ran near their limits leaves none for the next (their usual times are well under them)
#          OUT=/tmp/check bash benchmarks/gpu_check.sh 1 --small    on a CPU: part 1's commands at a small shape
#
# Then copy $OUT into benchmarks/gpu_runs/<date>-<device>/ with the wheels' list and a README (gpu_runs/README.md).
set -u
OUT=${OUT:?set OUT to the folder the logs go to}
PART=${1:?give the part: 1, 2 or 3}
SMALL=${2:-}
CHECK=""
if [ -n "$SMALL" ]; then CHECK="--batch 4 --max-new-tokens 4"; fi  # the suite's size (tests/test_gpu_paths.py)
mkdir -p "$OUT"
if [ -d wheels ]; then
    python -m pip install --no-index --no-deps -q wheels/*.whl > "$OUT/install.log" 2>&1
    python -m pip list > "$OUT/wheels.txt" 2>&1
fi
step() {  # step NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, and how it ended
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/steps.log"
}
if [ "$PART" = 1 ]; then
    step check 420 python benchmarks/gpu_benchmark.py --check $SMALL $CHECK
    step profile 150 python benchmarks/gpu_benchmark.py --profile $SMALL
    exit 0
fi
if [ "$PART" = 2 ] && python -c "import trl" 2> /dev/null; then
    TRL=--trl
    if python -c "import vllm" 2> /dev/null; then TRL="--trl --trl-vllm"; fi
    step trl 540 python benchmarks/gpu_benchmark.py $TRL $SMALL
fi
if [ "$PART" = 3 ] && [ -z "$SMALL" ]; then
    # --dtype float16 with its loss scaler (issue 76), never run on a GPU before: the default task, 150 steps
    step float16 180 python grpo.py --dtype float16 --num-steps 150 --output-dir "$OUT/float16"
    # every file's learning test on CUDA: the files pick CUDA and bfloat16 by themselves
    step learns 360 python -m pytest -q -p no:cacheprovider tests/test_scripts.py -k "learns"
fi
