"""One node's image store, as the env pool and `swectl image sync` use it: the images it holds (by the name the tasks
use), whether it holds one, a pull, a removal, and the disk its images take.

A pull goes through the registry the fleet uses when one is given (``registry.ref(image)``, then tagged back with the
name the tasks use and the registry's name dropped), else under the image's own name (Docker Hub's official images).
An image counts as present only once its pull completed and was tagged.

A pull runs with a temporary folder of its own (``TMPDIR``, ``swectl-pull.*`` under the node's ``$TMPDIR`` or
``/var/tmp``), removed when podman ends: measured with podman 4.3, a pull stopped by any signal (INT, TERM, HUP,
KILL; or its SSH session gone) leaves the layers it was downloading in such a folder, never reused and never
removed (the layers it had already committed stay in the store, without an image, and a later pull reuses them).
The folder is locked (``flock``) while its pull runs; ``sweep_pull_leftovers`` removes the unlocked ones, the
downloads of pulls that were stopped. Without ``flock`` on the node, pulls use podman's own folder.

A removal is a plain ``rmi``: never forced,
so an image a container still uses (the pool's or anyone's) stays and the removal says why. The disk is what the
store's images take together, each shared layer once (``podman system df``).

Over a node's podman CLI (remote/nodes/podman.py; PodmanApi is one too) or docker CLI (a Docker node: its daemon's
image store). Docker differs in four places: whether an image is there is ``image inspect``; a pull has no TLS flag
(the daemon reaches a plain-HTTP registry only when its ``insecure-registries`` name it, or on 127.0.0.0/8), and its
registry name is dropped with ``rmi`` (docker has no ``untag``); the disk comes from ``system df`` in docker's
decimal units (``1.234GB``). Every call may raise InfraError (NodeError when the node is lost); the caller bounds
the wait.
"""

from __future__ import annotations

import re
from typing import Protocol

from swectl.errors import InfraError, NodeError
from swectl.images.registry import Registry, normal_name
from swectl.remote.nodes.podman import ContainerCli, PodmanCli, qualify_image

# podman's messages when the registry answered that it has no such image
NOT_IN_REGISTRY = ("manifest unknown", "name unknown")
_GONE = ("image not known", "no such image")
# docker's answer when its daemon speaks HTTPS to a plain-HTTP registry it was not told is insecure
_INSECURE = "server gave http response to https client"
_DOCKER_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}


class ImagePullError(InfraError):
    """An image could not be made present on a node: the pull failed or ran out of time (the message says which,
    and what the node said)."""


class ImageStore(Protocol):
    """What the env pool needs of a node's images (NodeImageStore; tests give fakes)."""

    async def names(self) -> dict[str, str]:
        """The images present, by normal name (``normal_name``) -> image id."""
        ...

    async def exists(self, image: str) -> bool: ...

    async def pull(self, image: str) -> None:
        """Make ``image`` present; ImagePullError when it cannot be."""
        ...

    async def remove(self, image: str) -> str:
        """Remove ``image`` (never forced): "" when it is gone now, else why it stays (a container uses it)."""
        ...

    async def disk_bytes(self) -> int:
        """The bytes the store's images take on the node's disk, each shared layer once."""
        ...


def cli_error(stderr: str) -> str:
    """The line of a podman or docker error output that says what went wrong."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    return (errors or lines or ["podman failed with no message"])[-1]


def is_docker(cli: ContainerCli) -> bool:
    return cli.binary == "docker"


def docker_bytes(size: str) -> int:
    """Bytes of a size as docker prints it (``1.234GB``, ``512kB``, ``0B``: decimal units)."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKMGTP]?B)\s*", size)
    if not found:
        raise ValueError(f"not a docker size: {size!r}")
    return round(float(found.group(1)) * _DOCKER_UNITS[found.group(2).lower()])


async def list_images(cli: ContainerCli) -> dict[str, str]:
    """The node's images: normal name -> id (``sha256:...``); untagged ones left out. Prepares ``cli`` if needed."""
    if not cli.ready:
        await cli.prepare()
    out = await cli.run("images", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}")
    names: dict[str, str] = {}
    for line in out.stdout.decode().splitlines():
        name, _, image_id = line.strip().partition(" ")
        if name and "<none>" not in name:
            names[normal_name(name)] = image_id if image_id.startswith("sha256:") else f"sha256:{image_id}"
    return names


# sh -c PULL_SCRIPT swectl-pull PODMAN-ARGV...: the pull in a locked temporary folder of its own, removed after.
# The lock file is renamed into place only once locked, so a sweep never sees an unlocked one of a live pull.
PULL_SCRIPT = r"""
command -v flock >/dev/null 2>&1 || exec "$@"
d=$(mktemp -d "${TMPDIR:-/var/tmp}/swectl-pull.XXXXXX") || exit 125
exec 9>"$d/lock.new" && flock 9 && mv "$d/lock.new" "$d/lock" || { rm -rf "$d"; exit 125; }
TMPDIR="$d" "$@"
code=$?
rm -rf "$d"
exit "$code"
"""
# sh -c SWEEP_SCRIPT swectl-sweep [ROOT]: remove the folders of pulls that were stopped (unlocked; one without its lock
# file only when an hour old); prints how many and their KB.
SWEEP_SCRIPT = r"""
command -v flock >/dev/null 2>&1 || { echo "0 0"; exit 0; }
root="${1:-${TMPDIR:-/var/tmp}}"
n=0
kb=0
for d in "$root"/swectl-pull.*; do
  [ -d "$d" ] || continue
  size=$(du -sk "$d" 2>/dev/null | cut -f1)
  if [ -e "$d/lock" ]; then
    flock -n "$d/lock" rm -rf "$d" || continue
  elif [ -n "$(find "$d" -maxdepth 0 -mmin +60)" ]; then
    rm -rf "$d"
  else
    continue
  fi
  n=$((n + 1))
  kb=$((kb + ${size:-0}))
done
echo "$n $kb"
"""


async def sweep_pull_leftovers(cli: PodmanCli, root: str = "") -> tuple[int, int]:
    """Remove what stopped pulls left on the node (see the module docstring): (folders removed, their KB). Folders
    under ``root`` (default: the node's ``$TMPDIR`` or /var/tmp). (0, 0) when the node cannot say."""
    out = await cli.node.run(["sh", "-c", SWEEP_SCRIPT, "swectl-sweep", *([root] if root else [])])
    parts = out.stdout.decode(errors="replace").split()
    if out.exit_code != 0 or len(parts) != 2 or not all(p.isdigit() for p in parts):
        return 0, 0
    return int(parts[0]), int(parts[1])


async def pull_image(cli: ContainerCli, image: str, registry: Registry | None) -> str:
    """Pull ``image`` onto the node (see the module docstring): "" once it is there under its name, else what went
    wrong (``not in URL: ...`` when the registry lacks it). NodeError when the node is lost."""
    ref = registry.ref(image) if registry is not None else qualify_image(image)
    try:
        if not cli.ready:
            await cli.prepare()
        docker = is_docker(cli)
        tls = registry.tls_args() if registry is not None and not docker else []
        argv = cli.argv("pull", *tls, ref)
        out = await cli.node.run(["sh", "-c", PULL_SCRIPT, "swectl-pull", *argv])
        if out.exit_code != 0:
            error = cli_error(out.stderr.decode(errors="replace"))
            if registry is not None and any(s in error.lower() for s in NOT_IN_REGISTRY):
                error = f"not in {registry.url}: {error}"
            if docker and registry is not None and _INSECURE in error.lower():
                error += (f" -- hint: {registry.url} is plain HTTP: name {registry.host} in the node's dockerd "
                          f"\"insecure-registries\" (/etc/docker/daemon.json) and restart it")
            return error
        if normal_name(ref) != normal_name(image):
            await cli.run("tag", ref, image)
            if docker:
                await cli.run("rmi", ref)  # the image keeps the task's name; only the registry's goes
            else:
                await cli.run("untag", image, ref)
    except NodeError:
        raise  # the node's fault, not this image's
    except InfraError as exc:
        return str(exc)
    return ""


class NodeImageStore:
    """A node's image store through its podman or docker CLI; pulls from ``registry`` when given."""

    def __init__(self, cli: ContainerCli, registry: Registry | None = None) -> None:
        self.cli = cli
        self.registry = registry

    @property
    def node(self) -> str:
        return self.cli.node.name

    async def names(self) -> dict[str, str]:
        return await list_images(self.cli)

    async def exists(self, image: str) -> bool:
        if not self.cli.ready:
            await self.cli.prepare()
        if is_docker(self.cli):  # no `image exists`: inspect exits 1 for a missing image and for a daemon it lost
            out = await self.cli.run("image", "inspect", "--format", "{{.Id}}", qualify_image(image), check=False)
            gone = out.exit_code != 0 and any(s in out.stderr.decode(errors="replace").lower() for s in _GONE)
            if out.exit_code == 0 or gone:
                return not gone
        else:
            out = await self.cli.run("image", "exists", qualify_image(image), check=False)
            if out.exit_code in (0, 1):
                return out.exit_code == 0
        raise InfraError(f"node {self.node!r}: cannot tell whether {image} is there: "
                         f"{cli_error(out.stderr.decode(errors='replace'))}")

    async def pull(self, image: str) -> None:
        error = await pull_image(self.cli, image, self.registry)
        if error:
            source = f"from {self.registry.url}" if self.registry is not None else "under its own name"
            hint = ("" if self.registry is not None else
                    " -- hint: set env_pool.registry to a registry the nodes reach (`swectl image push` fills it), "
                    "or fill the nodes first with `swectl image sync`")
            raise ImagePullError(f"node {self.node!r}: pulling {image} {source} failed: {error}{hint}")

    async def remove(self, image: str) -> str:
        out = await self.cli.run("rmi", qualify_image(image), check=False)
        if out.exit_code == 0:
            return ""
        error = cli_error(out.stderr.decode(errors="replace"))
        return "" if any(s in error.lower() for s in _GONE) else error

    async def disk_bytes(self) -> int:
        docker = is_docker(self.cli)
        out = await self.cli.run("system", "df", "--format", "{{.Type}}|{{.Size}}" if docker else
                                 "{{.Type}}|{{.RawSize}}")
        for line in out.stdout.decode().splitlines():
            kind, _, size = line.partition("|")
            if kind.strip() != "Images":
                continue
            if size.strip().isdigit():
                return int(size)
            if docker:
                try:
                    return docker_bytes(size)
                except ValueError:
                    break
        raise InfraError(f"node {self.node!r}: `{self.cli.binary} system df` did not say how much disk the images "
                         f"take: {out.stdout.decode(errors='replace')[-300:]!r}")


def store_for(backend: object, registry: Registry | None) -> NodeImageStore | None:
    """The image store of a sandbox backend: its node's podman store (the podman and namespace backends) or its
    dockerd's (the docker backend); None for a backend without a container CLI."""
    cli = getattr(backend, "cli", None)
    return NodeImageStore(cli, registry) if isinstance(cli, ContainerCli) else None
