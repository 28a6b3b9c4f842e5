"""Command agent that runs inside a sandbox container and executes shell commands for the controller.

The controller starts it with ``python3 -u -c BOOTSTRAP`` inside the container and streams this very file
over stdin (``b"%d\\n" % len(src) + src``), so the image needs nothing but a stock ``python3``. The agent
uses the standard library only and carries its own minimal msgpack codec. On the controller the module
is importable as ``swectl.remote.exec_agent`` (importing it has no side effects) for ``BOOTSTRAP``,
``HeadTail`` and the codec.

Protocol (version 1): each frame is a 4-byte big-endian length followed by a msgpack map with str keys.
The agent first sends ``{"kind": "hello", "pid", "python", "protocol"}``, then serves requests one at a
time, one reply each. A nil field means "use the default".

- ``exec`` (id, command, timeout, cwd, env, head, tail) runs ``/bin/bash -c command`` (``/bin/sh`` when
  there is no bash) in its own session with stdin from /dev/null and stderr merged into stdout, and
  replies ``{"kind": "exec", id, exit_code, timed_out, output, elided, duration_s}``. Only the first
  ``head`` and the last ``tail`` bytes of output are kept; ``exit_code`` is 128+N for a signal N.
- ``write`` (id, path, data, append, mode) replies ``{"kind": "write", id, size}``.
- ``read`` (id, path, offset, length) replies ``{"kind": "read", id, data, size}``.
- ``ping`` (id) replies ``{"kind": "pong", id}``.
- Any failure replies ``{"kind": "error", id, error, errno}`` and the agent keeps serving. EOF on stdin
  kills a running command's process group and exits 0.

Security scope: the agent confines nothing. Commands run with the agent's own uid, filesystem and network;
isolation and resource limits (pids, memory, cpu) are the container's job. Output is bounded in memory and
every command is bounded in time, but only by process group: a process that calls setsid() or setpgid()
escapes the group kill and may outlive its command. Orphaned processes are reaped by the container's init,
not by the agent. Requests are trusted to come from the controller; paths are not restricted.
"""

import os
import platform
import selectors
import signal
import struct
import subprocess
import sys
import time

PROTOCOL_VERSION = 1

# Runs as `python3 -u -c BOOTSTRAP`: read the agent source from stdin and run it as the main program.
BOOTSTRAP = (
    "import sys\n"
    "n = int(sys.stdin.buffer.readline())\n"
    "src = sys.stdin.buffer.read(n)\n"
    "exec(compile(src, 'swectl_exec_agent.py', 'exec'), {'__name__': '__swectl_agent__'})\n"
)

DEFAULT_TIMEOUT = 600.0
DEFAULT_HEAD = DEFAULT_TAIL = 32 * 1024
CHUNK = 64 * 1024  # the default Linux pipe capacity: one read empties a full pipe
DRAIN_GRACE = 0.5  # how long background children holding the pipe may keep writing after the shell exits
KILL_ROUNDS = 5


class HeadTail:
    """Keeps the first `head` and the last `tail` bytes of a stream and counts what falls in between."""

    def __init__(self, head: int, tail: int) -> None:
        self._head_limit = max(0, head)
        self._tail_limit = max(0, tail)
        self._head = bytearray()
        self._tail = bytearray()
        self._total = 0

    def feed(self, data: bytes) -> None:
        self._total += len(data)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or not self._tail_limit:
            return
        if len(data) >= self._tail_limit:
            self._tail = bytearray(data[-self._tail_limit :])
        else:
            self._tail += data
            # bytearray drops a prefix in place, so trimming per chunk stays cheap
            del self._tail[: len(self._tail) - self._tail_limit]

    @property
    def total(self) -> int:
        return self._total

    @property
    def elided(self) -> int:
        return self._total - len(self._head) - len(self._tail)

    def output(self) -> bytes:
        return bytes(self._head + self._tail)


# ---- msgpack ---------------------------------------------------------------------------------------

_UINTS = ((0xCC, ">BB", 1 << 8), (0xCD, ">BH", 1 << 16), (0xCE, ">BI", 1 << 32), (0xCF, ">BQ", 1 << 64))
_SINTS = ((0xD0, ">Bb", 1 << 7), (0xD1, ">Bh", 1 << 15), (0xD2, ">Bi", 1 << 31), (0xD3, ">Bq", 1 << 63))
_CONSTS = {0xC0: None, 0xC2: False, 0xC3: True}
_SCALAR_FORMATS = ">f >d >B >H >I >Q >b >h >i >q".split()  # type bytes 0xca..0xd3 in order
_SCALARS = {op: struct.Struct(fmt) for op, fmt in zip(range(0xCA, 0xD4), _SCALAR_FORMATS, strict=True)}
# type byte -> (length field, kind); the fix* forms carry their length in the type byte itself
_SIZED = {
    0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin"),
    0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str"),
    0xDC: (">H", "array"), 0xDD: (">I", "array"), 0xDE: (">H", "map"), 0xDF: (">I", "map"),
}  # fmt: skip


def msgpack_encode(obj: object) -> bytes:
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)


def _header(n: int, fix: int | None, fix_limit: int, op8: int | None, op16: int, op32: int) -> bytes:
    if fix is not None and n < fix_limit:
        return bytes([fix | n])
    if op8 is not None and n < 1 << 8:
        return bytes([op8, n])
    if n < 1 << 16:
        return struct.pack(">BH", op16, n)
    if n < 1 << 32:
        return struct.pack(">BI", op32, n)
    raise ValueError(f"msgpack: object of length {n} is too large")


def _encode_int(n: int) -> bytes:
    if -32 <= n < 128:
        return bytes([n & 0xFF])
    for op, fmt, limit in _UINTS if n >= 0 else _SINTS:
        if (n < limit) if n >= 0 else (n >= -limit):
            return struct.pack(fmt, op, n)
    raise ValueError(f"msgpack: integer {n} does not fit in 64 bits")


def _encode(obj: object, out: list[bytes]) -> None:
    if obj is None:
        out.append(b"\xc0")
    elif obj is True or obj is False:
        out.append(b"\xc3" if obj else b"\xc2")
    elif isinstance(obj, int):
        out.append(_encode_int(obj))
    elif isinstance(obj, float):
        out.append(struct.pack(">Bd", 0xCB, obj))
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += (_header(len(raw), 0xA0, 32, 0xD9, 0xDA, 0xDB), raw)
    elif isinstance(obj, bytes | bytearray | memoryview):
        raw = obj if isinstance(obj, bytes) else bytes(obj)
        out += (_header(len(raw), None, 0, 0xC4, 0xC5, 0xC6), raw)
    elif isinstance(obj, list | tuple):
        out.append(_header(len(obj), 0x90, 16, None, 0xDC, 0xDD))
        for item in obj:
            _encode(item, out)
    elif isinstance(obj, dict):
        out.append(_header(len(obj), 0x80, 16, None, 0xDE, 0xDF))
        for key, value in obj.items():
            _encode(key, out)
            _encode(value, out)
    else:
        raise ValueError(f"msgpack: cannot encode {type(obj).__name__}")


def msgpack_decode(data: bytes) -> object:
    data = bytes(data)
    obj, pos = _decode(data, 0)
    if pos != len(data):
        raise ValueError(f"msgpack: {len(data) - pos} trailing bytes")
    return obj


def _span(data: bytes, pos: int, n: int) -> int:
    if pos + n > len(data):
        raise ValueError("msgpack: truncated data")
    return pos + n


def _decode(data: bytes, pos: int) -> tuple[object, int]:
    _span(data, pos, 1)
    op = data[pos]
    pos += 1
    if op <= 0x7F or op >= 0xE0:
        return (op if op <= 0x7F else op - 0x100), pos
    if op <= 0xBF:  # fixmap, fixarray, fixstr
        kind, n = ("map", op & 0x0F) if op <= 0x8F else ("array", op & 0x0F) if op <= 0x9F else ("str", op & 0x1F)
        return _decode_body(data, pos, kind, n)
    if op in _CONSTS:
        return _CONSTS[op], pos
    if op in _SCALARS:
        scalar = _SCALARS[op]
        return scalar.unpack_from(data, pos)[0], _span(data, pos, scalar.size)
    if op not in _SIZED:
        raise ValueError(f"msgpack: unsupported type byte 0x{op:02x}")
    fmt, kind = _SIZED[op]
    end = _span(data, pos, struct.calcsize(fmt))
    return _decode_body(data, end, kind, struct.unpack_from(fmt, data, pos)[0])


def _decode_body(data: bytes, pos: int, kind: str, n: int) -> tuple[object, int]:
    if kind == "str" or kind == "bin":
        end = _span(data, pos, n)
        return (data[pos:end].decode("utf-8") if kind == "str" else data[pos:end]), end
    if kind == "array":
        items = []
        for _ in range(n):
            item, pos = _decode(data, pos)
            items.append(item)
        return items, pos
    result = {}
    for _ in range(n):
        key, pos = _decode(data, pos)
        if isinstance(key, list | dict):
            raise ValueError("msgpack: unhashable map key")
        result[key], pos = _decode(data, pos)
    return result, pos


# ---- requests --------------------------------------------------------------------------------------


def _field(req: dict, name: str, default):
    value = req.get(name)
    return default if value is None else value


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command's process group and reap the shell."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.kill()  # the shell itself may have left the group
    proc.wait()
    # Members forked while the first signal was in flight survive it; the reaped shell's zombie no longer
    # keeps the group alive, but orphans' zombies do until init reaps them, hence the bounded retry.
    for _ in range(KILL_ROUNDS):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            return
        time.sleep(0.002)


def _pump(proc: subprocess.Popen, deadline: float, out: HeadTail, stdin) -> bool:
    """Collect output until the shell exits and the pipe closes; return whether the deadline hit."""
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    # Watching stdin lets a controller that goes away stop a runaway command instead of orphaning it.
    sel.register(stdin.fileno(), selectors.EVENT_READ)
    pipe_open, grace_end, poll_wait = True, None, 0.0005
    try:
        while True:
            now = time.monotonic()
            if grace_end is None and proc.poll() is not None:
                if not pipe_open:
                    return False
                grace_end = min(now + DRAIN_GRACE, deadline)
            end = deadline if grace_end is None else grace_end
            if now >= end:
                _kill_group(proc)
                if pipe_open:
                    _drain_now(sel, fd, out)
                return grace_end is None
            # Nothing signals the shell's exit, so poll it, fast right after output and backing off after.
            events = sel.select(min(end - now, poll_wait))
            poll_wait = 0.0005 if events else min(poll_wait * 2, 0.05)
            for key, _ in events:
                if key.fd != fd:
                    if not stdin.peek(1):
                        raise SystemExit(0)
                    sel.unregister(key.fd)  # a pipelined request: it stays buffered for the main loop
                    continue
                chunk = os.read(fd, CHUNK)
                if chunk:
                    out.feed(chunk)
                else:
                    pipe_open = False
                    sel.unregister(fd)
    finally:
        sel.close()


def _drain_now(sel: selectors.BaseSelector, fd: int, out: HeadTail) -> None:
    """Take what the killed processes already wrote, without waiting on writers that escaped the kill."""
    stop = time.monotonic() + 0.1
    while time.monotonic() < stop and any(key.fd == fd for key, _ in sel.select(0)):
        chunk = os.read(fd, CHUNK)
        if not chunk:
            return
        out.feed(chunk)


def _exec(req: dict, stdin) -> dict:
    command = req["command"]
    if not isinstance(command, str):
        raise TypeError("command must be a str")
    timeout = float(_field(req, "timeout", DEFAULT_TIMEOUT))
    env = dict(os.environ)
    env.update(_field(req, "env", {}))
    out = HeadTail(_field(req, "head", DEFAULT_HEAD), _field(req, "tail", DEFAULT_TAIL))
    shell = "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"
    start = time.monotonic()
    proc = subprocess.Popen(
        [shell, "-c", command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=_field(req, "cwd", "/"),
        env=env,
        start_new_session=True,  # one process group to kill, apart from the agent's own
    )
    try:
        timed_out = _pump(proc, start + timeout, out, stdin)
    finally:
        if proc.returncode is None:
            _kill_group(proc)
        proc.stdout.close()
    code = proc.returncode
    return {
        "kind": "exec",
        "id": req["id"],
        "exit_code": code if code >= 0 else 128 - code,
        "timed_out": timed_out,
        "output": out.output(),
        "elided": out.elided,
        "duration_s": time.monotonic() - start,
    }


def _write(req: dict) -> dict:
    path = req["path"]
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "ab" if _field(req, "append", False) else "wb") as f:
        f.write(_field(req, "data", b""))
        f.flush()
        size = os.fstat(f.fileno()).st_size
    if req.get("mode") is not None:
        os.chmod(path, req["mode"])
    return {"kind": "write", "id": req["id"], "size": size}


def _read(req: dict) -> dict:
    with open(req["path"], "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(_field(req, "offset", 0))
        length = req.get("length")
        data = f.read() if length is None else f.read(length)
    return {"kind": "read", "id": req["id"], "data": data, "size": size}


def _handle(body: bytes, stdin) -> dict:
    req_id = 0
    try:
        req = msgpack_decode(body)
        if not isinstance(req, dict):
            raise ValueError("request must be a map")
        req_id = req.get("id") if isinstance(req.get("id"), int) else 0
        op = req.get("op")
        if op == "exec":
            return _exec(req, stdin)
        if op == "write":
            return _write(req)
        if op == "read":
            return _read(req)
        if op == "ping":
            return {"kind": "pong", "id": req["id"]}
        raise ValueError(f"unknown op {op!r}")
    except Exception as exc:
        errno = getattr(exc, "errno", None)
        return {
            "kind": "error",
            "id": req_id,
            "error": f"{type(exc).__name__}: {exc}",
            "errno": errno if isinstance(errno, int) else None,
        }


def _send(obj: dict) -> None:
    body = msgpack_encode(obj)
    for part in (struct.pack(">I", len(body)), body):
        view = memoryview(part)
        while view:
            view = view[os.write(1, view) :]


def main() -> None:
    # The bootstrap already read through this buffered reader, so frames must come from it too.
    stdin = sys.stdin.buffer
    _send({"kind": "hello", "pid": os.getpid(), "python": platform.python_version(), "protocol": PROTOCOL_VERSION})
    while True:
        header = stdin.read(4)
        if len(header) < 4:
            return
        (length,) = struct.unpack(">I", header)
        body = stdin.read(length)
        if len(body) < length:
            return
        _send(_handle(body, stdin))


if __name__ in ("__main__", "__swectl_agent__"):
    main()
