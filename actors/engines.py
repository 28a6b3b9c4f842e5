"""The Engines actor: launches and supervises inference servers that speak SGLang's HTTP API, on this machine
or on nodes over SSH, and routes requests to them with session affinity (every turn of one episode goes to
the same server, so its prefix stays in that server's cache).

Kinds of server (``engine.kind``: ``cpu``, ``sglang``, ``vllm``) are specs in actors/engine_kinds.py: command line,
interpreter, port, tunnelling, client class and weight-sync hooks; nothing here branches on the kind. An external
server is a URL someone else runs (``Engines(config, url=...)``): only health-checked, never restarted.

Every server runs under a small ``sh`` supervisor (SUPERVISOR below) started through the node's
``spawn`` (a child process here, an SSH channel on an ssh node). The supervisor merges the server's
stdout and stderr into the pipe the controller reads (copied to ``<log_dir>/engine<i>.log`` on the
controller, last lines quoted in errors), reports the server's pid and exit code, and kills the server
when its stdin closes: when the controller stops it, dies, or loses the SSH connection, nothing is left
running on the node. Servers on ssh nodes bind 0.0.0.0 and get a random API key per Engines instance,
sent over the channel's stdin (it never appears on the SSH command line).

Ports: a kind that prints its port (the CPU engine) binds port 0. The others need a port on their command line:
one is picked free on the node, and if the server still loses the race ("address already in use") the
launch is retried with a new port (3 tries).

A server whose health check fails ``max_failures`` times in a row, or whose process exits, is restarted;
while it is down its sessions move to another healthy server (their next turn re-prefills there). Each
server's life is a small state machine (``_Server``, states in ``swectl.schema.ServerState``): STOPPED ->
STARTING -> HEALTHY <-> FAILING -> DOWN -> RESTARTING -> STARTING ..., and STOPPED at shutdown. Its methods
own the transitions; the actor does the I/O around them.

Consumes: ``route(session).generate(...)`` calls from the rollout. Waits for: every server's first start
(``await tg.start(engines.run)`` returns once all answer /health). Unblocked by: cancellation (servers are
stopped, TERM then KILL). Produces: generate results, ``statistics()`` (an ``EngineStatistics``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import secrets
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc

from swectl.actors.engine_kinds import EngineClient, Launch, engine_kind
from swectl.config import EngineConfig, LocalNodeConfig, NodeConfig
from swectl.engine.wire import (
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
)
from swectl.errors import ConfigError, EngineError, EngineRejectedError, EngineUnavailableError, NodeError
from swectl.remote.nodes.backends import make_node
from swectl.remote.nodes.node import LocalNode, Node, NodeProcess
from swectl.remote.nodes.ssh import SshNode
from swectl.remote.nodes.supervisor import SUPERVISOR, copy_output, stop_supervised
from swectl.rl.weight_sync import ParamSpec, stale_servers
from swectl.schema import EngineStatistics, ServerState, ServerStatistics

_log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
START_TRIES = 3
TAIL_LINES = 30
ROUTABLE_POLL_S = 0.2  # how often wait_routable looks for a server that came back

FREE_PORT = "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])"

_READY = re.compile(r"^ready on https?://\S+:(\d+)\s*$")
_PORT_TAKEN = re.compile(r"address already in use|errno 98", re.IGNORECASE)


@dataclass(frozen=True)
class EngineHost:
    """A node that runs servers, and the address the controller reaches them at."""

    node: Node
    address: str
    remote: bool  # servers bind 0.0.0.0 and require an API key

    @staticmethod
    def local() -> EngineHost:
        return EngineHost(LocalNode(), LOOPBACK, remote=False)


@contextlib.asynccontextmanager
async def engine_hosts(nodes: Sequence[NodeConfig]) -> AsyncIterator[list[EngineHost]]:
    """Hosts on ``nodes`` (``ClusterConfig.engine_nodes()``: engine.nodes, default the first node), connected;
    closed on exit."""
    hosts = []
    for node_config in nodes:
        node = make_node(node_config)
        if isinstance(node_config, LocalNodeConfig):
            hosts.append(EngineHost(node, LOOPBACK, remote=False))
        else:
            hosts.append(EngineHost(node, node_config.host, remote=True))
    try:
        for host in hosts:
            await host.node.connect()
        yield hosts
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(30):
            for host in hosts:
                await host.node.aclose()


def engine_python(config: EngineConfig) -> str:
    """The interpreter that starts a server of ``config.kind`` (actors/engine_kinds.py)."""
    return engine_kind(config.kind).python(config)


class _Server:
    """One server's state machine. The transitions are its methods (each asserts where it may come from);
    the Engines actor does the I/O (spawn, health checks, stop) and calls them."""

    def __init__(self, index: int, host: EngineHost, url: str = "") -> None:
        self.index = index
        self.host = host
        self.url = url
        self.state = ServerState.STOPPED
        self.proc: NodeProcess | None = None
        self.client: EngineClient | None = None
        self.failures = 0  # failed health checks in a row
        self.restarts = 0
        self.last_error = ""
        # What the current process has said (reset by each launch):
        self.pid: int | None = None  # the server's pid on its node
        self.port: int | None = None
        self.exit_code: int | None = None  # set when the server exited (-1: its channel closed first)
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.changed = anyio.Event()
        self.unforward: Callable[[], None] | None = None  # stops the SSH port forward the client reaches it by
        self.broken: str | None = None  # why it must be restarted though it answers its health checks
        self.weights: tuple[str, str] = ("", "")  # (model folder, weight version) this process serves

    @property
    def name(self) -> str:
        return f"{self.index} on {self.host.node.name}"

    @property
    def healthy(self) -> bool:
        """Routed to: answering, or failing fewer than max_failures checks in a row."""
        return self.state in (ServerState.HEALTHY, ServerState.FAILING) and self.client is not None

    def _move(self, to: ServerState, *sources: ServerState) -> None:
        assert self.state in sources, f"engine {self.name}: no transition {self.state.name} -> {to.name}"
        self.state = to

    # ------------------------------------------------------------------ transitions

    def starting(self, proc: NodeProcess | None) -> None:
        """A launch (attempt) begins: ``proc`` runs the supervisor (None for an external server)."""
        self._move(ServerState.STARTING, ServerState.STOPPED, ServerState.RESTARTING, ServerState.STARTING)
        self.proc = proc
        self.pid = self.port = self.exit_code = None
        self.broken = None
        self.tail = deque(maxlen=TAIL_LINES)
        self.changed = anyio.Event()

    def reachable(self, url: str, client: EngineClient) -> None:
        """Its address is known (the CPU engine prints its port): health checks can begin."""
        assert self.state is ServerState.STARTING and self.client is None
        self.url, self.client = url, client

    def up(self) -> None:
        """It answered /health: requests may be routed to it."""
        self._move(ServerState.HEALTHY, ServerState.STARTING)
        self.failures = 0

    def checked(self, ok: bool, max_failures: int) -> None:
        """A health check's result: HEALTHY on success; FAILING, then DOWN at max_failures in a row."""
        self._move(ServerState.HEALTHY if ok else ServerState.FAILING,
                   ServerState.HEALTHY, ServerState.FAILING, ServerState.DOWN)
        self.failures = 0 if ok else self.failures + 1
        if self.failures >= max_failures:
            self.state = ServerState.DOWN

    def lost(self, reason: str) -> None:
        """It exited, went down, or a relaunch failed (from any state): relaunched after a pause."""
        self._move(ServerState.RESTARTING, *ServerState)
        self.last_error = reason
        self.restarts += 1

    def detach(self) -> tuple[EngineClient | None, NodeProcess | None]:
        """Hand over the client and process to be closed. A server waiting to restart keeps waiting; any
        other stops."""
        if self.state is not ServerState.RESTARTING:
            self.state = ServerState.STOPPED
        client, proc, self.client, self.proc = self.client, self.proc, None, None
        return client, proc

    def stopped(self) -> None:
        """Supervision ended (shutdown, or a first start that failed); the actor has closed what detach() gave."""
        self.state = ServerState.STOPPED

    # ------------------------------------------------------------------ what the process says

    def on_line(self, line: str) -> None:
        """One line of the supervisor's output: its pid and exit code, the CPU engine's port, the tail."""
        if line.startswith("swectl-engine pid "):
            self.pid = int(line.split()[-1])
        elif line.startswith("swectl-engine exit "):
            self.exit_code = int(line.split()[-1])
        else:
            self.tail.append(line)
            ready = _READY.match(line)
            if ready:
                self.port = int(ready.group(1))
            else:
                return
        self._notify()

    def mark_broken(self, reason: str) -> None:
        """It answers /health but cannot serve (a vLLM reload that failed half-way): the watcher restarts it."""
        self.broken = reason
        self._notify()

    def on_channel_closed(self) -> None:
        """The supervisor's channel closed; if it did not report an exit code, the server is gone anyway."""
        if self.exit_code is None:
            self.exit_code = -1
            self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def last_output(self) -> str:
        lines = [line for line in self.tail if line.strip()]
        return "\n    ".join(lines[-12:]) or "(no output)"

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(index=self.index, node=self.host.node.name, url=self.url, state=self.state,
                                failures=self.failures, restarts=self.restarts, last_error=self.last_error)


@dataclass
class _WeightGroup:
    """The weight group the servers joined: its name, and each member with its restart count at the time."""
    name: str
    members: list[tuple[_Server, int]]


class Engines:
    """Start with ``await tg.start(engines.run)``; then ``route(session_key)`` gives an Engine for a session.

    ``url``: one external server (health-checked only). Otherwise ``model`` (a folder on every host) is
    served by ``config.replicas`` servers per host (default: one local host).
    """

    def __init__(self, config: EngineConfig, *, model: str = "", url: str = "",
                 hosts: Sequence[EngineHost] = (), log_dir: Path | None = None, api_key: str | None = None) -> None:
        if not url and not model:
            raise ValueError("Engines needs a model folder to launch, or the url of a running server")
        self._config = config
        self._kind = engine_kind(config.kind)
        self._model = model
        self._external = bool(url)
        self._log_dir = log_dir
        hosts = list(hosts) or [EngineHost.local()]
        if url:
            self._servers = [_Server(0, hosts[0], url.rstrip("/"))]
        else:
            self._servers = [_Server(i, host) for i, host in
                             enumerate(h for h in hosts for _ in range(config.replicas))]
        if api_key is None and not url and any(h.remote for h in hosts):
            api_key = secrets.token_urlsafe(24)
        self._api_key = api_key
        self._weight_group: _WeightGroup | None = None
        self._version = ""  # the weight version of self._model once update_weights replaced it
        self._outage_waits = 0
        self._outage_wait_s = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start every server (failing if one cannot start), then supervise them until cancelled."""
        async with anyio.create_task_group() as tg:
            for s in self._servers:
                await tg.start(self._serve, s)
            task_status.started()

    async def _serve(self, s: _Server, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                     ) -> None:
        """One server's life: launch, watch, relaunch. A failure of the first launch is raised."""
        started = False
        try:
            while True:
                failure: Exception | None = None
                try:
                    async with anyio.create_task_group() as tg:  # owns this incarnation's output reader
                        try:
                            await self._launch(s, tg)
                        except (EngineUnavailableError, NodeError, OSError) as exc:
                            failure = exc
                        else:
                            if not started:
                                started = True
                                task_status.started()
                            s.lost(await self._watch(s))
                        tg.cancel_scope.cancel()
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._stop(s)
                if failure is not None:
                    if not started:
                        raise failure
                    s.lost(str(failure))
                _log.warning("engine server %s: restart %d in %ss: %s", s.name, s.restarts,
                             self._config.health_interval_s, s.last_error)
                await anyio.sleep(self._config.health_interval_s)
        finally:
            s.stopped()

    @property
    def _python(self) -> str:
        return engine_python(self._config)

    def _client(self, url: str) -> EngineClient:
        return self._kind.client(url, timeout_s=self._config.request_timeout_s, api_key=self._api_key)

    async def _launch(self, s: _Server, tg: anyio.abc.TaskGroup) -> None:
        cfg = self._config
        if self._external:
            s.starting(None)
            client = self._client(s.url)
            s.reachable(s.url, client)
            with anyio.fail_after(cfg.start_timeout_s):
                while not await client.health():  # noqa: ASYNC110 (polling a remote server)
                    await anyio.sleep(0.5)
            s.up()
            return
        bind = cfg.host or ("0.0.0.0" if s.host.remote and not self._tunneled else LOOPBACK)
        facts = await self._kind.preflight(s.host.node, self._python, s.name)
        model_config = await self._check_model(s)
        for attempt in range(1, START_TRIES + 1):
            port = cfg.port if cfg.port or self._kind.prints_port else await self._free_port(s, bind)
            launch = Launch(python=self._python, model=self._model, bind=bind, port=port, config=cfg,
                            model_config=model_config, api_key=bool(self._api_key), weight_version=self._version,
                            facts=facts)
            argv = [*self._kind.argv(launch), *cfg.extra_args]
            proc = await s.host.node.spawn(["sh", "-c", SUPERVISOR, "swectl-engine", *argv])
            s.starting(proc)
            s.weights = (self._model, self._version)
            if not self._kind.prints_port:  # its port is the one given on its command line
                s.port = port
            await proc.send(f"{self._api_key or ''}\n".encode())
            tg.start_soon(self._read_output, s, proc)
            if await self._until_healthy(s, port):
                if self._version and s.client is not None:  # a restart serves the last pushed weights
                    await self._kind.restarted(s.client, self._version, timeout_s=cfg.request_timeout_s)
                s.up()
                return
            output = s.last_output()
            await self._stop(s)
            if attempt < START_TRIES and not cfg.port and _PORT_TAKEN.search(output):
                continue
            raise EngineUnavailableError(s.name, f"exited with {s.exit_code} while starting (log: "
                                         f"{self._log_path(s) or 'none'}); last output:\n    {output}")
        raise AssertionError("unreachable")

    async def _check_model(self, s: _Server) -> dict[str, object]:
        """A model given as a path must be a model folder on the node (SGLang and vLLM also take hub names). Returns
        the folder's config.json ({} for a hub name)."""
        if self._kind.takes_hub_names and not self._model.startswith(("/", ".", "~")):
            return {}
        with anyio.fail_after(60):
            out = await s.host.node.run(["cat", f"{self._model}/config.json"])
        if out.exit_code != 0:
            raise ConfigError(f"model folder {self._model} is not on node {s.host.node.name} (no config.json "
                              "there); give a Hugging Face model folder that exists on every engine node")
        try:
            config = json.loads(out.stdout)
        except ValueError:
            return {}  # the server says what is wrong with it, and its output is quoted
        return config if isinstance(config, dict) else {}

    async def _free_port(self, s: _Server, bind: str) -> int:
        with anyio.fail_after(60):
            out = await s.host.node.run([self._python, "-c", FREE_PORT, bind])
        text = out.stdout.decode(errors="replace").strip()
        if out.exit_code != 0 or not text.isdigit():
            raise EngineUnavailableError(s.name, f"cannot pick a free port on {s.host.node.name}: "
                                         f"{out.stderr.decode(errors='replace').strip()[:300]}")
        return int(text)

    async def _until_healthy(self, s: _Server, port: int) -> bool:
        """True once the server answers /health; False when it exited first. Bounded by start_timeout_s."""
        cfg = self._config
        try:
            with anyio.fail_after(cfg.start_timeout_s):
                while s.exit_code is None:
                    if not self._kind.prints_port or s.port is not None:
                        if s.client is None:
                            url = await self._url(s, s.port or port)
                            s.reachable(url, self._client(url))
                        assert s.client is not None
                        if await s.client.health(timeout_s=5):
                            _log.info("engine server %d (%s) is up on %s at %s", s.index, self._kind.name,
                                      s.host.node.name,
                                      s.url)
                            return True
                    with anyio.move_on_after(0.5):
                        await s.changed.wait()
        except TimeoutError:
            raise EngineUnavailableError(s.name, f"not healthy after {cfg.start_timeout_s:.0f} s (engine."
                                         f"start_timeout_s); last output:\n    {s.last_output()}") from None
        return False

    @property
    def _tunneled(self) -> bool:
        """On an ssh node, servers of a tunnelled kind listen on the node's loopback only and the controller reaches
        them through an SSH port forward."""
        return self._kind.tunneled(self._config)

    async def _url(self, s: _Server, port: int) -> str:
        if self._tunneled and isinstance(s.host.node, SshNode):
            local, s.unforward = await s.host.node.forward_tcp(port)
            return f"http://{LOOPBACK}:{local}"
        return f"http://{s.host.address}:{port}"

    def _log_path(self, s: _Server) -> Path | None:
        return self._log_dir / f"engine{s.index}.log" if self._log_dir is not None else None

    async def _read_output(self, s: _Server, proc: NodeProcess) -> None:
        """Copy the supervisor's output to the log, keep its last lines, and pick out pid, port and exit."""

        def on_line(line: str) -> None:
            if s.proc is proc:  # stopped: the rest only goes to the log
                s.on_line(line)

        await copy_output(proc, self._log_path(s), on_line)
        if s.proc is proc:
            s.on_channel_closed()

    async def _watch(self, s: _Server) -> str:
        """Health-check until the server must be restarted; returns why."""
        cfg = self._config
        assert s.client is not None
        while True:
            with anyio.move_on_after(cfg.health_interval_s):
                while s.exit_code is None and s.broken is None:
                    await s.changed.wait()
            if s.exit_code is not None and not self._external:
                return f"exited with {s.exit_code}; last output:\n    {s.last_output()}"
            if s.broken is not None and not self._external:
                return s.broken
            s.checked(await s.client.health(), cfg.max_failures)
            if s.state is ServerState.DOWN and not self._external:
                return f"{s.failures} failed health checks in a row"

    async def _stop(self, s: _Server) -> None:
        """Close the server's stdin (the supervisor stops it: TERM, then KILL), wait, close the channel."""
        client, proc = s.detach()
        if client is not None:
            await client.aclose()
        if s.unforward is not None:
            s.unforward()
            s.unforward = None
        if proc is None:
            return
        await stop_supervised(proc)

    # ------------------------------------------------------------------ weights

    async def update_weights(self, path: str, version: str, *, timeout_s: float | None = None) -> float:
        """Weight sync from disk (docs/architecture.md 5.3): pause generation on every routable server (in place:
        requests in flight keep their KV cache), load ``path`` (a Hugging Face folder on the engine nodes) with
        ``update_weights_from_disk`` tagged ``version``, and resume. Returns the seconds.

        An outage does not fail the push: when no server is up (one crashed and its supervisor is restarting it),
        or every server it went to was lost on the way, servers launched from now on load ``path`` as ``version``
        and the push waits for one to come back (``wait_routable``, bounded by engine.start_timeout_s), then goes
        to every healthy server not already serving ``version``. A server that rejects the update raises
        EngineRejectedError with its message (the weights are not taken up by restarts then); one that stays
        unreachable past the bound raises EngineUnavailableError."""
        t0 = anyio.current_time()
        bound = timeout_s or self._config.request_timeout_s
        wanted = (path, version)
        deadline = t0 + self._config.start_timeout_s
        while True:
            if not any(s.healthy and s.client is not None for s in self._servers):
                if self._external:
                    raise EngineUnavailableError("engines", "no server is up to take the new weights")
                self._model, self._version = wanted  # what a restarted server loads
                _log.warning("weights %s: no engine server is up; waiting for a restart to load them", version)
                await self.wait_routable(max(deadline - anyio.current_time(), ROUTABLE_POLL_S))
            targets = [s for s in self._servers if s.healthy and s.client is not None and s.weights != wanted]
            if not targets:  # every healthy server was launched on these weights
                break
            unreachable = await self._push_from_disk(targets, path, version, bound)
            if not unreachable:
                break
            # servers that went away mid-push: their restart loads the new weights; the others may take them again
            self._model, self._version = wanted
            if anyio.current_time() >= deadline:
                raise unreachable[0]
            _log.warning("weights %s: %d server(s) unreachable during the push (%s); trying again", version,
                         len(unreachable), unreachable[0])
            await anyio.sleep(ROUTABLE_POLL_S)
        if not self._external:
            self._model, self._version = wanted
        return anyio.current_time() - t0

    async def _push_from_disk(self, servers: list[_Server], path: str, version: str, bound: float
                              ) -> list[EngineError]:
        """``update_weights_from_disk`` on ``servers`` at once. A rejection raises; returns the errors of servers
        that could not be reached (down, restarting, timed out): the caller waits for them and tries again."""
        rejected: list[EngineError] = []
        unreachable: list[EngineError] = []

        async def one(s: _Server) -> None:
            assert s.client is not None
            client = s.client
            try:
                await self._kind.check_weights(s.host.node, path, s.url)
                await client.pause_generation("in_place", timeout_s=bound)
                failed: EngineRejectedError | None = None
                try:
                    await client.update_weights_from_disk(path, weight_version=version, timeout_s=bound)
                except EngineRejectedError as exc:
                    failed = exc
                    raise
                finally:
                    with anyio.CancelScope(shield=True):
                        if failed is None:
                            with contextlib.suppress(EngineUnavailableError):  # lost now: its restart loads `path`
                                await client.continue_generation(timeout_s=bound)
                        else:
                            with contextlib.suppress(EngineError):  # the update's error is the one to report
                                await client.continue_generation(timeout_s=bound)
                            if self._kind.failed_reload_breaks and not self._external:  # restarted on the
                                s.mark_broken(f"its weight reload failed, which leaves the {self._kind.name} "
                                              f"server's model unusable: {failed}")  # last weights
                s.weights = (path, version)
            except EngineUnavailableError as exc:
                unreachable.append(exc)
            except EngineError as exc:
                rejected.append(exc)

        async with anyio.create_task_group() as tg:
            for s in servers:
                tg.start_soon(one, s, name=f"update weights {s.name}")
        if rejected:
            raise rejected[0]
        return unreachable

    async def join_weight_group(self, address: str, port: int, group_name: str, backend: str, *,
                                timeout_s: float | None = None) -> None:
        """Every routable server joins the trainer's weight group (the distributed sync, docs/architecture.md 5.3)
        as ranks 1..n, while the trainer joins as rank 0 (``weight_group_size`` tells it the size first)."""
        servers = self._routable()
        bound = timeout_s or self._config.request_timeout_s
        world = 1 + len(servers)
        errors: list[EngineError] = []

        async def one(rank: int, s: _Server) -> None:
            assert s.client is not None
            request = InitWeightsUpdateGroupRequest(master_address=address, master_port=port, rank_offset=rank,
                                                    world_size=world, group_name=group_name, backend=backend)
            try:
                await s.client.init_weights_update_group(request, timeout_s=bound)
            except EngineError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for rank, s in enumerate(servers, start=1):
                tg.start_soon(one, rank, s, name=f"join weight group {s.name}")
        if errors:
            raise errors[0]
        self._weight_group = _WeightGroup(group_name, [(s, s.restarts) for s in servers])

    @property
    def remote(self) -> bool:
        """True when some server runs on another node (it reaches this machine only by a routable address)."""
        return any(s.host.remote for s in self._servers)

    def weight_group_size(self) -> int:
        """The size a weight group formed now would have: the trainer plus every routable server."""
        return 1 + len(self._routable())

    def weight_group_broken(self) -> str | None:
        """Why the weight group can no longer reach every server (one restarted, or none formed); None when whole.
        A group cannot take a new member, so the caller syncs from disk then."""
        group = self._weight_group
        if group is None:
            return "no weight group was formed"
        for s, restarts in group.members:
            if s.restarts != restarts or not s.healthy:
                return f"engine {s.name} restarted or is down since the weight group formed"
        if any(s.healthy for s in self._servers if all(s is not m for m, _ in group.members)):
            return "a server that is not in the weight group serves now"
        return None

    async def update_weights_distributed(self, buckets: list[list[ParamSpec]], version: str,
                                         push: Callable[[], Awaitable[object]], *, timeout_s: float | None = None
                                         ) -> float:
        """The distributed sync: pause every member in place, then at once ``push()`` (the trainer broadcasting the
        buckets) and, bucket by bucket, ``update_weights_from_distributed`` on every member (the last bucket
        tagged ``version``); resume; check that every member serves ``version``. Every bucket is posted even
        after a rejection, so the trainer's broadcasts never wait on a receiver that left. Returns the seconds."""
        group = self._weight_group
        broken = self.weight_group_broken()
        if group is None or broken:
            raise EngineUnavailableError("engines", f"no distributed weight sync: {broken}")
        t0 = anyio.current_time()
        bound = timeout_s or self._config.request_timeout_s
        members = [s for s, _ in group.members]
        errors: list[EngineError] = []

        async def post(s: _Server) -> None:
            assert s.client is not None
            for i, bucket in enumerate(buckets):
                request = UpdateWeightsFromDistributedRequest(
                    names=[p.name for p in bucket], dtypes=[p.dtype for p in bucket], shapes=[p.shape for p in bucket],
                    group_name=group.name, weight_version=version if i == len(buckets) - 1 else None)
                try:
                    await s.client.update_weights_from_distributed(request, timeout_s=bound)
                except EngineError as exc:
                    errors.append(exc)

        async def pushed() -> None:
            await push()

        paused: list[_Server] = []
        try:
            for s in members:
                assert s.client is not None
                await s.client.pause_generation("in_place", timeout_s=bound)
                paused.append(s)
            async with anyio.create_task_group() as tg:
                tg.start_soon(pushed, name="trainer broadcast")
                for s in members:
                    tg.start_soon(post, s, name=f"receive weights {s.name}")
        finally:
            with anyio.CancelScope(shield=True):
                for s in paused:
                    if s.client is not None:
                        with contextlib.suppress(EngineError):
                            await s.client.continue_generation(timeout_s=bound)
        if errors:
            raise errors[0]
        reported = {s.url: await s.client.get_weight_version(timeout_s=bound) for s in members if s.client}
        stale = stale_servers(version, reported)
        if stale:
            raise EngineUnavailableError(",".join(stale), f"still serve another weight version than {version} after "
                                                         "the distributed sync")
        return anyio.current_time() - t0

    def _routable(self) -> list[_Server]:
        servers = [s for s in self._servers if s.healthy and s.client is not None]
        if not servers:
            raise EngineUnavailableError("engines", "no server is up to take the new weights")
        return servers

    # ------------------------------------------------------------------ routing

    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(servers=[s.statistics() for s in self._servers],
                                routable=sum(s.healthy for s in self._servers), outage_waits=self._outage_waits,
                                outage_wait_s=round(self._outage_wait_s, 3))

    async def wait_routable(self, timeout_s: float | None = None) -> float:
        """Wait until some server is routable; returns the seconds waited (0.0 at once when one is). Raises
        EngineUnavailableError when none is within ``timeout_s`` (default engine.start_timeout_s: a restart loads the
        model again). The rollout calls it before it leases a sandbox, so an outage holds episodes back instead of
        starting (and aborting) them."""
        if any(s.healthy for s in self._servers):
            return 0.0
        bound = self._config.start_timeout_s if timeout_s is None else timeout_s
        t0 = anyio.current_time()
        _log.warning("no engine server is healthy: episodes wait for one (up to %.0f s)", bound)
        self._outage_waits += 1
        try:
            with anyio.move_on_after(bound):
                while not any(s.healthy for s in self._servers):  # noqa: ASYNC110 (servers change in many places)
                    await anyio.sleep(ROUTABLE_POLL_S)
                return anyio.current_time() - t0
        finally:
            self._outage_wait_s += anyio.current_time() - t0
        raise EngineUnavailableError(",".join(self.urls()), f"no engine server became healthy within {bound:.0f} s")

    def _pick(self, key: str) -> _Server:
        order = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
        n = len(self._servers)
        for i in range(n):
            s = self._servers[(order + i) % n]
            if s.healthy and s.client is not None:
                return s
        raise EngineUnavailableError(",".join(self.urls()), "no healthy engine")

    def route(self, session: str) -> _Session:
        return _Session(self, session)


class _Session:
    """An Engine bound to one session key: affinity to one server while it is healthy."""

    def __init__(self, engines: Engines, key: str) -> None:
        self._engines = engines
        self._key = key

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        server = self._engines._pick(self._key)
        assert server.client is not None
        return await server.client.generate(request)
