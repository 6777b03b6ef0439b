#!/usr/bin/env bash
# Create (or complete) the project environment in .venv/ at the repository root.
# Idempotent: a finished environment is left alone (marker file .venv/.miles_like_ready).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
marker=".venv/.miles_like_ready"
stamp="$(sha1sum pyproject.toml | cut -d' ' -f1)"
if [[ -f "$marker" && "$(cat "$marker")" == "$stamp" ]]; then
  exit 0
fi
python="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip=".venv/bin/pip"
"$pip" install --quiet --upgrade pip
# Without CUDA, install the CPU build of torch first: a bare `torch` requirement would
# otherwise resolve to a multi-GB CUDA wheel. With CUDA, the open range in pyproject applies.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "$pip" install --quiet "torch==2.13.0"
fi
"$pip" install --quiet -e ".[test]"
echo "$stamp" > "$marker"
echo "environment ready in $root/.venv"
