#!/usr/bin/env bash
# Download the wheels the GPU suite carries (benchmarks/gpu_suite/wheels.txt) for CPython 3.12
# on manylinux x86_64 into .gpu_wheels/ (git-ignored), where benchmarks/gpu_suite.sh installs
# them from on the device machine. Run here, where pip reaches a package index; carry the
# folder with the tree (the device tool's `carry: [".gpu_wheels"]`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PIP="${PIP:-.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"
DEST=.gpu_wheels
LIMIT_MB=32  # the tree and the wheels travel together, 64 MiB at most
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: pip stops at two
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
grep -v '^\s*#' benchmarks/gpu_suite/wheels.txt | grep -v '^\s*$' | while read -r req; do
    $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST" "$req"
done
ls -l "$DEST"
total_kb=$(du -sk "$DEST" | cut -f1)
echo "total: $((total_kb / 1024)) MiB in $DEST"
if [ "$total_kb" -gt $((LIMIT_MB * 1024)) ]; then
    echo "more than $LIMIT_MB MiB of wheels: trim benchmarks/gpu_suite/wheels.txt" >&2
    exit 1
fi
