#!/usr/bin/env bash
# GPU suite: every GPU path checked against its reference and timed, one JSON line per section
# on stdout (and in $OUT/gpu_suite.jsonl when $OUT is set), in at most 5 minutes on one H100 /
# H200: Python 3.12, its own torch, no package registry, no Ray. Wheels the machine lacks travel
# in .gpu_wheels/ (benchmarks/gpu_suite/download_wheels.sh fills it) and are installed first.
# `--dry-run` runs it on CPU (tiny sizes, Triton interpreted; sections without a CPU form are
# skipped). Exit status 0 when every check passed. See benchmarks/gpu_suite/__init__.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
CAP=300
for arg in "$@"; do [ "$arg" = "--dry-run" ] && CAP=960; done
# The harness keeps its own cap below this one and kills each section at its budget; this is
# the backstop. Every line it printed is already out (one flushed line per section).
exec timeout --kill-after=5 "$CAP" "$PYTHON" -u -m benchmarks.gpu_suite "$@"
