"""Docker sandboxes on one node (local or over SSH): the Podman backend's code over the ``docker`` CLI.

A sandbox is a container idling under Docker's init (``--init``: tini as ``docker-init``); commands go
through the exec agent, started once per sandbox by one long-lived ``docker exec -i``, and images without
python3 fall back to one ``docker exec`` per command, exactly as on Podman (``ContainerSandbox``). The CLI
runs on the node through the Node protocol (one process per lifecycle call), so local and SSH nodes work
the same; ``sandbox.docker_host`` is passed as ``DOCKER_HOST`` when set (else the node's default daemon).

Security settings Podman takes from swectl's containers.conf are flags here: the same capability set
(``--cap-drop ALL`` plus containers.conf's ``default_capabilities``), ``--network none`` unless the spec
asks for a network, the spec's memory, pids and CPU limits. Docker's default seccomp profile applies.

Images: a Docker node has its own image store, separate from Podman's. Images must be loaded there
(``podman save IMG | docker load``, or pulled from a registry the node reaches); a create from a missing
image fails with a CommandError that names the image and says so.
"""

from __future__ import annotations

import json
import re
import tomllib

from swectl.config import SandboxConfig
from swectl.errors import CommandError, InfraError
from swectl.remote.nodes.node import Node
from swectl.remote.nodes.podman import ContainerCli, bundled_containers_conf, last_error_line, qualify_image
from swectl.remote.nodes.podman_sandbox import ContainerBackend, ContainerSandbox
from swectl.schema import SandboxInfo, SandboxSpec


def default_capabilities() -> list[str]:
    """The capabilities a sandbox keeps: Podman's set from swectl's containers.conf (one list for both)."""
    conf = tomllib.loads(bundled_containers_conf().read_text())
    return list(conf["containers"]["default_capabilities"])


CAPABILITIES = default_capabilities()
# docker's answers: a missing image; a daemon that speaks HTTPS to a plain-HTTP registry it was not told is insecure
_NO_IMAGE = ("no such image", "no such object")
_INSECURE = "server gave http response to https client"
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}


def docker_bytes(size: str) -> int:
    """Bytes of a size as docker prints it (``1.234GB``, ``512kB``, ``0B``: decimal units)."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKMGTP]?B)\s*", size)
    if not found:
        raise ValueError(f"not a docker size: {size!r}")
    return round(float(found.group(1)) * _UNITS[found.group(2).lower()])


class DockerCli(ContainerCli):
    """The docker command line on one node, pointed at ``docker_host`` (``DOCKER_HOST``) when given."""

    binary = "docker"
    # docker's own failures (125-127), a container killed under a command (137), and 1: `docker exec` on a
    # stopped or removed container exits 1 ("is not running", "No such container"), like a failing command.
    exec_failure_codes = (1, 125, 126, 127, 137, 255)

    def __init__(self, node: Node, docker_host: str = "") -> None:
        super().__init__(node)
        self.docker_host = docker_host

    async def prepare(self) -> None:
        """Docker needs no files on the node; the daemon is reached through ``DOCKER_HOST`` when set."""
        self._prefix = ["env", f"DOCKER_HOST={self.docker_host}"] if self.docker_host else []

    async def version(self) -> str:
        """The daemon's version: unlike podman, the docker CLI is only a client (this checks the daemon)."""
        out = await self.run("version", "--format", "{{.Server.Version}}")
        return out.stdout.decode().strip()

    async def store_root(self) -> str:
        return (await self.run("info", "--format", "{{.DockerRootDir}}")).stdout.decode().strip()

    def security_args(self) -> list[str]:
        args = ["--cap-drop", "ALL"]
        for cap in CAPABILITIES:
            args += ["--cap-add", cap]
        return args

    async def create(self, spec: SandboxSpec, name: str) -> str:
        """Start a container that idles until removed; returns its id. A missing image (docker tried to pull
        it and could not) is a CommandError that names the image and how to load it."""
        args = self.run_args(spec, name)
        out = await self.run(*args, check=False)
        if out.exit_code == 0:
            return out.stdout.decode().split()[-1]
        stderr = out.stderr.decode(errors="replace")
        image = qualify_image(spec.image)
        if out.exit_code == 125 and not await self._image_known(image):
            stderr = (
                f"image {image} is not in the Docker image store of node {self.node.name} and could not be "
                f"pulled -- hint: load it there (`podman save {image} | docker load`) or push it to a "
                f"registry the node reaches. docker said: {stderr.strip()}"
            )
        raise CommandError(self.node.name, self.argv(*args), out.exit_code, stderr)

    async def _image_known(self, image: str) -> bool:
        try:
            return await self.image_exists(image)
        except InfraError:
            return True  # the daemon cannot say: the error stays docker's own

    # ------------------------------------------------------------ the image store: docker differs from podman here

    async def image_exists(self, image: str) -> bool:
        """No ``image exists``: ``inspect`` exits 1 both for a missing image and for a daemon it lost."""
        out = await self.run("image", "inspect", "--format", "{{.Id}}", qualify_image(image), check=False)
        if out.exit_code == 0:
            return True
        stderr = out.stderr.decode(errors="replace")
        if any(s in stderr.lower() for s in _NO_IMAGE):
            return False
        raise InfraError(f"node {self.node.name!r}: cannot tell whether {image} is there: {last_error_line(stderr)}")

    def pull_flags(self, registry_flags: list[str]) -> list[str]:
        """No TLS flag on a docker pull: the daemon decides (see ``pull_hint``)."""
        return []

    def pull_hint(self, error: str, *, registry_host: str, registry_url: str) -> str:
        """No TLS flag on a pull: the daemon reaches a plain-HTTP registry only when its ``insecure-registries``
        name it (or on 127.0.0.0/8)."""
        if _INSECURE not in error.lower():
            return ""
        return (f"{registry_url} is plain HTTP: name {registry_host} in the node's dockerd \"insecure-registries\" "
                f"(/etc/docker/daemon.json) and restart it")

    async def drop_name(self, image: str, name: str) -> None:
        """docker has no ``untag``: ``rmi`` of a name the image has another of removes only that name."""
        await self.run("rmi", name)

    async def images_disk_bytes(self) -> int:
        """``system df`` in docker's decimal units (``1.234GB``)."""
        out = await self.run("system", "df", "--format", "{{.Type}}|{{.Size}}")
        for line in out.stdout.decode().splitlines():
            kind, _, size = line.partition("|")
            if kind.strip() == "Images":
                try:
                    return docker_bytes(size)
                except ValueError:
                    break
        raise self._disk_error(out.stdout)

    async def list_containers(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """``docker ps`` prints labels as one "k=v,k=v" string (ambiguous when a value has a comma): the ids
        come from ``ps``, everything else from ``docker inspect``."""
        args = ["ps", "-a", "-q", "--no-trunc"]
        for key, value in sorted(labels.items()):
            args += ["--filter", f"label={key}={value}"]
        ids = (await self.run(*args)).stdout.decode().split()
        if not ids:
            return []
        argv = ["container", "inspect", *ids]
        out = await self.run(*argv, check=False)
        if out.exit_code != 0 and not _only_missing(out.stderr):  # one removed since `ps`: not an error
            raise CommandError(self.node.name, self.argv(*argv), out.exit_code, out.stderr.decode(errors="replace"))
        rows = json.loads(out.stdout or b"[]") or []
        return [
            SandboxInfo(
                id=row["Id"],
                name=row.get("Name", "").lstrip("/"),
                node=self.node.name,
                image=(row.get("Config") or {}).get("Image", ""),
                state=(row.get("State") or {}).get("Status", ""),
                labels=(row.get("Config") or {}).get("Labels") or {},
            )
            for row in rows
        ]

    async def remove(self, ids: list[str]) -> None:
        """Force-remove containers (SIGKILL, no stop timeout); missing ones are not an error (idempotent)."""
        if not ids:
            return
        argv = ["rm", "--force", *ids]
        out = await self.run(*argv, check=False)
        if out.exit_code != 0 and not _only_missing(out.stderr):
            raise CommandError(self.node.name, self.argv(*argv), out.exit_code, out.stderr.decode(errors="replace"))


def _only_missing(stderr: bytes) -> bool:
    """Whether every error docker printed says a container does not exist."""
    lines = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    return bool(lines) and all("No such container" in line or "No such object" in line for line in lines)


class DockerBackend(ContainerBackend):
    """Docker containers on one node, through its ``docker`` CLI."""

    def __init__(self, node: Node, config: SandboxConfig) -> None:
        self.docker = DockerCli(node, config.docker_host)
        super().__init__(node, config, self.docker)

    def _sandbox(self, cid: str, name: str, spec: SandboxSpec) -> DockerSandbox:
        return DockerSandbox(self, cid, name, spec)


class DockerSandbox(ContainerSandbox):
    """A docker container as a Sandbox, driven through the exec agent (or `docker exec`)."""
