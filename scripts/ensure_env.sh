#!/usr/bin/env bash
# Creates ./.venv with vgraph (editable) and its test tools when it is missing or older than
# pyproject.toml. Sourced by scripts/run.sh and scripts/test.sh; safe to run on its own.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.vgraph-installed"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "[vgraph] creating $venv" >&2
    "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    constraints=()
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        # No GPU driver: pin the CPU build of torch so pip never pulls CUDA packages.
        constraints=(-c "$root/constraints/cpu.txt")
    fi
    echo "[vgraph] installing vgraph and its dependencies into $venv" >&2
    "$venv/bin/python" -m pip install -q "${constraints[@]}" -e "$root[dev]"
    touch "$stamp"
fi
