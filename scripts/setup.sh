#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (never a CUDA one) and mplan with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel of torch 2.13.0 is installed first and pinned, so nothing below pulls a CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0 numpy
.venv/bin/python -m pip install -q -e '.[dev]'
