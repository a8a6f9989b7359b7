#!/usr/bin/env bash
# Creates ./.venv with vgraph (editable) and its test tools when it is missing or older than
# pyproject.toml. Sourced by scripts/run.sh and scripts/test.sh; safe to run on its own.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/venv.sh"

constraints=()
torch_build="the CUDA build of torch"
if ! command -v nvidia-smi >/dev/null 2>&1; then
    # No GPU driver: pin the CPU build of torch so pip never pulls CUDA packages.
    constraints=(-c "$root/constraints/cpu.txt")
    torch_build="the CPU build of torch (no GPU driver here)"
fi
ensure_venv "$root/.venv" "vgraph (editable) and its dependencies: $torch_build, triton, transformers,\
 FastAPI/uvicorn, and the dev tools (pytest, openai, litellm, langchain-openai, lm-eval, mkdocs); this takes\
 about 90 s on a 2-core machine with a warm package cache (longer when packages must be downloaded);\
 later runs skip it until pyproject.toml changes" \
    "${constraints[@]}" -e "$root[dev]"
