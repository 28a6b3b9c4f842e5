"""`just bench images`: a task set's images onto two empty nodes, `swectl image sync` against first-use pulls.

One run, two sshd test nodes with Podman stores of their own (``swectl.testing.nodes``, ``own_store``: each node
really starts empty) and Debian's registry on this machine's end of the first node's veth
(``swectl.testing.registry``). The task set: the bundled tasks (their four project images) and 21 real SWE-bench
Verified rows (requests, flask and pytest; instance images built offline from the repo cache with
``swectl image build --repo-cache``, on environment images shared per (repo, version)). Phases:

* ``images``: every image of the set on this machine; missing instance images are built from ``--repo-cache``
  (cached by content: a rerun builds nothing);
* ``nodes``: the two nodes and the registry; each node's store is checked empty;
* ``push``: ``swectl image push``'s code (environment images first) to the registry, then every image's layers read
  from the registry (their stored sizes are the bytes a transfer moves);
* ``first_use``: the seeds' way, simulated: each node walks the images in the order episodes first need them (the
  tasks in a seeded random order) and, for each, pulls it when its first episode starts (the ``podman pull`` the
  seed's ``podman run`` did implicitly, against the same registry, with sync's own pull function), then
  starts that episode (a sandbox of the default backend, namespace, on the node: created, and the first command run
  in it). One episode start at a time per node; the two nodes at once. Podman skips layers the node's store
  already has, so these pulls share layers too: what they lack is concurrency and being done before the episodes
  start;
* ``wipe``: every image removed from both nodes' stores (checked empty); before each measured phase (first_use,
  sync, sync_one_per_node) the disk is flushed and its writeback waited for, so no phase pays for the one before;
* ``sync``: ``swectl image sync``'s code (``sync_images``, default bounds: 2 pulls per node, 8 in all);
* ``synced_episodes``: one episode start per image on each synced node (no pull);
* ``second_sync``: a sync that finds everything present (moves nothing);
* ``sync_one_per_node`` (full runs): the stores wiped again and the same sync with one pull at a time per node
  (``sync_one_per_node_s``): what sync's concurrency buys on this machine;
* ``from_controller_serial`` and ``from_controller``: the stores wiped, and `swectl image sync` without
  a registry (``sync_from_controller``: the controller's own registry on a fresh, empty cache, each node pulling
  through its SSH forward), first with every push before the pulls (the code before 2026-11-29), then with each
  image's pulls starting once its push ended (now): ``from_controller_serial_s``, ``from_controller_s``,
  ``from_controller_speedup``.

Keys: ``sync_s`` (the sync, to every image present on both nodes), ``first_use_s`` (the slower node's pulls in the
first-use phase, summed: the time its episodes waited on pulls; ``first_use_wall_s``: the phase's wall time, the
episode starts between the pulls included), ``sync_speedup`` = first_use_s / sync_s (goal
>= 3), ``bytes_ratio`` = bytes the sync moved (the stored sizes of the layers each node lacked) / the bytes of
whole-image transfers (each image's every layer as the registry stores it, to each node: a pull into a store that
shares no layers; ``podman save | ssh podman load`` per image moves more still, uncompressed) (goal <= 1/5),
``real_bytes_ratio`` (the same for the real instance images alone, from their layers), ``first_episode_synced_ms``
and ``first_episode_unsynced_ms`` (p50 over images and nodes of an image's first episode start: after the sync,
against pull + start in the first-use phase), and the counts and sizes. The bytes that really crossed each node's
veth (``*_wire_bytes``, ssh traffic included) check the computed ones.

Run: ``.venv/bin/python benchmarks/images.py [--quick] [--repo-cache DIR] [--verified FILE]`` (root: network
namespaces). ``--quick``: the bundled images only (four, about three minutes), into ``results/images.quick.json``.
Everything it starts (nodes, their stores, the registry and its blobs, sandboxes) is removed at the end, also on
error or Ctrl-C; the images built here stay (a rerun reuses them), and so does the task set it used
(``runs/bench-images/tasks.jsonl`` and ``images.json``, for ``swectl image push|sync`` by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from common import Goal, Progress, host_meta, loadavg, ms_since, report, summarize

from swectl.config import ClusterConfig, decode_config
from swectl.errors import InfraError
from swectl.images.from_controller import sync_from_controller
from swectl.images.instance import build_instance_images, instance_image_name, write_image_map
from swectl.images.names import ImageResolver
from swectl.images.push import push_images, task_images, with_environments
from swectl.images.registry import ImageLayers, Registry, normal_name, parse_registry
from swectl.images.store import pull_image
from swectl.images.sync import SyncOptions, SyncReport, SyncTarget, format_report, read_layers, sync_images
from swectl.remote.nodes.backends import close_backends, make_backends, make_node
from swectl.remote.nodes.node import LocalNode
from swectl.remote.nodes.podman import PodmanCli, local_podman_env, run_local_podman
from swectl.sandbox import SandboxBackend
from swectl.schema import SandboxSpec
from swectl.tasks.record import Task
from swectl.tasks.sources import load_tasks
from swectl.testing import nodes as testnodes
from swectl.testing.registry import LocalRegistry, can_run_registry, start_registry, stop_registry

SUITE = "images"
REPO = Path(__file__).resolve().parents[1]
BUNDLED_TASKS = REPO / "swectl" / "data" / "bundled" / "tasks.jsonl"
VERIFIED = Path("/work/shared/data/swe_bench_verified.jsonl")  # the 500 Verified rows (see its SOURCES.md)
REPO_CACHE = REPO / "runs" / "repo-cache"  # clones: psf__requests, pallets__flask, pytest-dev__pytest
WORKDIR = REPO / "runs" / "bench-images"  # the task set's tasks.jsonl and images.json, for image push|sync by hand
PREFIX, BASE_INDEX = "swbi", 232  # nodes swbi232, swbi233 at 10.200.232.2 and .233.2
ORDER_SEED = 0
PULL_TIMEOUT_S = 1800.0
SETTLED_KB = 64 * 1024  # dirty + writeback below this: the disk has caught up
MIN_FREE_GB = 15.0  # two node stores of the full set, the registry's blobs, and room to spare
# Verified rows whose environments are cheap and shared: every requests and flask row, and pytest's versions with
# three or four rows (one environment image each, one Python 3.9 layer under all of them).
REAL_IDS = (
    "psf__requests-1142", "psf__requests-1724", "psf__requests-1766", "psf__requests-1921", "psf__requests-2317",
    "psf__requests-2931", "psf__requests-5414", "psf__requests-6028", "pallets__flask-5014",
    "pytest-dev__pytest-6197", "pytest-dev__pytest-6202", "pytest-dev__pytest-7205", "pytest-dev__pytest-7236",
    "pytest-dev__pytest-7324", "pytest-dev__pytest-7432", "pytest-dev__pytest-7490", "pytest-dev__pytest-7521",
    "pytest-dev__pytest-7571", "pytest-dev__pytest-10051", "pytest-dev__pytest-10081", "pytest-dev__pytest-10356",
)  # fmt: skip


@dataclass
class TaskSet:
    """The bench's tasks and their images, in the order episodes first need them."""

    tasks: list[Task]
    images: list[str]  # normal names, first need first
    real: set[str]  # the real instance images among them
    workdir: Path  # tasks.jsonl and images.json (WORKDIR): the same set for `swectl image push|sync` by hand


@dataclass
class Bench:
    quick: bool
    repo_cache: Path
    verified: Path
    per_node: int
    progress: Progress = field(default_factory=lambda: Progress(SUITE))
    bench_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    summaries: dict[str, Any] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)
    fleet: testnodes.TestNodes | None = None
    registry_proc: LocalRegistry | None = None

    # ------------------------------------------------------------------ the task set

    def task_set(self) -> TaskSet:
        bundled = load_tasks(str(BUNDLED_TASKS)).tasks
        real: list[Task] = []
        if not self.quick:
            if not self.verified.exists():
                raise RuntimeError(f"{self.verified}: no SWE-bench Verified rows (--verified FILE)")
            wanted = set(REAL_IDS)
            real = [t for t in load_tasks(str(self.verified)).tasks if t.instance_id in wanted]
            missing = wanted - {t.instance_id for t in real}
            if missing:
                raise RuntimeError(f"{self.verified} lacks rows {sorted(missing)}")
        workdir = WORKDIR
        workdir.mkdir(parents=True, exist_ok=True)
        mapping = {t.instance_id: instance_image_name(t) for t in real}
        (workdir / "images.json").write_text(json.dumps(mapping, indent=1) + "\n")
        rows = [json.loads(line) for line in BUNDLED_TASKS.read_text().splitlines() if line.strip()]
        if real:
            ids = set(mapping)
            rows += [r for r in map(json.loads, self.verified.read_text().splitlines()) if r["instance_id"] in ids]
        (workdir / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        tasks = bundled + real
        resolver = ImageResolver(mapping=mapping, mapping_origin=str(workdir / "images.json"))
        order = list(tasks)
        random.Random(ORDER_SEED).shuffle(order)
        images = [normal_name(i) for i in task_images(order, resolver)]
        return TaskSet(tasks=tasks, images=images, real={normal_name(i) for i in mapping.values()}, workdir=workdir)

    def ensure_images(self, ts: TaskSet) -> None:
        """Every image of the set on this machine: instance images built from the repo cache where missing."""
        absent = [i for i in ts.images if run_local_podman("image", "exists", i, check=False).exit_code != 0]
        bundled = [i for i in absent if i not in ts.real]
        if bundled:
            raise RuntimeError(f"bundled images missing: {bundled} (build them: .venv/bin/swectl image build)")
        todo = [t for t in ts.tasks if normal_name(instance_image_name(t)) in absent]
        if not todo:
            return
        if not self.repo_cache.is_dir():
            raise RuntimeError(f"{len(todo)} instance image(s) missing and no repo cache at {self.repo_cache}: "
                               "--repo-cache DIR with clones of psf/requests, pallets/flask, pytest-dev/pytest")
        from swectl.tasks.specs import load_specs

        self.progress(f"images: building {len(todo)} missing instance image(s) from {self.repo_cache}")
        start = time.monotonic()
        outcomes = build_instance_images(todo, load_specs(), self.repo_cache, say=lambda _m: None)
        write_image_map(outcomes, ts.workdir / "built.json")
        failed = [f"{o.instance_id} ({o.step}: {o.message})" for o in outcomes if not o.ok]
        if failed:
            raise RuntimeError(f"instance images failed to build: {'; '.join(failed)}")
        self.details["build_s"] = round(time.monotonic() - start, 1)

    # ------------------------------------------------------------------ the run

    async def run(self) -> None:
        t = time.monotonic()
        ts = self.task_set()
        await anyio.to_thread.run_sync(self.ensure_images, ts)
        self.metrics.update(images=len(ts.images), real_images=len(ts.real),
                            bundled_images=len(ts.images) - len(ts.real))
        self.details["task_set"] = {"tasks": len(ts.tasks), "files": str(ts.workdir), "order_seed": ORDER_SEED,
                                    "images_in_first_need_order": ts.images}
        self._phase_done("images", t, f"{len(ts.images)} images ({len(ts.real)} real instance images, "
                         f"{len(ts.tasks)} tasks)")

        t = time.monotonic()
        fleet = await anyio.to_thread.run_sync(self._start_fleet)
        registry = parse_registry(self.registry_proc.url)  # type: ignore[union-attr]
        for node in fleet.nodes:
            left = _node_images(node)
            if left:
                raise RuntimeError(f"{node.name}'s own store is not empty: {left}")
        self._phase_done("nodes", t, f"{', '.join(n.name for n in fleet.nodes)} with empty stores of their own, "
                         f"registry {registry.url}")

        t = time.monotonic()
        pushed = await anyio.to_thread.run_sync(self._push, ts, registry)
        layers, missing, note = await read_layers(registry, ts.images, timeout_s=300)
        if note or missing:
            raise RuntimeError(f"reading the registry's manifests: {note or missing}")
        self._sizes(ts, layers)
        self._phase_done("push", t, f"{pushed} images pushed ({pushed - len(ts.images)} environment images under "
                         f"them), {_gb(self.metrics['registry_bytes'])} stored")

        # episodes on the default sandbox backend (namespace: the image's layers from the node's own store)
        config = decode_config(tomllib.loads(fleet.cluster_toml() + '[sandbox]\nbackend = "namespace"\n'), "<bench>")
        clis = [PodmanCli(make_node(n), n.containers_conf) for n in config.sandbox_nodes()]
        try:
            for cli in clis:
                await cli.prepare()
            await self._measure(ts, layers, registry, fleet, clis, config)
        finally:
            with anyio.CancelScope(shield=True):
                for cli in clis:
                    await cli.node.aclose()

    async def _measure(self, ts: TaskSet, layers: dict[str, ImageLayers], registry: Registry,
                       fleet: testnodes.TestNodes, clis: list[PodmanCli], config: ClusterConfig) -> None:
        nodes = fleet.nodes
        # first use: per node, one image at a time, pulled when its first episode starts
        self.details.setdefault("settle_s", {})["first_use"] = await anyio.to_thread.run_sync(_settle)
        t = time.monotonic()
        wire = _veth_tx(nodes)
        first: list[list[dict[str, Any]]] = [[] for _ in nodes]
        async with _backends(config) as backends, anyio.create_task_group() as tg:
            for i in range(len(nodes)):
                tg.start_soon(self._first_use_node, ts, layers, registry, clis[i], backends[i], first[i])
        self.details["first_use_wire_bytes_per_node"] = _delta(wire, _veth_tx(nodes))
        pulls_per_node = [sum(r["pull_s"] for r in rows) for rows in first]
        first_use_s = max(pulls_per_node)
        self.details["first_use_per_node"] = first
        self.details["first_use_pull_s_per_node"] = [round(s, 2) for s in pulls_per_node]
        self.details["first_use_wall_s"] = round(time.monotonic() - t, 2)
        for node in nodes:
            have = set(_node_images(node))
            if not set(ts.images) <= have:
                raise RuntimeError(f"{node.name} lacks {sorted(set(ts.images) - have)} after the first-use phase")
        self._phase_done("first_use", t, f"pulls took {', '.join(f'{s:.1f}s' for s in pulls_per_node)} on the nodes "
                         f"(wall {self.details['first_use_wall_s']}s with the episode starts)")

        t = time.monotonic()
        for node in nodes:
            _wipe(node)
        self._phase_done("wipe", t, "both stores empty again")

        self.details["settle_s"]["sync"] = await anyio.to_thread.run_sync(_settle)
        t = time.monotonic()
        wire = _veth_tx(nodes)
        targets = [SyncTarget(n.name, cli) for n, cli in zip(nodes, clis, strict=True)]
        options = SyncOptions(per_node=self.per_node, pull_timeout_s=PULL_TIMEOUT_S)
        sync = await sync_images(targets, ts.images, registry, options=options, say=lambda _m: None)
        sync_s = time.monotonic() - t
        self.details["sync_wire_bytes_per_node"] = _delta(wire, _veth_tx(nodes))
        if not sync.ok:
            raise RuntimeError(f"image sync failed:\n{format_report(sync)}")
        self.details["sync_table"] = format_report(sync).splitlines()
        self.details["sync_pull_s_sum_per_node"] = [round(sum(p.seconds for p in n.pulls), 2) for n in sync.nodes]
        self.details["sync_per_node"] = [{"node": n.node, "seconds": round(n.seconds, 2), "bytes": n.bytes,
                                          "pulls": [{"image": p.image, "s": round(p.seconds, 2), "bytes": p.bytes}
                                                    for p in n.pulls]} for n in sync.nodes]
        self._phase_done("sync", t, f"{sync_s:.1f}s, {_gb(sum(n.bytes or 0 for n in sync.nodes))} moved "
                         f"(per node {', '.join(f'{n.seconds:.1f}s' for n in sync.nodes)})")

        t = time.monotonic()
        synced: list[list[float]] = [[] for _ in nodes]
        async with _backends(config) as backends, anyio.create_task_group() as tg:  # fresh: no image looked up yet
            for i in range(len(nodes)):
                tg.start_soon(self._episodes, ts.images, backends[i], synced[i])
        self._phase_done("synced_episodes", t, f"{sum(map(len, synced))} first episodes on synced nodes")

        t = time.monotonic()
        again = await sync_images(targets, ts.images, registry, options=options, say=lambda _m: None)
        second_pulled = sum(len(n.pulls) for n in again.nodes)
        second_s = time.monotonic() - t
        self._phase_done("second_sync", t, f"{second_s:.1f}s, {second_pulled} pulls")
        self.details["store_bytes_per_node"] = [_du(Path(n.storage_conf).parent / "graph") for n in nodes]

        serial_s = None
        if not self.quick and self.per_node > 1:  # the same sync one pull at a time per node: what concurrency buys
            for node in nodes:
                _wipe(node)
            self.details["settle_s"]["sync_one_per_node"] = await anyio.to_thread.run_sync(_settle)
            t = time.monotonic()
            serial = await sync_images(targets, ts.images, registry, say=lambda _m: None,
                                       options=SyncOptions(per_node=1, pull_timeout_s=PULL_TIMEOUT_S))
            serial_s = time.monotonic() - t
            if not serial.ok:
                raise RuntimeError(f"image sync (one pull per node) failed:\n{format_report(serial)}")
            self._phase_done("sync_one_per_node", t, f"{serial_s:.1f}s after a wipe")
        self.metrics["sync_one_per_node_s"] = round(serial_s, 2) if serial_s is not None else None
        self._results(ts, layers, first, first_use_s, sync, sync_s, synced, again, second_s)
        await self._from_controller(ts, targets)

    async def _from_controller(self, ts: TaskSet, targets: list[SyncTarget]) -> None:
        """The sync from the controller onto the emptied nodes, from a cold cache: pushes before pulls, then overlapped
        (each on the same, fresh cache state: a new cache folder each)."""
        seconds: dict[str, float] = {}
        controller = PodmanCli(LocalNode("controller"))  # as `swectl image sync` makes it
        try:
            for name, overlap in (("from_controller_serial", False), ("from_controller", True)):
                for node in self.fleet.nodes:  # type: ignore[union-attr]
                    _wipe(node)
                self.details["settle_s"][name] = await anyio.to_thread.run_sync(_settle)
                cache = Path(tempfile.mkdtemp(prefix=f"swectl-bench-cache-{name}-"))
                try:
                    t = time.monotonic()
                    report = await sync_from_controller(
                        targets, ts.images, controller=controller, cache=cache, say=lambda _m: None,
                        options=SyncOptions(per_node=self.per_node, pull_timeout_s=PULL_TIMEOUT_S), overlap=overlap)
                    seconds[name] = time.monotonic() - t
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
                if not report.ok:
                    raise RuntimeError(f"image sync from the controller ({name}) failed:\n{format_report(report)}")
                self.details[f"{name}_table"] = format_report(report).splitlines()
                self._phase_done(name, t, f"{seconds[name]:.1f}s from a cold cache, sent "
                                 + ", ".join(_gb(n.sent_bytes) for n in report.nodes))
        finally:
            with anyio.CancelScope(shield=True):
                await controller.node.aclose()
        serial, overlapped = seconds["from_controller_serial"], seconds["from_controller"]
        self.metrics.update(from_controller_serial_s=round(serial, 2), from_controller_s=round(overlapped, 2),
                            from_controller_speedup=round(serial / overlapped, 2) if overlapped else None)

    async def _first_use_node(self, ts: TaskSet, layers: dict[str, ImageLayers], registry: Registry, cli: PodmanCli,
                              backend: SandboxBackend, rows: list[dict[str, Any]]) -> None:
        have: set[str] = set()
        for image in ts.images:
            lacking = {layer.diff_id: layer.size for layer in layers[image].layers if layer.diff_id not in have}
            start = time.perf_counter_ns()
            with anyio.fail_after(PULL_TIMEOUT_S):
                await _pull(cli, image, registry)
            pull_ms = ms_since(start)
            start_ms = await self._episode_start(backend, image)
            have.update(lacking)
            rows.append({"image": image, "pull_s": round(pull_ms / 1000, 3), "start_ms": round(start_ms, 1),
                         "bytes": sum(lacking.values())})

    async def _episodes(self, images: list[str], backend: SandboxBackend, out: list[float]) -> None:
        for image in images:
            out.append(await self._episode_start(backend, image))

    async def _episode_start(self, backend: SandboxBackend, image: str) -> float:
        """An episode's start on the node: its sandbox created and the first command run in it (ms)."""
        sandbox = None
        try:
            start = time.perf_counter_ns()
            sandbox = await backend.create(SandboxSpec(image=image, labels={"swectl.bench": self.bench_id}))
            result = await sandbox.exec("true", 30)
            elapsed = ms_since(start)
            if result.exit_code != 0:
                raise RuntimeError(f"exec('true') in {image} gave {result.exit_code}: {result.output[:200]}")
            return elapsed
        finally:
            if sandbox is not None:
                with anyio.CancelScope(shield=True):
                    await sandbox.destroy()

    # ------------------------------------------------------------------ results

    def _sizes(self, ts: TaskSet, layers: dict[str, ImageLayers]) -> None:
        """Whole-image and shared-layer bytes of the set, and of its real instance images alone (one node)."""

        def unique(images: list[str]) -> int:
            seen: dict[str, int] = {}
            for image in images:
                seen.update((layer.diff_id, layer.size) for layer in layers[image].layers)
            return sum(seen.values())

        real = [i for i in ts.images if i in ts.real]
        self.metrics["registry_bytes"] = unique(ts.images)
        users: dict[str, int] = {}  # diff id -> how many images of the set have the layer
        for image in ts.images:
            for diff_id in {layer.diff_id for layer in layers[image].layers}:
                users[diff_id] = users.get(diff_id, 0) + 1
        self.details["image_bytes"] = {  # own: its layers no other image of the set has
            i: {"whole": layers[i].size, "own": sum(x.size for x in layers[i].layers if users[x.diff_id] == 1),
                "layers": len(layers[i].layers), "real": i in ts.real} for i in ts.images}
        self.details["whole_image_bytes_one_node"] = sum(layers[i].size for i in ts.images)
        self.details["real_whole_bytes_one_node"] = sum(layers[i].size for i in real)
        self.details["real_unique_bytes_one_node"] = unique(real)

    def _results(self, ts: TaskSet, layers: dict[str, ImageLayers], first: list[list[dict[str, Any]]],
                 first_use_s: float, sync: SyncReport, sync_s: float, synced: list[list[float]], again: SyncReport,
                 second_s: float) -> None:
        n_nodes = len(sync.nodes)
        sync_bytes = sum(n.bytes or 0 for n in sync.nodes)
        whole = self.details["whole_image_bytes_one_node"] * n_nodes
        real_whole = self.details["real_whole_bytes_one_node"]
        unsynced = [r["pull_s"] * 1000 + r["start_ms"] for rows in first for r in rows]
        unsynced_real = [r["pull_s"] * 1000 + r["start_ms"] for rows in first for r in rows if r["image"] in ts.real]
        synced_all = [ms for rows in synced for ms in rows]
        for name, samples in (("first_episode_unsynced_ms", unsynced), ("first_episode_synced_ms", synced_all),
                              ("first_episode_unsynced_real_ms", unsynced_real),
                              ("first_use_pull_ms", [r["pull_s"] * 1000 for rows in first for r in rows]),
                              ("first_use_start_ms", [r["start_ms"] for rows in first for r in rows]),
                              ("sync_pull_ms", [p.seconds * 1000 for n in sync.nodes for p in n.pulls])):
            if samples:
                self.summaries[name] = summarize(samples, 1)
        self.metrics.update(
            nodes=n_nodes,
            sync_s=round(sync_s, 2),
            first_use_s=round(first_use_s, 2),
            first_use_wall_s=self.details["first_use_wall_s"],
            sync_speedup=round(first_use_s / sync_s, 2) if sync_s else None,
            sync_one_per_node_s=self.metrics.pop("sync_one_per_node_s", None),
            bytes_ratio=round(sync_bytes / whole, 4) if whole else None,
            real_bytes_ratio=(round(self.details["real_unique_bytes_one_node"] / real_whole, 4) if real_whole
                              else None),
            sync_bytes=sync_bytes,
            whole_image_bytes=whole,
            first_use_bytes=sum(r["bytes"] for rows in first for r in rows),
            first_episode_synced_ms=self.summaries["first_episode_synced_ms"]["p50"],
            first_episode_unsynced_ms=self.summaries["first_episode_unsynced_ms"]["p50"],
            first_episode_unsynced_real_ms=(self.summaries["first_episode_unsynced_real_ms"]["p50"]
                                            if unsynced_real else None),
            first_episode_unsynced_empty_ms=round(
                sum(rows[0]["pull_s"] * 1000 + rows[0]["start_ms"] for rows in first) / n_nodes, 1),
            sync_wire_bytes=sum(self.details["sync_wire_bytes_per_node"]),
            first_use_wire_bytes=sum(self.details["first_use_wire_bytes_per_node"]),
            push_s=self.phase_s.get("push"),
            second_sync_s=round(second_s, 2),
            second_sync_pulls=sum(len(n.pulls) for n in again.nodes),
            store_bytes_per_node=max(self.details["store_bytes_per_node"]),
        )
        self.metrics["registry_bytes"] = self.metrics.pop("registry_bytes")

    def goals(self) -> list[Goal]:
        quick = "--quick: the bundled images only; the goal is on the real instance images" if self.quick else ""
        return [Goal("sync_speedup", ">=", 3.0), Goal("bytes_ratio", "<=", 0.2, not_applicable=quick),
                Goal("real_bytes_ratio", "<=", 0.2, not_applicable=quick)]

    def notes(self) -> list[str]:
        notes = [
            "first_use_s: the seeds' way simulated per node (no code path of the seed could pull a locally built "
            "image: its podman run pulled only names a registry served): each image pulled (podman pull from the "
            "same registry, tag, untag: sync's own pull function, swectl.images.store.pull_image) when its first "
            "episode starts, one episode start at a time per node, the two nodes at once; first_use_s is the "
            "slower node's pull time (episode starts excluded; "
            f"the phase's wall time with them: {self.details.get('first_use_wall_s')} s). Podman skips the layers a "
            "node's store already has, so these pulls share layers as sync's do (first_use_bytes).",
            "whole_image_bytes: every image's every layer to each node (stored, compressed sizes from the "
            "registry): what pulls into a store that shares no layers move (`podman save | ssh podman load` per "
            "image moves more, uncompressed).",
            "first episode: a sandbox of the default backend (namespace: an overlay of the image's layers in the "
            "node's own store) created on the node and the first command run in it; unsynced adds the pull the "
            "seed's podman run did implicitly. p50 over the (node, image) pairs. (The podman backend cannot start "
            "these images: its exec agent runs on the image's python3, the instance images' Python 3.9 venv, and the "
            "agent uses zip(strict=True), Python 3.10+.)",
            "what stands in the way of sync_speedup: the registry runs on this machine and the two nodes are "
            "namespaces of it, so every pull of both nodes shares the same 2 cores and disk, with no network limit: a "
            "pull is bound by CPU and disk (gunzip, unpacking and committing the layers, podman's start-up), and the "
            "first-use phase's one pull per node already keeps both cores busy. Overlapping pulls cannot add cores: "
            f"sync's pulls took {self.details.get('sync_pull_s_sum_per_node')} s summed per node against "
            f"{self.details.get('first_use_pull_s_per_node')} s one at a time. The same sync with one pull per "
            "node (sync_one_per_node_s) is slower than first_use_s, likely (not verified) because back to back each "
            "pull meets the previous one's disk writes, which the first-use pulls leave to the episode start between "
            "them (first_use_s counts the pulls alone; first_use_wall_s counts the starts too). Sync's concurrency "
            "pays where a pull waits on the network (a remote registry, per-connection throughput, round trips), on "
            "nodes with cores of their own.",
        ]
        return notes

    # ------------------------------------------------------------------ helpers

    def _start_fleet(self) -> testnodes.TestNodes:
        self.fleet = testnodes.start_test_nodes(2, prefix=PREFIX, base_index=BASE_INDEX, own_store=True)
        self.registry_proc = start_registry(self.fleet.nodes[0].host_addr)
        return self.fleet

    def _push(self, ts: TaskSet, registry: Registry) -> int:
        ordered = with_environments(ts.images)
        envs = [i for i in ordered if i not in ts.images]
        if envs:
            ids = run_local_podman("image", "inspect", "--format", "{{.Id}}", *envs).stdout.decode().split()
            self.details["environment_images"] = {"names": len(envs), "distinct": len(set(ids))}
        outcomes = push_images(ordered, registry, say=lambda _m: None)
        failed = [f"{o.image}: {o.error}" for o in outcomes if not o.ok]
        if failed:
            raise RuntimeError(f"push failed: {failed}")
        return len(outcomes)

    def _phase_done(self, name: str, start: float, message: str) -> None:
        self.phase_s[name] = round(time.monotonic() - start, 2)
        self.details.setdefault("loadavg_at_phase_end", {})[name] = loadavg()
        self.progress(f"{name}: {message} [{self.phase_s[name]:.1f}s]")

    def teardown(self) -> None:
        if self.registry_proc is not None:
            self.details["registry_log_tail"] = self.registry_proc.log_tail(1000)[-1000:]
            stop_registry(self.registry_proc)
            self.registry_proc = None
        if self.fleet is not None:
            testnodes.stop_test_nodes(self.fleet)  # kills sshd, removes each node's store (containers, images)
            self.fleet = None


@asynccontextmanager
async def _backends(config: ClusterConfig) -> AsyncIterator[list[SandboxBackend]]:
    """Each node's sandbox backend, prepared; closed after."""
    backends = make_backends(config)
    try:
        for _, backend in backends:
            await backend.prepare()
        yield [backend for _, backend in backends]
    finally:
        with anyio.CancelScope(shield=True):
            await close_backends(backends)


async def _pull(cli: PodmanCli, image: str, registry: Registry) -> None:
    """What the first episode on a node without ``image`` waited for: its pull (podman skips layers it has), with the
    very function sync pulls with."""
    error = await pull_image(cli, image, registry)
    if error:
        raise InfraError(f"{cli.node.name}: pulling {image}: {error}")


def _node_images(node: testnodes.TestNode) -> list[str]:
    out = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                         text=True, env=node.podman_env(), timeout=120, check=True)
    return [normal_name(n) for n in out.stdout.split() if "<none>" not in n]


def _wipe(node: testnodes.TestNode) -> None:
    env = node.podman_env()
    for args in (["rm", "--all", "--force", "--time", "0"], ["rmi", "--all", "--force"]):
        subprocess.run(["podman", *args], capture_output=True, env=env, timeout=300, check=False)
    left = subprocess.run(["podman", "images", "--all", "--quiet"], capture_output=True, text=True, env=env,
                          timeout=120, check=True).stdout.split()
    if left:
        raise RuntimeError(f"{node.name}: {len(left)} image(s) left after the wipe")


def _settle(limit_s: float = 120.0) -> float:
    """Flush the disk's dirty pages and wait until writeback is done (at most ``limit_s``), so that no measured phase
    pays for the writes of the one before (a push, the deletions of a wipe); the seconds it took."""
    start = time.monotonic()
    os.sync()
    while time.monotonic() - start < limit_s:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        if int(fields["Dirty"].split()[0]) + int(fields["Writeback"].split()[0]) < SETTLED_KB:
            break
        time.sleep(0.5)
    return round(time.monotonic() - start, 1)


def _veth_tx(nodes: list[testnodes.TestNode]) -> list[int]:
    """Bytes this machine has sent to each node over its veth (registry blobs, ssh)."""
    return [int(Path(f"/sys/class/net/{n.host_veth}/statistics/tx_bytes").read_text()) for n in nodes]


def _delta(before: list[int], after: list[int]) -> list[int]:
    return [b - a for a, b in zip(before, after, strict=True)]


def _du(path: Path) -> int | None:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, timeout=300, check=False)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout else None


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def _leaves(exc: BaseException) -> list[BaseException]:
    """The errors inside (nested) exception groups, or the error itself."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the bundled images only (four): about three minutes")
    parser.add_argument("--repo-cache", type=Path, default=REPO_CACHE,
                        help=f"clones to build missing instance images from (default {REPO_CACHE.relative_to(REPO)})")
    parser.add_argument("--verified", type=Path, default=VERIFIED, help=f"SWE-bench Verified rows (default {VERIFIED})")
    parser.add_argument("--per-node", type=int, default=SyncOptions().per_node,
                        help="sync's pulls at once per node (default: swectl image sync's)")
    args = parser.parse_args(argv)
    for reason in (testnodes.can_run_test_nodes(), can_run_registry()):
        if reason is not None:
            print(f"cannot run: {reason}", file=sys.stderr)
            return 2
    free_gb = shutil.disk_usage(tempfile.gettempdir()).free / 1e9
    if free_gb < MIN_FREE_GB:
        print(f"cannot run: {free_gb:.0f} GB free under {tempfile.gettempdir()}, want {MIN_FREE_GB:g}", file=sys.stderr)
        return 2

    bench = Bench(quick=args.quick, repo_cache=args.repo_cache, verified=args.verified, per_node=args.per_node)
    host = host_meta()
    version = run_local_podman("version", "--format", "{{.Client.Version}}").stdout.decode().strip()
    bench.progress(f"{'quick' if args.quick else 'full'} run, bench id {bench.bench_id}, podman {version}, "
                   f"{host['cpu_count']} cpus, load {host['loadavg_start']}")
    error = ""
    try:
        anyio.run(bench.run, backend="asyncio")
    except KeyboardInterrupt:
        error = "interrupted"
    except Exception as exc:  # a failed phase: reported, nothing written
        error = "; ".join(f"{type(e).__name__}: {e}" for e in _leaves(exc))
    finally:
        bench.teardown()
    if error:
        bench.progress(f"FAILED: {error} (nodes, stores and registry removed; no results written)")
        return 130 if error == "interrupted" else 1
    meta = {
        **host, "quick": args.quick, "podman": version,
        "containers_conf_env": local_podman_env().get("CONTAINERS_CONF"),
        "bench_id": bench.bench_id, "per_node": args.per_node, "phase_s": bench.phase_s,
        "seconds": round(bench.progress.elapsed_s(), 1), "distributions_ms": bench.summaries,
        "notes": bench.notes(), "details": bench.details,
    }
    report(SUITE, bench.metrics, meta, bench.goals())
    print("\n".join(["", *meta["notes"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
