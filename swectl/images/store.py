"""One node's image store, as the env pool and `swectl image sync` use it: the images it holds (by the name the tasks
use), whether it holds one, a pull, a removal, and the disk its images take.

A pull goes through the registry the fleet uses when one is given (``registry.ref(image)``, then tagged back with the
name the tasks use and the registry's name dropped), else under the image's own name (Docker Hub's official images).
An image counts as present only once its pull completed and was tagged.

A pull runs with a temporary folder of its own, locked while it runs and removed after: a podman pull that is
stopped leaves its downloads there, and ``ContainerCli.sweep_pull_leftovers`` removes them
(remote/nodes/pull_folders.py says why).

A removal is a plain ``rmi``: never forced,
so an image a container still uses (the pool's or anyone's) stays and the removal says why. The disk is what the
store's images take together, each shared layer once (``podman system df``).

Over a node's podman CLI (remote/nodes/podman.py; PodmanApi is one too) or docker CLI (a Docker node: its daemon's
image store). Where they differ (whether an image is there, a pull's TLS flag and hints, dropping a second name,
the disk, stopped pulls' leftovers) is a ``ContainerCli`` method of each. Every call may raise InfraError
(NodeError when the node is lost); the caller bounds the wait.
"""

from __future__ import annotations

from typing import Protocol

from swectl.errors import InfraError, NodeError
from swectl.images.registry import Registry, normal_name
from swectl.remote.nodes.backends import IMAGE_STORE_BACKENDS
from swectl.remote.nodes.podman import ContainerCli, last_error_line, qualify_image
from swectl.remote.nodes.pull_folders import in_own_folder
from swectl.sandbox import SandboxBackend

# podman's messages when the registry answered that it has no such image
NOT_IN_REGISTRY = ("manifest unknown", "name unknown")
_GONE = ("image not known", "no such image")


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


async def list_images(cli: ContainerCli) -> dict[str, str]:
    """The node's images: normal name -> id (``sha256:...``); untagged ones left out. Prepares ``cli`` if needed."""
    await cli.ensure_ready()
    out = await cli.run("images", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}")
    names: dict[str, str] = {}
    for line in out.stdout.decode().splitlines():
        name, _, image_id = line.strip().partition(" ")
        if name and "<none>" not in name:
            names[normal_name(name)] = image_id if image_id.startswith("sha256:") else f"sha256:{image_id}"
    return names


async def pull_image(cli: ContainerCli, image: str, registry: Registry | None) -> str:
    """Pull ``image`` onto the node (see the module docstring): "" once it is there under its name, else what went
    wrong (``not in URL: ...`` when the registry lacks it). NodeError when the node is lost."""
    ref = registry.ref(image) if registry is not None else qualify_image(image)
    try:
        await cli.ensure_ready()
        flags = cli.pull_flags(registry.tls_args()) if registry is not None else []
        out = await cli.node.run(in_own_folder(cli.argv("pull", *flags, ref)))
        if out.exit_code != 0:
            error = last_error_line(out.stderr.decode(errors="replace"))
            if registry is not None:
                if any(s in error.lower() for s in NOT_IN_REGISTRY):
                    error = f"not in {registry.url}: {error}"
                hint = cli.pull_hint(error, registry_host=registry.host, registry_url=registry.url)
                error += f" -- hint: {hint}" if hint else ""
            return error
        if normal_name(ref) != normal_name(image):
            await cli.run("tag", ref, image)
            await cli.drop_name(image, ref)  # the image keeps the task's name; only the registry's goes
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
        await self.cli.ensure_ready()
        return await self.cli.image_exists(image)

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
        error = last_error_line(out.stderr.decode(errors="replace"))
        return "" if any(s in error.lower() for s in _GONE) else error

    async def disk_bytes(self) -> int:
        await self.cli.ensure_ready()
        return await self.cli.images_disk_bytes()


def store_for(backend: SandboxBackend, registry: Registry | None) -> NodeImageStore | None:
    """The image store of a sandbox backend: its node's podman store (the podman and namespace backends) or its
    dockerd's (the docker backend); None for a backend that keeps none (remote/nodes/backends.py says which do)."""
    return NodeImageStore(backend.cli, registry) if isinstance(backend, IMAGE_STORE_BACKENDS) else None
