"""The Engines actor with real engine processes: routing with session affinity, a killed engine is restarted,
servers launched on an ssh node (a real sshd in a network namespace) are reached over the node's address with
an API key and die with their channel, a failed start quotes the server's output, and the SGLang launch path
(free port on the node, --api-key, retry when the port is taken) against a stand-in that takes SGLang's flags."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")
pytest.importorskip("uvicorn", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from swectl.actors.engines import EngineHost, Engines, engine_hosts
from swectl.config import EngineConfig, decode_config
from swectl.engine.client import SglangClient
from swectl.engine.wire import GenerateRequest, SamplingParams
from swectl.errors import ConfigError, EngineRejectedError, EngineUnavailableError
from swectl.schema import ServerState
from swectl.testing import nodes as testnodes

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

FAST = {"health_interval_s": 0.3, "max_failures": 2, "start_timeout_s": 120.0}
REQUEST = GenerateRequest(input_ids=[5, 6, 7, 8], sampling_params=SamplingParams(max_new_tokens=4, temperature=0))


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[testnodes.TestNodes, testnodes.TestNode]]:
    reason = testnodes.can_run_test_nodes()
    if reason is not None:
        pytest.skip(reason)
    with testnodes.test_nodes(1, prefix="swe", base_index=240) as tn:
        yield tn, tn.nodes[0]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110 (polling the actor's state is the point)
            await anyio.sleep(0.1)


async def test_affinity_and_restart(model: Path, tmp_path: Path) -> None:
    engines = Engines(EngineConfig(replicas=2, **FAST), model=str(model), log_dir=tmp_path)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(engines.run)
        assert len(set(engines.urls())) == 2
        assert engines.statistics().routable == 2
        # Affinity: a session keeps its server; sessions spread over both.
        picks = {k: engines._pick(k).index for k in (f"task{i}#0" for i in range(20))}
        assert set(picks.values()) == {0, 1}
        assert all(engines._pick(k).index == v for k, v in picks.items())
        first = await engines.route("task0#0").generate(REQUEST)
        assert len(first.output_ids) == 4

        victim = engines._servers[picks["task0#0"]]
        assert victim.pid is not None
        assert alive(victim.pid)
        old_pid = victim.pid
        os.kill(old_pid, signal.SIGKILL)
        # While it is down, its sessions are served by the other engine.
        await until(lambda: not victim.healthy, 60, "the killed engine is noticed")
        assert "exited with" in victim.last_error
        assert engines.statistics().servers[victim.index].state in (ServerState.RESTARTING, ServerState.STARTING)
        assert (await engines.route("task0#0").generate(REQUEST)).output_ids == first.output_ids
        await until(lambda: victim.healthy and victim.restarts == 1, 120, "the engine restarts")
        assert engines._pick("task0#0") is victim
        assert victim.pid != old_pid
        assert (await engines.route("task0#0").generate(REQUEST)).output_ids == first.output_ids
        pids = [s.pid for s in engines._servers]
        tg.cancel_scope.cancel()
    assert all(s.proc is None for s in engines._servers)
    assert [s.state for s in engines.statistics().servers] == [ServerState.STOPPED] * 2
    assert not any(alive(p) for p in pids if p is not None)
    log = (tmp_path / "engine0.log").read_text()
    assert "swectl-engine pid" in log
    assert "ready on" in log


def first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def test_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    engines = Engines(EngineConfig(**FAST), model=str(tmp_path / "no-such-model"), log_dir=tmp_path)
    with pytest.raises(BaseException) as caught:  # an ExceptionGroup around the error
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(60):
                await tg.start(engines.run)
    error = first_leaf(caught.value)
    assert isinstance(error, ConfigError), repr(error)
    assert "no-such-model is not on node local" in str(error), repr(error)


async def test_failed_start_quotes_the_server_output(tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    engines = Engines(EngineConfig(**FAST), model=str(broken), log_dir=tmp_path)
    with pytest.raises(BaseException) as caught:  # an ExceptionGroup around the error
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(120):
                await tg.start(engines.run)
    error = first_leaf(caught.value)
    assert isinstance(error, EngineUnavailableError), repr(error)
    assert "0 on local: exited with 1 while starting" in str(error), str(error)
    assert "broken-model" in str(error), str(error)  # the server's own complaint, quoted
    assert (tmp_path / "engine0.log").exists()


async def test_engine_on_ssh_node(model: Path, node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tn, test_node = node
    doc = tomllib.loads(tn.cluster_toml(extra_node_fields="connect_timeout_s = 5\nkeepalive_interval_s = 1"))
    doc["engine"] = {"nodes": [test_node.name], **FAST}
    config = decode_config(doc)
    netns_inode = os.stat(f"/run/netns/{test_node.netns}").st_ino
    async with engine_hosts(config.engine_nodes()) as hosts, anyio.create_task_group() as tg:
        engines = Engines(config.engine, model=str(model), hosts=hosts, log_dir=tmp_path)
        with anyio.fail_after(150):
            await tg.start(engines.run)
        (server,) = engines._servers
        assert server.url.startswith(f"http://{test_node.host}:"), server.url
        assert server.pid is not None
        assert os.stat(f"/proc/{server.pid}/ns/net").st_ino == netns_inode
        result = await engines.route("t#0").generate(REQUEST)
        assert len(result.output_ids) == 4
        # Bound to 0.0.0.0 on the node, so it takes a key: a client without it is turned away.
        async with SglangClient(server.url, timeout_s=10) as stranger:
            with pytest.raises(EngineRejectedError) as rejected:
                await stranger.generate(REQUEST)
        assert rejected.value.status == 401

        # The SSH connection drops (as when the controller dies): the server on the node goes with it,
        # and the actor brings a new one up over a fresh connection.
        first_pid = server.pid
        await hosts[0].node.aclose()
        await until(lambda: not alive(first_pid), 30, "the server dies with its channel")
        await until(lambda: server.healthy and server.restarts >= 1, 150, "a new server on the node")
        assert server.pid != first_pid
        assert alive(server.pid)
        assert (await engines.route("t#0").generate(REQUEST)).output_ids == result.output_ids
        last_pid = server.pid
        tg.cancel_scope.cancel()
    await until(lambda: not alive(last_pid), 30, "the server stops with the actor")


def stand_in_sglang(tmp_path: Path) -> Path:
    """A ``python`` for engine.python under which ``-m sglang.launch_server`` is a stand-in taking SGLang's
    flags (--model-path, --host, --port, --api-key) and serving with swectl's CPU engine. The first launch
    fails the way a lost port race does."""
    package = tmp_path / "standin" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    marker = tmp_path / "standin" / "first-launch-done"
    (package / "launch_server.py").write_text(f"""
import argparse, pathlib, sys
from swectl.remote.programs import cpu_engine
p = argparse.ArgumentParser()
p.add_argument("--model-path", required=True)
p.add_argument("--host", required=True)
p.add_argument("--port", type=int, required=True)
p.add_argument("--api-key", default=None)
a = p.parse_args()
marker = pathlib.Path({str(marker)!r})
if not marker.exists():
    marker.write_text("")
    print("OSError: [Errno 98] error while attempting to bind on address: address already in use", flush=True)
    sys.exit(1)
argv = ["--model", a.model_path, "--host", a.host, "--port", str(a.port)]
cpu_engine.main(argv + (["--api-key", a.api_key] if a.api_key else []))
""")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={package.parent} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


async def test_sglang_launch_path(model: Path, tmp_path: Path) -> None:
    config = EngineConfig(kind="sglang", python=str(stand_in_sglang(tmp_path)), **FAST)
    engines = Engines(config, model=str(model), hosts=[EngineHost.local()], log_dir=tmp_path, api_key="k3y")
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(engines.run)
        assert len((await engines.route("s#0").generate(REQUEST)).output_ids) == 4
        log = (tmp_path / "engine0.log").read_text()
        assert "address already in use" in log, log
        assert log.count("swectl-engine pid") == 2, log
        async with SglangClient(engines.urls()[0], timeout_s=10) as stranger:
            with pytest.raises(EngineRejectedError):
                await stranger.generate(REQUEST)
        tg.cancel_scope.cancel()


async def test_weight_sync_versions_and_a_rejected_update(model: Path, tmp_path: Path) -> None:
    """update_weights reaches every server (pause, load, resume): the next generation carries the version; a folder
    the engine cannot load is rejected with the engine's message, and the engines keep serving the old weights."""
    engines = Engines(EngineConfig(replicas=2, **FAST), model=str(model))
    async with anyio.create_task_group() as tg:
        await tg.start(engines.run)
        seconds = await engines.update_weights(str(model), "7")
        assert seconds >= 0
        for key in ("a", "b", "c", "d"):
            result = await engines.route(key).generate(REQUEST)
            assert result.weight_version == "7"
        with pytest.raises(EngineRejectedError) as rejected:
            await engines.update_weights(str(tmp_path / "missing"), "8")
        assert "missing" in str(rejected.value)
        result = await engines.route("a").generate(REQUEST)
        assert result.weight_version == "7"
        tg.cancel_scope.cancel()


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def test_faults_a_server_survives_and_a_push_through_an_outage(model: Path, tmp_path: Path) -> None:
    """Issue 62's engine faults on one CPU server: its supervisor killed (the server must not go on as an orphan:
    it dies and is restarted), the server stopped (SIGSTOP: its health checks time out, it is killed and
    restarted), and the server killed just before a weight push (the push waits for the restart instead of failing,
    and the restarted server loads the pushed weights under their version)."""
    config = EngineConfig(**{**FAST, "max_failures": 2})
    engines = Engines(config, model=str(model), log_dir=tmp_path)
    new_weights = tmp_path / "weights-step-7"
    shutil.copytree(model, new_weights)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(engines.run)
        (server,) = engines._servers
        assert server.pid is not None

        # 1. kill -9 of the supervisor shell: the guard kills the server, the controller restarts it
        first = server.pid
        supervisor = parent_pid(first)
        assert Path(f"/proc/{supervisor}/cmdline").read_bytes().startswith(b"sh\0")  # noqa: ASYNC240
        os.kill(supervisor, signal.SIGKILL)
        await until(lambda: not alive(first), 10, "the server dies with its supervisor")
        await until(lambda: server.healthy and server.restarts == 1, 120, "the server restarts")

        # 2. SIGSTOP: alive but silent; found by its health checks, killed (KILL reaches a stopped process), restarted
        second = server.pid
        assert second is not None and second != first
        os.kill(second, signal.SIGSTOP)
        await until(lambda: not alive(second), 120, "the stopped server is killed")
        assert "failed health checks" in server.last_error
        await until(lambda: server.healthy and server.restarts == 2, 120, "the server restarts")

        # 3. kill -9 of the server, then at once a weight push: it waits for the restart
        third = server.pid
        assert third is not None
        os.kill(third, signal.SIGKILL)
        await until(lambda: not server.healthy, 30, "the killed server is noticed")
        with anyio.fail_after(150):
            await engines.update_weights(str(new_weights), "7")
        assert server.healthy and server.restarts == 3 and server.pid != third
        assert server.client is not None
        assert await server.client.get_weight_version() == "7"
        assert server.weights == (str(new_weights), "7")
        out = await engines.route("s#0").generate(REQUEST)
        assert len(out.output_ids) == 4 and out.weight_version == "7"
        # the push to a server already on those weights does nothing
        assert await engines.update_weights(str(new_weights), "7") < 1.0
        pids = [s.pid for s in engines._servers]
        tg.cancel_scope.cancel()
    assert not any(alive(p) for p in pids if p is not None)
