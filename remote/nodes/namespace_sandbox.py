"""Namespace sandboxes on one node (local or over SSH): the container-free SandboxBackend.

A per-node daemon (remote/programs/nsbox.py, started by ``prepare``) starts each sandbox as new mount, PID,
IPC, UTS and network namespaces over an overlay of the image's read-only layers, with cgroup limits and
Podman's capability set; the sandbox's PID 1 is the exec agent, speaking over the channel it was handed.
On this machine that channel is a socket pair whose far end the controller passes to the daemon (no
process spawned per sandbox); on an SSH node it is the pipe of an ``attach`` process that hands its
stdin/stdout to the daemon and then waits as ``tail --pid`` (sshd closes a channel whose process exited).
Nothing else of a sandbox lives outside its namespaces on the node, and closing the channel ends it (the
agent exits, and with it the namespace).

Images come from the node's Podman store (``podman image inspect``: layer directories and environment),
resolved once per image and backend, or, for nodes without Podman, from a rootfs tarball on this machine
(``sandbox.ns_rootfs``) that is shipped once and unpacked on the node under its content hash (unsafe
members refused by name). The exec agent needs no python3 in the image: it runs on the node's
interpreter, loaded before the sandbox's root is entered.

Covered: filesystem (overlay over read-only layers, old root detached), processes (PID namespace), network
(loopback only unless ``network``), memory, pids and CPU limits (cgroups; a controller the node lacks is
reported by ``swectl nodes check`` and logged once), capabilities and ``no_new_privs``, and an identity-mapped
user namespace (``sandbox.ns_userns``, where the node allows one) entered after every other namespace and mount
was made, so no capability reaches beyond the sandbox's own user namespace. Not covered: seccomp, the kernel.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import socket
import sys
from importlib import resources

import anyio
import anyio.abc
import msgspec

from swectl.config import SandboxConfig
from swectl.errors import CommandError, SandboxError
from swectl.remote.nodes.agent_client import AgentClient, agent_source
from swectl.remote.nodes.agent_sandbox import AgentSandbox, RemovalBatcher, translate_lost
from swectl.remote.nodes.node import LocalNode, Node, NodeProcess, SocketChannel
from swectl.remote.nodes.podman import PodmanCli, qualify_image
from swectl.remote.programs import nsbox
from swectl.remote.programs.nsbox import BOOTSTRAP
from swectl.schema import SandboxInfo, SandboxSpec

log = logging.getLogger(__name__)

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "TERM": "xterm",
    "HOME": "/root",
    "container": "swectl-namespace",
}
CALL_TIMEOUT_S = 60.0
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str) -> int:
    """``"300m"`` -> bytes (binary units, as Podman reads ``--memory``)."""
    match = _SIZE.match(text)
    if not match:
        raise SandboxError(f"{what}: {text!r} is not a size (examples: 512m, 2g)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** "bkmgt".index(unit or "b"))


def nsbox_source() -> bytes:
    return resources.files("swectl.remote.programs").joinpath("nsbox.py").read_bytes()


def daemon_socket(state_dir: str) -> str:
    """Where this version's nsbox daemon listens on a node with ``state_dir`` (one daemon per version)."""
    return nsbox.socket_path(state_dir, nsbox.version_of(nsbox_source(), agent_source()))


def _blob(data: bytes) -> bytes:
    return b"%d\n" % len(data) + data


class ImageRoot(msgspec.Struct, frozen=True):
    """An image as the daemon needs it: its read-only layer directories (top first) and environment."""
    image_id: str
    layers: list[str]
    env: dict[str, str]


class NamespaceBackend:
    """Creates, lists and removes namespace sandboxes on one node through its nsbox daemon."""

    def __init__(self, node: Node, config: SandboxConfig, containers_conf: str = "bundled") -> None:
        self.name = node.name
        self.node = node
        self.config = config
        self.podman = PodmanCli(node, containers_conf)  # the image store the layers come from
        self.cli = self.podman  # the container engine on the node, as the other backends name it
        self._local = isinstance(node, LocalNode)
        self._python = sys.executable if self._local else config.ns_python
        self._socket: str | None = None
        self._roots: dict[str, ImageRoot] = {}
        self._removals = RemovalBatcher(lambda ids: self.remove(ids), node.name)
        self._warned_limits = False
        self._userns = False  # whether the node allows user namespaces (from its check at prepare)
        self.daemon_version = ""
        self._reviving = anyio.Lock()
        self.revivals = 0  # times the daemon was started again after it stopped answering

    own_cgroup_limits = True  # the nsbox daemon enforces the limits with cgroups of its own (the node needs them)

    def preloaded_images(self) -> set[str]:
        return set(self.config.ns_rootfs)

    @property
    def prepared(self) -> bool:
        return self._socket is not None

    @property
    def alive(self) -> bool:
        return self.node.alive

    def _argv(self, *args: str) -> list[str]:
        return [self._python, "-S", "-I", "-c", BOOTSTRAP, *args]

    async def check(self) -> dict:
        """What the node offers this backend (``nsbox check``): ok, problems, limits, ..."""
        await self.node.connect()
        out = await self.node.run(self._argv("check"), input=_blob(nsbox_source()))
        if out.exit_code != 0:
            raise CommandError(self.name, self._argv("check")[:4], out.exit_code, out.stderr.decode(errors="replace"))
        return json.loads(out.stdout)

    async def prepare(self) -> None:
        await self.node.connect()
        await self.podman.prepare()
        report = await self.check()
        if not report["ok"]:
            raise SandboxError(
                f"node {self.name} cannot run namespace sandboxes: {'; '.join(report['problems'])} "
                '-- hint: use sandbox.backend = "podman" there'
            )
        if report["unenforced_limits"] and not self._warned_limits:
            self._warned_limits = True
            log.warning("node %s: namespace sandboxes run without %s limits (no cgroup controller for them)",
                        self.name, ", ".join(report["unenforced_limits"]))  # fmt: skip
        self._userns = report.get("user_namespaces") == "yes"
        if self.config.ns_userns and not self._userns:
            log.warning("node %s: no user namespaces (max_user_namespaces is 0): sandboxes run without one",
                        self.name)  # fmt: skip
        await self._ensure_daemon()

    async def _ensure_daemon(self) -> None:
        """``nsbox ensure``: this version's daemon serves its socket (started if it is not running)."""
        argv = self._argv("ensure", self.config.ns_state_dir)
        out = await self.node.run(argv, input=_blob(nsbox_source()) + _blob(agent_source()))
        if out.exit_code != 0:
            raise CommandError(self.name, argv[:4] + argv[5:], out.exit_code, out.stderr.decode(errors="replace"))
        reply = json.loads(out.stdout)
        self.daemon_version = reply.get("version", "")
        self._socket = reply["socket"]

    async def _revive(self, why: BaseException, seen: int) -> None:
        """The daemon did not answer on its socket (killed, or gone idle between our calls): start it again, once
        for every caller that saw the same socket fail. The new daemon reclaims the sandboxes the dead one
        recorded (kills them, removes their cgroups and scratch): their episodes end as infrastructure failures."""
        async with self._reviving:
            if self.revivals != seen:
                return  # another caller revived it since this one's call failed
            log.warning("node %s: the nsbox daemon does not answer (%s); starting it again", self.name, why)
            await self._ensure_daemon()
            self.revivals += 1

    async def probe(self) -> str:
        await self.node.connect()
        reply = await self._call({"op": "ping"})
        return f"nsbox {reply.get('version', '?')} ({reply.get('sandboxes', 0)} sandboxes)"

    async def create(self, spec: SandboxSpec) -> NamespaceSandbox:
        root = await self._image_root(spec.image)
        sandbox_id = f"ns-{secrets.token_hex(6)}"
        request = {
            "op": "launch", "id": sandbox_id, "name": sandbox_id, "image": spec.image, "labels": spec.labels,
            "layers": root.layers, "env": {**DEFAULT_ENV, **root.env, **spec.env}, "workdir": spec.workdir,
            "hostname": sandbox_id, "network": spec.network, "userns": self.config.ns_userns and self._userns,
            "memory_bytes": parse_size(spec.memory, "sandbox.memory"), "pids": spec.pids_limit, "cpus": spec.cpus,
            "upper": self.config.ns_scratch,
            "upper_size": parse_size(self.config.ns_scratch_size, "sandbox.ns_scratch_size"),
            "mounts": [[m.source, m.target] for m in spec.mounts],
        }  # fmt: skip
        sandbox = NamespaceSandbox(self, sandbox_id, spec)
        try:
            with translate_lost(self.node, f"starting namespace sandbox {sandbox_id}"):
                with anyio.fail_after(self.config.start_timeout_s):
                    seen = self.revivals
                    try:
                        await self._start_agent(sandbox, request)
                    except _DaemonGone as gone:
                        await self._revive(gone, seen)
                        await self._start_agent(sandbox, request)
        except SandboxError as exc:
            await sandbox.destroy()
            if "is gone" in str(exc):
                self._roots.pop(spec.image, None)  # the image was rebuilt or removed: look it up again
            raise
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def list(self, labels: dict[str, str]) -> list[SandboxInfo]:
        reply = await self._call({"op": "list"})
        return [
            SandboxInfo(
                id=row["id"], name=row["name"], node=self.name, image=row["image"], state=row["state"],
                labels=row["labels"],
            )
            for row in reply["sandboxes"]
            if row["labels"].items() >= labels.items()
        ]

    async def host_pids(self) -> dict[str, int]:
        """{sandbox id: host pid of its PID 1} (for measurements and fault injection on the node)."""
        reply = await self._call({"op": "list"})
        return {row["id"]: row["pid"] for row in reply["sandboxes"]}

    async def remove(self, ids: list[str]) -> None:
        """Kill the sandboxes and wait until the daemon has reaped and cleaned them up."""
        if ids:
            await self._call({"op": "remove", "ids": list(ids)})

    async def remove_one(self, sandbox_id: str) -> None:
        await self._removals.remove_one(sandbox_id)

    async def aclose(self) -> None:
        await self.node.aclose()

    def forget_image(self, image: str) -> None:
        """An image was removed from the node: every image's layers are looked up again at its next sandbox (one
        ``podman image inspect`` each; names differ in spelling, and removals are rare)."""
        self._roots = {n: root for n, root in self._roots.items() if n in self.config.ns_rootfs}

    # ------------------------------------------------------------------ internals

    async def _image_root(self, image: str) -> ImageRoot:
        cached = self._roots.get(image)
        if cached is not None:
            return cached
        if image in self.config.ns_rootfs:
            root = await self._tarball_root(image, self.config.ns_rootfs[image])
            self._roots[image] = root
            return root
        out = await self.podman.run("image", "inspect", "--format", "{{json .}}", qualify_image(image), check=False)
        if out.exit_code != 0:
            raise CommandError(
                self.name, self.podman.argv("image", "inspect", image), out.exit_code,
                out.stderr.decode(errors="replace") + " -- the namespace backend takes images from the node's "
                "Podman store: build or load the image there",
            )
        data = json.loads(out.stdout)
        data = data[0] if isinstance(data, list) else data
        driver = data.get("GraphDriver") or {}
        info = driver.get("Data") or {}
        if driver.get("Name") == "overlay":
            layers = [info["UpperDir"], *[d for d in (info.get("LowerDir") or "").split(":") if d]]
        elif driver.get("Name") == "vfs" and info.get("Dir"):
            layers = [info["Dir"]]
        else:
            raise SandboxError(
                f"image {image} on {self.name}: Podman storage driver {driver.get('Name')!r} is not supported by "
                "the namespace backend (overlay or vfs)"
            )
        env = dict(item.split("=", 1) for item in (data.get("Config") or {}).get("Env") or [] if "=" in item)
        root = ImageRoot(image_id=data.get("Id", ""), layers=layers, env=env)
        self._roots[image] = root
        return root

    async def _tarball_root(self, image: str, tarball: str) -> ImageRoot:
        """The image's rootfs tarball, unpacked once on the node under its content hash."""
        try:
            data = await (await anyio.Path(tarball).expanduser()).read_bytes()
        except OSError as exc:
            raise SandboxError(f"sandbox.ns_rootfs[{image!r}]: cannot read {tarball}: {exc}") from exc
        digest = await anyio.to_thread.run_sync(lambda: hashlib.sha256(data).hexdigest())
        target = f"{self.config.ns_state_dir}/rootfs/{digest}"
        exists = await self.node.run(["test", "-d", target])
        if exists.exit_code != 0:
            argv = self._argv("unpack", self.config.ns_state_dir, digest)
            out = await self.node.run(argv, input=_blob(nsbox_source()) + data)
            if out.exit_code != 0:
                stderr = out.stderr.decode(errors="replace")
                raise CommandError(self.name, argv[:4] + argv[5:], out.exit_code, stderr)
            reply = json.loads(out.stdout or b"{}")
            if not reply.get("ok"):
                raise SandboxError(f"rootfs tarball {tarball} for {image} on {self.name}: {reply.get('error')}")
        return ImageRoot(image_id=f"sha256:{digest}", layers=[target], env={})

    def _require_socket(self) -> str:
        if self._socket is None:
            raise SandboxError(f"node {self.name}: namespace backend used before prepare()")
        return self._socket

    async def _call(self, request: dict) -> dict:
        path = self._require_socket()
        payload = json.dumps(request).encode() + b"\n"
        seen = self.revivals
        try:
            try:
                return await self._call_bounded(path, request, payload)
            except _DaemonGone as gone:
                await self._revive(gone, seen)
                return await self._call_bounded(self._require_socket(), request, payload)
        except TimeoutError:
            raise SandboxError(f"node {self.name}: nsbox {request.get('op')}: no answer within "
                               f"{CALL_TIMEOUT_S:.0f} s") from None

    async def _call_bounded(self, path: str, request: dict, payload: bytes) -> dict:
        with anyio.fail_after(CALL_TIMEOUT_S):
            if self._local:
                data = await self._ask_local(path, payload)
            else:
                argv = self._argv("call", path)
                out = await self.node.run(argv, input=_blob(nsbox_source()) + payload)
                if out.exit_code == nsbox.DAEMON_GONE_EXIT:
                    raise _DaemonGone(f"node {self.name}: {out.stderr.decode(errors='replace').strip()}")
                if out.exit_code != 0:
                    stderr = out.stderr.decode(errors="replace")
                    raise CommandError(self.name, argv[:4] + argv[5:], out.exit_code, stderr)
                data = out.stdout
        reply = json.loads(data or b"{}")
        if not reply.get("ok"):
            raise SandboxError(f"node {self.name}: nsbox {request.get('op')}: {reply.get('error', 'no answer')}")
        return reply

    async def _start_agent(self, sandbox: NamespaceSandbox, request: dict) -> None:
        """Launch the sandbox and wait for its agent's hello. _DaemonGone when the daemon did not answer: on this
        node from its socket, on a remote node from the `attach` process's report in the channel."""
        channel = await self._launch(request)
        client = AgentClient(channel, f"sandbox {request['id']} on {self.name}")
        sandbox._agent = client
        try:
            await client.read_hello()
        except SandboxError as exc:
            if nsbox.DAEMON_GONE_MARK not in str(exc):
                raise
            sandbox._agent = None
            with anyio.CancelScope(shield=True):
                await client.aclose()
            raise _DaemonGone(str(exc)) from exc

    async def _launch(self, request: dict) -> NodeProcess:
        path = self._require_socket()
        if not self._local:
            process = await self.node.spawn(self._argv("attach", path, json.dumps(request)))
            await process.send(_blob(nsbox_source()))
            return process
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            reply = json.loads(await self._ask_local(path, json.dumps(request).encode() + b"\n", theirs))
        except BaseException:
            ours.close()
            theirs.close()
            raise
        if not reply.get("ok"):
            ours.close()
            raise SandboxError(f"namespace sandbox {request['id']} on {self.name}: {reply.get('error', 'no answer')}")
        return SocketChannel(await anyio.abc.UNIXSocketStream.from_socket(ours))

    async def _ask_local(self, path: str, payload: bytes, fd: socket.socket | None = None) -> bytes:
        """One request line to this node's daemon on its unix socket (``fd``: a descriptor passed with it, closed
        once sent), its reply line. _DaemonGone when nothing answers: refused, or a daemon dying as it accepted
        (reset, or closed without a reply)."""
        try:
            async with await anyio.connect_unix(path) as stream:
                if fd is None:
                    await stream.send(payload)
                else:
                    await stream.send_fds(payload, [fd.fileno()])
                    fd.close()
                line = await _read_line(stream)
        except (OSError, anyio.BrokenResourceError) as exc:
            raise _DaemonGone(f"node {self.name}: the nsbox daemon at {path} does not answer: {exc!r}") from exc
        if not line:
            raise _DaemonGone(f"node {self.name}: the nsbox daemon at {path} closed the request unanswered")
        return line


class _DaemonGone(SandboxError):
    """Nothing answers on the daemon's socket (this node's own, or a remote node's through `nsbox call` and
    `nsbox attach`, which exit with nsbox.DAEMON_GONE_EXIT then)."""


async def _read_line(stream: anyio.abc.ByteReceiveStream) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        try:
            data += await stream.receive()
        except anyio.EndOfStream:
            break
    return data


class NamespaceSandbox(AgentSandbox):
    """A namespace sandbox: its exec agent is its PID 1."""

    def __init__(self, backend: NamespaceBackend, sandbox_id: str, spec: SandboxSpec) -> None:
        super().__init__(backend.node, backend.config, sandbox_id, sandbox_id, spec)
        self._backend = backend

    async def host_root(self) -> str:
        pid = (await self._backend.host_pids()).get(self.id)
        if pid is None:
            raise SandboxError(f"sandbox {self.name}: the nsbox daemon does not list it")
        return f"/proc/{pid}/root"

    async def _remove(self) -> None:
        await self._backend.remove_one(self.id)
