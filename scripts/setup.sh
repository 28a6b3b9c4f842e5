#!/usr/bin/env bash
# Set up swectl on a fresh Debian 12 machine (idempotent; safe to re-run).
#   1. system packages: podman, runc, catatonit, debootstrap, uidmap, openssh-server, iproute2, git;
#      docker.io (the docker sandbox backend and its tests) and docker-registry (the image push/sync tests):
#      installed, never started (tests run their own dockerd and registry)
#   2. a virtualenv in .venv with swectl installed editable (extras from $SWECTL_EXTRAS, default "dev,cpu")
#   3. the offline base image localhost/swectl-base:bookworm (debootstrap + podman import; en_US.UTF-8 locale)
#   4. with --with-vllm: vLLM's CPU build in .venv-vllm for `[engine] kind = "vllm"` (scripts/setup_vllm.sh;
#      the test command passes it, so vLLM's tests run against the real server)
#   5. with --with-harnesses: the agent harnesses the gateway is tested with (mini-swe-agent) in .venv-harness,
#      and Harbor (its ATIF validator, task loader, oracle and no-op agents) in .venv-harbor (Python 3.12)
#      (scripts/setup_harnesses.sh; the test command passes it too); and the CLI agents run inside sandboxes (Codex
#      CLI, Claude Code: npm, pinned) in .tools/cli-agents (scripts/setup_cli_agents.sh)
# Podman is configured through CONTAINERS_CONF=remote/nodes/containers.conf for swectl's own calls only;
# the user's /etc/containers configuration is never modified.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WITH_VLLM=0
WITH_HARNESSES=0
for arg in "$@"; do
    case "$arg" in
        --with-vllm) WITH_VLLM=1 ;;
        --with-harnesses) WITH_HARNESSES=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "setup: unknown option $arg (options: --with-vllm, --with-harnesses)" >&2; exit 2 ;;
    esac
done
EXTRAS=${SWECTL_EXTRAS:-dev,cpu}
BASE_IMAGE=${SWECTL_BASE_IMAGE:-localhost/swectl-base:bookworm}
export CONTAINERS_CONF="$ROOT/remote/nodes/containers.conf"

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
need_root() { [ "$(id -u)" = 0 ] || { echo "setup: $1 needs root (run with sudo)" >&2; exit 1; }; }

# --- 1. system packages -------------------------------------------------------------------------
# chromium + chromium-driver: the browser tests of `swectl view` (headless, driven by selenium); faketime: a
# trainer node whose clock runs ahead (tests)
PKGS=(podman runc catatonit conmon debootstrap uidmap openssh-server iproute2 git patch python3-venv chromium
      chromium-driver faketime)
missing=()
for p in "${PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    need_root "installing ${missing[*]}"
    say "installing system packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Packages whose services must not start: Docker from Debian's apt (the docker backend's tests run a private
# dockerd) and Debian's OCI registry, docker-registry (the image push/sync tests run one on a test address; its
# service would listen on every address, port 5000). A policy-rc.d answering 101 ("action forbidden") keeps the
# package scripts from starting them on hosts with an init system; one already there is kept.
QUIET=(docker.io docker-registry)
quiet_missing=()
for p in "${QUIET[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || quiet_missing+=("$p"); done
if [ ${#quiet_missing[@]} -gt 0 ]; then
    need_root "installing ${quiet_missing[*]}"
    say "installing system packages: ${quiet_missing[*]} (not started)"
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${quiet_missing[@]}" >/dev/null
    if [ -n "$policy" ]; then rm -f "$policy"; trap - EXIT; fi
fi

# --- 2. python environment ----------------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import swectl, msgspec, anyio, asyncssh" 2>/dev/null || [ pyproject.toml -nt .venv/.swectl-installed ] || [ setup.py -nt .venv/.swectl-installed ]; then
    say "installing swectl[$EXTRAS] into .venv"
    # pip's and setuptools' chatter (the editable-install notice about package-dir mappings) goes to a log;
    # it is shown only when the install fails.
    log=.venv/pip-install.log
    if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e ".[$EXTRAS]"; } >"$log" 2>&1; then
        tail -40 "$log" >&2; echo "setup: pip install failed (full log: $log)" >&2; exit 1
    fi
    .venv/bin/python -c "import swectl, msgspec, anyio, asyncssh"
    touch .venv/.swectl-installed
fi

# SWE-bench 4.1.0's per-repo specs (swebench 5.x dropped them): the eval scripts of classic rows.
bash scripts/fetch_swebench_specs.sh

# --- 3. base image --------------------------------------------------------------------------------
# Images built before python3-venv (needed by project images) or the en_US.UTF-8 locale joined the base are
# rebuilt. The locale: the official SWE-bench images have every locale (locales-all), and specs' eval commands
# export LANG=en_US.UTF-8 (django's): without it Python 3.6 opens text files as ASCII and gold patches fail.
base_ok='import ensurepip, locale; locale.setlocale(locale.LC_ALL, "en_US.UTF-8")'
if podman image exists "$BASE_IMAGE" && ! podman run --rm --network none "$BASE_IMAGE" python3 -c "$base_ok" 2>/dev/null; then
    say "rebuilding $BASE_IMAGE: it lacks python3-venv or the en_US.UTF-8 locale"
    podman rmi -f "$BASE_IMAGE" >/dev/null
fi
if ! podman image exists "$BASE_IMAGE"; then
    need_root "building the base image"
    mirror=$( (cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true) | grep -oE "^(URIs:|deb) +https?://[^ ]+" | grep -v security | awk "NR==1 {print \$2}")
    mirror=${mirror:-http://deb.debian.org/debian}
    rootfs=$(mktemp -d /var/tmp/swectl-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    say "building $BASE_IMAGE with debootstrap from $mirror (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,git,patch,procps,locales bookworm "$rootfs" "$mirror" >/var/tmp/swectl-debootstrap.log 2>&1 \
        || { echo "setup: debootstrap failed, see /var/tmp/swectl-debootstrap.log" >&2; exit 1; }
    # en_US.UTF-8 generated (and left uncommented in /etc/locale.gen, so an eval script's locale-gen keeps it)
    sed -i '/^# *en_US.UTF-8 UTF-8/s/^# *//' "$rootfs"/etc/locale.gen
    chroot "$rootfs" locale-gen >>/var/tmp/swectl-debootstrap.log 2>&1 \
        || { echo "setup: locale-gen in the base image failed, see /var/tmp/swectl-debootstrap.log" >&2; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --quiet - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"; trap - EXIT
fi
# --- 4. bundled task set: one image per project version (cached by content; a no-op when unchanged)
say "building the bundled project images (cached)"
.venv/bin/swectl image build

if [ "$WITH_VLLM" = 1 ]; then
    bash scripts/setup_vllm.sh
fi
if [ "$WITH_HARNESSES" = 1 ]; then
    bash scripts/setup_harnesses.sh
    bash scripts/setup_cli_agents.sh
fi

say "ready: $(podman --version), image $BASE_IMAGE, $(.venv/bin/python --version)"
