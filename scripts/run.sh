#!/usr/bin/env bash
# The main job, in ./.venv (created when missing). With no arguments it generates text with
# the built-in demo model (the server replaces this default once it lands); otherwise the
# arguments are a vgraph command line, e.g. `bash scripts/run.sh ops check`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
if [ "$#" -eq 0 ]; then
    set -- generate --prompt "The quick brown fox" --prompt "Once upon a time" --max-tokens 32
fi
exec "$root/.venv/bin/vgraph" "$@"
