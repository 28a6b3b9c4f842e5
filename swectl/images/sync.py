"""`swectl image sync`: make every image of a task set present on the nodes, each node pulling from a registry (the
fleet's, or the controller's own: from_controller.py, where each node reaches it at an address of its own,
``SyncTarget.registry``).

For each node (the env pool's nodes of the config): list its images (one ``podman images``), then pull each one
it lacks from the registry (``podman pull REF``, ``podman tag REF NAME``, ``podman untag`` the registry name). A
Docker node (``sandbox.backend = "docker"``) goes through its daemon the same way (``docker pull``, ``tag``, ``rmi``
of the registry's name: store.py); its daemon reaches a plain-HTTP registry only on 127.0.0.0/8 or when its
``insecure-registries`` lists it. An
image counts as present under the name the tasks use only once its pull completed and it was tagged (and, where the
registry's copy is known, only when its id is that copy's: an image rebuilt since is pulled again), so a pull
that fails, times out or is interrupted leaves nothing that a later sync or an episode takes as present (podman
drops the layers of a pull it did not finish; the next sync pulls that image again). A second sync finds
everything present and moves nothing.

Concurrency: at most ``per_node`` pulls at once on one node and ``total`` across the fleet, one pull per (node,
image). Where the images' layers are known (read from the registry by the controller, ``image_layers``), a pull
waits while another pull on the same node is fetching a layer it needs too, so an environment layer moves once
per node and each instance image then costs its own layer. Every wait is bounded: listing a node's images
(``check_timeout_s``), each pull and the wait for a shared layer before it (``pull_timeout_s``; a pull holds the
slots others wait for, so those waits are bounded too).

Disk: where the layers are known, the node's free disk (its store's file system) is read once, and a pull that
would leave less than ``min_free_gb`` (its layers' stored sizes times ``UNPACKED_PER_STORED``, less what the node's
earlier pulls are expected to take) fails without starting, naming the numbers.

Before its pulls, a node's downloads left by stopped pulls are removed (``ContainerCli.sweep_pull_leftovers``; a
docker daemon drops those of a stopped pull itself).

Faults: a node that cannot be reached, or is lost during the sync, is one error for that node; a registry the node
cannot reach (refused, no route, timed out, TLS spoken to a plain-HTTP registry) stops that node's pulls with one
error that names the registry, its missing images reported as not pulled; an image the registry does not have is
listed once, before any pull, and the rest goes on. Other nodes are not affected by one node's faults.

Bytes: a pull's bytes are the stored (compressed) sizes of the layers of the image that the node lacked (by diff
id, as podman reuses them); unknown (None) where the controller could not read the manifests.

Images still on their way into the registry (a sync from the controller pushes while the nodes pull): with a
``gate``, a node's pull of an image first waits until the gate says the image is in the registry (or why it will not
be: the pull then fails with that reason, holding no slot while it waits), and its manifest is read then, once per
sync; ``ids`` (each image's id, known before it is in the registry) tell a node's stale copy from the right one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import anyio
import httpx
import msgspec

from swectl.errors import InfraError, NodeError
from swectl.images.registry import (
    ImageLayers,
    NotInRegistryError,
    Registry,
    RegistryError,
    image_layers,
    normal_name,
)
from swectl.images.store import list_images, pull_image
from swectl.remote.nodes.podman import ContainerCli

FORMAT_VERSION = 1
# A layer on disk against its stored (gzip) size, for the disk check: source trees, wheels and binaries compress
# about 2-3x; the check errs on the safe side.
UNPACKED_PER_STORED = 3.0
MANIFEST_READS = 8  # manifests the controller reads from the registry at once
# podman's messages when it cannot talk to the registry at all (as opposed to a missing or broken image)
_UNREACHABLE = ("pinging container registry", "connection refused", "no route to host", "i/o timeout",
                "network is unreachable", "no such host", "connection reset", "server gave http response to https")
Say = Callable[[str], None]


class SyncOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How many pulls at once, and the time bounds."""

    per_node: int = 2  # pulls at once on one node
    total: int = 8  # pulls at once across the fleet
    check_timeout_s: float = 120.0  # connecting to a node and listing its images
    pull_timeout_s: float = 1800.0  # one pull (and the wait for a layer another pull is fetching)
    manifest_timeout_s: float = 60.0  # the controller reading every image's manifest from the registry
    # Free disk a node keeps (GB): a pull that would leave less (by the estimate below) is not started.
    min_free_gb: float = 2.0

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.total < 1:
            raise ValueError(f"pulls at once must be at least 1 (per node {self.per_node}, total {self.total})")


class Pull(msgspec.Struct, frozen=True, kw_only=True):
    """One image pulled, or not, on one node."""

    image: str
    ok: bool
    seconds: float = 0.0
    bytes: int | None = None  # the stored sizes of the layers the node lacked; None when unknown
    error: str = ""


class NodeSync(msgspec.Struct, kw_only=True):
    """What a sync did on one node."""

    node: str
    wanted: int = 0  # images of the task set
    present_before: list[str] = []
    pulls: list[Pull] = []
    error: str = ""  # the node's one error: node unreachable, registry unreachable from it
    seconds: float = 0.0
    # The bytes the controller really sent the node (a sync from the controller; None otherwise)
    sent_bytes: int | None = None

    @property
    def pulled(self) -> list[str]:
        return [p.image for p in self.pulls if p.ok]

    @property
    def failed(self) -> list[Pull]:
        return [p for p in self.pulls if not p.ok]

    @property
    def bytes(self) -> int | None:
        sizes = [p.bytes for p in self.pulls if p.ok]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    @property
    def ok(self) -> bool:
        return not self.error and not self.failed and len(self.present_before) + len(self.pulled) == self.wanted


class SyncReport(msgspec.Struct, kw_only=True):
    """What a sync did: per node, and the images the registry lacks (``--json`` prints it)."""

    format_version: int = FORMAT_VERSION
    registry: str
    images: list[str]
    not_in_registry: dict[str, str] = {}  # image -> why, found before any pull (from the controller: not on it)
    nodes: list[NodeSync] = []
    seconds: float = 0.0
    error: str = ""  # a fault of the sync as a whole (the controller's registry stopped during it)

    @property
    def ok(self) -> bool:
        return not self.error and not self.not_in_registry and all(n.ok for n in self.nodes)


class SyncTarget(msgspec.Struct, frozen=True):
    """A node to sync: its name and its image store's CLI (podman, or docker on a Docker node: its daemon's store;
    ``prepare`` runs here if it has not); ``registry``: the registry as this node reaches it, when not at the sync's
    address (the controller's, through the node's SSH forward)."""

    name: str
    cli: ContainerCli
    registry: Registry | None = None


class ImageGate(Protocol):
    """Images that reach the registry during the sync: ``wait(image)`` returns "" once ``image`` is there, else why it
    will not be. Each wait ends by itself (the pusher bounds each push and opens every gate when it stops)."""

    async def wait(self, image: str) -> str: ...


class _Manifests:
    """The registry's layers of each image, read when first asked for (once per sync, every node's pulls sharing the
    read); None where they cannot be read (the pull then goes on with bytes unknown)."""

    def __init__(self, registry: Registry, client: httpx.AsyncClient | None, timeout_s: float,
                 known: dict[str, ImageLayers]) -> None:
        self.registry = registry
        self.client = client
        self.timeout_s = timeout_s
        self.known = known
        self._reads: dict[str, anyio.Event] = {}

    async def get(self, image: str) -> ImageLayers | None:
        if image in self.known or self.client is None:
            return self.known.get(image)
        if image in self._reads:
            await self._reads[image].wait()
            return self.known.get(image)
        done = self._reads[image] = anyio.Event()
        try:
            with anyio.move_on_after(self.timeout_s):
                self.known[image] = await image_layers(self.client, self.registry, image)
        except RegistryError:
            pass
        finally:
            done.set()
        return self.known.get(image)


class _NodeState:
    """One node's pulls in flight: the layers it has (diff ids) and the layers being fetched, each with the event
    its pull sets when it ends."""

    def __init__(self, layers: set[str], free_gb: float | None) -> None:
        self.have = layers
        self.free_gb = free_gb  # the store's free disk at the start, less what the pulls since are expected to take
        self.fetching: dict[str, anyio.Event] = {}
        # A fault that stops every pull of the node (registry unreachable from it, node lost): the node's one error,
        # and what its images not pulled say.
        self.fault = ""
        self.fault_note = ""
        self.done = 0

    def stop(self, fault: str, note: str, scope: anyio.CancelScope) -> bool:
        """Stop the node's pulls for ``fault`` (the first fault wins); whether this call was the first."""
        scope.cancel()
        if self.fault:
            return False
        self.fault, self.fault_note = fault, note
        return True


async def read_layers(registry: Registry, images: Sequence[str], *, timeout_s: float,
                      client: httpx.AsyncClient | None = None) -> tuple[dict[str, ImageLayers], dict[str, str], str]:
    """The registry's layers of each image, the images it lacks (-> why), and a note when the controller cannot
    read them at all ("": read). Bounded by ``timeout_s`` in all."""
    layers: dict[str, ImageLayers] = {}
    missing: dict[str, str] = {}
    failures: list[str] = []
    own = client is None
    client = client if client is not None else httpx.AsyncClient(timeout=10.0, verify=not registry.plain_http)
    limiter = anyio.CapacityLimiter(MANIFEST_READS)

    async def read(image: str, scope: anyio.CancelScope) -> None:
        async with limiter:
            try:
                layers[image] = await image_layers(client, registry, image)
            except NotInRegistryError as exc:
                missing[image] = str(exc)
            except RegistryError as exc:
                failures.append(str(exc))
                scope.cancel()

    try:
        with anyio.fail_after(timeout_s):
            async with anyio.create_task_group() as tg:
                for image in images:
                    tg.start_soon(read, image, tg.cancel_scope, name=f"manifest of {image}")
    except TimeoutError:
        return {}, {}, f"reading the manifests from {registry.url} took more than {timeout_s:g}s"
    finally:
        if own:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await client.aclose()
    if failures:
        return {}, {}, failures[0]
    return layers, missing, ""


async def sync_images(targets: Sequence[SyncTarget], images: Sequence[str], registry: Registry, *,
                      options: SyncOptions | None = None, say: Say = print,
                      client: httpx.AsyncClient | None = None, gate: ImageGate | None = None,
                      ids: Mapping[str, str] | None = None) -> SyncReport:
    """Pull onto every target the images of ``images`` it lacks, from ``registry``; the report says per node what was
    there, what was pulled, what failed and why (see the module docstring). ``gate``: the images reach the registry
    during the sync (their manifests are read as they do); ``ids``: each image's id (``sha256:...``) when known."""
    options = options or SyncOptions()
    start = time.monotonic()
    wanted = list(dict.fromkeys(normal_name(i) for i in images))
    layers: dict[str, ImageLayers] = {}
    not_in_registry: dict[str, str] = {}
    own_client = None
    if gate is None:
        layers, not_in_registry, note = await read_layers(registry, wanted, timeout_s=options.manifest_timeout_s,
                                                          client=client)
        if note:
            say(f"layer sizes unknown (bytes not counted): {note}")
        for why in not_in_registry.values():
            say(f"not pulled anywhere: {why}")
    elif client is None:
        client = own_client = httpx.AsyncClient(timeout=10.0, verify=not registry.plain_http)
    manifests = _Manifests(registry, client if gate is not None else None, options.manifest_timeout_s, layers)
    report = SyncReport(registry=registry.url, images=wanted, not_in_registry=not_in_registry)
    fleet = anyio.CapacityLimiter(options.total)
    results: dict[str, NodeSync] = {}
    pullable = [i for i in wanted if i not in not_in_registry]
    known_ids = dict(ids or {})
    try:
        async with anyio.create_task_group() as tg:
            for target in targets:
                node = _Node(target, wanted, pullable, registry, manifests, gate, known_ids, fleet, options, say,
                             results)
                tg.start_soon(node.sync, name=f"image sync {target.name}")
    finally:
        if own_client is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await own_client.aclose()
    report.nodes = [results[t.name] for t in targets]
    report.seconds = time.monotonic() - start
    return report


async def _node_images(target: SyncTarget, with_layers: bool) -> tuple[dict[str, str], set[str]]:
    """The node's images (name -> id, ``sha256:...``) and, ``with_layers``, the diff ids of their layers."""
    cli = target.cli
    names = await list_images(cli)
    if not with_layers or not names:
        return names, set()
    out = await cli.run("image", "inspect", "--format", "{{range .RootFS.Layers}}{{println .}}{{end}}",
                        *dict.fromkeys(names.values()))
    return names, set(out.stdout.decode().split())


async def _free_gb(cli: ContainerCli) -> float | None:
    """The free disk of the node's image store (GB); None when the node does not say (no disk check then)."""
    try:
        return await cli.free_disk_gb()
    except (InfraError, ValueError, IndexError):
        return None


def _is_present(image: str, names: dict[str, str], layers: dict[str, ImageLayers], ids: dict[str, str]) -> bool:
    """Whether the node has ``image``: by name, and, where the registry's copy is known (its config digest, or the id
    the caller gave), the same image; a different image of that name (rebuilt since) is pulled again."""
    if image not in names:
        return False
    known = layers.get(image)
    expected = known.config_digest if known is not None else ids.get(image, "")
    return not expected or names[image] == expected


class _Node:
    """One node's part of a sync: its census, then its pulls (bounded per node and across the fleet)."""

    def __init__(self, target: SyncTarget, wanted: list[str], pullable: list[str], registry: Registry,
                 manifests: _Manifests, gate: ImageGate | None, ids: dict[str, str], fleet: anyio.CapacityLimiter,
                 options: SyncOptions, say: Say, results: dict[str, NodeSync]) -> None:
        self.target = target
        self.name = target.name
        self.wanted = wanted
        self.pullable = pullable
        self.registry = target.registry or registry
        self.manifests = manifests
        self.gate = gate
        self.ids = ids
        self.fleet = fleet
        self.options = options
        self.say = say
        self.result = results[target.name] = NodeSync(node=target.name, wanted=len(wanted))
        self.start = time.monotonic()
        self.slots = anyio.CapacityLimiter(options.per_node)
        self.count = 0

    async def sync(self) -> None:
        result, options = self.result, self.options
        with_layers = bool(self.manifests.known) or self.gate is not None
        try:
            with anyio.fail_after(options.check_timeout_s):
                present, have = await _node_images(self.target, with_layers)
                free_gb = await _free_gb(self.target.cli) if with_layers else None
                swept, swept_kb = await self.target.cli.sweep_pull_leftovers()
        except TimeoutError:
            result.error = f"listing its images took more than {options.check_timeout_s:g}s"
        except InfraError as exc:
            result.error = str(exc)
        if result.error:
            self.say(f"{self.name}: {result.error}")
            result.seconds = time.monotonic() - self.start
            return
        if swept:
            self.say(f"{self.name}: removed {swept} download(s) of stopped pulls ({human_bytes(swept_kb * 1024)})")
        known = self.manifests.known
        result.present_before = [i for i in self.wanted if _is_present(i, present, known, self.ids)]
        missing = [i for i in self.pullable if not _is_present(i, present, known, self.ids)]
        stale = [i for i in missing if i in present]
        if stale:
            self.say(f"{self.name}: {len(stale)} image(s) differ from the registry's and are pulled again: "
                     f"{', '.join(stale)}")
        self.say(f"{self.name}: {len(result.present_before)}/{len(self.wanted)} images present, {len(missing)} to pull")
        self.count = len(missing)
        state = _NodeState(have, free_gb)
        async with anyio.create_task_group() as tg:
            for image in missing:
                tg.start_soon(self._pull_one, image, state, tg.cancel_scope, name=f"pull {image} on {self.name}")
        if state.fault:
            # one error for the node: its pulls that met the same fault, and those never started, say only that
            result.error = state.fault
            result.pulls = [p for p in result.pulls if p.ok or not _unreachable(p.error)]
            tried = {p.image for p in result.pulls}
            result.pulls += [Pull(image=i, ok=False, error=f"not pulled: {state.fault_note}") for i in missing
                             if i not in tried]
        result.seconds = time.monotonic() - self.start

    async def _layers(self, image: str) -> tuple[ImageLayers | None, str]:
        """The image's layers (None: unknown), once it is in the registry; else why it will not be there."""
        if self.gate is not None:
            why = await self.gate.wait(image)
            if why:
                return None, why
        return await self.manifests.get(image), ""

    async def _pull_one(self, image: str, state: _NodeState, node_scope: anyio.CancelScope) -> None:
        options, say = self.options, self.say
        image_layers, why = await self._layers(image)
        if why:
            self._done(Pull(image=image, ok=False, error=why), state)
            return
        async with self.slots, self.fleet:
            lacking: dict[str, int] = {}
            mine = anyio.Event()
            try:
                with anyio.fail_after(options.pull_timeout_s):
                    if image_layers is not None:
                        lacking = await _claim_layers(image_layers, state, mine)
                    if state.fault:  # found while this pull waited: the node's pulls stop
                        return
                    short = _short_of_disk(state, sum(lacking.values()), options.min_free_gb)
                    pull = (Pull(image=image, ok=False, error=short) if short
                            else await _pull(self.target.cli, image, self.registry))
            except NodeError as exc:
                if state.stop(str(exc), "the node was lost", node_scope):
                    say(f"{self.name}: {exc}")
                return
            except TimeoutError:
                pull = Pull(image=image, ok=False, error=f"pull took more than {options.pull_timeout_s:g}s")
            finally:
                for diff_id in lacking:
                    state.fetching.pop(diff_id, None)
                mine.set()
            if pull.ok:
                state.have.update(lacking)
                pull = msgspec.structs.replace(pull, bytes=sum(lacking.values()) if image_layers is not None else None)
            if not pull.ok and _unreachable(pull.error):
                self.result.pulls.append(pull)
                state.done += 1
                fault = f"registry {self.registry.url} is unreachable from the node: {pull.error}"
                if state.stop(fault, "the registry is unreachable from the node", node_scope):
                    say(f"{self.name}: {fault}")
                return
            self._done(pull, state)

    def _done(self, pull: Pull, state: _NodeState) -> None:
        self.result.pulls.append(pull)
        state.done += 1
        if pull.ok:
            elapsed = time.monotonic() - self.start
            eta = elapsed / state.done * (self.count - state.done)
            self.say(f"{self.name}: [{state.done}/{self.count}] pulled {pull.image} in {pull.seconds:.1f}s"
                     f"{'' if pull.bytes is None else ', ' + human_bytes(pull.bytes)}, eta {eta:.0f}s")
        else:
            self.say(f"{self.name}: [{state.done}/{self.count}] FAILED {pull.image}: {pull.error}")


def _short_of_disk(state: _NodeState, stored_bytes: int, min_free_gb: float) -> str:
    """Why a pull of layers of ``stored_bytes`` must not start on the node ("": it may); books its disk when it may."""
    if state.free_gb is None:
        return ""
    need_gb = stored_bytes * UNPACKED_PER_STORED / 1e9
    if state.free_gb - need_gb < min_free_gb:
        return (f"not enough disk on the node: about {need_gb:.1f} GB needed, {state.free_gb:.1f} GB free, "
                f"{min_free_gb:g} GB to keep")
    state.free_gb -= need_gb
    return ""


async def _claim_layers(image: ImageLayers, state: _NodeState, mine: anyio.Event) -> dict[str, int]:
    """Wait until no other pull on the node fetches a layer this image lacks, then claim the lacking ones (all at
    once, so two pulls never wait on each other); their diff ids -> stored sizes."""
    while True:
        lacking = {layer.diff_id: layer.size for layer in image.layers if layer.diff_id not in state.have}
        busy = [state.fetching[d] for d in lacking if d in state.fetching]
        if not busy:
            break
        await busy[0].wait()
    for diff_id in lacking:
        state.fetching[diff_id] = mine
    return lacking


async def _pull(cli: ContainerCli, image: str, registry: Registry) -> Pull:
    start = time.monotonic()
    error = await pull_image(cli, image, registry)
    return Pull(image=image, ok=not error, seconds=time.monotonic() - start, error=error)


def _unreachable(error: str) -> bool:
    return any(s in error.lower() for s in _UNREACHABLE)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def format_report(report: SyncReport) -> str:
    """The final table: one row per node (then its errors and failed images, one line each)."""
    sent = any(n.sent_bytes is not None for n in report.nodes)
    header = ("node", "present before", "pulled", "failed", "bytes", *(("sent",) if sent else ()), "seconds")
    rows = [(n.node, f"{len(n.present_before)}/{n.wanted}", str(len(n.pulled)), str(len(n.failed)),
             human_bytes(n.bytes) if n.pulled else "0 B", *((human_bytes(n.sent_bytes or 0),) if sent else ()),
             f"{n.seconds:.1f}") for n in report.nodes]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    for node in report.nodes:
        if node.error:
            lines.append(f"{node.node}: ERROR {node.error}")
        for pull in node.failed:
            if not node.error or not pull.error.startswith("not pulled:"):
                lines.append(f"{node.node}: {pull.image}: {pull.error}")
    for image, why in report.not_in_registry.items():
        lines.append(f"{image}: {why}")
    if report.error:
        lines.append(f"ERROR {report.error}")
    return "\n".join(lines)
