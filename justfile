# swectl tasks. `just --list` shows them. Run `bash scripts/setup.sh` (or `just setup`) first.
set positional-arguments
set shell := ["bash", "-cu"]

venv := justfile_directory() / ".venv/bin"

# list recipes
default:
    @just --list

# install system packages, the venv and the base image (idempotent)
setup:
    bash scripts/setup.sh

# run the main job on a cluster config (default: the embedded one-local-node default)
up *args:
    {{venv}}/swectl up "$@"

# run the tests (unit + integration: real podman, sshd in network namespaces)
test *args:
    {{venv}}/python -m pytest "$@"

# ruff
lint:
    {{venv}}/ruff check .

# benchmarks: `just bench env`, `just bench gateway` (the latency the gateway adds; --engine cpu), `just bench harness_env` (mini's commands: environment class vs docker shim), `just bench cli_agents` (Codex CLI and Claude Code in the sandbox vs swectl's loop), `just bench harbor` (Harbor's trial time: its podman environment vs swectl's sandboxes), `just bench learn_harness` (learning through mini-swe-agent, with its shuffled control), `just bench grade`, `just bench hack` (the grader under GRPO), `just bench chaos` (faults during `swectl up`), `just bench rollout`, `just bench train`, `just bench serve` (--quick), `just bench view`, `just bench engine`, `just bench gpu` (CUDA), `just bench async` (simulated), `just bench images` (root; --quick)
bench suite *args:
    {{venv}}/python benchmarks/{{suite}}.py "${@:2}"

# research runs with their controls (experiments/): `just experiment prm --tasks ... --judge-data ... --policy ...` (a trained judge), `just experiment probe_update ...`
experiment name *args:
    {{venv}}/python experiments/{{name}}.py "${@:2}"

# the learning demo: gold trajectories, SFT, GRPO and its zero-advantage control run; benchmarks/results/learn.json
learn *args:
    {{venv}}/python experiments/learn.py "$@"

# two sshd test nodes in network namespaces (for examples/two-nodes.toml); `just nodes-down` removes them
nodes-up count="2":
    {{venv}}/python -m swectl.testing.nodes up --count {{count}}

nodes-down:
    {{venv}}/python -m swectl.testing.nodes down
