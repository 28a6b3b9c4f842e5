#!/usr/bin/env bash
# The agent harnesses swectl's gateway is tested with, unmodified, in a venv of their own (.venv-harness;
# idempotent, about a minute and 750 MiB the first time): mini-swe-agent (PyPI, pinned). Run by
# `bash scripts/setup.sh --with-harnesses` (the test command does; CI runs it), or alone.
#   - its own venv: mini-swe-agent pulls litellm and the openai SDK, which swectl does not need;
#   - tests run it with LITELLM_LOCAL_MODEL_COST_MAP=True and MSWEA_CONFIGURED=true, so it asks nothing and
#     reaches nothing but the gateway on loopback.
# $SWECTL_HARNESS_VENV moves the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SWECTL_HARNESS_VENV:-.venv-harness}
MINI_VERSION=2.4.6
say() { printf '\033[1m[setup harnesses]\033[0m %s\n' "$*"; }

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
