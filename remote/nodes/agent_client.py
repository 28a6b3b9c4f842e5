"""Controller side of the exec agent protocol: length-prefixed msgspec frames over a node pipe.

One request is in flight at a time (the agent serves one at a time). Replies carry the request id: a
caller cancelled mid-call leaves its reply in the pipe, and the next call skips stale replies by id.
A frame is always written whole (the send is shielded), so the stream never desyncs.
"""

from __future__ import annotations

import struct
from importlib import resources

import anyio
import msgspec

from swectl.errors import AgentProtocolError, SandboxError, SandboxLostError
from swectl.remote.nodes.node import NodeProcess
from swectl.remote.programs.exec_agent import BOOTSTRAP, LISTEN_BOOTSTRAP
from swectl.schema import AgentHello, AgentReply, AgentRequest, ErrorReply

_HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024
SEND_TIMEOUT_S = 60.0
NO_PYTHON = b"NOPY"

# The agent's interpreter (it needs 3.8+): the image's system python3 where there is one, else the python3 on PATH.
# A project environment first on PATH may be older (Django 3.0's SWE-bench environment is Python 3.6 in /opt/venv,
# where the agent died at start: "exec agent exited"); the commands still run with the image's PATH.
PICK_PYTHON = 'py=/usr/bin/python3; [ -x "$py" ] || py=$(command -v python3) || py=; '

# Runs inside the sandbox: the agent needs only python3; without it we answer NOPY and the caller falls
# back to one `podman exec` per command.
# Without python3 the script still drains stdin (the agent source being sent) so that podman never
# drops the NOPY answer when its input side breaks.
START_SCRIPT = (
    PICK_PYTHON + '[ -n "$py" ] || { printf NOPY; exec cat >/dev/null; }; exec "$py" -u -c "$0"'
)


# The socket channel's start (one short `podman exec`): the agent in the background, listening on SOCKET; prints
# LISTENING, or NOPY without python3. The agent's own output goes nowhere: its channel is the socket.
LISTEN_SCRIPT = (
    PICK_PYTHON + '[ -n "$py" ] || { printf NOPY; exit 0; }; '
    '"$py" -u -c "$0" "$1" </dev/null >/dev/null 2>&1 & printf LISTENING'
)
LISTENING = b"LISTENING"
AGENT_SOCKET = "/dev/shm/.swectl-agent.sock"  # podman gives every container its own /dev/shm (a tmpfs)


def agent_command() -> list[str]:
    return ["sh", "-c", START_SCRIPT, BOOTSTRAP]


def listen_command(socket_path: str = AGENT_SOCKET) -> list[str]:
    return ["sh", "-c", LISTEN_SCRIPT, LISTEN_BOOTSTRAP, socket_path]


def agent_source() -> bytes:
    return resources.files("swectl.remote.programs").joinpath("exec_agent.py").read_bytes()


class AgentClient:
    """Speaks the exec agent's msgpack protocol over one node process."""

    def __init__(self, process: NodeProcess, where: str) -> None:
        self._process = process
        self._where = where
        self._buffer = bytearray()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AgentReply)
        self._lock = anyio.Lock()
        self._next_id = 1
        self._broken = ""
        self.hello: AgentHello | None = None

    async def start(self) -> bool:
        """Send the agent's source and wait for hello. False if the sandbox has no python3."""
        source = agent_source()
        await self._send(b"%d\n" % len(source) + source)
        first = await self._read_exactly(4)
        if first == NO_PYTHON:
            return False
        await self.read_hello(first)
        return True

    async def read_hello(self, header: bytes | None = None) -> AgentHello:
        """Wait for the agent's hello (its source already sent). An error frame with id 0 in its place is the
        launcher's report of why the agent could not start: a SandboxError with that message."""
        (length,) = _HEADER.unpack(header or await self._read_exactly(4))
        reply = self._decode(await self._read_exactly(length))
        if isinstance(reply, ErrorReply) and reply.id == 0:
            raise SandboxError(f"{self._where}: {reply.error}")
        if not isinstance(reply, AgentHello):
            raise AgentProtocolError(f"{self._where}: exec agent did not say hello: {reply!r}")
        self.hello = reply
        return reply

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def call(self, request: AgentRequest) -> AgentReply:
        async with self._lock:
            payload = self._encoder.encode(request)
            await self._send(_HEADER.pack(len(payload)) + payload)
            while True:
                (length,) = _HEADER.unpack(await self._read_exactly(4))
                if length > MAX_FRAME:
                    raise AgentProtocolError(f"{self._where}: frame of {length} bytes exceeds the limit")
                reply = self._decode(await self._read_exactly(length))
                if getattr(reply, "id", None) == request.id:
                    return reply
                if isinstance(reply, ErrorReply) and reply.id == 0:
                    raise AgentProtocolError(f"{self._where}: exec agent rejected a frame: {reply.error}")

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._process.close_input()
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            await self._process.aclose()

    def _decode(self, frame: bytes) -> AgentReply:
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise AgentProtocolError(f"{self._where}: undecodable frame from exec agent: {exc}") from exc

    async def _send(self, data: bytes) -> None:
        if self._broken:
            raise SandboxLostError(f"{self._where}: exec agent pipe broke earlier ({self._broken})")
        # A half-written frame would desync the stream for good: finish it, within its own bound.
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + SEND_TIMEOUT_S
            try:
                await self._process.send(data)
            except BrokenPipeError as exc:
                self._broken = "pipe closed"
                raise SandboxLostError(f"{self._where}: exec agent pipe is closed") from exc
        if scope.cancelled_caught:
            self._broken = f"a send took over {SEND_TIMEOUT_S}s"
            raise SandboxLostError(f"{self._where}: exec agent stopped reading ({self._broken})")

    async def _read_exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = await self._process.receive(max(65536, n - len(self._buffer)))
            if not chunk:
                raise SandboxLostError(f"{self._where}: exec agent exited (container gone or killed)")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data
