"""Command agent: runs inside a sandbox container and executes shell commands for the controller.

The controller runs ``python3 -u -c BOOTSTRAP`` in the container and streams this very file over stdin
(``b"%d\\n" % len(src) + src``), so the image needs nothing but python3 (with ``LISTEN_BOOTSTRAP``, stdin and
stdout are one unix socket connection instead of a pipe: the Podman backend's channel). Standard library only, with its
own minimal msgpack codec. The controller imports ``BOOTSTRAP``, ``HeadTail`` and the codec from here.

Protocol 1: each frame is a 4-byte big-endian length and a msgpack map with str keys. The agent sends
``{"kind": "hello", pid, python, protocol}``, then serves requests one at a time, one reply each; a nil
field takes its default. A failure replies ``{"kind": "error", id, error, errno}`` and serving goes on.

- ``exec`` (id, command, timeout=600, cwd="/", env, head=32K, tail=32K) runs ``/bin/bash -c command``
  (or ``/bin/sh``) in a new session, stdin /dev/null, stderr merged into stdout, and replies
  ``{"kind": "exec", id, exit_code, timed_out, output, elided, duration_s}``: output keeps the first
  ``head`` and last ``tail`` bytes, elided counts the rest; a signal N gives exit_code 128+N.
- ``write`` (id, path, data, append, mode) -> ``{"kind": "write", id, size}``.
- ``read`` (id, path, offset=0, length=to the end) -> ``{"kind": "read", id, data, size}``.
- ``ping`` (id) -> ``{"kind": "pong", id}``. EOF on stdin kills a running command and exits 0.
- ``forward`` (id, port, path) listens on 127.0.0.1:port and relays every connection to the unix socket ``path``
  (served from the node through the sandbox's root: a CLI agent's way to the model gateway, nothing else), in a
  child process in its own session -> ``{"kind": "forward", id, pid}``; the relay lives until it is killed or the
  sandbox ends.

Security scope: it confines nothing. Commands run with the agent's uid, filesystem and network; isolation
and limits (pids, memory, cpu) are the container's job, and requests are trusted. It bounds the memory a
command's output takes, and its time, by SIGKILL to the command's process group at the deadline.
Background children still holding the output pipe when the shell exits get 0.5 s, then the group is
killed; ones that redirected their output survive (servers). A process that calls setsid() or setpgid()
escapes the group kill. Orphans are reaped by the container's init; where the agent is that init (PID 1 of
a namespace sandbox), it reaps them between requests.
"""

# Runs on Python 3.8 and later (the image's python3 under the podman backend), and in a namespace sandbox after its
# pivot_root, where only modules the nsbox daemon had already imported can be imported: so no 3.9+ syntax at run time
# (annotations in signatures are strings), and no `from __future__` (it imports the __future__ module).
import contextlib
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

# Runs as `python3 -u -c LISTEN_BOOTSTRAP SOCKET`, detached from any relay process: wait (at most ACCEPT_TIMEOUT_S)
# for one connection on a fresh unix socket only the agent's user may use, remove the socket, make the connection
# stdin and stdout, then go on as BOOTSTRAP. The controller reaches the socket through the container's root as the
# node sees it (/proc/PID/root/...), so no process stands between it and the agent; nothing in the sandbox can
# connect after it (the path is gone) or before it (no command runs before the agent answers).
ACCEPT_TIMEOUT_S = 120
LISTEN_BOOTSTRAP = (
    "import os, socket, sys\n"
    "server = socket.socket(socket.AF_UNIX)\n"
    "umask = os.umask(0o077)\n"
    "server.bind(sys.argv[1])\n"
    "os.umask(umask)\n"  # the commands get the image's umask
    "server.listen(1)\n"
    f"server.settimeout({ACCEPT_TIMEOUT_S})\n"
    "try:\n"
    "    conn = server.accept()[0]\n"
    "finally:\n"
    "    server.close()\n"
    "    os.unlink(sys.argv[1])\n"
    "conn.setblocking(True)\n"
    "os.dup2(conn.fileno(), 0)\n"
    "os.dup2(conn.fileno(), 1)\n"
    "conn.close()\n"
) + BOOTSTRAP

DEFAULT_TIMEOUT = 600.0
DEFAULT_HEAD = DEFAULT_TAIL = 32 * 1024
CHUNK = 64 * 1024  # the default Linux pipe capacity: one read empties a full pipe
DRAIN_GRACE = 0.5
KILL_ROUNDS = 5


class HeadTail:
    """Keeps the first `head` and the last `tail` bytes of a stream and counts what falls in between."""

    def __init__(self, head: int, tail: int) -> None:
        self._head_limit, self._tail_limit = max(0, head), max(0, tail)
        self._head, self._tail = bytearray(), bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or not self._tail_limit:
            return
        # Appending at most `tail` bytes bounds memory; bytearray drops a prefix without moving the rest.
        self._tail += data[-self._tail_limit :]
        del self._tail[: -self._tail_limit]

    @property
    def elided(self) -> int:
        return self.total - len(self._head) - len(self._tail)

    def output(self) -> bytes:
        return bytes(self._head + self._tail)


_UINTS = ((0xCC, ">BB", 1 << 8), (0xCD, ">BH", 1 << 16), (0xCE, ">BI", 1 << 32), (0xCF, ">BQ", 1 << 64))
_SINTS = ((0xD0, ">Bb", 1 << 7), (0xD1, ">Bh", 1 << 15), (0xD2, ">Bi", 1 << 31), (0xD3, ">Bq", 1 << 63))
_CONSTS = {0xC0: None, 0xC2: False, 0xC3: True}
_SCALAR_FORMATS = ">f >d >B >H >I >Q >b >h >i >q".split()  # type bytes 0xca..0xd3 in order
_SCALARS = {op: struct.Struct(fmt) for op, fmt in zip(range(0xCA, 0xD4), _SCALAR_FORMATS)}  # noqa: B905 (the agent runs on Python 3.8+)
_SIZED = {  # type byte -> (length field, kind)
    0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin"),
    0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str"),
    0xDC: (">H", "array"), 0xDD: (">I", "array"), 0xDE: (">H", "map"), 0xDF: (">I", "map"),
}  # fmt: skip


def msgpack_encode(obj: object) -> bytes:
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)


def _header(n: int, fix: "int | None", fix_limit: int, op8: "int | None", op16: int, op32: int) -> bytes:
    if fix is not None and n < fix_limit:
        return bytes([fix | n])
    if op8 is not None and n < 1 << 8:
        return bytes([op8, n])
    if n < 1 << 16:
        return struct.pack(">BH", op16, n)
    if n < 1 << 32:
        return struct.pack(">BI", op32, n)
    raise ValueError(f"msgpack: object of length {n} is too large")


def _encode(obj: object, out: "list[bytes]") -> None:
    if obj is None:
        out.append(b"\xc0")
    elif obj is True or obj is False:
        out.append(b"\xc3" if obj else b"\xc2")
    elif isinstance(obj, int):
        if -32 <= obj < 128:
            out.append(bytes([obj & 0xFF]))
            return
        for op, fmt, limit in _UINTS if obj >= 0 else _SINTS:
            if -limit <= obj < limit:
                out.append(struct.pack(fmt, op, obj))
                return
        raise ValueError(f"msgpack: integer {obj} does not fit in 64 bits")
    elif isinstance(obj, float):
        out.append(struct.pack(">Bd", 0xCB, obj))
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += (_header(len(raw), 0xA0, 32, 0xD9, 0xDA, 0xDB), raw)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        raw = obj if isinstance(obj, bytes) else bytes(obj)
        out += (_header(len(raw), None, 0, 0xC4, 0xC5, 0xC6), raw)
    elif isinstance(obj, (list, tuple)):
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


def _decode(data: bytes, pos: int) -> "tuple[object, int]":
    pos = _span(data, pos, 1)
    op = data[pos - 1]
    if op <= 0x7F or op >= 0xE0:
        return (op if op <= 0x7F else op - 0x100), pos
    if op <= 0xBF:  # the fix* forms carry their length in the type byte
        kind = "map" if op <= 0x8F else "array" if op <= 0x9F else "str"
        n = op & (0x1F if kind == "str" else 0x0F)
    elif op in _CONSTS:
        return _CONSTS[op], pos
    elif op in _SCALARS:
        scalar = _SCALARS[op]
        _span(data, pos, scalar.size)
        return scalar.unpack_from(data, pos)[0], pos + scalar.size
    elif op in _SIZED:
        fmt, kind = _SIZED[op]
        end = _span(data, pos, struct.calcsize(fmt))
        (n,), pos = struct.unpack_from(fmt, data, pos), end
    else:
        raise ValueError(f"msgpack: unsupported type byte 0x{op:02x}")
    if kind in ("str", "bin"):
        end = _span(data, pos, n)
        return (data[pos:end].decode("utf-8") if kind == "str" else data[pos:end]), end
    items = []
    for _ in range(n * 2 if kind == "map" else n):
        item, pos = _decode(data, pos)
        items.append(item)
    if kind == "array":
        return items, pos
    if any(isinstance(key, (list, dict)) for key in items[::2]):
        raise ValueError("msgpack: unhashable map key")
    return dict(zip(items[::2], items[1::2])), pos  # noqa: B905 (Python 3.8+: no strict=)


def _field(req: dict, name: str, default):
    value = req.get(name)
    return default if value is None else value


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command's process group and reap the shell."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()  # the shell itself may have left the group
    proc.wait()
    # Children forked while the first signal was in flight survive it (a fork bomb). Zombie orphans keep
    # the group alive until init reaps them, so the retry is bounded rather than waiting for ESRCH.
    for _ in range(KILL_ROUNDS):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            return
        time.sleep(0.002)


def _pump(proc: subprocess.Popen, deadline: float, out: HeadTail, stdin) -> bool:
    """Collect output until the shell has exited and the pipe is closed; return whether the deadline hit."""
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    # Watching stdin lets a controller that goes away stop a runaway command instead of orphaning it.
    with contextlib.suppress(OSError, ValueError):  # a regular file cannot be polled; then don't watch
        sel.register(stdin.fileno(), selectors.EVENT_READ)
    pipe_open, exited, killed, timed_out = True, False, False, False
    end, poll_wait = deadline, 0.0005
    try:
        while pipe_open or not exited:
            now = time.monotonic()
            if not exited and proc.poll() is not None:
                exited = True
                end = min(end, now + DRAIN_GRACE)  # only matters if background children hold the pipe
                continue
            if now >= end:
                if killed:  # writers that escaped the kill could hold the pipe forever
                    break
                timed_out, killed = not exited, True
                _kill_group(proc)
                end = now + 0.1  # to collect what the killed processes already wrote
            # Nothing wakes us when the shell exits, so poll it: fast right after output, backing off after.
            events = sel.select(min(end - now, poll_wait))
            poll_wait = 0.0005 if events else min(poll_wait * 2, 0.05)
            for key, _ in events:
                if key.fd != fd:
                    if not stdin.peek(1):
                        raise SystemExit(0)
                    sel.unregister(key.fd)  # a pipelined request: it stays buffered for the main loop
                elif chunk := os.read(fd, CHUNK):
                    out.feed(chunk)
                else:
                    pipe_open = False
                    sel.unregister(fd)
    finally:
        sel.close()
    return timed_out


NUL_MESSAGE = b"swectl: the command holds a NUL byte, which no shell can be given; nothing was run\n"


def _exec(req: dict, stdin) -> dict:
    # a shell refuses it too: the command's failure (an observation for the agent), not the sandbox's
    if (b"\0" if isinstance(req["command"], bytes) else "\0") in req["command"]:
        return {"kind": "exec", "id": req["id"], "exit_code": 126, "timed_out": False, "output": NUL_MESSAGE,
                "elided": 0, "duration_s": 0.0}
    timeout = float(_field(req, "timeout", DEFAULT_TIMEOUT))
    env = {**os.environ, **_field(req, "env", {})}
    out = HeadTail(_field(req, "head", DEFAULT_HEAD), _field(req, "tail", DEFAULT_TAIL))
    shell = "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"
    start = time.monotonic()
    proc = subprocess.Popen(
        [shell, "-c", req["command"]],
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


def _write(req: dict, stdin) -> dict:
    path = req["path"]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "ab" if _field(req, "append", False) else "wb") as f:
        f.write(_field(req, "data", b""))
        f.flush()
        size = os.fstat(f.fileno()).st_size
    if req.get("mode") is not None:
        os.chmod(path, req["mode"])
    return {"kind": "write", "id": req["id"], "size": size}


def _read(req: dict, stdin) -> dict:
    with open(req["path"], "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(_field(req, "offset", 0))
        data = f.read(_field(req, "length", -1))
    return {"kind": "read", "id": req["id"], "data": data, "size": size}


def _ping(req: dict, stdin) -> dict:
    return {"kind": "pong", "id": req["id"]}


def _forward(req: dict, stdin) -> dict:
    import socket  # already loaded in a namespace sandbox (the nsbox daemon's import)

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", int(req["port"])))  # a port in use fails here, in the reply
    server.listen(64)
    pid = os.fork()
    if pid == 0:  # the relay: never returns
        code = 0
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # off the controller's channel
                os.dup2(null, fd)
            _relay(server, req["path"])
        except BaseException:
            code = 1
        os._exit(code)
    server.close()
    return {"kind": "forward", "id": req["id"], "pid": pid}


def _relay(server, path: str) -> None:
    """Every connection to ``server`` joined to a new connection to the unix socket ``path``, byte for byte; one
    side's end closes both."""
    import socket

    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    peer = {}
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            if sock is server:
                conn = server.accept()[0]
                up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    up.connect(path)
                except OSError:
                    conn.close()  # the episode's way out is gone: the client sees a refused request
                    up.close()
                    continue
                peer[conn], peer[up] = up, conn
                sel.register(conn, selectors.EVENT_READ)
                sel.register(up, selectors.EVENT_READ)
                continue
            other = peer.get(sock)
            if other is None:
                continue
            try:
                data = sock.recv(CHUNK)
                if data:
                    other.sendall(data)
                    continue
            except OSError:
                pass
            for s in (sock, other):
                sel.unregister(s)
                peer.pop(s, None)
                s.close()


_HANDLERS = {"exec": _exec, "write": _write, "read": _read, "ping": _ping, "forward": _forward}


def _handle(body: bytes, stdin) -> dict:
    req_id = 0
    try:
        req = msgpack_decode(body)
        if not isinstance(req, dict):
            raise ValueError("request must be a map")
        req_id = req["id"] if isinstance(req.get("id"), int) else 0
        if req.get("op") not in _HANDLERS:
            raise ValueError(f"unknown op {req.get('op')!r}")
        return _HANDLERS[req["op"]](req, stdin)
    except Exception as exc:
        errno = getattr(exc, "errno", None)
        errno = errno if isinstance(errno, int) else None
        return {"kind": "error", "id": req_id, "error": f"{type(exc).__name__}: {exc}", "errno": errno}


def _send(obj: dict) -> None:
    body = msgpack_encode(obj)
    for part in (struct.pack(">I", len(body)), body):
        view = memoryview(part)
        while view:
            view = view[os.write(1, view) :]


def _reap_orphans() -> None:
    """As a namespace's PID 1 the agent inherits every orphan: collect the dead ones between requests
    (never during a command, whose own exit status must reach its Popen)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _not_dumpable() -> None:
    """Commands run as the agent's own user, so they could open /proc/<agent>/fd/1 and write frames into
    the controller's channel (a forged reply: a grading command passing itself off as its test run), or read
    /proc/<agent>/exe and environ. A process that is not dumpable keeps those files to holders of
    CAP_SYS_PTRACE, which no sandbox has. Commands it starts are dumpable again (execve)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (ImportError, OSError, AttributeError):  # a python without ctypes: the escape tests notice
        pass


def main() -> None:
    _not_dumpable()
    # The bootstrap already read through this buffered reader, so frames must come from it too.
    stdin = sys.stdin.buffer
    version = platform.python_version()
    _send({"kind": "hello", "pid": os.getpid(), "python": version, "protocol": PROTOCOL_VERSION})
    while len(header := stdin.read(4)) == 4:
        (length,) = struct.unpack(">I", header)
        body = stdin.read(length)
        if len(body) < length:
            return
        _send(_handle(body, stdin))
        if os.getpid() == 1:
            _reap_orphans()


if __name__ in ("__main__", "__swectl_agent__"):
    main()
