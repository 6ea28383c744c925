#!/bin/bash
# The GPU check a session runs first when it has a device (DEVELOPERS.md; issue 74): one script, each command's output
# in $OUT, sized to fit one call of the device tool (at most 10 minutes) with time left to run it again.
#
#   carry: wheels/ (tyro and its dependencies; trl 1.16 and datasets for --trl; vllm matching the image's torch for
#   --trl-vllm) and SmolLM2-135M-Instruct/ (benchmarks/smollm2.py builds its tokenizer)
#   run:   bash benchmarks/gpu_check.sh              on the device (OUT is set there)
#          OUT=/tmp/check bash benchmarks/gpu_check.sh --small    on a CPU: the same commands at the small shape
#
# Then copy $OUT into benchmarks/gpu_runs/<date>-<device>/ with the wheels' list and a README (gpu_runs/README.md).
set -u
OUT=${OUT:?set OUT to the folder the logs go to}
SMALL=${1:-}
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
step check 240 python benchmarks/gpu_benchmark.py --check $SMALL
step profile 120 python benchmarks/gpu_benchmark.py --profile $SMALL
if python -c "import trl" 2> /dev/null; then
    TRL=--trl
    if python -c "import vllm" 2> /dev/null; then TRL="--trl --trl-vllm"; fi
    step trl 300 python benchmarks/gpu_benchmark.py $TRL $SMALL
fi
if [ -z "$SMALL" ]; then  # every file's learning test on CUDA: the files pick CUDA and bfloat16 by themselves
    step learns 240 python -m pytest -q -p no:cacheprovider tests/test_scripts.py -k "learns"
fi
