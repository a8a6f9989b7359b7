#!/usr/bin/env bash
# The main job, in ./.venv (created when missing). With no arguments it runs the default
# entry point; otherwise the arguments are a vgraph command line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
if [ "$#" -eq 0 ]; then
    set -- ops check
fi
exec "$root/.venv/bin/vgraph" "$@"
