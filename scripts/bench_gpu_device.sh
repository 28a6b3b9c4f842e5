#!/usr/bin/env bash
# `just bench gpu` on the lent device machine (torch/transformers are the machine's own; nothing can be
# downloaded there). Prepare here first: `bash scripts/bench_gpu_device.sh --prepare` (wheels into .gpu/whl,
# the golden test's tiny model into .gpu/tiny); then run this script on the device with `.gpu` carried.
# Results: $OUT/gpu.json (and the log on stdout).
set -euo pipefail
R="$(cd "$(dirname "$0")/.." && pwd)"
if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p "$R/.gpu/whl"
    pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        -d "$R/.gpu/whl" msgspec anyio asyncssh cryptography cffi pycparser starlette uvicorn trio outcome \
        sniffio h11 click attrs sortedcontainers idna
    [[ -d "$R/.gpu/tiny" ]] || "$R/.venv/bin/swectl" model init --vocab 600 --layers 2 --hidden 64 \
        --corpus-max-bytes 300000 --out "$R/.gpu/tiny"
    exit 0
fi
OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT"
pip install -q --no-index --no-deps --target /tmp/site "$R"/.gpu/whl/*.whl
rm -rf /tmp/pkg && mkdir /tmp/pkg && cp -r "$R/swectl" /tmp/pkg/ && cp -r "$R/actors" "$R/remote" /tmp/pkg/swectl/
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
cd /tmp  # not the checkout: its swectl/ has no actors or remote
PYTHONPATH=/tmp/site:/tmp/pkg python3 "$R/benchmarks/gpu.py" --tiny "$R/.gpu/tiny" --out "$OUT/gpu.json" "${@}"
