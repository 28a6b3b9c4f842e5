"""The Trainer actor (the trainer link): launches the torchrun FSDP2 workers (remote/programs/trainer.py) on
the ``[trainer]`` nodes and speaks to rank 0 over the control channel (swectl/rl/wire.py).

Each node runs ``torchrun --nproc_per_node N`` under the node supervisor (remote/nodes/supervisor.py), through
the node layer (a child process here, an SSH channel on an ssh node), so the ranks live exactly as long as
that channel. Several nodes rendezvous through torchrun's static rendezvous on the first node
(``--nnodes --node-rank --master-addr --master-port``). Rank 0 prints the port it listens on; the actor
connects, sends the run's key (the supervisor got it over stdin, never on a command line) and waits for
``Ready``.

Samples go through shared memory: the controller writes the TrainBatch with a BatchWriter and sends only the
BatchRef. A trainer whose first node is not this machine gets the frame streamed over the control channel
(``StepRequest.frame``) and rank 0 writes it into that node's shared memory; a trainer on several nodes gets the
frame too, and rank 0 passes it to every rank with the request (no memory is shared between nodes).

A worker that dies is noticed (the supervisor reports its exit, or the channel or connection closes):
``run`` raises TrainerLostError with the last lines of its log, and the controller restarts the run from
its last checkpoint.

Consumes: ``step``/``checkpoint``/``save_weights`` calls, one at a time. Waits for: the ranks (each call is
bounded by trainer.step_timeout_s). Produces: StepReplys, ``statistics()`` (a TrainerStatistics).
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from swectl.actors.engines import FREE_PORT, EngineHost
from swectl.config import TrainerConfig, ranks_per_node
from swectl.errors import InfraError, SwectlError
from swectl.remote.nodes.node import NodeProcess
from swectl.remote.nodes.supervisor import SUPERVISOR, copy_output, stop_supervised
from swectl.rl.shm import BatchRef
from swectl.rl.weight_sync import ParamSpec
from swectl.rl.wire import (
    FRAME_HEADER,
    MAX_FRAME,
    BroadcastWeightsRequest,
    CheckpointRequest,
    Done,
    Failed,
    Hello,
    JoinWeightGroupRequest,
    Ready,
    SaveWeightsRequest,
    ShutdownRequest,
    StepReply,
    StepRequest,
    TrainerReply,
    TrainerSettings,
    decode_reply,
    frame,
)
from swectl.schema import TrainerStatistics

_log = logging.getLogger(__name__)
# Searched, not matched: another rank's output can share the line (seen in CI: "... ready on 0.0.0.0:41493swectl-...").
_READY = re.compile(r"swectl-trainer ready on (\S+?):(\d+)")
_RANK_UP = re.compile(r"swectl-trainer rank (\d+): up on ")
TAIL_LINES = 40
# A Python exception's last line in a rank's output ("RuntimeError: ...", "[rank1]: ValueError: ..."): the cause that
# torchrun's ChildFailedError summary, printed after it, pushes out of the tail.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception)): ")
ERROR_LINES = 3
# Ranks on several nodes: how long a request that failed waits for a node's connection to be known gone, so the
# error names the node that went away (SSH keepalives notice it: keepalive_interval_s x keepalive_count_max)
NODE_LOSS_GRACE_S = 20.0
# The rendezvous check: a listener on the first trainer node (address, port, seconds, connections) that answers each
# connection and exits after the last, and a client on each other node (address, port, seconds) that exits 1 with
# its error.
RENDEZVOUS_CHECK_S = 20
RENDEZVOUS_CONNECT_S = 5
RENDEZVOUS_LISTEN = """
import socket, sys
try:
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
except OSError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
server.settimeout(float(sys.argv[3]))
print("listening", flush=True)
try:
    for _ in range(int(sys.argv[4])):
        conn = server.accept()[0]
        conn.settimeout(5)
        conn.sendall(b"swectl-rendezvous\\n")
        conn.recv(1)  # the client closes first: no TIME_WAIT on this port for torchrun's store to meet
        conn.close()
except OSError:
    pass
"""
RENDEZVOUS_CONNECT = """
import socket, sys
try:
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    assert conn.recv(64).startswith(b"swectl-rendezvous"), "something else answers on that port"
except (OSError, AssertionError) as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
"""


def exception_line(line: str) -> bool:
    """Whether ``line`` ends a Python traceback of a rank (torchrun's own ChildFailedError does not count)."""
    found = _EXCEPTION_LINE.match(line)
    return found is not None and found.group(1) != "ChildFailedError"


async def pick_port(host: EngineHost, python: str) -> int:
    """A free port on ``host`` for a rendezvous (bound where the trainer's ranks would listen)."""
    with anyio.fail_after(60):
        out = await host.node.run([python, "-c", FREE_PORT, "0.0.0.0" if host.remote else "127.0.0.1"])
    text = out.stdout.decode(errors="replace").strip()
    if out.exit_code != 0 or not text.isdigit():
        raise TrainerLostError(f"cannot pick a rendezvous port on {host.node.name}: "
                               f"{out.stderr.decode(errors='replace').strip()[:300]} (is python/torch there? "
                               "set trainer.python)")
    return int(text)


async def check_rendezvous(hosts: list[EngineHost], port: int, python: str) -> list[str]:
    """Whether every other host opens a TCP connection to the first one's address and ``port``, where a short
    listener answers (within about RENDEZVOUS_CHECK_S): one line per host that cannot (naming both nodes, the
    address and the error), or for a port the first cannot listen on; empty when all can."""
    first = hosts[0]
    failures: list[str] = []
    with anyio.fail_after(RENDEZVOUS_CHECK_S + 15):
        listener = await first.node.spawn([python, "-c", RENDEZVOUS_LISTEN, "0.0.0.0", str(port),
                                           str(RENDEZVOUS_CHECK_S), str(len(hosts) - 1)])
        try:
            said = (await listener.receive()).decode(errors="replace")
            if not said.startswith("listening"):
                return [f"{first.node.name} cannot listen on the rendezvous port {port}: "
                        f"{said.strip()[-300:] or 'no answer (is python there? trainer.python)'}"]

            async def reach(host: EngineHost) -> None:
                out = await host.node.run([python, "-c", RENDEZVOUS_CONNECT, first.address, str(port),
                                           str(RENDEZVOUS_CONNECT_S)])
                if out.exit_code != 0:
                    why = (out.stderr or out.stdout).decode(errors="replace").strip().splitlines()
                    failures.append(f"{host.node.name} cannot reach {first.node.name}'s rendezvous "
                                    f"{first.address}:{port}: {why[-1] if why else f'exit {out.exit_code}'}")

            async with anyio.create_task_group() as tg:
                for host in hosts[1:]:
                    tg.start_soon(reach, host)
            if not failures:
                await listener.wait()  # it has let go of the port
        finally:
            await listener.aclose()
    return sorted(failures)


class TrainerLostError(InfraError):
    """The trainer workers died or stopped answering; the message holds the last lines of their log."""


class TrainerFailedError(SwectlError):
    """The ranks refused a request (a bad batch, a full disk); they are still up."""


class TrainerNoSpaceError(TrainerFailedError, InfraError):
    """A write of the ranks (a checkpoint, a step's weights) found its disk full; they are still up. A checkpoint
    that failed so is skipped; a step restarts from the last checkpoint once there is space (the controller)."""


class _Launch:
    """One node's torchrun: its channel, output tail and exit code."""

    def __init__(self, host: EngineHost, index: int, exited: anyio.Event,
                 rank_up: Callable[[int, str], None] | None = None) -> None:
        self.host = host
        self.rank_up = rank_up  # called with (rank, node name) when a rank of this node has loaded its model
        self.exited = exited  # shared by every node's launch: set when any of them exits
        self.index = index
        self.proc: NodeProcess | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.errors: list[str] = []  # the first exception lines of the ranks' output (see exception_line)
        self.exit_code: int | None = None
        self.ready: tuple[str, int] | None = None
        self.changed = anyio.Event()

    def on_line(self, line: str) -> None:
        if line.startswith("swectl-engine pid "):
            return
        if line.startswith("swectl-engine exit "):
            self.exit_code = int(line.split()[-1])
            self.exited.set()
        else:
            self.tail.append(line)
            if len(self.errors) < ERROR_LINES and exception_line(line):
                self.errors.append(line.strip())
            up = _RANK_UP.search(line)
            if up and self.rank_up is not None:
                self.rank_up(int(up.group(1)), self.host.node.name)
            found = _READY.search(line)
            if not found:
                return
            self.ready = (found.group(1), int(found.group(2)))
        self.changed.set()
        self.changed = anyio.Event()


class Trainer:
    """Start with ``ready = await tg.start(trainer.run)``; then ``step``, ``checkpoint``, ``save_weights``."""

    def __init__(self, config: TrainerConfig, settings: TrainerSettings, hosts: list[EngineHost], *,
                 log_dir: Path, run_id: str = "swectl", progress: Callable[[str], None] | None = None) -> None:
        if not hosts:
            raise ValueError("the trainer needs at least one node")
        self._config = config
        self._settings = settings
        self._exited = anyio.Event()
        self._progress = progress  # one line per rank that is up while the trainer starts (``swectl up`` says them)
        self._ranks_up: set[int] = set()
        self._launches = [_Launch(h, i, self._exited, self._rank_up) for i, h in enumerate(hosts)]
        self._ranks = ranks_per_node(config, len(hosts))  # torchrun ranks on each node, in node order
        self._log_dir = log_dir
        self._run_id = run_id
        self._key = secrets.token_urlsafe(24)
        self._stream: anyio.abc.SocketStream | None = None
        self._lock = anyio.Lock()
        self._ready: Ready | None = None
        self._steps = 0
        self._skipped = 0
        self._restarts = 0
        self._last_step_s = 0.0

    def _rank_up(self, rank: int, node: str) -> None:
        self._ranks_up.add(rank)
        world = sum(self._ranks)
        line = f"trainer: rank {rank} is up on {node} ({len(self._ranks_up)} of {world} ranks)"
        _log.info(line)
        if self._progress is not None:
            self._progress(line)

    @property
    def stream_frames(self) -> bool:
        """True when rank 0 is not on this machine, or the ranks span several nodes: batches travel over the
        control channel (and from rank 0 to the other nodes' ranks with the request), not shared memory."""
        return self._launches[0].host.remote or len(self._launches) > 1

    # ------------------------------------------------------------ life

    async def run(self, *, task_status: anyio.abc.TaskStatus[Ready] = anyio.TASK_STATUS_IGNORED) -> None:
        """Launch every node's torchrun, connect to rank 0, report Ready; then watch until cancelled. A worker
        that exits raises TrainerLostError."""
        try:
            async with anyio.create_task_group() as tg:
                port = self._config.rdzv_port or await self._free_port()
                if len(self._launches) > 1:
                    await self._check_rendezvous(port)
                for launch in self._launches:
                    await self._spawn(launch, port, tg)
                ready = await self._connect()
                _log.info("trainer ready: %d ranks, %d parameters on %s", ready.world_size, ready.parameters,
                          ready.device)
                task_status.started(ready)
                await self._watch()
        finally:
            with anyio.CancelScope(shield=True):
                await self._shutdown()

    def _argv(self, launch: _Launch, port: int) -> list[str]:
        cfg = self._config
        python = cfg.python or sys.executable
        first = self._launches[0].host
        argv = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(self._ranks[launch.index])]
        if len(self._launches) > 1:
            argv += ["--nnodes", str(len(self._launches)), "--node-rank", str(launch.index),
                     "--master-addr", first.address, "--master-port", str(port)]
        else:
            argv += ["--standalone"] if not cfg.rdzv_port else ["--master-port", str(port)]
        listen = "0.0.0.0" if launch.host.remote else "127.0.0.1"
        settings = msgspec.json.encode(self._settings).decode()
        return [*argv, "-m", "swectl.remote.programs.trainer", "--settings", settings, "--listen", listen]

    async def _free_port(self) -> int:
        return await pick_port(self._launches[0].host, self._config.python or sys.executable)

    async def _check_rendezvous(self, port: int) -> None:
        """Before any rank starts: every other trainer node must reach the first one's rendezvous address and port
        (``check_rendezvous``), or the run stops here naming them (torchrun would retry until
        trainer.start_timeout_s, saying nothing)."""
        hosts = [launch.host for launch in self._launches]
        failures = await check_rendezvous(hosts, port, self._config.python or sys.executable)
        if failures:
            raise TrainerLostError("trainer nodes must reach each other (torchrun's rendezvous on the first "
                                   "node): " + "; ".join(failures))
        _log.info("trainer: %d node(s) reach the rendezvous %s:%d on %s", len(hosts) - 1, hosts[0].address, port,
                  hosts[0].node.name)

    async def _spawn(self, launch: _Launch, port: int, tg: anyio.abc.TaskGroup) -> None:
        proc = await launch.host.node.spawn(["sh", "-c", SUPERVISOR, "swectl-trainer", *self._argv(launch, port)])
        launch.proc = proc
        await proc.send(f"{self._key}\n".encode())
        tg.start_soon(self._read_output, launch, name=f"trainer output {launch.index}")

    async def _read_output(self, launch: _Launch) -> None:
        assert launch.proc is not None
        await copy_output(launch.proc, self._log_dir / f"trainer{launch.index}.log", launch.on_line)
        if launch.exit_code is None:
            launch.exit_code = -1
        launch.exited.set()
        launch.changed.set()

    def _lost(self, launch: _Launch, what: str) -> TrainerLostError:
        tail = "\n    ".join(list(launch.tail)[-15:])
        hint = ""
        if "No module named 'torch'" in tail or "No module named 'swectl'" in tail:
            hint = (f"\n  {self._config.python or sys.executable} on {launch.host.node.name} lacks torch or swectl: "
                    "install swectl[cpu] there, or point trainer.python at an interpreter that has them")
        errors = "".join(f"\n  error: {line}" for line in launch.errors)
        return TrainerLostError(f"trainer on {launch.host.node.name} {what} (log: "
                                f"{self._log_dir / f'trainer{launch.index}.log'}){errors}\n  last output:\n    {tail}"
                                f"{hint}")

    async def _connect(self) -> Ready:
        first = self._launches[0]
        try:
            with anyio.fail_after(self._config.start_timeout_s):
                while first.ready is None:
                    for launch in self._launches:
                        if launch.exit_code is not None:
                            raise self._lost(launch, f"exited with {launch.exit_code} while starting")
                    with anyio.move_on_after(1):  # a rank on another node may exit first: look again each second
                        await first.changed.wait()
                host, port = first.ready
                address = first.host.address if first.host.remote else host
                self._stream = await anyio.connect_tcp(address, port)
                await self._stream.send(frame(Hello(key=self._key)))
                reply = await self._receive()
        except TimeoutError:
            raise self._lost(first, f"was not ready after {self._config.start_timeout_s:.0f} s "
                                    "(trainer.start_timeout_s)") from None
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            raise self._lost(first, f"refused the control connection ({exc})") from None
        if not isinstance(reply, Ready):
            raise self._lost(first, f"answered {reply!r} instead of Ready")
        self._ready = reply
        return reply

    async def _watch(self) -> None:
        while True:
            for launch in self._launches:
                if launch.exit_code is not None:
                    raise self._lost(launch, f"exited with {launch.exit_code}")
            with anyio.move_on_after(5):
                await self._launches[0].changed.wait()

    async def _shutdown(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with anyio.move_on_after(30), contextlib.suppress(Exception):
                await stream.send(frame(ShutdownRequest()))
                await _read_frame(stream)
            with contextlib.suppress(Exception):
                await stream.aclose()
        for launch in self._launches:
            proc, launch.proc = launch.proc, None
            if proc is not None:
                await stop_supervised(proc)

    # ------------------------------------------------------------ requests

    async def _receive(self) -> TrainerReply:
        assert self._stream is not None
        return decode_reply(await _read_frame(self._stream))

    async def _call(self, request: msgspec.Struct, what: str) -> TrainerReply:
        async with self._lock:
            if self._stream is None:
                raise self._lost(self._launches[0], "is not connected")
            try:
                with anyio.fail_after(self._config.step_timeout_s):
                    await self._stream.send(frame(request))
                    reply = await self._receive()
            except TimeoutError:
                raise await self._named_loss(f"did not finish {what} within {self._config.step_timeout_s:.0f} s "
                                             "(trainer.step_timeout_s)") from None
            except (OSError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                raise await self._named_loss(f"closed the control connection during {what} ({exc})") from None
        if isinstance(reply, Failed):
            if reply.fatal or await self._exited_soon():
                raise self._lost(self._first_exited(), f"failed {what}: {reply.message}")
            error = TrainerNoSpaceError if reply.no_space else TrainerFailedError
            raise error(f"trainer: {what} failed: {reply.message}")
        return reply

    async def _exited_soon(self, grace_s: float = 5.0) -> bool:
        """A rank that died mid-request makes its peers' collectives fail before torchrun reports the death:
        give the supervisors ``grace_s`` to report an exit before calling the failure the ranks' own."""
        with anyio.move_on_after(grace_s):
            await self._exited.wait()
        return self._exited.is_set()

    async def _named_loss(self, what: str) -> TrainerLostError:
        """Rank 0 stopped answering. With ranks on several nodes the cause is often another node that went away
        (its network: rank 0's collective fails first): wait up to NODE_LOSS_GRACE_S for a node's connection to be
        known gone (SSH keepalives) and name that node; else name rank 0's."""
        first = self._launches[0]
        if len(self._launches) > 1:  # a node's liveness has no event to wait on: look four times a second
            for _ in range(int(NODE_LOSS_GRACE_S * 4)):
                if not all(launch.host.node.alive for launch in self._launches):
                    break
                await anyio.sleep(0.25)
        gone = next((launch for launch in self._launches if not launch.host.node.alive), None)
        if gone is not None and gone is not first:
            return self._lost(gone, f"lost its node (the connection to {gone.host.node.name} dropped); rank 0 on "
                                    f"{first.host.node.name} {what}")
        return self._lost(first, what)

    def _first_exited(self) -> _Launch:
        return next((launch for launch in self._launches if launch.exit_code is not None), self._launches[0])

    async def step(self, step: int, ref: BatchRef, *, weights_dir: str = "", frame_bytes: bytes | None = None
                   ) -> StepReply:
        """One optimizer step on the batch at ``ref`` (or the streamed ``frame_bytes``)."""
        reply = await self._call(StepRequest(step=step, ref=ref, weights_dir=weights_dir, frame=frame_bytes),
                                 f"step {step}")
        assert isinstance(reply, StepReply)
        self._steps += 1
        self._skipped += reply.skipped
        self._last_step_s = reply.metrics.get("train_s", 0.0)
        return reply

    async def checkpoint(self, step: int, path: Path) -> Done:
        reply = await self._call(CheckpointRequest(step=step, path=str(path)), f"checkpoint {path}")
        assert isinstance(reply, Done)
        return reply

    async def save_weights(self, path: Path) -> Done:
        reply = await self._call(SaveWeightsRequest(path=str(path)), f"saving weights to {path}")
        assert isinstance(reply, Done)
        return reply

    async def join_weight_group(self, port: int, world_size: int, group_name: str, backend: str, *,
                                timeout_s: float = 300.0) -> Done:
        """Rank 0 hosts the weight group at ``weight_group_address:port``; returns once the engines joined it too
        (Engines.join_weight_group runs meanwhile)."""
        request = JoinWeightGroupRequest(address=self.weight_group_address, port=port, world_size=world_size,
                                         group_name=group_name, backend=backend, timeout_s=timeout_s)
        reply = await self._call(request, f"joining weight group {group_name}")
        assert isinstance(reply, Done)
        return reply

    async def broadcast_weights(self, group_name: str, buckets: list[list[ParamSpec]]) -> Done:
        """Rank 0 broadcasts the current weights over the weight group, bucket by bucket (the engines receive
        them through Engines.update_weights_distributed meanwhile)."""
        reply = await self._call(BroadcastWeightsRequest(group_name=group_name, buckets=buckets),
                                 f"broadcasting weights over {group_name}")
        assert isinstance(reply, Done)
        return reply

    async def free_port(self) -> int:
        """A free port on the first trainer node (for the weight group's rendezvous)."""
        return await self._free_port()

    @property
    def remote(self) -> bool:
        """True when rank 0 runs on another node."""
        return self._launches[0].host.remote

    @property
    def weight_group_address(self) -> str:
        """Where engines reach rank 0's weight-group rendezvous: the first node's address (loopback for this
        machine)."""
        first = self._launches[0].host
        return first.address

    @property
    def params(self) -> list[ParamSpec]:
        """What a distributed weight sync sends (from Ready)."""
        return list(self._ready.params) if self._ready is not None else []

    def statistics(self) -> TrainerStatistics:
        ready = self._ready
        return TrainerStatistics(world_size=ready.world_size if ready else 0,
                                 parameters=ready.parameters if ready else 0, steps=self._steps,
                                 skipped=self._skipped, last_step_s=self._last_step_s)


async def _read_frame(stream: anyio.abc.ByteReceiveStream) -> bytes:
    header = await _read_exact(stream, FRAME_HEADER.size)
    (length,) = FRAME_HEADER.unpack(header)
    if length > MAX_FRAME:
        raise anyio.BrokenResourceError(f"frame of {length} bytes")
    return await _read_exact(stream, length)


async def _read_exact(stream: anyio.abc.ByteReceiveStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        buf += await stream.receive(n - len(buf))
    return bytes(buf)
