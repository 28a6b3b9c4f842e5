"""The podman CLI on one node: create, list and remove containers; version, images, disk. Also podman on
this machine, synchronously (``run_local_podman``), for image builds and the official harness.
``ContainerCli`` holds what the podman and docker CLIs share (remote/nodes/docker_sandbox.py has DockerCli).

We drive the CLI rather than podman-py: podman-py's ``exec_run`` is not clearly cheaper than a ``podman exec``
process (docs/results.md, "Figures the code relies on"), and the hot path (commands in a sandbox) goes through our
exec agent anyway. The CLI needs no API service per node and works identically over SSH; lifecycle
calls (``podman run``, ``podman rm``) cost one process either way.

Podman settings come from swectl's containers.conf (copied to the node and passed as CONTAINERS_CONF),
so a user's own /etc/containers files are never modified.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from importlib import resources
from pathlib import Path

import anyio

from swectl.errors import CommandError, InfraError
from swectl.remote.nodes import pull_folders
from swectl.remote.nodes.node import Node
from swectl.schema import CommandOutput, SandboxInfo, SandboxSpec

_UPLOAD_CONF = (
    'd="${XDG_CACHE_HOME:-$HOME/.cache}/swectl" && mkdir -p "$d" && cat > "$d/containers.conf.$$" '
    '&& mv -f "$d/containers.conf.$$" "$d/containers.conf" && printf %s "$d/containers.conf"'
)


def qualify_image(image: str) -> str:
    """Docker's reading of a short name: ``swebench/x`` is ``docker.io/swebench/x``. Podman refuses short
    names when no unqualified-search registry is configured, and the official SWE-bench image names are
    short. A missing image is pulled by ``podman run`` on nodes that reach the registry."""
    first, sep, _rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if sep else image  # a bare name may be a local image: podman resolves it


def bundled_containers_conf() -> Path:
    """swectl's own containers.conf on this machine (shipped as package data beside this module)."""
    return Path(str(resources.files("swectl.remote.nodes").joinpath("containers.conf")))


def local_podman_env() -> dict[str, str]:
    """The environment for running ``podman`` on this machine with swectl's containers.conf."""
    return {**os.environ, "CONTAINERS_CONF": str(bundled_containers_conf())}


def run_local_podman(
    *args: str, input: bytes | None = None, timeout: float = 600, check: bool = True, log: Path | None = None
) -> CommandOutput:
    """``podman *args`` on this machine with swectl's containers.conf, synchronously (image builds, the
    official harness, tests; sandboxes go through PodmanCli). A non-zero exit raises CommandError (argv, exit
    code, stderr tail) when ``check``; podman not starting or overrunning ``timeout`` always does. ``log``:
    a file that gets the command line and its output appended."""
    argv = ["podman", *args]
    try:
        done = subprocess.run(argv, input=input, capture_output=True, env=local_podman_env(), timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise CommandError("local", argv, None, f"timed out after {timeout:g}s") from exc
    except OSError as exc:
        raise CommandError("local", argv, None, f"could not start podman: {exc}") from exc
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as f:
            f.write(f"$ {shlex.join(argv)}\n".encode() + done.stdout + done.stderr)
    if check and done.returncode != 0:
        raise CommandError("local", argv, done.returncode, done.stderr.decode(errors="replace"))
    return CommandOutput(exit_code=done.returncode, stdout=done.stdout, stderr=done.stderr)


def last_error_line(stderr: str) -> str:
    """The line of a podman or docker error output that says what went wrong."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    return (errors or lines or ["podman failed with no message"])[-1]


class ContainerCli:
    """A container engine's command line on one node: what ``podman`` and ``docker`` share (their ``run``
    flags, images, version). Subclasses say how to reach the engine (``prepare``), how to list and remove."""

    binary = ""
    # Exit codes of `<binary> exec` that may mean the engine failed or the container is gone, not the command.
    exec_failure_codes: tuple[int, ...] = ()

    def __init__(self, node: Node) -> None:
        self.node = node
        self._prefix: list[str] | None = None

    async def prepare(self) -> None:
        raise NotImplementedError

    @property
    def ready(self) -> bool:
        return self._prefix is not None

    async def ensure_ready(self) -> None:
        """``prepare`` unless it already ran."""
        if not self.ready:
            await self.prepare()

    def argv(self, *args: str) -> list[str]:
        assert self._prefix is not None, f"{type(self).__name__}.prepare() must run first"
        return [*self._prefix, self.binary, *args]

    async def run(self, *args: str, input: bytes | None = None, check: bool = True) -> CommandOutput:
        argv = self.argv(*args)
        out = await self.node.run(argv, input=input)
        if check and out.exit_code != 0:
            raise CommandError(self.node.name, argv, out.exit_code, out.stderr.decode(errors="replace"))
        return out

    async def store_root(self) -> str:
        """The folder of the engine's image store ("" when it does not say)."""
        raise NotImplementedError

    async def free_disk_gb(self) -> float:
        """The free disk (GB) of the file system that holds the engine's image store."""
        root = await self.store_root()
        out = await self.node.run(["df", "-Pk", root or "/"])
        fields = out.stdout.decode().splitlines()[-1].split()
        return int(fields[3]) / 1024 / 1024

    async def version(self) -> str:
        out = await self.run("version", "--format", "{{.Client.Version}}")
        return out.stdout.decode().strip()

    async def images(self) -> list[str]:
        out = await self.run("images", "--format", "{{.Repository}}:{{.Tag}}")
        return [line for line in out.stdout.decode().split() if line and "<none>" not in line]

    # ------------------------------------------------------------ the image store (swectl/images/store.py)

    async def image_exists(self, image: str) -> bool:
        """Whether the store holds ``image``; InfraError when the engine cannot tell."""
        raise NotImplementedError

    def pull_flags(self, registry_flags: list[str]) -> list[str]:
        """``pull`` flags for a registry, from its podman flags (``Registry.tls_args``): podman takes them as is."""
        return registry_flags

    def pull_hint(self, error: str, *, registry_host: str, registry_url: str) -> str:
        """What to do about a failed pull from a registry (appended to its error), "" when nothing to say."""
        return ""

    async def drop_name(self, image: str, name: str) -> None:
        """Remove ``name``, a second name of ``image``; the image stays under ``image``."""
        raise NotImplementedError

    async def images_disk_bytes(self) -> int:
        """The bytes the store's images take on the node's disk, each shared layer once (``system df``)."""
        raise NotImplementedError

    async def sweep_pull_leftovers(self, root: str = "") -> tuple[int, int]:
        """Remove what stopped pulls left on the node (remote/nodes/pull_folders.py): (folders, KB)."""
        return 0, 0

    def _disk_error(self, stdout: bytes) -> InfraError:
        return InfraError(f"node {self.node.name!r}: `{self.binary} system df` did not say how much disk the images "
                          f"take: {stdout.decode(errors='replace')[-300:]!r}")

    def security_args(self) -> list[str]:
        """Extra `run` flags for capabilities and the like (podman's come from containers.conf)."""
        return []

    async def pidfile(self, cid: str) -> str | None:
        """Where the node keeps the pid (as the node sees it) of the container's first process; None when this
        engine does not say (the exec agent then speaks through a relay process)."""
        return None

    def run_args(self, spec: SandboxSpec, name: str) -> list[str]:
        """The `run` command line of a container that idles until removed."""
        args = ["run", "-d", "--init", "--name", name, "--stop-timeout", "0"]
        for key, value in sorted(spec.labels.items()):
            args += ["--label", f"{key}={value}"]
        for key, value in sorted(spec.env.items()):
            args += ["--env", f"{key}={value}"]
        if not spec.network:
            args += ["--network", "none"]
        for mount in spec.mounts:
            args += ["--mount", f"type=bind,source={mount.source},target={mount.target},readonly"]
        args += ["--memory", spec.memory, "--pids-limit", str(spec.pids_limit)]
        if spec.cpus > 0:  # 0: no CPU limit
            args += ["--cpus", str(spec.cpus)]
        args += self.security_args()
        args += ["--workdir", spec.workdir, "--entrypoint", "sleep", qualify_image(spec.image), "infinity"]
        return args

    async def create(self, spec: SandboxSpec, name: str) -> str:
        """Start a container that idles until removed; returns its id."""
        out = await self.run(*self.run_args(spec, name))
        return out.stdout.decode().strip()

    async def list_containers(self, labels: dict[str, str]) -> list[SandboxInfo]:
        raise NotImplementedError

    async def remove(self, ids: list[str]) -> None:
        raise NotImplementedError


class PodmanCli(ContainerCli):
    """The podman command line on one node, with swectl's containers.conf."""

    binary = "podman"
    # podman's own failures (125-127), a container killed under a command (137), a stopped container (255)
    exec_failure_codes = (125, 126, 127, 137, 255)

    def __init__(self, node: Node, containers_conf: str = "bundled") -> None:
        super().__init__(node)
        self._conf = containers_conf
        self._store: tuple[str, ...] | None = None  # (run root, storage driver), () when podman does not say
        self._store_lock = anyio.Lock()

    async def pidfile(self, cid: str) -> str | None:
        """Podman keeps every container's pid in its run root: ``<run root>/<driver>-containers/<id>/userdata/
        pidfile`` (gone with the container)."""
        async with self._store_lock:
            if self._store is None:
                out = await self.run("info", "--format", "{{.Store.RunRoot}} {{.Store.GraphDriverName}}", check=False)
                parts = out.stdout.decode(errors="replace").split()
                self._store = tuple(parts) if out.exit_code == 0 and len(parts) == 2 else ()
        if not self._store:
            return None
        run_root, driver = self._store
        return f"{run_root}/{driver}-containers/{cid}/userdata/pidfile"

    async def prepare(self) -> None:
        """Put swectl's containers.conf on the node (idempotent)."""
        if self._conf == "system":
            self._prefix = []
            return
        if self._conf != "bundled":
            self._prefix = ["env", f"CONTAINERS_CONF={self._conf}"]
            return
        text = bundled_containers_conf().read_bytes()
        argv = ["sh", "-c", _UPLOAD_CONF]
        out = await self.node.run(argv, input=text)
        if out.exit_code != 0:
            raise CommandError(self.node.name, argv, out.exit_code, out.stderr.decode(errors="replace"))
        self._prefix = ["env", f"CONTAINERS_CONF={out.stdout.decode()}"]

    async def store_root(self) -> str:
        return (await self.run("info", "--format", "{{.Store.GraphRoot}}")).stdout.decode().strip()

    async def image_exists(self, image: str) -> bool:
        out = await self.run("image", "exists", qualify_image(image), check=False)
        if out.exit_code in (0, 1):
            return out.exit_code == 0
        raise InfraError(f"node {self.node.name!r}: cannot tell whether {image} is there: "
                         f"{last_error_line(out.stderr.decode(errors='replace'))}")

    async def drop_name(self, image: str, name: str) -> None:
        await self.run("untag", image, name)

    async def images_disk_bytes(self) -> int:
        out = await self.run("system", "df", "--format", "{{.Type}}|{{.RawSize}}")
        for line in out.stdout.decode().splitlines():
            kind, _, size = line.partition("|")
            if kind.strip() == "Images" and size.strip().isdigit():
                return int(size)
        raise self._disk_error(out.stdout)

    async def sweep_pull_leftovers(self, root: str = "") -> tuple[int, int]:
        return await pull_folders.sweep(self.node, root)

    async def list_containers(self, labels: dict[str, str]) -> list[SandboxInfo]:
        args = ["ps", "-a", "--format", "json"]
        for key, value in sorted(labels.items()):
            args += ["--filter", f"label={key}={value}"]
        out = await self.run(*args)
        return self._sandbox_infos(json.loads(out.stdout or b"[]") or [])

    def _sandbox_infos(self, rows: list[dict]) -> list[SandboxInfo]:
        """Podman's container list rows (``ps --format json`` and the API's /containers/json agree)."""
        return [
            SandboxInfo(
                id=row["Id"],
                name=(row.get("Names") or [""])[0],
                node=self.node.name,
                image=row.get("Image", ""),
                state=row.get("State", ""),
                labels=row.get("Labels") or {},
            )
            for row in rows
        ]

    async def remove(self, ids: list[str]) -> None:
        """Force-remove containers; missing ones are not an error (idempotent)."""
        if ids:
            await self.run("rm", "--force", "--ignore", "--time", "0", *ids)
