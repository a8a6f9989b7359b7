#!/usr/bin/env bash
# The main job, in ./.venv (created when missing). With no arguments it serves the built-in demo
# model as an OpenAI-compatible API on http://localhost:8000 (Ctrl+C or SIGTERM stops it);
# otherwise the arguments are a vgraph command line, e.g. `bash scripts/run.sh ops check`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
if [ "$#" -eq 0 ]; then
    set -- serve
fi
exec "$root/.venv/bin/vgraph" "$@"
