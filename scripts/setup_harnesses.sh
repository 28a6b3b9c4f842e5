#!/usr/bin/env bash
# The agent harnesses swectl's gateway is tested with, unmodified, in a venv of their own (.venv-harness;
# idempotent, about a minute and 750 MiB the first time): mini-swe-agent (PyPI, pinned); and Harbor (PyPI
# `harbor`, pinned; Python >= 3.12, so pyenv's 3.12 in .venv-harbor, about two minutes and 430 MiB) with
# podman-compose, whose ATIF validator, linter, oracle and no-op agents and podman environment the tests run. Run by
# `bash scripts/setup.sh --with-harnesses` (the test command does; CI runs it), or alone.
#   - its own venv: mini-swe-agent pulls litellm and the openai SDK, which swectl does not need;
#   - tests run it with LITELLM_LOCAL_MODEL_COST_MAP=True and MSWEA_CONFIGURED=true, so it asks nothing and
#     reaches nothing but the gateway on loopback.
# $SWECTL_HARNESS_VENV moves the venv; $SWECTL_HARBOR_VENV Harbor's, $SWECTL_PYTHON312 names the 3.12 interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SWECTL_HARNESS_VENV:-.venv-harness}
MINI_VERSION=2.4.6
say() { printf '\033[1m[setup harnesses]\033[0m %s\n' "$*"; }

HARBOR_VENV=${SWECTL_HARBOR_VENV:-.venv-harbor}
HARBOR_VERSION=0.25.0
# Harbor's podman environment drives podman through compose; podman 4.3 has no `podman compose`, so podman-compose
# (PyPI) goes into Harbor's venv, whose bin/ the tests put on PATH.
PODMAN_COMPOSE_VERSION=1.6.0

setup_harbor() {
    local check='import importlib.metadata as m, sys; sys.exit(m.version("harbor") != sys.argv[1] or m.version("podman-compose") != sys.argv[2])'
    if [ -x "$HARBOR_VENV/bin/harbor" ] && "$HARBOR_VENV/bin/python" -c "$check" "$HARBOR_VERSION" "$PODMAN_COMPOSE_VERSION" 2>/dev/null; then
        say "harbor $HARBOR_VERSION is ready in $HARBOR_VENV"
        return 0
    fi
    local py=${SWECTL_PYTHON312:-}
    if [ -z "$py" ]; then
        for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12; do
            if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
                py=$(command -v "$c"); break
            fi
        done
    fi
    if [ -z "$py" ]; then
        echo "setup harnesses: Harbor needs Python >= 3.12 and none was found (tried python3.12 on PATH and" >&2
        echo "  ~/.pyenv/versions/3.12*); install one (pyenv install 3.12) or set SWECTL_PYTHON312=/path/to/python3.12" >&2
        exit 1
    fi
    [ -x "$HARBOR_VENV/bin/python" ] || "$py" -m venv "$HARBOR_VENV"
    say "installing harbor $HARBOR_VERSION into $HARBOR_VENV with $py (about two minutes)"
    local log="$HARBOR_VENV/pip-install.log"
    if ! "$HARBOR_VENV/bin/pip" install -q "harbor==$HARBOR_VERSION" "podman-compose==$PODMAN_COMPOSE_VERSION" >"$log" 2>&1; then
        tail -40 "$log" >&2; echo "setup harnesses: pip install harbor failed (full log: $log)" >&2; exit 1
    fi
    say "harbor $HARBOR_VERSION is ready in $HARBOR_VENV"
}
setup_harbor

check='import importlib.metadata as m, sys; sys.exit(m.version("mini-swe-agent") != sys.argv[1])'
if [ -x "$VENV/bin/mini" ] && "$VENV/bin/python" -c "$check" "$MINI_VERSION" 2>/dev/null; then
    say "mini-swe-agent $MINI_VERSION is ready in $VENV"
    exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
say "installing mini-swe-agent $MINI_VERSION into $VENV (about a minute)"
log="$VENV/pip-install.log"
if ! "$VENV/bin/pip" install -q "mini-swe-agent==$MINI_VERSION" >"$log" 2>&1; then
    tail -40 "$log" >&2; echo "setup harnesses: pip install failed (full log: $log)" >&2; exit 1
fi
if ! "$VENV/bin/python" -c "$check" "$MINI_VERSION" >>"$log" 2>&1; then
    tail -20 "$log" >&2; echo "setup harnesses: mini-swe-agent is not $MINI_VERSION after the install ($log)" >&2
    exit 1
fi
say "mini-swe-agent $MINI_VERSION is ready in $VENV"
