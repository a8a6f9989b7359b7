# Sourced by scripts/ensure_env.sh and scripts/test_min_torch.sh: the one place that creates a
# venv and keeps its install current.
#
# ensure_venv VENV DESCRIPTION PIP_ARGS...: creates VENV when missing, then runs `pip install -q
# PIP_ARGS` in it unless it already ran since pyproject.toml (and every file among PIP_ARGS,
# such as a constraints file) last changed. DESCRIPTION says what is coming before pip's long
# silence (-q): a first run looks hung otherwise.
ensure_venv() {
    local venv="$1" what="$2"
    shift 2
    local stamp="$venv/.vgraph-installed" root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [ ! -x "$venv/bin/python" ]; then
        echo "[vgraph] creating $venv" >&2
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    local stale=0 arg
    [ -f "$stamp" ] || stale=1
    for arg in "$root/pyproject.toml" "$@"; do
        if [ -f "$arg" ] && [ "$arg" -nt "$stamp" ]; then stale=1; fi
    done
    if [ "$stale" = 1 ]; then
        echo "[vgraph] installing into $venv: $what" >&2
        "$venv/bin/python" -m pip install -q "$@"
        touch "$stamp"
    fi
}
