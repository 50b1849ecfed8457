#!/usr/bin/env bash
# The wheels the GPU machines' image lacks: for planning there (the sharding ILP: PuLP and HiGHS) and
# Liger Kernel, the peer that benchmarks/models/hf_models.py and `python -m benchmarks.kernel_peers hf` time mplan against
# (pure Python over the image's Triton; --no-deps: its torch and triton are the image's), downloaded
# from this machine's package index into .device_wheels/ (git-ignored, ~20 MB) for the device tool
# to carry. Then, in a device call with carry=[".device_wheels"]:
#     pip install --no-index --find-links .device_wheels pulp highspy liger-kernel && ...
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
pulp=$("$python" -c "import importlib.metadata as m; print(m.version('pulp'))")
highspy=$("$python" -c "import importlib.metadata as m; print(m.version('highspy'))")
liger=${LIGER_VERSION:-0.8.5}
rm -rf .device_wheels
# the device image runs CPython 3.12 on x86-64 Linux and already has numpy
"$python" -m pip download "pulp==$pulp" "highspy==$highspy" "liger-kernel==$liger" --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any -d .device_wheels --quiet
ls -la .device_wheels
