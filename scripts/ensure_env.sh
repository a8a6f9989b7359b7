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
    # Say what is coming before pip's long silence (-q): a first run looks hung otherwise.
    torch_build="the CUDA build of torch"
    [ ${#constraints[@]} -gt 0 ] && torch_build="the CPU build of torch (no GPU driver here)"
    echo "[vgraph] installing vgraph (editable) and its dependencies into $venv: $torch_build, triton," \
         "transformers, FastAPI/uvicorn, and the dev tools (pytest, openai, litellm, langchain-openai, lm-eval, mkdocs)" >&2
    echo "[vgraph] this takes about 90 s on a 2-core machine with a warm package cache (longer when" \
         "packages must be downloaded); later runs skip it until pyproject.toml changes" >&2
    "$venv/bin/python" -m pip install -q "${constraints[@]}" -e "$root[dev]"
    touch "$stamp"
fi
