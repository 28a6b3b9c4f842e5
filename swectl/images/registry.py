"""A registry the fleet's images go through: its URL, the name an image has there, and its layers as it stores them.

``--registry URL`` (``swectl image push|sync``): ``http://HOST:PORT[/PREFIX]`` is a plain-HTTP registry (podman's
``--tls-verify=false``: for a registry on a private network or in tests, never across an untrusted one);
``https://HOST...`` or a bare ``HOST...`` speaks TLS with verified certificates.

An image keeps its path and tag and loses its own registry host: ``localhost/swectl-inst.x:latest`` is
``HOST:PORT/PREFIX/swectl-inst.x:latest`` there, ``swebench/sweb.eval.x86_64.y:latest`` (Docker Hub's)
``HOST:PORT/PREFIX/swebench/sweb.eval.x86_64.y:latest``. A node that pulls it tags it back with the name the tasks use.

``image_layers`` reads an image's manifest and config over the registry's HTTP API (v2): each layer's digest,
its size as stored (compressed) and its diff id (the uncompressed digest a node's ``podman image inspect``
shows), so that a sync knows which layers a node lacks and how many bytes it moves; and its config's digest, which
is the id podman gives the image, so that a sync knows whether a node's image of that name is the registry's.
"""

from __future__ import annotations

import re

import httpx
import msgspec

from swectl.errors import ConfigError, InfraError
from swectl.remote.nodes.podman import qualify_image

MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
_HOST = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:]+\](:[0-9]{1,5})?$")
_PATH = re.compile(r"^[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*$")


class Registry(msgspec.Struct, frozen=True):
    """Where images go: ``host`` (``HOST[:PORT]``), an optional path ``prefix``, plain HTTP or TLS."""

    host: str
    prefix: str = ""
    plain_http: bool = False

    @property
    def url(self) -> str:
        return f"{'http' if self.plain_http else 'https'}://{self.host}" + (f"/{self.prefix}" if self.prefix else "")

    def tls_args(self) -> list[str]:
        """podman flags for this registry (``push``, ``pull``)."""
        return ["--tls-verify=false"] if self.plain_http else []

    def ref(self, image: str) -> str:
        """The name ``image`` has in this registry (see the module docstring)."""
        path = image_path(image)
        return f"{self.host}/{self.prefix}/{path}" if self.prefix else f"{self.host}/{path}"


def parse_registry(url: str, knob: str = "--registry") -> Registry:
    """``http://HOST:PORT[/PREFIX]``, ``https://...`` or ``HOST...`` as a Registry; ConfigError naming ``knob``."""
    text = url.strip().rstrip("/")
    plain = text.startswith("http://")
    if "://" in text and not text.startswith(("http://", "https://")):
        raise ConfigError(f"{knob} {url!r}: the scheme must be http:// (plain HTTP) or https:// (TLS)")
    rest = text.split("://", 1)[-1]
    host, _, prefix = rest.partition("/")
    if not host or not _HOST.match(host):
        raise ConfigError(f"{knob} {url!r}: expected [http://|https://]HOST[:PORT][/PREFIX], e.g. http://10.0.0.5:5000")
    if prefix and not _PATH.match(prefix):
        raise ConfigError(f"{knob} {url!r}: the path prefix {prefix!r} must be lowercase [a-z0-9._-] parts joined by /")
    return Registry(host=host, prefix=prefix, plain_http=plain)


def normal_name(image: str) -> str:
    """``image`` as podman lists it: qualified (``qualify_image``), with ``:latest`` when it names no tag."""
    name = qualify_image(image)
    if "@" not in name and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name


def image_path(image: str) -> str:
    """``image``'s path and tag without its registry host (``:latest`` when it names no tag)."""
    name = normal_name(image)
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        name = rest
    return name


class Layer(msgspec.Struct, frozen=True):
    """One layer of an image as the registry stores it."""

    digest: str  # as the registry stores it (compressed)
    size: int  # bytes as stored: what a pull moves
    diff_id: str  # the uncompressed digest (podman image inspect's RootFS.Layers)


class ImageLayers(msgspec.Struct, frozen=True):
    """An image in the registry: its manifest's layers, base first."""

    image: str  # the name the tasks use
    layers: list[Layer]
    # The digest of its config blob: the image id podman gives it (built here, or pulled), "sha256:..."
    config_digest: str = ""

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)


class _Descriptor(msgspec.Struct):
    digest: str
    size: int = 0


class _Manifest(msgspec.Struct):
    config: _Descriptor
    layers: list[_Descriptor] = []


class _RootFs(msgspec.Struct):
    diff_ids: list[str] = []


class _Config(msgspec.Struct):
    rootfs: _RootFs = msgspec.field(default_factory=_RootFs)


class RegistryError(InfraError):
    """The registry could not be asked (down, refused, an answer that is not a manifest), or the controller's own
    registry cannot start (its binary missing, its cache in use)."""


class NotInRegistryError(RegistryError):
    """The registry answered: it has no such image."""


def _repo_and_reference(registry: Registry, image: str) -> tuple[str, str]:
    path = image_path(image)
    if "@" in path:
        repo, _, reference = path.partition("@")
    else:
        repo, _, reference = path.rpartition(":")
    return (f"{registry.prefix}/{repo}" if registry.prefix else repo), reference


async def image_layers(client: httpx.AsyncClient, registry: Registry, image: str) -> ImageLayers:
    """``image``'s layers as ``registry`` stores it; RegistryError when the registry does not answer or lacks it.
    The caller bounds the wait (its cancel scope)."""
    repo, reference = _repo_and_reference(registry, image)
    base = f"{'http' if registry.plain_http else 'https'}://{registry.host}/v2/{repo}"
    try:
        response = await client.get(f"{base}/manifests/{reference}", headers={"Accept": ", ".join(MANIFEST_TYPES)})
        if response.status_code == 404:
            raise NotInRegistryError(f"{registry.url} has no image {image_path(image)} (push it: swectl image push)")
        response.raise_for_status()
        manifest = msgspec.json.decode(response.content, type=_Manifest)
        response = await client.get(f"{base}/blobs/{manifest.config.digest}")
        response.raise_for_status()
        config = msgspec.json.decode(response.content, type=_Config)
    except httpx.HTTPError as exc:
        raise RegistryError(f"{registry.url}: cannot read the manifest of {image_path(image)}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise RegistryError(f"{registry.url}: {image_path(image)}: not a single-platform image manifest: {exc}") \
            from exc
    if len(config.rootfs.diff_ids) != len(manifest.layers):
        raise RegistryError(f"{registry.url}: {image_path(image)}: {len(manifest.layers)} layers but "
                            f"{len(config.rootfs.diff_ids)} diff ids in its config")
    layers = [Layer(digest=d.digest, size=d.size, diff_id=diff)
              for d, diff in zip(manifest.layers, config.rootfs.diff_ids, strict=True)]
    return ImageLayers(image=image, layers=layers, config_digest=manifest.config.digest)
