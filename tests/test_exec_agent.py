"""The sandbox exec agent, run for real as a local subprocess and spoken to with msgspec's msgpack.

The agent is launched exactly as the controller launches it inside a container (``sh -c`` with the
bootstrap, then the source over stdin), so these tests also prove that its stdlib msgpack codec
interoperates with a real implementation.
"""

import math
import os
import random
import selectors
import signal
import struct
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from swectl.remote.programs import exec_agent
from swectl.remote.programs.exec_agent import HeadTail, msgpack_decode, msgpack_encode

LAUNCH = 'command -v python3 >/dev/null 2>&1 || { printf NOPY; exit 0; }; exec python3 -u -c "$0"'
AGENT_SOURCE = Path(exec_agent.__file__).read_bytes()


class AgentClient:
    """A minimal synchronous controller: frames out on the agent's stdin, frames in from its stdout. ``path``: the
    PATH the agent's ``python3`` is looked up in (default this process's)."""

    def __init__(self, path: str | None = None) -> None:
        argv = ["sh", "-c", LAUNCH, exec_agent.BOOTSTRAP]
        env = {**os.environ, "PATH": path} if path is not None else None
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env)
        self._fd = self.proc.stdout.fileno()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._fd, selectors.EVENT_READ)
        self._buf = bytearray()
        self._next_id = 0
        self.send_raw(b"%d\n" % len(AGENT_SOURCE) + AGENT_SOURCE, framed=False)
        self.hello = self.recv()

    def send_raw(self, data: bytes, framed: bool = True) -> None:
        view = memoryview(struct.pack(">I", len(data)) + data if framed else data)
        while view:
            view = view[self.proc.stdin.write(view) :]

    def send(self, request: dict) -> None:
        self.send_raw(msgspec.msgpack.encode(request))

    def recv(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        (length,) = struct.unpack(">I", self._read_exact(4, deadline))
        return msgspec.msgpack.decode(self._read_exact(length, deadline))

    def _read_exact(self, n: int, deadline: float) -> bytes:
        while len(self._buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise TimeoutError("no reply from the agent")
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                raise EOFError("the agent closed its stdout")
            self._buf += chunk
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    def call(self, op: str, **fields) -> dict:
        self._next_id += 1
        self.send({"op": op, "id": self._next_id, **fields})
        reply = self.recv()
        assert reply["id"] == self._next_id
        return reply

    def exec(self, command: str, **fields) -> dict:
        request = {"command": command, "timeout": 5.0, "cwd": None, "env": None, "head": 4096, "tail": 4096}
        return self.call("exec", **{**request, **fields})

    def close(self) -> None:
        self._sel.close()
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=3)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.proc.stdout.close()


@pytest.fixture
def agent():
    client = AgentClient()
    try:
        yield client
    finally:
        client.close()


def _gone(pid: int, timeout: float = 2.0) -> bool:
    """Whether the process is dead (a zombie awaiting its reaper counts) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False


def _children(pid: int) -> str:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return path.read_text().strip() if path.exists() else ""


# ---- the agent over its pipes ----------------------------------------------------------------------


def test_hello(agent):
    assert agent.hello == {
        "kind": "hello",
        "pid": agent.proc.pid,  # `exec python3` keeps the pid of the launching shell
        "python": agent.hello["python"],
        "protocol": exec_agent.PROTOCOL_VERSION,
    }
    assert agent.hello["python"].startswith("3.")


OLD_PYTHONS = sorted(Path("/root/.pyenv/versions").glob("3.[89].*"))  # pyenv's, on the machines of this project


@pytest.mark.skipif(not OLD_PYTHONS, reason="no Python 3.8 or 3.9 under /root/.pyenv/versions")
@pytest.mark.parametrize("python", OLD_PYTHONS, ids=lambda p: p.name)
def test_the_agent_runs_on_the_python_of_older_images(python: Path, tmp_path: Path) -> None:
    """Instance images of SWE-bench rows have their environment's python3 (3.8, 3.9, ...), and the podman backend runs
    the agent on it: no 3.10+ syntax or runtime features (a zip(strict=True) once killed it on 3.9)."""
    (tmp_path / "python3").symlink_to(python / "bin" / "python3")
    client = AgentClient(path=f"{tmp_path}:/usr/bin:/bin")
    try:
        assert client.hello["python"].startswith(python.name.rsplit(".", 1)[0])
        reply = client.exec("echo hi; printf '%s' \"$(printf 'x%.0s' 1 2 3)\" >&2; exit 3")
        assert (reply["output"], reply["exit_code"]) == (b"hi\nxxx", 3)
    finally:
        client.close()


def test_echo(agent):
    reply = agent.exec("echo hi")
    assert (reply["kind"], reply["output"], reply["exit_code"]) == ("exec", b"hi\n", 0)
    assert (reply["timed_out"], reply["elided"]) == (False, 0)
    assert 0 <= reply["duration_s"] < 2


def test_stderr_is_merged_and_exit_codes(agent):
    assert agent.exec("echo out; echo err >&2; exit 7")["output"] == b"out\nerr\n"
    assert agent.exec("exit 7")["exit_code"] == 7
    assert agent.exec("kill -TERM $$")["exit_code"] == 128 + signal.SIGTERM


def test_a_command_with_a_nul_byte_fails_as_a_command_not_as_the_sandbox(agent):
    """A model wrote a NUL into its command (seen in the chaos soak): before, Popen's ValueError came back as an
    exec-agent error, the episode was ABORTED as infrastructure and never scored. It is the command's failure."""
    reply = agent.exec("echo a\0b")
    assert reply["kind"] == "exec" and reply["exit_code"] == 126 and b"NUL byte" in reply["output"], reply
    assert agent.exec("echo still here")["output"] == b"still here\n"


def test_timeout_kills_the_group(agent, tmp_path):
    pidfile = tmp_path / "bg.pid"
    start = time.monotonic()
    reply = agent.exec(f"echo before; sleep 100 & echo $! > {pidfile}; sleep 30", timeout=0.5)
    assert time.monotonic() - start < 2
    assert (reply["timed_out"], reply["exit_code"], reply["output"]) == (True, 137, b"before\n")
    assert 0.5 <= reply["duration_s"] < 2
    assert _gone(int(pidfile.read_text()))
    assert _children(agent.proc.pid) == ""


def test_plain_sleep_timeout(agent):
    start = time.monotonic()
    reply = agent.exec("sleep 30", timeout=0.5)
    assert (reply["timed_out"], reply["exit_code"]) == (True, 137)
    assert time.monotonic() - start < 2


def test_background_child_holding_the_pipe_does_not_hang(agent, tmp_path):
    pidfile = tmp_path / "bg.pid"
    start = time.monotonic()
    reply = agent.exec(f"sleep 100 & echo $! > {pidfile}; (sleep 0.1; echo late) & echo early", timeout=10)
    assert time.monotonic() - start < 1.5
    assert (reply["timed_out"], reply["exit_code"], reply["output"]) == (False, 0, b"early\nlate\n")
    assert _gone(int(pidfile.read_text()))
    assert _children(agent.proc.pid) == ""  # the shell was reaped


def test_background_child_with_redirected_output_survives(agent):
    reply = agent.exec("sleep 100 >/dev/null 2>&1 & echo $!")
    pid = int(reply["output"])
    try:
        assert reply["duration_s"] < 0.4
        assert not _gone(pid, timeout=0.05)
    finally:
        os.kill(pid, signal.SIGKILL)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def test_timeout_kills_a_fork_storm(agent, tmp_path):
    pgidfile = tmp_path / "pgid"
    command = f"echo $$ > {pgidfile}; for i in $(seq 3000); do sleep 100 & done; sleep 30"
    reply = agent.exec(command, timeout=0.3)
    assert (reply["timed_out"], reply["exit_code"]) == (True, 137)
    pgid = int(pgidfile.read_text())
    deadline = time.monotonic() + 2
    while _group_members(pgid):
        assert time.monotonic() < deadline, _group_members(pgid)
        time.sleep(0.02)


def test_stdin_is_dev_null(agent):
    reply = agent.exec("cat; echo done", timeout=2)
    assert (reply["output"], reply["timed_out"]) == (b"done\n", False)


def test_setsid_escapes_the_group_kill_but_not_the_call(agent):
    # A documented limit: a new session is out of reach of killpg; the reply must still come back.
    start = time.monotonic()
    reply = agent.exec("setsid sleep 100 & echo $!", timeout=5)
    pid = int(reply["output"])
    try:
        assert time.monotonic() - start < 1.5
        assert (reply["timed_out"], reply["exit_code"]) == (False, 0)
        assert not _gone(pid, timeout=0.05)
    finally:
        os.kill(pid, signal.SIGKILL)


def test_huge_output_is_bounded(agent):
    reply = agent.exec("head -c 50000000 /dev/zero", head=1000, tail=1000, timeout=10)
    assert (reply["exit_code"], len(reply["output"]), reply["elided"]) == (0, 2000, 49_998_000)
    assert reply["output"] == bytes(2000)


def test_head_and_tail_are_the_right_bytes(agent):
    full = "".join(f"{i}\n" for i in range(1, 100_001)).encode()
    reply = agent.exec("seq 1 100000", head=10, tail=7)
    assert reply["output"] == full[:10] + full[-7:]
    assert reply["elided"] == len(full) - 17


def test_binary_output_is_byte_exact(agent):
    assert agent.exec(r"printf '\xff\xfe\x00abc'")["output"] == b"\xff\xfe\x00abc"


def test_cwd_and_env(agent, tmp_path):
    command = 'pwd; echo "$SWECTL_TEST_VAR"; command -v sh'
    reply = agent.exec(command, cwd=str(tmp_path), env={"SWECTL_TEST_VAR": "a b"})
    pwd, value, sh = reply["output"].decode().splitlines()
    assert (pwd, value) == (str(tmp_path), "a b")
    assert sh.endswith("/sh")  # PATH comes from the agent's own environment
    assert agent.exec("pwd", cwd=None)["output"] == b"/\n"


def test_missing_cwd_is_an_error_frame(agent, tmp_path):
    reply = agent.exec("true", cwd=str(tmp_path / "nope"))
    assert reply["kind"] == "error"
    assert reply["errno"] == 2
    assert agent.call("ping")["kind"] == "pong"


def test_nil_and_absent_fields_take_defaults(agent):
    reply = agent.call("exec", command="echo ok")
    assert (reply["output"], reply["exit_code"]) == (b"ok\n", 0)
    nils = {"timeout": None, "cwd": None, "env": None, "head": None, "tail": None}
    assert agent.call("exec", command="echo ok", **nils)["output"] == b"ok\n"


def test_write_then_chunked_read_round_trips(agent, tmp_path):
    data = random.Random(1).randbytes(20_000_000)
    path = tmp_path / "sub" / "dir" / "file.bin"
    reply = agent.call("write", path=str(path), data=data, append=False, mode=0o640)
    assert reply == {"kind": "write", "id": reply["id"], "size": len(data)}
    assert path.stat().st_mode & 0o777 == 0o640
    chunks = []
    while sum(map(len, chunks)) < len(data):
        reply = agent.call("read", path=str(path), offset=sum(map(len, chunks)), length=4 << 20)
        assert reply["size"] == len(data)
        chunks.append(reply["data"])
    assert b"".join(chunks) == data


def test_append_and_truncate(agent, tmp_path):
    path = str(tmp_path / "f")
    assert agent.call("write", path=path, data=b"abc", append=False, mode=None)["size"] == 3
    assert agent.call("write", path=path, data=b"def", append=True, mode=None)["size"] == 6
    assert agent.call("read", path=path, offset=0, length=100)["data"] == b"abcdef"
    assert agent.call("read", path=path, offset=2, length=None)["data"] == b"cdef"
    assert agent.call("write", path=path, data=b"x", append=None, mode=None)["size"] == 1


def test_missing_file_gives_error_and_agent_keeps_serving(agent, tmp_path):
    reply = agent.call("read", path=str(tmp_path / "missing"), offset=0, length=10)
    assert reply["kind"] == "error"
    assert reply["errno"] == 2
    assert reply["error"].startswith("FileNotFoundError:")
    assert agent.call("ping") == {"kind": "pong", "id": reply["id"] + 1}


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # the one never-used type byte
        b"\x81\xa2op",  # truncated map
        msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"x")),
        msgspec.msgpack.encode([1, 2]),  # valid msgpack, not a map
        msgspec.msgpack.encode({"op": "ping", "id": 1}) + b"\x00",  # trailing bytes
    ],
)
def test_malformed_frame_gets_error_reply(agent, body):
    agent.send_raw(body)
    reply = agent.recv()
    assert (reply["kind"], reply["id"], reply["errno"]) == ("error", 0, None)
    assert agent.call("ping")["kind"] == "pong"


def test_unknown_op(agent):
    reply = agent.call("frobnicate")
    assert reply["kind"] == "error"
    assert "frobnicate" in reply["error"]


def test_pipelined_requests_are_answered_in_order(agent):
    agent.send({"op": "exec", "id": 1, "command": "sleep 0.2; echo done", "timeout": 5})
    agent.send({"op": "ping", "id": 2})
    first, second = agent.recv(), agent.recv()
    assert (first["kind"], first["id"], first["output"]) == ("exec", 1, b"done\n")
    assert second == {"kind": "pong", "id": 2}


def test_stdin_eof_kills_running_command_and_exits(agent, tmp_path):
    pidfile = tmp_path / "bg.pid"
    command = f"sleep 100 & echo $! > {pidfile}; sleep 30"
    agent.send({"op": "exec", "id": 1, "command": command, "timeout": 30})
    deadline = time.monotonic() + 5
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    agent.proc.stdin.close()
    assert agent.proc.wait(timeout=3) == 0
    assert _gone(int(pidfile.read_text()))


# ---- codec -----------------------------------------------------------------------------------------

EDGE_VALUES = [
    None, True, False, 0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
    0.0, -0.0, 1.5, -2.25, 1e300, 5e-324, math.inf, -math.inf,
    "", "é✓🙂", "a" * 31, "a" * 32, "a" * 255, "a" * 256, "a" * 65535, "a" * 65536,
    b"", b"\x00\xff", b"x" * 255, b"x" * 256, b"x" * 65535, b"x" * 65536,
    [], {}, [[]], {"": {}}, [1] * 15, [1] * 16, [None] * 65535, [None] * 65536,
    {str(i): i for i in range(15)}, {str(i): i for i in range(16)}, {str(i): None for i in range(65536)},
    {1: "int key", -5: b"neg"}, {"nested": [1, {"deeper": [b"bin", -(2**40), 2.5, None]}]},
]  # fmt: skip


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 4 else 7)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randint(-(2**63), 2**64 - 1) >> rng.randrange(64)
    if kind == 2:
        return -rng.randrange(2 ** rng.randrange(1, 64))
    if kind == 3:
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randrange(-200, 200)
    if kind == 4:
        return "".join(rng.choice("ab é✓🙂\x00") for _ in range(rng.choice([0, 5, 31, 32, 300])))
    if kind in (5, 6):
        return rng.randbytes(rng.choice([0, 3, 255, 256, 70_000]))
    if kind == 7:
        return [_random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 15, 16, 20]))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.choice([0, 1, 15, 16, 20]))}


@pytest.mark.parametrize("value", EDGE_VALUES, ids=lambda v: type(v).__name__)
def test_codec_matches_msgspec_on_edge_values(value):
    encoded = msgspec.msgpack.encode(value)
    assert msgpack_decode(encoded) == value
    assert msgspec.msgpack.decode(msgpack_encode(value)) == value
    assert msgpack_encode(value) == encoded  # both pick the smallest format


def test_codec_matches_msgspec_on_random_values():
    rng = random.Random(7)
    for _ in range(300):
        value = _random_value(rng)
        assert msgpack_decode(msgspec.msgpack.encode(value)) == value
        assert msgspec.msgpack.decode(msgpack_encode(value)) == value


def test_codec_details():
    assert msgpack_decode(b"\xca" + struct.pack(">f", 1.5)) == 1.5  # float32, which msgspec never writes
    assert math.isnan(msgpack_decode(msgspec.msgpack.encode(math.nan)))
    assert msgpack_decode(msgpack_encode((1, bytearray(b"ab"), memoryview(b"cd")))) == [1, b"ab", b"cd"]
    assert msgpack_decode(b"\xdb\x00\x00\x00\x01z") == "z"  # str32 holding a short string is still valid
    for bad in (2**64, -(2**63) - 1, object(), {1, 2}):
        with pytest.raises(ValueError):
            msgpack_encode(bad)
    # empty, never-used byte, fixext, ext8, short str, short uint16, trailing byte, unhashable key
    bad_inputs = [b"", b"\xc1", b"\xd4\x01\x00", b"\xc7\x01\x01x", b"\xa3ab", b"\xcd\x01", b"\x00\x00"]
    for bad in [*bad_inputs, b"\x81\x90\x00"]:
        with pytest.raises(ValueError):
            msgpack_decode(bad)


# ---- HeadTail --------------------------------------------------------------------------------------


def _expected(data: bytes, head: int, tail: int) -> bytes:
    return data if len(data) <= head + tail else data[:head] + data[len(data) - tail :]


def _fed(data: bytes, head: int, tail: int, sizes) -> HeadTail:
    ht, pos = HeadTail(head, tail), 0
    for size in sizes:
        ht.feed(data[pos : pos + size])
        pos += size
    ht.feed(data[pos:])
    return ht


@pytest.mark.parametrize("length", [0, 5, 10, 11, 25, 26, 1000])
def test_headtail_boundaries(length):
    data = bytes(range(256)) * 4
    data = data[:length]
    for sizes in ([], [1] * length, [7] * (length // 7)):
        ht = _fed(data, 10, 15, sizes)
        assert ht.output() == _expected(data, 10, 15)
        assert (ht.total, ht.elided) == (length, max(0, length - 25))


def test_headtail_zero_limits():
    data = b"0123456789"
    assert _fed(data, 0, 3, [4]).output() == b"789"
    assert _fed(data, 3, 0, [4]).output() == b"012"
    ht = _fed(data, 0, 0, [1, 2])
    assert (ht.output(), ht.elided, ht.total) == (b"", 10, 10)


def test_headtail_many_random_feeds():
    rng = random.Random(3)
    for _ in range(200):
        data = rng.randbytes(rng.randrange(5000))
        head, tail = rng.randrange(300), rng.randrange(300)
        sizes = [rng.randrange(200) for _ in range(rng.randrange(50))]
        ht = _fed(data, head, tail, sizes)
        assert ht.output() == _expected(data, head, tail)
        assert ht.elided == len(data) - len(ht.output())


def test_headtail_tiny_feeds_of_a_long_stream():
    ht = HeadTail(100, 100)
    for i in range(100_000):
        ht.feed(bytes([i % 251]))
    data = bytes(i % 251 for i in range(100_000))
    assert ht.output() == data[:100] + data[-100:]
    assert (ht.total, ht.elided) == (100_000, 99_800)
