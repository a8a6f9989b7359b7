#!/usr/bin/env bash
# The whole test suite, in ./.venv (created when missing): first the documentation site, built
# strictly (a broken link, anchor or page fails here; not --quiet, which hides the warnings
# that --strict counts), then pytest. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_env.sh"
cd "$root"
site="$(mktemp -d "${TMPDIR:-/tmp}/vgraph-site.XXXXXX")"
trap 'rm -rf "$site"' EXIT
echo "[vgraph] building the documentation (mkdocs build --strict)" >&2
NO_MKDOCS_2_WARNING=1 "$root/.venv/bin/python" -m mkdocs build --strict -d "$site"
"$root/.venv/bin/python" -m pytest "${@:-tests}"
