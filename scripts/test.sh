#!/usr/bin/env bash
# The whole test suite, in ./.venv (created when missing). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "${@:-tests}"
