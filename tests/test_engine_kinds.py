"""One spec per engine kind (actors/engine_kinds.py): the command lines, ports, interpreters, tunnelling and client
classes that the Engines actor used to branch on."""

from __future__ import annotations

import sys

import pytest

from swectl.actors.engine_kinds import KINDS, CpuKind, Launch, VllmKind, engine_kind
from swectl.config import EngineConfig
from swectl.engine.client import SglangClient
from swectl.engine.vllm import VllmClient
from swectl.remote.nodes.supervisor import API_KEY_PLACEHOLDER


def _launch(kind: str, **kw: object) -> Launch:
    fields: dict[str, object] = {"python": "/py", "model": "/m", "bind": "0.0.0.0", "port": 8123,
                                 "config": EngineConfig(kind=kind), **kw}  # type: ignore[arg-type]
    return Launch(**fields)  # type: ignore[arg-type]


def test_every_configurable_kind_has_a_spec() -> None:
    kinds = EngineConfig.__annotations__["kind"]
    assert set(KINDS) == {"cpu", "sglang", "vllm"}, kinds
    with pytest.raises(ValueError, match="not one of cpu, sglang, vllm"):
        engine_kind("tgi")


def test_cpu_prints_its_port_and_is_told_pushed_weights_on_its_command_line() -> None:
    kind = engine_kind("cpu")
    assert isinstance(kind, CpuKind) and kind.prints_port and not kind.takes_hub_names
    argv = kind.argv(_launch("cpu", port=0))
    assert argv[:3] == ["/py", "-m", "swectl.remote.programs.cpu_engine"] and "--weight-version" not in argv
    assert kind.argv(_launch("cpu", weight_version="7"))[-2:] == ["--weight-version", "7"]
    assert kind.python(EngineConfig()) == sys.executable
    assert isinstance(kind.client("http://x:1", timeout_s=1, api_key=None), SglangClient)


def test_sglang_takes_its_port_and_the_key_placeholder() -> None:
    kind = engine_kind("sglang")
    argv = kind.argv(_launch("sglang", api_key=True))
    assert argv[1:3] == ["-m", "sglang.launch_server"] and argv[argv.index("--port") + 1] == "8123"
    assert argv[-2:] == ["--api-key", API_KEY_PLACEHOLDER]
    assert "--api-key" not in kind.argv(_launch("sglang"))
    assert not kind.prints_port and not kind.tunneled(EngineConfig(kind="sglang"))


def test_vllm_is_tunnelled_unless_bound_on_purpose_and_has_its_own_interpreter() -> None:
    kind = engine_kind("vllm")
    assert isinstance(kind, VllmKind) and kind.needs_untied_head and kind.failed_reload_breaks
    assert kind.tunneled(EngineConfig(kind="vllm")) and not kind.tunneled(EngineConfig(kind="vllm", host="0.0.0.0"))
    assert kind.python(EngineConfig(kind="vllm")).endswith(".venv-vllm/bin/python")
    assert kind.python(EngineConfig(kind="vllm", python="/opt/v")) == "/opt/v"
    assert isinstance(kind.client("http://x:1", timeout_s=1, api_key=None), VllmClient)
    config = {"max_position_embeddings": 4096, "torch_dtype": "float32"}
    cpu_build = kind.argv(_launch("vllm", model_config=config, facts={"cpu_build": True}))
    gpu_build = kind.argv(_launch("vllm", model_config=config, facts={"cpu_build": False}))
    assert cpu_build != gpu_build  # the CPU build prefills a whole prompt at once (vllm_argv)
