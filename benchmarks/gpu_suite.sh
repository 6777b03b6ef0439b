#!/usr/bin/env bash
# GPU suite (issue 6): Triton kernels checked against the torch reference on the device, then
# decode attention timed against the HBM roofline. Prints one JSON object; exit 1 on a kernel
# mismatch. Hard cap of 8 minutes on a GPU. `--dry-run` runs the same code on CPU under the
# Triton interpreter at tiny sizes (cap 15 minutes: the interpreter and a shared CPU are slow).
# Other flags: see `benchmarks/gpu_suite.py --help`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
CAP=480
for arg in "$@"; do [ "$arg" = "--dry-run" ] && CAP=900; done
exec timeout "$CAP" "$PYTHON" benchmarks/gpu_suite.py "$@"
