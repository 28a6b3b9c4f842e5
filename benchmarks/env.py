"""`just bench env`: the sandbox layer against mini-swe-agent's way, side by side in one run.

Measures on this machine (and, with ``--ssh``, on a throwaway sshd node in a network namespace) one set of
phases, run on each sandbox backend in turn (Podman, namespace, docker on a private dockerd; Podman over SSH):

* exec of ``true`` through swectl's exec agent vs one CLI process per command against the same sandbox
  (``podman exec CID true``, ``docker exec``, ``ssh ... podman exec``: subprocess.run of the CLI, as
  mini-swe-agent does it); the agent's ping round trip and what spawning bash costs inside (for context);
* a cold start (create + agent + first exec), next to the plain ``podman run --rm IMAGE true``;
* how many sandboxes one node holds at once with every exec succeeding, the host memory they take, and host
  memory (PSS) and host processes per sandbox, counted the same way on Podman and namespace sandboxes (512
  namespace sandboxes at once);
* the disk an episode leaves in a namespace sandbox's writable layer;
* a lease served from the EnvPool's warm pool (the namespace backend, the default);
* Podman's lifecycle through the API service (``sandbox.podman_api``: ``podman system service`` over podman-py)
  beside the CLI (one ``podman`` process per create/list/remove), interleaved in one phase: cold start to first
  exec, and warm-lease latency (p99) from an EnvPool of Podman sandboxes on each path;
* over SSH: the above exec next to the ssh round trip.

Goals come from docs/architecture.md 13.2. Results: a table on stdout and ``benchmarks/results/env.json``
(``--quick``: ``env.quick.json``). Every container and namespace sandbox it creates carries
``swectl.bench=<id>``, except the EnvPools', which the pool labels itself (``swectl.run=<bench run id>``); all of
them are removed at the end, also on error or Ctrl-C (the nsbox daemon, shared by every namespace sandbox on the
node, stays, and so does the node's Podman API service: started by the podman_api phase if none ran, it is the
one the backend manages; the private dockerd goes, with its containers).

Run: ``.venv/bin/python benchmarks/env.py [--quick] [--ssh]`` (``--quick``: under a minute).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import asyncssh
import msgspec
from common import (
    RESULTS_DIR,
    Goal,
    Progress,
    host_meta,
    loadavg,
    mem_used_mib,
    ms_since,
    percentile,
    result_table,
    run_each,
    summarize,
    write_results,
)

from swectl.actors.cli_agents import default_tools_dir, tools_mounts
from swectl.actors.env_pool import running_pool
from swectl.config import DEFAULT_IMAGE, SandboxConfig, decode_config, load_config
from swectl.errors import InfraError
from swectl.remote.nodes.backends import close_backends, make_backends
from swectl.remote.nodes.docker_sandbox import DockerBackend
from swectl.remote.nodes.namespace_sandbox import NamespaceBackend
from swectl.remote.nodes.node import LocalNode
from swectl.remote.nodes.podman import bundled_containers_conf, local_podman_env, run_local_podman
from swectl.remote.nodes.podman_sandbox import PodmanBackend
from swectl.sandbox import LABEL_RUN, Sandbox, SandboxBackend
from swectl.schema import ExecResult, SandboxSpec
from swectl.testing.nodes import TestNodes, start_test_nodes, stop_test_nodes

SUITE = "env"
REPO = Path(__file__).resolve().parents[1]
CONTAINERS_CONF = bundled_containers_conf()
IMAGE = DEFAULT_IMAGE
BENCH_LABEL = "swectl.bench"
WARMUP = 20  # calls before any timed exec / ping / rtt loop
WARM_K = 4  # env_pool.warm for the warm-lease phases (the config default)
CREATE_CONCURRENCY = 8  # sandboxes started at once in the concurrency phase (a node's max_starting)
SSH_PREFIX, SSH_INDEX = "swb", 220  # test node swb220 at 10.200.220.2
CLEANUP_TIMEOUT_S = 120.0

# Spawns bash N times inside the sandbox and prints each time in microseconds: what a command costs
# at the very least, whatever carries it there.
BASH_SPAWN_SCRIPT = """
import subprocess, sys, time
out = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter_ns()
    subprocess.run(["/bin/bash", "-c", "true"], stdin=subprocess.DEVNULL)
    out.append((time.perf_counter_ns() - t) // 1000)
print(" ".join(map(str, out)))
"""


@dataclass(frozen=True)
class Sizes:
    """Samples per measurement."""

    exec: int
    ping: int
    podman_exec: int  # also `docker exec`
    bash_spawn: int
    warm_lease: int
    cold_run: int  # Podman and docker: create + first exec
    podman_run: int
    concurrent: int
    ssh_exec: int  # also the ssh pings
    ssh_rtt: int
    ssh_podman_exec: int
    ns_cold_run: int  # namespace sandboxes: create + first exec (exec and ping counts are exec's and ping's)
    ns_concurrent: int  # namespace sandboxes live at once (the first `concurrent` of them are measured apart)


FULL = Sizes(
    exec=1000, ping=1000, podman_exec=200, bash_spawn=500, warm_lease=50, cold_run=20, podman_run=10,
    concurrent=128, ssh_exec=500, ssh_rtt=500, ssh_podman_exec=50, ns_cold_run=50, ns_concurrent=512,
)
QUICK = Sizes(
    exec=200, ping=200, podman_exec=50, bash_spawn=100, warm_lease=15, cold_run=5, podman_run=3,
    concurrent=32, ssh_exec=100, ssh_rtt=100, ssh_podman_exec=10, ns_cold_run=10, ns_concurrent=64,
)
NS_CONCURRENT_GOAL = 512  # namespace sandboxes one node should hold at once (the podman goal is 128)
# A short "episode" in a fresh namespace sandbox, for the disk its writable layer keeps afterwards.
NS_EPISODE = (
    "cd /srv && git init -q . && echo x > f && git add f && "
    "git -c user.name=bench -c user.email=bench@localhost commit -qm x && "
    "python3 -c 'import json, subprocess; print(1)' && ls -la / > /dev/null"
)

# Table and JSON order; every key is present (null when its phase failed).
METRICS = (
    "exec_p50_ms", "exec_p99_ms", "podman_exec_p50_ms", "exec_speedup", "ping_p50_ms", "bash_spawn_p50_ms",
    "warm_lease_p50_ms", "warm_hits", "cold_run_p50_ms", "podman_run_p50_ms",
    "podman_api_cold_run_p50_ms", "podman_api_cold_speedup", "podman_cli_warm_lease_p99_ms",
    "podman_api_warm_lease_p99_ms",
    "concurrent_ok", "concurrent_tried", "concurrent_create_s", "concurrent_mem_mib",
    "podman_mem_per_sandbox_mib", "podman_host_procs_per_sandbox",
    "ns_exec_p50_ms", "ns_cold_start_ms", "ns_cold_start_speedup", "ns_tools_mount_extra_ms", "ns_disk_frac",
    "ns_mem_per_sandbox_mib", "ns_host_procs_per_sandbox", "ns_concurrent_ok", "ns_concurrent_tried",
    "ns_concurrent_mem_mib", "docker_cold_run_p50_ms", "docker_exec_p50_ms", "docker_cli_exec_p50_ms",
)  # fmt: skip
SSH_METRICS = ("ssh_exec_p50_ms", "ssh_podman_exec_p50_ms", "ssh_exec_speedup", "ssh_rtt_ms")


class Skipped(Exception):
    """A backend this machine cannot run: its phases are skipped, not failed."""


@dataclass(frozen=True)
class Baseline:
    """One CLI process per operation (subprocess.run, as mini-swe-agent does it), timed as often as the Sizes field
    ``n`` says; its distribution goes under ``key`` (``<name>_ms``), its p50 under ``<name>_p50_ms``."""

    key: str
    text: str  # for the progress line
    argv: Callable[..., list[str]]  # of the sandbox, for an exec
    n: str
    env: Callable[[], dict[str, str] | None] = local_podman_env


@dataclass(frozen=True)
class Side:
    """One backend under test: the shared phases (``EnvBench.phase_<name>``) reach it through ``open`` and its
    small pieces. Its phases are named, and its metric, summary and detail keys start with, ``prefix``; its
    footprint keys with ``label``. The ``*_n`` fields name the Sizes fields of its sample counts."""

    name: str  # the backend, as sandbox.backend spells it
    label: str
    prefix: str
    open: Callable[[], AbstractAsyncContextManager[SandboxBackend]]  # raises Skipped where it cannot run
    phases: tuple[str, ...] = ("exec", "cold_run")
    exec_n: tuple[str, str] = ("exec", "ping")  # exec('true') and ping samples
    cold_n: str = "cold_run"
    concurrent_n: tuple[str, ...] = ("concurrent",)  # sandboxes held at once, in steps
    exec_cli: Baseline | None = None  # vs exec through the agent
    run_cli: Baseline | None = None  # vs a cold start
    # Host processes and memory of these sandboxes, given this process's descendants from before them.
    footprint: Callable[[list[Sandbox], set[tuple[int, int]]], Awaitable[Footprint]] | None = None


# ---------------------------------------------------------------------- the suite


class EnvBench:
    """One run of the suite: phases fill ``metrics`` (the table), ``summaries`` and ``details`` (meta)."""

    def __init__(self, *, quick: bool, ssh: bool) -> None:
        self.quick = quick
        self.ssh = ssh
        self.sizes = QUICK if quick else FULL
        self.bench_id = uuid.uuid4().hex[:12]
        self.run_id = f"bench-{self.bench_id}"  # the EnvPools label their sandboxes swectl.run=<this>
        self.labels = {BENCH_LABEL: self.bench_id}
        self.progress = Progress(SUITE)
        self.metrics: dict[str, Any] = dict.fromkeys(METRICS + (SSH_METRICS if ssh else ()))
        self.summaries: dict[str, dict[str, float]] = {}
        self.details: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.interrupted = ""  # the signal's name once Ctrl-C / SIGTERM arrived
        self._gc_runs = 0
        self.ns_backend: NamespaceBackend | None = None  # while the namespace phases run
        self.ns_leftovers = 0  # namespace sandboxes of this run still there at cleanup (then removed)
        self.docker: Any = None  # the private dockerd, while the docker phases run
        self.test_nodes: TestNodes | None = None  # while the ssh phases run
        label = f"{BENCH_LABEL}={self.bench_id}"
        podman_exec = Baseline("podman_exec_ms", "podman exec CID true", lambda sb: ["podman", "exec", sb.id, "true"],
                               "podman_exec")
        podman_run = Baseline("podman_run_ms", "podman run --rm IMAGE true", lambda: [
            "podman", "run", "--rm", "--network", "none", "--label", label, IMAGE, "true"], "podman_run")
        docker_exec = Baseline("docker_cli_exec_ms", "docker exec CID true",
                               lambda sb: ["docker", "exec", sb.id, "true"], "podman_exec", lambda: self.docker.env())
        ssh_exec = Baseline("ssh_podman_exec_ms", "ssh ... podman exec CID true", self.ssh_argv, "ssh_podman_exec",
                            lambda: None)
        self.sides = [
            Side("podman", "podman", "", self.open_podman, ("exec", "cold_run", "podman_api", "concurrent"),
                 exec_cli=podman_exec, run_cli=podman_run, footprint=_podman_footprint),
            Side("namespace", "ns", "ns_", self.open_namespace,
                 ("exec", "warm_lease", "cold_run", "tools_mount", "disk", "concurrent"), cold_n="ns_cold_run",
                 concurrent_n=("concurrent", "ns_concurrent"), footprint=self.ns_footprint),
            Side("docker", "docker", "docker_", self.open_docker, exec_cli=docker_exec),
        ]  # fmt: skip
        if ssh:  # Podman on a test node over SSH (as many pings as execs)
            ssh_n = ("ssh_exec", "ssh_exec")
            self.sides.append(Side("podman", "ssh", "ssh_", self.open_ssh, ("exec", "rtt"), ssh_n, exec_cli=ssh_exec))

    # ------------------------------------------------------------------ the backends

    @asynccontextmanager
    async def open_podman(self) -> AsyncIterator[PodmanBackend]:
        yield await _podman_backend()

    @asynccontextmanager
    async def open_namespace(self) -> AsyncIterator[NamespaceBackend]:
        """Preparing the backend starts the node's nsbox daemon (shared by every namespace sandbox on the node,
        ours or not, and left running) or finds it running."""
        backend = self.ns_backend = NamespaceBackend(LocalNode(), SandboxConfig())
        try:
            await backend.prepare()
            self.details["ns_daemon_version"] = backend.daemon_version
            yield backend
        finally:
            await self.remove_ns_sandboxes()

    async def remove_ns_sandboxes(self) -> None:
        """Remove every namespace sandbox labelled with this run's bench id or run id (the EnvPool's), shielded and
        bounded: the phases destroy their own, this catches what a failure or Ctrl-C left. Safe to call twice."""
        backend = self.ns_backend
        if backend is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
            try:
                if not backend.prepared:
                    await backend.prepare()
                for labels in (self.labels, {LABEL_RUN: self.run_id}):
                    leftovers = [info.id for info in await backend.list(labels)]
                    await backend.remove(leftovers)
                    self.ns_leftovers += len(leftovers)
                await backend.aclose()
                self.ns_backend = None
            except (InfraError, OSError, ValueError) as exc:
                self.progress(f"cleanup: could not list or remove this run's namespace sandboxes: {exc}")

    async def ns_footprint(self, sandboxes: list[Sandbox], before: set[tuple[int, int]]) -> Footprint:
        """Each namespace sandbox's PID 1 (its exec agent) and everything in its PID namespace, plus any process
        outside them made for them: one naming a sandbox id (the SSH path's `attach`, for instance), a child of the
        nsbox daemon that is no sandbox (a launch helper, a scratch cleaner), or a new child of this process (a
        local controller hands the daemon a socket; it spawns nothing per sandbox). The daemon itself is shared by
        every sandbox on the node: not counted, its PSS is recorded apart."""
        assert self.ns_backend is not None
        ids = {s.id for s in sandboxes}
        pids = [pid for sandbox_id, pid in (await self.ns_backend.host_pids()).items() if sandbox_id in ids]

        def count() -> Footprint:
            procs, me = _processes(), os.getpid()
            daemons = {procs[pid].ppid for pid in pids if pid in procs}
            helpers = [pid for pid, proc in procs.items() if proc.ppid in daemons and proc.pidns == procs[me].pidns]
            new_children = [pid for pid in _descendants(procs, [me]) - {me} if (pid, procs[pid].start) not in before]
            return _footprint(
                ids, [*pids, *helpers, *new_children], procs,
                daemon_pids=sorted(daemons), daemon_pss_mib=round(sum(_pss_kib(pid) for pid in daemons) / 1024, 2),
            )  # fmt: skip

        return await anyio.to_thread.run_sync(count)

    @asynccontextmanager
    async def open_docker(self) -> AsyncIterator[DockerBackend]:
        """A private dockerd (no bridge, no iptables) loaded with the image from Podman."""
        from swectl.testing.docker import docker_unavailable, start_private_docker

        reason = docker_unavailable()
        if reason is not None:
            raise Skipped(reason)
        self.progress("docker: starting a private dockerd")
        self.docker = await anyio.to_thread.run_sync(start_private_docker)
        try:
            await anyio.to_thread.run_sync(self.docker.load_from_podman, [IMAGE])
            backend = DockerBackend(LocalNode(), msgspec.structs.replace(SandboxConfig(), docker_host=self.docker.host))
            await backend.prepare()
            yield backend
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.docker.stop)  # removes every container it holds

    @asynccontextmanager
    async def open_ssh(self) -> AsyncIterator[SandboxBackend]:
        """Podman on a test node (sshd in a network namespace) reached over SSH."""
        self.progress(f"ssh: starting test node {SSH_PREFIX}{SSH_INDEX} (sshd in a network namespace)")

        def start_nodes() -> TestNodes:
            # Stored from the thread: if we are cancelled meanwhile, the caller still finds and stops them.
            self.test_nodes = start_test_nodes(1, prefix=SSH_PREFIX, base_index=SSH_INDEX)
            return self.test_nodes

        try:
            cluster = (await anyio.to_thread.run_sync(start_nodes)).cluster_toml() + '[sandbox]\nbackend = "podman"\n'
            backends = make_backends(decode_config(tomllib.loads(cluster), "<test node>"))
            try:
                await backends[0][1].prepare()
                yield backends[0][1]
            finally:
                await close_backends(backends)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop_test_nodes)

    def stop_test_nodes(self) -> None:
        if self.test_nodes is not None:
            nodes, self.test_nodes = self.test_nodes, None
            stop_test_nodes(nodes)

    def ssh_argv(self, sandbox: Sandbox) -> list[str]:
        assert self.test_nodes is not None
        nodes, node = self.test_nodes, self.test_nodes.nodes[0]
        return [
            "ssh", "-i", nodes.key_path, "-o", f"UserKnownHostsFile={nodes.known_hosts_path}",
            "-o", "BatchMode=yes", "-p", str(node.port), f"root@{node.host}",
            "env", f"CONTAINERS_CONF={CONTAINERS_CONF}", "podman", "exec", sandbox.id, "true",
        ]  # fmt: skip

    # ------------------------------------------------------------------ driver

    async def run(self) -> None:
        """All phases; Ctrl-C cancels them through anyio, so shielded cleanup finishes its work."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_interrupt, tg.cancel_scope, name="Ctrl-C watcher")
            await self._phases()
            tg.cancel_scope.cancel("all phases done")

    async def _watch_interrupt(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self.interrupted = signal.Signals(signum).name
                self.progress(f"{self.interrupted}: cleaning up (Ctrl-C again aborts the cleanup)")
                scope.cancel(f"benchmark interrupted by {self.interrupted}")
                break
        # Leaving the receiver restores Python's handler: a second Ctrl-C raises KeyboardInterrupt.

    async def _phases(self) -> None:
        """Each backend's phases, named ``<prefix><phase>``; a broken phase or backend is reported, the others run."""
        gc.callbacks.append(self._on_gc)
        try:
            for side in self.sides:
                try:
                    async with side.open() as backend:
                        for phase in side.phases:
                            name, load = f"{side.prefix}{phase}", loadavg()
                            try:
                                await getattr(self, f"phase_{phase}")(side, backend)
                            except Exception as exc:
                                self._failed(name, exc)
                            self.details.setdefault("loadavg_at_phase_start", {})[name] = load
                except Skipped as why:
                    self.details[f"{side.label}_skipped"] = str(why)
                except Exception as exc:  # starting or closing the backend
                    self._failed(side.label, exc)
        finally:
            gc.callbacks.remove(self._on_gc)

    def _failed(self, name: str, exc: Exception) -> None:
        self.errors[name] = f"{type(exc).__name__}: {exc}"
        self.progress(f"{name}: FAILED: {self.errors[name]}")

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_runs += 1

    def spec(self) -> SandboxSpec:
        return SandboxSpec(image=IMAGE, labels=self.labels)

    def summary(self, name: str, samples: list[float]) -> dict[str, float]:
        self.summaries[name] = summarize(samples)
        return self.summaries[name]

    def record(self, **values: Any) -> None:
        """Table metrics into ``metrics``; the rest (what another backend has in the table) into ``details``."""
        for key, value in values.items():
            (self.metrics if key in self.metrics else self.details)[key] = value

    async def baseline(self, cli: Baseline, *args: Any) -> float:
        """Time a CLI baseline (``args``: for its argv); records its distribution and p50; returns the p50."""
        samples = await _time_cli(cli.argv(*args), getattr(self.sizes, cli.n), cli.env())
        p50 = self.summary(cli.key, samples)["p50"]
        self.record(**{f"{cli.key.removesuffix('_ms')}_p50_ms": p50})
        return p50

    # ------------------------------------------------------------------ phases, every backend

    async def phase_exec(self, side: Side, backend: SandboxBackend) -> None:
        p, n, baseline = side.prefix, self.sizes, side.exec_cli
        n_exec, n_ping = (getattr(n, field) for field in side.exec_n)
        self.progress(
            f"{p}exec: {n_exec} x exec('true') through the agent of a {side.name} sandbox, {n_ping} pings, "
            + (f"{getattr(n, baseline.n)} x `{baseline.text}`, " if baseline else "")
            + f"{n.bash_spawn} bash spawns inside (after {WARMUP} warm-up calls)"
        )
        sandbox = await backend.create(self.spec())
        try:
            exec_stats, ping_stats = await self._time_agent(sandbox, p, n_exec, n_ping)
            cli = await self.baseline(baseline, sandbox) if baseline else None
            result = await sandbox.exec(f"python3 -c {shlex.quote(BASH_SPAWN_SCRIPT)} {n.bash_spawn}", 300)
            if result.exit_code != 0:
                raise RuntimeError(f"bash spawn probe failed ({result.exit_code}): {result.output[-500:]}")
            spawn_stats = self.summary(f"{p}bash_spawn_ms", [int(x) / 1000 for x in result.output.split()])
        finally:
            await sandbox.destroy()
        self.record(**{
            f"{p}exec_p50_ms": exec_stats["p50"], f"{p}exec_p99_ms": exec_stats["p99"],
            f"{p}ping_p50_ms": ping_stats["p50"], f"{p}bash_spawn_p50_ms": spawn_stats["p50"],
            **({f"{p}exec_speedup": round(cli / exec_stats["p50"], 1)} if cli else {}),
        })  # fmt: skip

    async def _time_agent(
        self, sandbox: Sandbox, prefix: str, n_exec: int, n_ping: int
    ) -> tuple[dict[str, float], dict[str, float]]:
        """exec('true') and ping round trips through a sandbox's agent, each after WARMUP untimed calls; the
        summaries go under ``<prefix>exec_ms`` etc.; returns (exec, ping) summaries."""
        for _ in range(WARMUP):
            await _exec_true(sandbox)
        totals, inside, gc_hit = [], [], []
        for _ in range(n_exec):
            gc_before = self._gc_runs
            start = time.perf_counter_ns()
            result = await _exec_true(sandbox)
            totals.append(ms_since(start))
            inside.append(result.duration_s * 1000)
            gc_hit.append(self._gc_runs != gc_before)
        exec_stats = self.summary(f"{prefix}exec_ms", totals)
        self.summary(f"{prefix}exec_inside_agent_ms", inside)
        self.summary(f"{prefix}exec_outside_agent_ms", [t - i for t, i in zip(totals, inside, strict=True)])
        self.details[f"{prefix}exec_outliers"] = _outliers(totals, inside, gc_hit)

        for _ in range(WARMUP):
            await sandbox.ping()
        pings = []
        for _ in range(n_ping):
            start = time.perf_counter_ns()
            await sandbox.ping()
            pings.append(ms_since(start))
        return exec_stats, self.summary(f"{prefix}ping_ms", pings)

    async def phase_cold_run(self, side: Side, backend: SandboxBackend) -> None:
        p, n, baseline = side.prefix, getattr(self.sizes, side.cold_n), side.run_cli
        self.progress(
            f"{p}cold_run: {n} x create + first exec on the {side.name} backend"
            + (f"; {getattr(self.sizes, baseline.n)} x `{baseline.text}`" if baseline else "")
        )
        # One untimed start first: a backend looks an image up once (the namespace backend resolves its layers
        # with `podman image inspect`), as a pool's first start would.
        start = time.perf_counter_ns()
        await self._cold_start(backend)
        self.details[f"{p}first_start_and_destroy_ms"] = round(ms_since(start), 3)
        pairs = [await self._cold_start(backend) for _ in range(n)]
        cold = self.summary(f"{p}cold_run_ms", [total for total, _ in pairs])["p50"]
        self.summary(f"{p}cold_create_ms", [create for _, create in pairs])
        self.record(**{f"{p}cold_run_p50_ms": cold})
        if p:  # beside Podman's, this run
            podman_cold = self.metrics.get("cold_run_p50_ms")
            speedup = round(podman_cold / cold, 1) if podman_cold else None
            self.record(**{f"{p}cold_start_ms": cold, f"{p}cold_start_speedup": speedup})
        if baseline:
            await self.baseline(baseline)

    async def phase_tools_mount(self, side: Side, backend: SandboxBackend) -> None:
        """What the CLI agents' read-only tools folder (actors/cli_agents.py) adds to a cold start: starts with and
        without the mount, interleaved (the same load on both), the extra p50."""
        p, n = side.prefix, getattr(self.sizes, side.cold_n)
        tools = anyio.Path(default_tools_dir())
        if not await tools.is_dir():
            raise Skipped(f"no tools folder at {tools} (bash scripts/setup_cli_agents.sh)")
        self.progress(f"{p}tools_mount: {n} x cold start with the tools mount, {n} x without, interleaved")
        mounted = msgspec.structs.replace(self.spec(), mounts=tools_mounts("codex", str(tools)))
        plain, withm = [], []
        for _ in range(n):
            plain.append((await self._cold_start(backend))[0])
            withm.append((await self._cold_start(backend, mounted))[0])
        a = self.summary(f"{p}cold_run_unmounted_ms", plain)["p50"]
        b = self.summary(f"{p}cold_run_tools_mount_ms", withm)["p50"]
        self.record(**{f"{p}tools_mount_extra_ms": round(b - a, 3)})

    async def _cold_start(self, backend: SandboxBackend, spec: SandboxSpec | None = None) -> tuple[float, float]:
        """One create + first exec('true'), the sandbox destroyed after; returns (total, create) in ms."""
        sandbox = None
        try:
            start = time.perf_counter_ns()
            sandbox = await backend.create(spec or self.spec())
            create = ms_since(start)
            await _exec_true(sandbox)
            return ms_since(start), create
        finally:
            if sandbox is not None:
                await sandbox.destroy()

    async def phase_concurrent(self, side: Side, backend: SandboxBackend) -> None:
        p, label = side.prefix, side.label
        counts = sorted({getattr(self.sizes, field) for field in side.concurrent_n})
        self.progress(
            f"{p}concurrent: {' then '.join(map(str, counts))} {side.name} sandboxes ({CREATE_CONCURRENCY} started at "
            "once), one exec in each, their host memory and processes"
        )
        batch = _Batch(backend, self.spec())
        before = await anyio.to_thread.run_sync(_own_descendants)
        mem_before, create_s, exec_s = mem_used_mib(), 0.0, 0.0
        steps: list[tuple[Footprint, float]] = []  # at each count: the footprint, host memory used since before
        try:
            for done, count in zip([0, *counts], counts, strict=False):
                create_s += await batch.create(count - done)
                self.progress(f"{p}concurrent: {len(batch.sandboxes)} created in {create_s:.1f}s; exec in all at once")
                exec_s = await batch.exec_all()
                mem = mem_used_mib() - mem_before
                assert side.footprint is not None
                steps.append((await side.footprint(batch.sandboxes, before), mem))
        finally:
            self.progress(f"{p}concurrent: destroying {len(batch.sandboxes)} sandboxes")
            self.details[f"{p}concurrent_destroy_s"] = await batch.destroy_all()
        created, tried = len(batch.sandboxes), counts[-1]
        footprints = [{**f.record(), "mem_used_per_sandbox_mib": round(m / max(f.sandboxes, 1), 2)} for f, m in steps]
        outside = [f.outside_per_sandbox for f, _ in steps if f.sandboxes]
        self.record(**{
            f"{p}concurrent_ok": batch.exec_ok if batch.exec_ok == tried else 0,
            f"{p}concurrent_tried": tried,
            f"{p}concurrent_created": created,
            f"{p}concurrent_exec_ok": batch.exec_ok,
            f"{p}concurrent_create_s": round(create_s, 2),
            f"{p}concurrent_exec_s": round(exec_s, 3),
            f"{p}concurrent_mem_before_mib": round(mem_before, 1),
            f"{p}concurrent_mem_mib": round(mem, 1),
            f"{p}concurrent_mem_per_sandbox_mib": round(mem / max(created, 1), 2),
            f"{p}concurrent_problems": batch.problems[:10],
            # Per sandbox at the first count (the same on every backend).
            f"{label}_mem_per_sandbox_mib": steps[0][0].pss_per_sandbox_mib,
            f"{label}_host_procs_per_sandbox": max(outside) if outside else None,  # at any count
            f"{label}_footprint": footprints[0],
            **({f"{label}_footprint_at_full_count": footprints[-1]} if len(steps) > 1 else {}),
        })  # fmt: skip

    # ------------------------------------------------------------------ phases of one backend

    async def phase_warm_lease(self, side: Side, backend: SandboxBackend) -> None:
        n = self.sizes.warm_lease
        self.progress(f"warm_lease: EnvPool of {side.name} sandboxes, env_pool.warm={WARM_K}; {n} x acquire")
        lease_stats, stats = await self._warm_leases([f"sandbox.backend={side.name}"], "")
        self.metrics.update(warm_lease_p50_ms=lease_stats["p50"], warm_hits=stats.warm_hits)
        _check_warm_hits(stats, n)

    async def _warm_leases(self, overrides: list[str], prefix: str) -> tuple[dict[str, float], Any]:
        """``warm_lease`` acquires from an EnvPool (``env_pool.warm=WARM_K`` and ``overrides``), each released and
        the pool refilled before the next; summaries under ``<prefix>warm_lease_ms`` etc. Returns the acquire
        summary and the pool's statistics."""
        n = self.sizes.warm_lease
        cfg = load_config(None, [f"env_pool.warm={WARM_K}", *overrides])
        leases, pings, refills = [], [], []
        async with running_pool(cfg, self.run_id) as pool:
            with anyio.fail_after(180):
                await pool.wait_warm(WARM_K)
            for _ in range(n):
                with anyio.fail_after(60):
                    start = time.perf_counter_ns()
                    lease = await pool.acquire()
                    leases.append(ms_since(start))
                    # The same round trip once the refill the acquire triggered has been spawned:
                    # tells the ping inside acquire() apart from the rest of its cost.
                    start = time.perf_counter_ns()
                    await lease.ping()
                    pings.append(ms_since(start))
                start = time.perf_counter_ns()
                await pool.release(lease)  # destroys the sandbox; the warm loop starts another
                with anyio.fail_after(120):
                    await pool.wait_warm(WARM_K)
                refills.append(ms_since(start))
            stats = pool.statistics()
        self.details[f"{prefix}warm_pool_statistics"] = msgspec.to_builtins(stats)
        self.summary(f"{prefix}release_and_refill_ms", refills)
        self.summary(f"{prefix}warm_lease_ping_after_acquire_ms", pings)
        return self.summary(f"{prefix}warm_lease_ms", leases), stats

    async def phase_podman_api(self, side: Side, cli: SandboxBackend) -> None:
        n = self.sizes
        self.progress(
            f"podman_api: {n.cold_run} x create + first exec through the Podman API service and as many through the "
            f"CLI, interleaved; then {n.warm_lease} x acquire from a warm EnvPool of Podman sandboxes on each path"
        )
        api = await _podman_backend(podman_api=True)
        self.details["podman_api_socket"] = api.podman.socket
        samples: dict[str, list[tuple[float, float]]] = {"podman_cli_": [], "podman_api_": []}
        try:
            for _ in range(n.cold_run):  # the two paths take turns: both see the same load on the machine
                for prefix, backend in (("podman_cli_", cli), ("podman_api_", api)):
                    samples[prefix].append(await self._cold_start(backend))
        finally:
            await api.aclose()
        cold = {}
        for prefix, pairs in samples.items():
            cold[prefix] = self.summary(f"{prefix}cold_run_ms", [total for total, _ in pairs])["p50"]
            self.summary(f"{prefix}cold_create_ms", [create for _, create in pairs])
        self.metrics.update(
            podman_api_cold_run_p50_ms=cold["podman_api_"],
            podman_api_cold_speedup=round(cold["podman_cli_"] / cold["podman_api_"], 2),
        )
        self.progress("podman_api: warm lease through the CLI, then through the API service")
        podman = ["sandbox.backend=podman"]
        cli_lease, cli_stats = await self._warm_leases(podman, "podman_cli_")
        self.metrics.update(podman_cli_warm_lease_p99_ms=cli_lease["p99"])
        api_lease, api_stats = await self._warm_leases([*podman, "sandbox.podman_api=true"], "podman_api_")
        self.metrics.update(podman_api_warm_lease_p99_ms=api_lease["p99"])
        _check_warm_hits(cli_stats, n.warm_lease)
        _check_warm_hits(api_stats, n.warm_lease)

    async def phase_disk(self, side: Side, backend: SandboxBackend) -> None:
        p = side.prefix
        self.progress(f"{p}disk: a short episode in a {side.name} sandbox, then `du -sb` of its writable layer")
        inspect = await anyio.to_thread.run_sync(
            lambda: run_local_podman("image", "inspect", "--format", "{{.Size}}", IMAGE, timeout=60)
        )
        image_bytes = int(inspect.stdout.decode().strip())
        sandbox = await backend.create(self.spec())
        try:
            # The writable layer (overlay upper) of a disk-scratch sandbox, on the node while the sandbox lives.
            assert self.ns_backend is not None
            upper = Path(self.ns_backend.config.ns_state_dir) / "boxes" / sandbox.id / "upper"
            fresh = await anyio.to_thread.run_sync(_du_bytes, upper)
            result = await sandbox.exec(NS_EPISODE, 120)
            if result.exit_code != 0 or result.timed_out:
                raise RuntimeError(f"the episode failed ({result.exit_code}): {result.output[-500:]}")
            after = await anyio.to_thread.run_sync(_du_bytes, upper)
        finally:
            await sandbox.destroy()
        self.record(**{
            f"{p}disk_image_bytes": image_bytes, f"{p}disk_upper_fresh_bytes": fresh,
            f"{p}disk_upper_after_episode_bytes": after, f"{p}disk_episode": NS_EPISODE,
            f"{p}disk_frac": round(after / image_bytes, 5),
        })  # fmt: skip

    async def phase_rtt(self, side: Side, backend: SandboxBackend) -> None:
        assert self.test_nodes is not None
        self.progress(f"{side.prefix}rtt: {self.sizes.ssh_rtt} ssh echo round trips")
        rtt = self.summary("ssh_rtt_ms", await _ssh_echo_rtt(self.test_nodes, self.sizes.ssh_rtt))
        self.metrics.update(ssh_rtt_ms=rtt["p50"])

    # ------------------------------------------------------------------ report

    def goals(self) -> list[Goal]:
        podman_mem = self.metrics.get("podman_mem_per_sandbox_mib")
        ns_tried = max(self.sizes.ns_concurrent, self.sizes.concurrent)
        goals = [
            Goal("exec_p50_ms", "<=", 2.0),
            Goal("exec_speedup", ">=", 10.0),
            Goal("warm_lease_p50_ms", "<=", 5.0),
            Goal(
                "concurrent_ok", ">=", 128,
                not_applicable=f"--quick tries {self.sizes.concurrent}" if self.sizes.concurrent < 128 else "",
            ),
            Goal("ns_cold_start_speedup", ">=", 10.0),
            Goal("ns_tools_mount_extra_ms", "<=", 5.0),
            Goal(
                "ns_mem_per_sandbox_mib", "<=", round((podman_mem or 0.0) / 3, 3),
                text="<= podman_mem_per_sandbox_mib / 3",
                not_applicable="" if podman_mem is not None else "no podman_mem_per_sandbox_mib",
            ),
            Goal("ns_host_procs_per_sandbox", "<=", 0),
            Goal("ns_disk_frac", "<=", 0.05),
            Goal(
                "ns_concurrent_ok", ">=", NS_CONCURRENT_GOAL,
                not_applicable=f"--quick tries {ns_tried}" if ns_tried < NS_CONCURRENT_GOAL else "",
            ),
        ]  # fmt: skip
        if self.ssh:
            rtt = self.metrics.get("ssh_rtt_ms")
            goals.append(
                Goal(
                    "ssh_exec_p50_ms", "<=", round((rtt or 0.0) + 2.0, 3), text="<= ssh_rtt_ms + 2",
                    not_applicable="" if rtt is not None else "no ssh_rtt_ms",
                )
            )  # fmt: skip
        return goals

    def notes(self) -> list[str]:
        """Context for reading the table: where time goes, what the machine was doing."""
        d, s = self.details, self.summaries

        def exec_note() -> str:
            o = d["exec_outliers"]
            return (
                f"exec: p50 {s['exec_ms']['p50']} ms = {s['exec_inside_agent_ms']['p50']} ms inside the agent "
                f"(bash spawn alone: {s['bash_spawn_ms']['p50']} ms) + {s['exec_outside_agent_ms']['p50']} ms "
                f"transport; the {o['count']} samples >= p99 ({o['threshold_ms']} ms) spent "
                f"{o['inside_agent_share']:.0%} of their time inside the agent, {o['with_controller_gc']} "
                f"overlapped a controller GC; bash spawn p99 inside: {s['bash_spawn_ms']['p99']} ms"
            )

        def warm_note() -> str:
            return (
                f"warm lease: acquire p50 {s['warm_lease_ms']['p50']} ms / p99 {s['warm_lease_ms']['p99']} ms; "
                f"a ping right after it {s['warm_lease_ping_after_acquire_ms']['p50']} ms; release + refill "
                f"p50 {s['release_and_refill_ms']['p50']} ms"
            )

        def podman_api_note() -> str:
            return (
                f"podman API service vs CLI (interleaved): cold start p50 {s['podman_api_cold_run_ms']['p50']} vs "
                f"{s['podman_cli_cold_run_ms']['p50']} ms (create {s['podman_api_cold_create_ms']['p50']} vs "
                f"{s['podman_cli_cold_create_ms']['p50']} ms), p99 {s['podman_api_cold_run_ms']['p99']} vs "
                f"{s['podman_cli_cold_run_ms']['p99']} ms; warm lease p50 {s['podman_api_warm_lease_ms']['p50']} vs "
                f"{s['podman_cli_warm_lease_ms']['p50']} ms, p99 {s['podman_api_warm_lease_ms']['p99']} vs "
                f"{s['podman_cli_warm_lease_ms']['p99']} ms; release + refill p50 "
                f"{s['podman_api_release_and_refill_ms']['p50']} vs {s['podman_cli_release_and_refill_ms']['p50']} ms"
            )

        def concurrent_note() -> str:
            created = d["concurrent_created"]
            return (
                f"concurrent: {created} created, {d['concurrent_exec_ok']} execs ok in {d['concurrent_exec_s']} s, "
                f"{d['concurrent_mem_per_sandbox_mib']} MiB host memory per sandbox (host-side `podman exec -i` "
                f"attach processes: {d['podman_footprint']['host_attach_pss_mib'] / max(created, 1):.1f} MiB PSS "
                f"each), destroyed in {d['concurrent_destroy_s']} s"
            )

        def podman_footprint_note() -> str:
            f = d["podman_footprint"]
            return (
                f"podman footprint at {f['sandboxes']} sandboxes: {f['pss_per_sandbox_mib']} MiB PSS per sandbox over "
                f"{f['processes']} processes (conmon, catatonit, the container's processes, the exec session's conmon, "
                f"the host-side `podman exec -i`), {f['outside_per_sandbox']} of them per sandbox on the host's side"
            )

        def ns_exec_note() -> str:
            return (
                f"namespace exec: p50 {s['ns_exec_ms']['p50']} ms = {s['ns_exec_inside_agent_ms']['p50']} ms inside "
                f"the agent + {s['ns_exec_outside_agent_ms']['p50']} ms transport, p99 {s['ns_exec_ms']['p99']} ms; "
                f"ping p50 {s['ns_ping_ms']['p50']} ms (podman sandbox: exec {s['exec_ms']['p50']} ms, ping "
                f"{s['ping_ms']['p50']} ms)"
            )

        def ns_cold_note() -> str:
            return (
                f"namespace cold start: p50 {s['ns_cold_run_ms']['p50']} ms (create {s['ns_cold_create_ms']['p50']} "
                f"ms) / p99 {s['ns_cold_run_ms']['p99']} ms vs podman {s['cold_run_ms']['p50']} ms (create "
                f"{s['cold_create_ms']['p50']} ms); the first start with the image lookup took "
                f"{d['ns_first_start_and_destroy_ms']} ms with its destroy"
            )

        def ns_disk_note() -> str:
            return (
                f"namespace disk: the writable layer holds {d['ns_disk_upper_fresh_bytes']} bytes fresh, "
                f"{d['ns_disk_upper_after_episode_bytes']} after the episode; image {d['ns_disk_image_bytes']} bytes"
            )

        def ns_concurrent_note() -> str:
            step, full = d["ns_footprint"], d.get("ns_footprint_at_full_count", d["ns_footprint"])
            return (
                f"namespace concurrent: {d['ns_concurrent_created']} created in {d['ns_concurrent_create_s']} s, "
                f"{d['ns_concurrent_exec_ok']} execs ok in {d['ns_concurrent_exec_s']} s, destroyed in "
                f"{d['ns_concurrent_destroy_s']} s; PSS per sandbox {step['pss_per_sandbox_mib']} MiB at "
                f"{step['sandboxes']}, {full['pss_per_sandbox_mib']} MiB at {full['sandboxes']} (the shared nsbox "
                f"daemon: {full['daemon_pss_mib']} MiB, not counted); host memory in use per sandbox "
                f"{step['mem_used_per_sandbox_mib']} MiB at {step['sandboxes']} (podman: "
                f"{d.get('concurrent_mem_per_sandbox_mib', '-')} MiB, kernel memory included)"
            )

        def ssh_note() -> str:
            return (
                f"ssh: exec p50 {s['ssh_exec_ms']['p50']} ms, agent ping {s['ssh_ping_ms']['p50']} ms, echo rtt "
                f"{s['ssh_rtt_ms']['p50']} ms, `ssh ... podman exec` p50 {s['ssh_podman_exec_ms']['p50']} ms"
            )

        def load_note() -> str:
            loads = d["loadavg_at_phase_start"]
            return "load average (1 min) at phase start: " + ", ".join(f"{k} {v[0]}" for k, v in loads.items() if v)

        out = []
        notes = (
            exec_note, warm_note, podman_api_note, concurrent_note, podman_footprint_note, ns_exec_note, ns_cold_note,
            ns_disk_note, ns_concurrent_note, ssh_note, load_note,
        )  # fmt: skip
        for note in notes:
            try:
                out.append(note())
            except KeyError:
                continue  # that phase did not run or failed
        return out

    def meta(self, host: dict[str, Any], podman_version: str, leftovers: int) -> dict[str, Any]:
        goals = self.goals()
        return {
            **host,
            "loadavg_end": loadavg(),
            "podman_version": podman_version,
            "quick": self.quick,
            "ssh": self.ssh,
            "image": IMAGE,
            "bench_id": self.bench_id,
            "pool_run_id": self.run_id,
            "n": {**asdict(self.sizes), "warmup": WARMUP},
            "warm_pool_size": WARM_K,
            "create_concurrency": CREATE_CONCURRENCY,
            "sandbox_config": msgspec.to_builtins(SandboxConfig()),
            "goals": [goal.record(self.metrics) for goal in goals],
            # Goals this run cannot test (concurrency in --quick) neither pass nor fail it.
            "all_goals_met": all(goal.met(self.metrics.get(goal.metric)) is not False for goal in goals),
            "notes": self.notes(),
            "distributions_ms": self.summaries,
            "details": self.details,
            "errors": self.errors,
            "leftover_containers_removed_at_exit": leftovers,
            "leftover_ns_sandboxes_removed_at_exit": self.ns_leftovers,
            "wall_s": round(self.progress.elapsed_s(), 1),
        }


# ---------------------------------------------------------------- measurement helpers


async def _podman_backend(*, podman_api: bool = False) -> PodmanBackend:
    backend = PodmanBackend(LocalNode(), SandboxConfig(podman_api=podman_api))
    await backend.prepare()
    return backend


def _check_warm_hits(stats: Any, n: int) -> None:
    if stats.warm_hits != n:
        raise RuntimeError(
            f"only {stats.warm_hits} of {n} leases came from the warm pool ({stats.cold_starts} cold starts)"
        )


async def _exec_true(sandbox: Sandbox) -> ExecResult:
    result = await sandbox.exec("true", 10)
    if result.exit_code != 0 or result.timed_out:
        raise RuntimeError(f"exec('true') in {sandbox.name} gave {result.exit_code}: {result.output[:200]}")
    return result


def _run_cli_once(argv: list[str], env: dict[str, str] | None) -> float:
    """One blocking subprocess.run, output captured like mini-swe-agent does; returns milliseconds."""
    start = time.perf_counter_ns()
    done = subprocess.run(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        timeout=120, check=False,
    )  # fmt: skip
    elapsed = ms_since(start)
    if done.returncode != 0:
        output = done.stdout.decode(errors="replace")[-500:]
        raise RuntimeError(f"`{shlex.join(argv)}` exited {done.returncode}: {output}")
    return elapsed


async def _time_cli(argv: list[str], n: int, env: dict[str, str] | None) -> list[float]:
    """n timed runs of a CLI, each in a worker thread (the event loop stays free; Ctrl-C waits one run)."""
    return [await anyio.to_thread.run_sync(_run_cli_once, argv, env) for _ in range(n)]


async def _ssh_echo_rtt(nodes: TestNodes, n: int) -> list[float]:
    """Round trips of a few bytes through a persistent remote `cat` (no shell startup per sample)."""
    node = nodes.nodes[0]
    payload = b"swectl-rtt\n"
    with anyio.fail_after(60):
        conn = await asyncssh.connect(
            node.host, port=node.port, username="root", client_keys=[nodes.key_path],
            known_hosts=nodes.known_hosts_path, agent_path=None, config=[],
        )  # fmt: skip
    samples = []
    async with conn:
        process = await conn.create_process("cat", encoding=None)
        try:
            for i in range(WARMUP + n):
                with anyio.fail_after(10):
                    start = time.perf_counter_ns()
                    process.stdin.write(payload)
                    await process.stdin.drain()
                    echoed = b""
                    while len(echoed) < len(payload):
                        chunk = await process.stdout.read(len(payload) - len(echoed))
                        if not chunk:
                            raise RuntimeError("remote cat closed its output")
                        echoed += chunk
                    if i >= WARMUP:
                        samples.append(ms_since(start))
        finally:
            process.close()
    return samples


def _outliers(totals: list[float], inside: list[float], gc_hit: list[bool]) -> dict[str, Any]:
    """Where the slowest 1% of exec round trips spent their time: in the sandbox or on the way."""
    threshold = percentile(sorted(totals), 99)
    slow = [i for i, t in enumerate(totals) if t >= threshold]
    worst = sorted(slow, key=lambda i: totals[i], reverse=True)[:5]
    return {
        "threshold_ms": round(threshold, 3),
        "count": len(slow),
        "inside_agent_share": round(sum(inside[i] for i in slow) / sum(totals[i] for i in slow), 3),
        "with_controller_gc": sum(gc_hit[i] for i in slow),
        "worst": [
            {"index": i, "total_ms": round(totals[i], 3), "inside_agent_ms": round(inside[i], 3)} for i in worst
        ],
    }


async def _podman_footprint(sandboxes: list[Sandbox], before: set[tuple[int, int]]) -> Footprint:
    """Each container's conmon, catatonit (podman-init) and everything in its PID namespace (the idle `sleep`, the
    exec agent), the exec session's own conmon, and the `podman exec -i` holding the agent's stdio here (a child of
    this process): all found through the processes naming the container."""
    ids = [s.id for s in sandboxes]
    return await anyio.to_thread.run_sync(lambda: _footprint(ids, [], host_attach_pss_mib=_children_pss_mib()))


def _children_pss_mib() -> float:
    """Proportional memory of this process's children: the host-side `podman exec -i` attach processes."""
    return round(sum(_pss_kib(pid) for pid, proc in _processes().items() if proc.ppid == os.getpid()) / 1024, 1)


class _Batch:
    """Sandboxes of one backend held at once (the concurrency phase): started CREATE_CONCURRENCY at a time,
    then one exec('echo ok') in each, all at once; destroyed CREATE_CONCURRENCY at a time."""

    def __init__(self, backend: SandboxBackend, spec: SandboxSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.sandboxes: list[Sandbox] = []
        self.problems: list[str] = []
        self.exec_ok = 0

    async def create(self, count: int) -> float:
        """Start ``count`` more sandboxes (failures go to ``problems``); returns the seconds it took."""

        async def create_one(_: int) -> None:
            try:
                with anyio.fail_after(300):
                    self.sandboxes.append(await self.backend.create(self.spec))
            except (InfraError, TimeoutError) as exc:
                self.problems.append(f"create: {type(exc).__name__}: {exc}")

        return await run_each(create_one, range(count), CREATE_CONCURRENCY)

    async def exec_all(self) -> float:
        """exec('echo ok') in every sandbox at once, counting successes in ``exec_ok``; returns seconds."""

        async def exec_echo(sandbox: Sandbox) -> None:
            try:
                result = await sandbox.exec("echo ok", 60)
            except InfraError as exc:
                self.problems.append(f"exec in {sandbox.name}: {type(exc).__name__}: {exc}")
                return
            if result.exit_code == 0 and result.output == "ok\n":
                self.exec_ok += 1
            else:
                self.problems.append(f"exec in {sandbox.name}: exit {result.exit_code}, output {result.output[:200]!r}")

        self.exec_ok = 0
        return await run_each(exec_echo, list(self.sandboxes))

    async def destroy_all(self) -> float | None:
        """Destroy them all (shielded, at most CLEANUP_TIMEOUT_S); the seconds it took, None when cut off."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
            return round(await run_each(lambda sandbox: sandbox.destroy(), self.sandboxes, CREATE_CONCURRENCY), 2)
        return None


@dataclass(frozen=True)
class _Proc:
    ppid: int
    pidns: str  # the /proc/PID/ns/pid link, e.g. "pid:[4026531836]"
    start: int  # start time in clock ticks (tells a pid from its reuse)
    cmdline: str


@dataclass(frozen=True)
class Footprint:
    """The host processes of a set of sandboxes and their memory (PSS: each shared page split among the
    processes that map it, so summing over processes counts every page once)."""

    sandboxes: int
    processes: int
    pss_mib: float
    outside: list[str]  # command lines of the processes outside the sandboxes' PID namespaces
    extra: dict[str, Any]

    @property
    def pss_per_sandbox_mib(self) -> float | None:
        return round(self.pss_mib / self.sandboxes, 2) if self.sandboxes else None

    @property
    def outside_per_sandbox(self) -> float | None:
        return round(len(self.outside) / self.sandboxes, 2) if self.sandboxes else None

    def record(self) -> dict[str, Any]:
        return {
            "sandboxes": self.sandboxes, "processes": self.processes, "pss_mib": round(self.pss_mib, 1),
            "pss_per_sandbox_mib": self.pss_per_sandbox_mib, "outside_processes": len(self.outside),
            "outside_per_sandbox": self.outside_per_sandbox,
            "outside_examples": sorted({cmd[:160] for cmd in self.outside})[:5], **self.extra,
        }  # fmt: skip


def _processes() -> dict[int, _Proc]:
    """Every process on the host that we can read: {pid: _Proc}."""
    out: dict[int, _Proc] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(entry.name)] = _Proc(int(fields[1]), os.readlink(entry / "ns" / "pid"), int(fields[19]), cmdline)
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile, or a kernel thread we cannot look into
    return out


def _descendants(procs: dict[int, _Proc], roots: Iterable[int]) -> set[int]:
    """The roots (those still alive) and all their descendants."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, proc in procs.items():
        children[proc.ppid].append(pid)
    seen: set[int] = set()
    todo = [pid for pid in roots if pid in procs]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children[pid])
    return seen


def _pss_kib(pid: int) -> int:
    try:
        for row in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if row.startswith("Pss:"):
                return int(row.split()[1])
    except (OSError, IndexError, ValueError):
        pass  # exited meanwhile
    return 0


def _footprint(
    ids: Collection[str], roots: Iterable[int], procs: dict[int, _Proc] | None = None, **extra: Any
) -> Footprint:
    """The host processes of these sandboxes: the roots, every process whose command line names one of the
    ids (as a word: podman's conmon names its container in its options and paths), all their descendants,
    and every process in a PID namespace (other than ours) that one of those is in. ``outside``: those of
    them in our PID namespace, i.e. on the host's side of the sandboxes."""
    procs = _processes() if procs is None else procs
    host_ns = os.readlink("/proc/self/ns/pid")
    wanted = set(ids)
    named = {pid for pid, proc in procs.items() if wanted.intersection(re.findall(r"[\w.-]+", proc.cmdline))}
    members = _descendants(procs, {*roots, *named})
    sandbox_ns = {procs[pid].pidns for pid in members} - {host_ns}
    members |= {pid for pid, proc in procs.items() if proc.pidns in sandbox_ns}
    outside = [procs[pid].cmdline for pid in sorted(members) if procs[pid].pidns not in sandbox_ns]
    pss_mib = sum(_pss_kib(pid) for pid in members) / 1024
    return Footprint(len(wanted), len(members), pss_mib, outside, extra)


def _own_descendants() -> set[tuple[int, int]]:
    """(pid, start time) of this process's descendants now."""
    procs = _processes()
    return {(pid, procs[pid].start) for pid in _descendants(procs, [os.getpid()]) - {os.getpid()}}


def _du_bytes(path: Path) -> int:
    """``du -sb PATH``: apparent bytes of the files and directories under it."""
    done = subprocess.run(["du", "-sb", str(path)], capture_output=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"du -sb {path} exited {done.returncode}: {done.stderr.decode(errors='replace')[-300:]}")
    return int(done.stdout.split()[0])


def _podman_version() -> str:
    out = run_local_podman("version", "--format", "{{.Client.Version}}", timeout=60, check=False)
    return out.stdout.decode().strip() or f"unknown ({out.stderr.decode(errors='replace').strip()[:200]})"


def remove_leftovers(bench: EnvBench) -> int:
    """Last line of defence (runs outside the event loop, also after Ctrl-C): remove every container of
    this run that is still there; returns how many were found."""
    ids: set[str] = set()
    for label in (f"{BENCH_LABEL}={bench.bench_id}", f"{LABEL_RUN}={bench.run_id}"):
        out = run_local_podman("ps", "-a", "-q", "--no-trunc", "--filter", f"label={label}", timeout=120, check=False)
        ids.update(out.stdout.decode().split())
    if ids:
        run_local_podman("rm", "--force", "--ignore", "--time", "0", *sorted(ids), timeout=300, check=False)
    return len(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples: finishes within a minute")
    parser.add_argument("--ssh", action="store_true", help="also measure exec over ssh to a test node")
    args = parser.parse_args(argv)

    bench = EnvBench(quick=args.quick, ssh=args.ssh)
    host = host_meta()
    version = _podman_version()
    bench.progress(
        f"{'quick' if args.quick else 'full'} run, bench id {bench.bench_id}, podman {version}, "
        f"{host['cpu_count']} cpus, load {host['loadavg_start']}"
    )
    try:
        anyio.run(bench.run, backend="asyncio")
    except KeyboardInterrupt:  # before the watcher started, or a second Ctrl-C during cleanup
        bench.interrupted = "SIGINT"
    finally:
        bench.stop_test_nodes()  # only does something if the ssh phases were cut short
        leftovers = remove_leftovers(bench)
        if leftovers:
            bench.progress(f"removed {leftovers} leftover containers of this run")
        if bench.ns_backend is not None:  # the in-loop cleanup was cut short (a second Ctrl-C)
            anyio.run(bench.remove_ns_sandboxes, backend="asyncio")
        if bench.ns_leftovers:
            bench.progress(f"removed {bench.ns_leftovers} leftover namespace sandboxes of this run")
    if bench.interrupted:
        bench.progress("interrupted: no results written; everything this run created is removed")
        return 130

    meta = bench.meta(host, version, leftovers)
    path = write_results(SUITE, bench.metrics, meta, RESULTS_DIR / f"{SUITE}.quick.json" if args.quick else None)
    print(result_table(bench.metrics, bench.goals()))
    print("\n".join(["", *meta["notes"]]))
    for name, error in bench.errors.items():
        print(f"phase {name} failed: {error}")
    print(f"\nwrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
