"""`swectl image sync` without ``--registry``: the controller sends the images itself, for fleets whose nodes reach no
registry. Layer by layer, as a registry serves them: a thin instance image costs only its own layer on a node that
holds its environment layers.

1. Census: the controller lists its own images (name -> id) and each node its own (bounded by ``check_timeout_s``).
   A node lacks an image when it holds none of that name, or another image of that name (one rebuilt here since).
   An image the controller lacks as well is listed once, where a node lacks it. Nothing lacking: done, no registry.
2. The controller's registry (controller_registry.py, on the cache folder) starts. Each image some node lacks is
   pushed to it, the environment image under an instance image first, one at a time, each bounded by
   ``pull_timeout_s``, unless the registry holds that very image already (its config digest is the image id); podman
   sends only the layers the registry lacks. A push does not start when the cache's disk has less than
   ``min_free_gb`` free.
3. While the pushes go on, each SSH node gets a port on its loopback forwarded over its SSH connection to a relay of
   its own (relay.py) in front of the registry; a local node reaches the registry directly (and, sharing the
   controller's store, lacks nothing). The pulls are sync.py's: bounded per node and across the fleet, a shared layer
   fetched once per node, a disk check, faults per node, each node pulling from ``127.0.0.1:ITS_PORT`` over plain
   HTTP. A node's pull of an image starts as soon as that image's push ended (sync.py's ``gate``), not after every
   push; an image whose push failed is a failed pull that says why.
4. The report is sync.py's, with the bytes the controller really sent each node (``sent_bytes``) and, when the
   registry stopped during the sync, ``error`` saying so.

Stopped anywhere (Ctrl-C, SIGKILL, a node or the registry lost), a sync leaves no image half there on a node: presence
is by name, given only once a pull completed and was tagged. Run again, it pushes only what the registry's cache
lacks and pulls only what the nodes lack. A pull that completed after its sync was stopped leaves the image under the
forwarded registry's name (``127.0.0.1:PORT/...``, a port that the next sync will not use): the next sync pulls that
image through its own forward (every layer already there) and then removes those names (``rmi``, never forced).
podman keeps the layers a stopped pull had committed and reuses them; the layer it was downloading starts over
(podman 4.3 does not resume a layer; the next sync removes its partial download).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import anyio
import httpx

from swectl.errors import InfraError
from swectl.images.controller_registry import RunningRegistry, controller_registry
from swectl.images.push import PushOutcome, push_with
from swectl.images.registry import Registry, RegistryError, image_layers, image_path, normal_name
from swectl.images.relay import ByteRelay
from swectl.images.store import list_images
from swectl.images.sync import NodeSync, Pull, Say, SyncOptions, SyncReport, SyncTarget, sync_images
from swectl.remote.nodes.podman import PodmanCli

CENSUS_AT_ONCE = 16  # nodes listed at once
NOT_HERE = "not on the controller: build it here (swectl image build) or pull it here first"
RegistryStarter = Callable[[Path], contextlib.AbstractAsyncContextManager[RunningRegistry]]


@runtime_checkable
class ForwardsToController(Protocol):
    """A node that can forward a port of its loopback to a unix socket of the controller (SshNode)."""

    async def forward_to_local_path(self, local_path: str) -> tuple[int, Callable[[], None]]: ...


async def sync_from_controller(targets: Sequence[SyncTarget], images: Sequence[str], *, controller: PodmanCli,
                               cache: Path, options: SyncOptions | None = None, say: Say = print,
                               start_registry: RegistryStarter = controller_registry,
                               client: httpx.AsyncClient | None = None, overlap: bool = True) -> SyncReport:
    """Make every image of ``images`` present on every target, sent from the controller (see the module docstring).
    RegistryError when the controller's registry cannot start (its binary missing: the message names the package).
    ``client``: how the controller reads the registry's manifests (tests give a scripted one). ``overlap=False``:
    every push first, then the pulls (the order before the overlap, kept as the bench's baseline; docs/results.md,
    "Figures the code relies on")."""
    options = options or SyncOptions()
    start = time.monotonic()
    wanted = list(dict.fromkeys(normal_name(i) for i in images))
    try:
        with anyio.fail_after(options.check_timeout_s):
            here = await list_images(controller)
    except TimeoutError:
        raise InfraError(f"listing the controller's own images took more than {options.check_timeout_s:g}s") from None
    census = await _census(targets, options)
    report = SyncReport(registry=f"the controller (cache {cache})", images=wanted)
    lacking: dict[str, list[str]] = {}
    for target in targets:
        names = census[target.name]
        if isinstance(names, dict):
            lacking[target.name] = [i for i in wanted if names.get(i) is None or (i in here and names[i] != here[i])]
    report.not_in_registry = {i: NOT_HERE for i in wanted if i not in here and any(i in x for x in lacking.values())}
    for image in report.not_in_registry:
        say(f"not sent anywhere: {image}: {NOT_HERE}")
    to_send = [i for i in wanted if i in here and any(i in x for x in lacking.values())]
    failed_pushes: dict[str, str] = {}
    synced: dict[str, NodeSync] = {}
    if to_send:
        async with start_registry(cache) as running:
            say(f"controller: its registry (pid {running.pid}) listens on {running.registry.url} (cache {cache}); "
                f"{len(to_send)} image(s) to send")
            async with contextlib.AsyncExitStack() as stack:
                if client is None:
                    client = await stack.enter_async_context(httpx.AsyncClient(timeout=10.0))
                gate = PushGate(to_send)
                busy = [t for t in targets if t.name in lacking and set(lacking[t.name]) & set(to_send)]
                if not overlap:
                    await _push_all(controller, client, to_send, here, running.registry, cache, options, say, gate)
                async with anyio.create_task_group() as tg:
                    if overlap:
                        tg.start_soon(_push_all, controller, client, to_send, here, running.registry, cache, options,
                                      say, gate, name="pushes to the controller's registry")
                    if busy:
                        synced = await _pull_through_forwards(busy, to_send, running, client, options, say, gate,
                                                              {i: here[i] for i in to_send})
                failed_pushes = {i: why for i, why in gate.failed.items() if i in to_send}
            if running.exit_code is not None:
                report.error = (f"the controller's registry stopped during the sync (exit {running.exit_code}); "
                                "nothing half-written is taken as present, run the sync again: "
                                f"{running.log_tail(500)}")
    else:
        say("nothing to send: every node holds every image of the set that the controller has")
    await _remove_leftovers(targets, census, wanted, options, say)
    report.nodes = [_node_result(t.name, wanted, census[t.name], lacking.get(t.name, []), synced.get(t.name),
                                 report.not_in_registry, failed_pushes) for t in targets]
    report.seconds = time.monotonic() - start
    return report


async def _census(targets: Sequence[SyncTarget], options: SyncOptions) -> dict[str, dict[str, str] | str]:
    """Each target's images (name -> id), or its one error."""
    found: dict[str, dict[str, str] | str] = {}
    limiter = anyio.CapacityLimiter(CENSUS_AT_ONCE)

    async def one(target: SyncTarget) -> None:
        async with limiter:
            try:
                with anyio.fail_after(options.check_timeout_s):
                    found[target.name] = await list_images(target.cli)
            except TimeoutError:
                found[target.name] = f"listing its images took more than {options.check_timeout_s:g}s"
            except InfraError as exc:
                found[target.name] = str(exc)

    async with anyio.create_task_group() as tg:
        for target in targets:
            tg.start_soon(one, target, name=f"images of {target.name}")
    return found


def leftovers(names: dict[str, str], wanted: Sequence[str]) -> list[str]:
    """A node's images under the name an earlier sync from the controller pulled them by (a loopback registry's), of
    images of ``wanted``: left by a pull that completed after its sync stopped."""
    paths = {image_path(i) for i in wanted}
    found = []
    for name in names:
        host, _, rest = name.partition("/")
        if host.rpartition(":")[0] in ("127.0.0.1", "localhost") and image_path(name) in paths and rest:
            found.append(name)
    return found


async def _remove_leftovers(targets: Sequence[SyncTarget], census: dict[str, dict[str, str] | str],
                            wanted: Sequence[str], options: SyncOptions, say: Say) -> None:
    """``rmi`` (never forced) each node's ``leftovers``: a name only, where the image has its task's name too."""
    async def one(target: SyncTarget, names: list[str]) -> None:
        with anyio.move_on_after(options.check_timeout_s), contextlib.suppress(InfraError):  # the next sync then
            out = await target.cli.run("rmi", *names, check=False)
            if out.exit_code == 0:
                say(f"{target.name}: removed {len(names)} name(s) a stopped sync had pulled by: {', '.join(names)}")

    async with anyio.create_task_group() as tg:
        for target in targets:
            names = census[target.name]
            found = leftovers(names, wanted) if isinstance(names, dict) else []
            if found:
                tg.start_soon(one, target, found, name=f"leftovers on {target.name}")


async def _environments(controller: PodmanCli, images: Sequence[str]) -> dict[str, str]:
    """The environment image under each instance image of ``images`` (its ``swectl.env`` label), where it has one."""
    out = await controller.run("image", "inspect", "--format", '{{index .Labels "swectl.env"}}', *images, check=False)
    lines = out.stdout.decode(errors="replace").splitlines()
    if out.exit_code != 0 or len(lines) != len(images):
        return {}
    return {image: normal_name(env.strip()) for image, env in zip(images, lines, strict=True)
            if env.strip() and env.strip() != "<no value>"}


class PushGate:
    """Which images are in the controller's registry yet (sync.py's ImageGate): each push opens its image's gate,
    with why when it failed; every gate still shut opens, failed, when the pushes stop."""

    def __init__(self, images: Sequence[str]) -> None:
        self._open = {i: anyio.Event() for i in images}
        self.failed: dict[str, str] = {}

    def done(self, image: str, why: str = "") -> None:
        if why:
            self.failed[image] = why
        if image in self._open:
            self._open[image].set()

    def close(self, why: str) -> None:
        for image, event in self._open.items():
            if not event.is_set():
                self.done(image, why)

    async def wait(self, image: str) -> str:
        event = self._open.get(image)
        if event is not None:
            await event.wait()
        return self.failed.get(image, "")


async def _push_all(controller: PodmanCli, client: httpx.AsyncClient, to_send: Sequence[str], here: dict[str, str],
                    registry: Registry, cache: Path, options: SyncOptions, say: Say, gate: PushGate) -> None:
    """Push ``to_send`` (each environment image first) to the controller's registry, opening each image's gate as its
    push ends (``gate.failed``: the images not pushed -> why)."""
    try:
        envs = await _environments(controller, to_send)
        order = list(dict.fromkeys(i for image in to_send for i in (envs.get(image), image)
                                   if i is not None and i in here))
        for n, image in enumerate(order, 1):
            outcome = await _push_one(controller, client, image, here[image], registry, cache, options)
            if outcome is None:
                say(f"controller: [{n}/{len(order)}] {image} is in its registry already")
                gate.done(image)
            elif outcome.ok:
                say(f"controller: [{n}/{len(order)}] pushed {image} to its registry in {outcome.seconds:.1f}s")
                gate.done(image)
            else:
                say(f"controller: [{n}/{len(order)}] FAILED to push {image}: {outcome.error}")
                gate.done(image, f"not sent: the push to the controller's registry failed: {outcome.error}")
    finally:
        gate.close("not sent: the sync stopped before its push")


async def _push_one(controller: PodmanCli, client: httpx.AsyncClient, image: str, image_id: str, registry: Registry,
                    cache: Path, options: SyncOptions) -> PushOutcome | None:
    """Push ``image`` unless the registry holds that very image (None then)."""
    with contextlib.suppress(RegistryError, TimeoutError):
        with anyio.fail_after(options.manifest_timeout_s):
            if (await image_layers(client, registry, image)).config_digest == image_id:
                return None
    free_gb = shutil.disk_usage(cache).free / 1e9
    if free_gb < options.min_free_gb:
        return PushOutcome(image=image, ref=registry.ref(image), ok=False,
                           error=f"not enough disk for the cache {cache}: {free_gb:.1f} GB free, "
                           f"{options.min_free_gb:g} GB to keep")
    try:
        with anyio.fail_after(options.pull_timeout_s):
            return await push_with(controller, image, registry)
    except TimeoutError:
        return PushOutcome(image=image, ref=registry.ref(image), ok=False,
                           error=f"the push took more than {options.pull_timeout_s:g}s")


RELAY_PREFIX = "swectl-relay-"


def _remove_stale_relay_folders() -> None:
    """The relay folders of syncs that were killed (their pid, in the name, is gone)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{RELAY_PREFIX}*-*"):
        pid = folder.name.removeprefix(RELAY_PREFIX).split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(folder, ignore_errors=True)
            except PermissionError:  # another user's live process
                pass


@contextlib.asynccontextmanager
async def _private_folder() -> AsyncIterator[str]:
    _remove_stale_relay_folders()
    # mode 0700: only this user reaches the relays' sockets
    folder = tempfile.mkdtemp(prefix=f"{RELAY_PREFIX}{os.getpid()}-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _pull_through_forwards(busy: Sequence[SyncTarget], images: list[str], running: RunningRegistry,
                                 client: httpx.AsyncClient, options: SyncOptions, say: Say, gate: PushGate,
                                 ids: dict[str, str]) -> dict[str, NodeSync]:
    """sync.py's pulls onto ``busy``, each SSH node through a forward of its own to a relay, each image as soon as its
    push ended (``gate``; ``ids``: the images' ids on the controller); results by node."""
    results: dict[str, NodeSync] = {}
    relays: dict[str, ByteRelay] = {}
    stops: list[Callable[[], None]] = []
    targets: list[SyncTarget] = []
    async with _private_folder() as folder, anyio.create_task_group() as tg:
        try:
            for target in busy:
                node = target.cli.node
                if not isinstance(node, ForwardsToController):  # this machine: the registry's own address
                    targets.append(target)
                    continue
                relay = ByteRelay(os.path.join(folder, f"{len(relays)}.sock"), "127.0.0.1", running.port)
                await tg.start(relay.run, name=f"relay to {target.name}")
                try:
                    with anyio.fail_after(options.check_timeout_s):
                        port, stop = await node.forward_to_local_path(relay.path)
                except TimeoutError:
                    results[target.name] = NodeSync(node=target.name, error="forwarding a port to the controller "
                                                    f"took more than {options.check_timeout_s:g}s")
                    continue
                except InfraError as exc:
                    results[target.name] = NodeSync(node=target.name, error=str(exc))
                    continue
                stops.append(stop)
                relays[target.name] = relay
                targets.append(SyncTarget(target.name, target.cli,
                                          registry=Registry(host=f"127.0.0.1:{port}", plain_http=True)))
            for name, result in results.items():
                say(f"{name}: {result.error}")
            report = await sync_images(targets, images, running.registry, options=options, say=say, client=client,
                                       gate=gate, ids=ids)
        finally:
            for stop in stops:
                stop()
            tg.cancel_scope.cancel()
    for result in report.nodes:
        relay = relays.get(result.node)
        result.sent_bytes = relay.statistics().sent if relay is not None else None
        results[result.node] = result
    return results


def _node_result(name: str, wanted: list[str], names: dict[str, str] | str, lacking: list[str],
                 synced: NodeSync | None, not_here: dict[str, str], failed_pushes: dict[str, str]) -> NodeSync:
    """One node's part of the report: its census, its pulls (when it had any), the images it lacks that were not
    sent (not on the controller, or their push failed) as failed pulls."""
    if isinstance(names, str):
        return NodeSync(node=name, wanted=len(wanted), error=names)
    result = NodeSync(node=name, wanted=len(wanted), present_before=[i for i in wanted if i not in lacking],
                      sent_bytes=0)
    if synced is not None:
        result.error, result.seconds, result.pulls = synced.error, synced.seconds, list(synced.pulls)
        result.sent_bytes = synced.sent_bytes
        before = set(synced.present_before)  # became present since the census (another sync, a pool's pull)
        result.present_before = [i for i in wanted if i not in lacking or i in before]
    unsent = {**{i: f"not sent: {why}" for i, why in not_here.items()}, **failed_pushes}
    tried = {p.image for p in result.pulls}
    result.pulls += [Pull(image=i, ok=False, error=unsent[i]) for i in lacking if i in unsent and i not in tried]
    return result
