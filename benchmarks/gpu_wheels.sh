#!/bin/bash
# The wheels gpu_check.sh needs on the device and its image lacks (it has torch 2.11 and transformers 5.17, and no
# registry to install from): tyro for the files' flags, TRL 1.16 and datasets for --trl, each with the dependencies
# the image does not hold (its package list: the device tool's KINDS.md). Run here, where pip reaches the registry:
#
#   bash benchmarks/gpu_wheels.sh        # fills wheels/ (git ignores it: about 2 MB), then carry wheels/
#
# CPython 3.12 on x86-64, the image's. vLLM for --trl-vllm is not among them: too large to carry (docs/gpu.md).
set -eu
cd "$(dirname "$0")/.."
rm -rf wheels
mkdir wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels \
    tyro==1.0.16 docstring-parser==0.18.0 typeguard==4.6.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls wheels
du -sh wheels
