"""`just bench env`: the sandbox layer against mini-swe-agent's way, side by side in one run.

Measures on this machine (and, with ``--ssh``, on a throwaway sshd node in a network namespace):

* exec of ``true`` through swectl's exec agent vs one ``podman exec CID true`` process per command
  (subprocess.run of the CLI, as mini-swe-agent does it), against the same container;
* the agent's ping round trip, and what spawning bash costs inside the sandbox (for context);
* a lease served from the EnvPool's warm pool vs a cold start (``podman run`` + agent + first exec)
  and the plain ``podman run --rm IMAGE true``;
* how many sandboxes one node holds at once with every exec succeeding, and the host memory they take;
* the namespace backend (cold start, exec, memory and processes per sandbox, disk, 512 at once) and the
  docker backend (a private dockerd: cold start, exec through the agent and `docker exec`) beside Podman;
* Podman's lifecycle through the API service (``sandbox.podman_api``: ``podman system service`` over podman-py)
  beside the CLI (one ``podman`` process per create/list/remove), interleaved in one phase: cold start to first
  exec, and warm-lease latency (p99) from an EnvPool of Podman sandboxes on each path;
* the namespace backend (``sandbox.backend = "namespace"``) beside Podman: exec, cold start to first exec,
  the disk an episode leaves in a sandbox's writable layer, host memory (PSS) and host processes per sandbox
  next to Podman's counted the same way, and how many namespace sandboxes one node holds at once;
* over SSH: exec through the agent vs ``ssh ... podman exec`` per command, next to the ssh round trip.

Goals come from DESIGN.md section 6. Results: a table on stdout and ``benchmarks/results/env.json``.
Every container and namespace sandbox it creates carries ``swectl.bench=<id>``, except the EnvPool's, which
the pool labels itself (``swectl.run=<bench run id>``); all of them are removed at the end, also on error or
Ctrl-C (the nsbox daemon, shared by every namespace sandbox on the node, stays, and so does the node's Podman
API service: started by the podman_api phase if none ran, it is the one the backend manages).

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
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import asyncssh
import msgspec
from common import (
    Goal,
    Progress,
    host_meta,
    loadavg,
    mem_used_mib,
    ms_since,
    percentile,
    result_table,
    summarize,
    write_results,
)

from swectl.actors.env_pool import running_pool
from swectl.config import DEFAULT_IMAGE, SandboxConfig, decode_config, load_config
from swectl.errors import InfraError
from swectl.remote.nodes.agent_sandbox import AgentSandbox
from swectl.remote.nodes.backends import close_backends, make_backends
from swectl.remote.nodes.namespace_sandbox import NamespaceBackend
from swectl.remote.nodes.node import LocalNode
from swectl.remote.nodes.podman import bundled_containers_conf, local_podman_env, run_local_podman
from swectl.remote.nodes.podman_sandbox import PodmanBackend, PodmanSandbox
from swectl.sandbox import LABEL_RUN
from swectl.schema import ExecResult, SandboxSpec
from swectl.testing.nodes import TestNodes, start_test_nodes, stop_test_nodes

SUITE = "env"
REPO = Path(__file__).resolve().parents[1]
CONTAINERS_CONF = bundled_containers_conf()
IMAGE = DEFAULT_IMAGE
BENCH_LABEL = "swectl.bench"
WARMUP = 20  # calls before any timed exec / ping / rtt loop
WARM_K = 4  # env_pool.warm for the warm-lease phase (the config default)
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
    podman_exec: int
    bash_spawn: int
    warm_lease: int
    cold_run: int
    podman_run: int
    concurrent: int
    ssh_exec: int
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
    "ns_exec_p50_ms", "ns_cold_start_ms", "ns_cold_start_speedup", "ns_disk_frac",
    "ns_mem_per_sandbox_mib", "ns_host_procs_per_sandbox", "ns_concurrent_ok", "ns_concurrent_tried",
    "ns_concurrent_mem_mib", "docker_cold_run_p50_ms", "docker_exec_p50_ms", "docker_cli_exec_p50_ms",
)  # fmt: skip
SSH_METRICS = ("ssh_exec_p50_ms", "ssh_podman_exec_p50_ms", "ssh_exec_speedup", "ssh_rtt_ms")


class EnvBench:
    """One run of the suite: phases fill ``metrics`` (the table), ``summaries`` and ``details`` (meta)."""

    def __init__(self, *, quick: bool, ssh: bool) -> None:
        self.quick = quick
        self.ssh = ssh
        self.sizes = QUICK if quick else FULL
        self.bench_id = uuid.uuid4().hex[:12]
        self.run_id = f"bench-{self.bench_id}"  # the EnvPool labels its containers swectl.run=<this>
        self.labels = {BENCH_LABEL: self.bench_id}
        self.progress = Progress(SUITE)
        self.metrics: dict[str, Any] = dict.fromkeys(METRICS + (SSH_METRICS if ssh else ()))
        self.summaries: dict[str, dict[str, float]] = {}
        self.details: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.test_nodes: TestNodes | None = None
        self.interrupted = ""  # the signal's name once Ctrl-C / SIGTERM arrived
        self._gc_runs = 0
        self._ns_backend: NamespaceBackend | None = None  # shared by the ns_* phases, made by the first
        self.ns_leftovers = 0  # namespace sandboxes of this run still there at cleanup (then removed)

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
        phases: list[tuple[str, Callable[[], Any]]] = [
            ("exec", self.phase_exec),
            ("warm_lease", self.phase_warm_lease),
            ("cold_run", self.phase_cold_run),
            ("podman_api", self.phase_podman_api),
            ("concurrent", self.phase_concurrent),
            ("ns_exec", self.phase_ns_exec),
            ("ns_cold_run", self.phase_ns_cold_run),
            ("ns_disk", self.phase_ns_disk),
            ("ns_concurrent", self.phase_ns_concurrent),
            ("docker", self.phase_docker),
        ]
        if self.ssh:
            phases.append(("ssh", self.phase_ssh))
        gc.callbacks.append(self._on_gc)
        try:
            for name, phase in phases:
                load = loadavg()
                try:
                    await phase()
                except Exception as exc:  # a broken phase is reported; the others still run
                    self.errors[name] = f"{type(exc).__name__}: {exc}"
                    self.progress(f"{name}: FAILED: {self.errors[name]}")
                self.details.setdefault("loadavg_at_phase_start", {})[name] = load
        finally:
            gc.callbacks.remove(self._on_gc)
            await self.remove_ns_sandboxes()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_runs += 1

    def spec(self) -> SandboxSpec:
        return SandboxSpec(image=IMAGE, labels=self.labels)

    async def local_backend(self, *, podman_api: bool = False) -> PodmanBackend:
        backend = PodmanBackend(LocalNode(), SandboxConfig(podman_api=podman_api))
        await backend.prepare()
        return backend

    async def ns_backend(self) -> NamespaceBackend:
        """The namespace backend of the ns_* phases; preparing it starts the node's nsbox daemon (shared by every
        namespace sandbox on the node, ours or not, and left running) or finds it running."""
        if self._ns_backend is None:
            self._ns_backend = NamespaceBackend(LocalNode(), SandboxConfig())
        if not self._ns_backend.prepared:
            await self._ns_backend.prepare()
            self.details["ns_daemon_version"] = self._ns_backend.daemon_version
        return self._ns_backend

    @property
    def ns_backend_open(self) -> bool:
        return self._ns_backend is not None

    async def remove_ns_sandboxes(self) -> None:
        """Remove every namespace sandbox labelled with this run's bench id (shielded, bounded): the phases
        destroy their own, this catches what a failure or Ctrl-C left. Safe to call twice."""
        backend = self._ns_backend
        if backend is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
            try:
                await self.ns_backend()
                leftovers = [info.id for info in await backend.list(self.labels)]
                await backend.remove(leftovers)
                self.ns_leftovers += len(leftovers)
                await backend.aclose()
                self._ns_backend = None
            except (InfraError, OSError, ValueError) as exc:
                self.progress(f"cleanup: could not list or remove this run's namespace sandboxes: {exc}")

    def summary(self, name: str, samples: list[float]) -> dict[str, float]:
        self.summaries[name] = summarize(samples)
        return self.summaries[name]

    # ------------------------------------------------------------------ phases

    async def phase_exec(self) -> None:
        n = self.sizes
        self.progress(
            f"exec: {n.exec} x exec('true') through the agent, {n.ping} pings, {n.podman_exec} x "
            f"`podman exec CID true`, {n.bash_spawn} bash spawns inside (after {WARMUP} warm-up calls)"
        )
        backend = await self.local_backend()
        sandbox = await backend.create(self.spec())
        try:
            exec_stats, ping_stats = await self._time_agent(sandbox, "")

            argv = ["podman", "exec", sandbox.id, "true"]
            podman_stats = self.summary("podman_exec_ms", await _time_cli(argv, n.podman_exec, local_podman_env()))

            result = await sandbox.exec(f"python3 -c {shlex.quote(BASH_SPAWN_SCRIPT)} {n.bash_spawn}", 300)
            if result.exit_code != 0:
                raise RuntimeError(f"bash spawn probe failed ({result.exit_code}): {result.output[-500:]}")
            spawn_stats = self.summary("bash_spawn_ms", [int(x) / 1000 for x in result.output.split()])
        finally:
            await sandbox.destroy()
        self.metrics.update(
            exec_p50_ms=exec_stats["p50"],
            exec_p99_ms=exec_stats["p99"],
            podman_exec_p50_ms=podman_stats["p50"],
            exec_speedup=round(podman_stats["p50"] / exec_stats["p50"], 1),
            ping_p50_ms=ping_stats["p50"],
            bash_spawn_p50_ms=spawn_stats["p50"],
        )

    async def _time_agent(self, sandbox: AgentSandbox, prefix: str) -> tuple[dict[str, float], dict[str, float]]:
        """exec('true') and ping round trips through a sandbox's agent, each after WARMUP untimed calls; the
        summaries go under ``<prefix>exec_ms`` etc.; returns (exec, ping) summaries."""
        n = self.sizes
        for _ in range(WARMUP):
            await _exec_true(sandbox)
        totals, inside, gc_hit = [], [], []
        for _ in range(n.exec):
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
        for _ in range(n.ping):
            start = time.perf_counter_ns()
            await sandbox.ping()
            pings.append(ms_since(start))
        return exec_stats, self.summary(f"{prefix}ping_ms", pings)

    async def phase_warm_lease(self) -> None:
        n = self.sizes.warm_lease
        self.progress(f"warm_lease: EnvPool with env_pool.warm={WARM_K}; {n} x acquire from the warm pool")
        lease_stats, stats = await self._warm_leases([], "")
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

    async def phase_cold_run(self) -> None:
        n = self.sizes
        self.progress(f"cold_run: {n.cold_run} x create + first exec; {n.podman_run} x `podman run --rm IMAGE true`")
        backend = await self.local_backend()
        totals = await self._cold_starts(backend, n.cold_run, "")
        label = f"{BENCH_LABEL}={self.bench_id}"
        argv = ["podman", "run", "--rm", "--network", "none", "--label", label, IMAGE, "true"]
        podman_run = self.summary("podman_run_ms", await _time_cli(argv, n.podman_run, local_podman_env()))
        self.metrics.update(
            cold_run_p50_ms=self.summary("cold_run_ms", totals)["p50"], podman_run_p50_ms=podman_run["p50"]
        )

    async def _cold_starts(self, backend: PodmanBackend | NamespaceBackend, n: int, prefix: str) -> list[float]:
        """n x (create + first exec('true')), each sandbox destroyed after its timing; returns the totals (ms),
        and records the create part as ``<prefix>cold_create_ms``."""
        totals, creates = [], []
        for _ in range(n):
            total, create = await self._cold_start(backend)
            totals.append(total)
            creates.append(create)
        self.summary(f"{prefix}cold_create_ms", creates)
        return totals

    async def _cold_start(self, backend: PodmanBackend | NamespaceBackend) -> tuple[float, float]:
        """One create + first exec('true'), the sandbox destroyed after; returns (total, create) in ms."""
        sandbox = None
        try:
            start = time.perf_counter_ns()
            sandbox = await backend.create(self.spec())
            create = ms_since(start)
            await _exec_true(sandbox)
            return ms_since(start), create
        finally:
            if sandbox is not None:
                await sandbox.destroy()

    async def phase_podman_api(self) -> None:
        n = self.sizes
        self.progress(
            f"podman_api: {n.cold_run} x create + first exec through the Podman API service and as many through the "
            f"CLI, interleaved; then {n.warm_lease} x acquire from a warm EnvPool of Podman sandboxes on each path"
        )
        cli, api = await self.local_backend(), await self.local_backend(podman_api=True)
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

    async def phase_concurrent(self) -> None:
        tried = self.sizes.concurrent
        self.progress(f"concurrent: {tried} sandboxes ({CREATE_CONCURRENCY} started at once), then one exec in each")
        batch = _Batch(await self.local_backend(), self.spec())
        mem_before = mem_used_mib()
        try:
            create_s = await batch.create(tried)
            created = len(batch.sandboxes)
            self.progress(f"concurrent: {created} created in {create_s:.1f}s; exec('echo ok') in all at once")
            exec_s = await batch.exec_all()
            mem_after = mem_used_mib()
            attach_pss = _children_pss_mib()
            # What each container costs on the host, in PSS: its conmon, catatonit (podman-init) and everything
            # in its PID namespace (the idle `sleep`, the exec agent), the exec session's own conmon, and the
            # `podman exec -i` process holding the agent's stdio here (a child of this process).
            footprint = await anyio.to_thread.run_sync(_podman_footprint, [s.id for s in batch.sandboxes])
        finally:
            self.progress(f"concurrent: destroying {len(batch.sandboxes)} sandboxes")
            self.details["concurrent_destroy_s"] = await batch.destroy_all()
        mem = mem_after - mem_before
        created = len(batch.sandboxes)
        self.details.update(
            concurrent_created=created,
            concurrent_exec_ok=batch.exec_ok,
            concurrent_exec_s=round(exec_s, 3),
            concurrent_mem_before_mib=round(mem_before, 1),
            concurrent_mem_after_mib=round(mem_after, 1),
            concurrent_mem_per_sandbox_mib=round(mem / max(created, 1), 2),
            concurrent_host_attach_pss_mib=round(attach_pss, 1),
            concurrent_problems=batch.problems[:10],
            podman_footprint=footprint.record(),
        )
        self.metrics.update(
            concurrent_ok=batch.exec_ok if batch.exec_ok == tried else 0,
            concurrent_tried=tried,
            concurrent_create_s=round(create_s, 2),
            concurrent_mem_mib=round(mem, 1),
            podman_mem_per_sandbox_mib=footprint.pss_per_sandbox_mib,
            podman_host_procs_per_sandbox=footprint.outside_per_sandbox,
        )

    # ------------------------------------------------------------------ the namespace backend

    async def phase_docker(self) -> None:
        """The docker backend beside the others: a private dockerd (no bridge, no iptables) loaded with the
        image from Podman; cold start to first exec, exec through the agent, and `docker exec CID true`."""
        from swectl.remote.nodes.docker_sandbox import DockerBackend
        from swectl.testing.docker import docker_unavailable, start_private_docker

        reason = docker_unavailable()
        if reason is not None:
            self.details["docker_skipped"] = reason
            return
        n = self.sizes
        self.progress(f"docker: a private dockerd; {n.cold_run} x create + first exec, {n.exec} x exec('true'), "
                      f"{n.podman_exec} x `docker exec CID true`")  # fmt: skip
        daemon = await anyio.to_thread.run_sync(start_private_docker)
        try:
            await anyio.to_thread.run_sync(daemon.load_from_podman, [IMAGE])
            config = msgspec.structs.replace(SandboxConfig(), docker_host=daemon.host)
            backend = DockerBackend(LocalNode(), config)
            await backend.prepare()
            cold = self.summary("docker_cold_run_ms", await self._cold_starts(backend, n.cold_run, "docker_"))
            sandbox = await backend.create(self.spec())
            try:
                exec_stats, _ = await self._time_agent(sandbox, "docker_")
                cli = self.summary(
                    "docker_cli_exec_ms",
                    await _time_cli(["docker", "exec", sandbox.id, "true"], n.podman_exec, daemon.env()),
                )
            finally:
                await sandbox.destroy()
            self.metrics.update(
                docker_cold_run_p50_ms=cold["p50"], docker_exec_p50_ms=exec_stats["p50"],
                docker_cli_exec_p50_ms=cli["p50"],
            )  # fmt: skip
        finally:
            await anyio.to_thread.run_sync(daemon.stop)

    async def phase_ns_exec(self) -> None:
        n = self.sizes
        self.progress(
            f"ns_exec: {n.exec} x exec('true') through a namespace sandbox's agent, {n.ping} pings "
            f"(after {WARMUP} warm-up calls)"
        )
        backend = await self.ns_backend()
        sandbox = await backend.create(self.spec())
        try:
            exec_stats, _ = await self._time_agent(sandbox, "ns_")
        finally:
            await sandbox.destroy()
        self.metrics.update(ns_exec_p50_ms=exec_stats["p50"])

    async def phase_ns_cold_run(self) -> None:
        n = self.sizes.ns_cold_run
        self.progress(f"ns_cold_run: {n} x create + first exec on the namespace backend")
        backend = await self.ns_backend()
        # One untimed start first: it resolves the image's layers (`podman image inspect`), which a backend
        # does once per image, as a pool's first start would.
        start = time.perf_counter_ns()
        await (await backend.create(self.spec())).destroy()
        self.details["ns_first_start_and_destroy_ms"] = round(ms_since(start), 3)
        ns_cold = self.summary("ns_cold_run_ms", await self._cold_starts(backend, n, "ns_"))["p50"]
        podman_cold = self.metrics.get("cold_run_p50_ms")  # the cold_run phase's, this run
        self.metrics.update(
            ns_cold_start_ms=ns_cold,
            ns_cold_start_speedup=round(podman_cold / ns_cold, 1) if podman_cold else None,
        )

    async def phase_ns_disk(self) -> None:
        self.progress("ns_disk: a short episode in a namespace sandbox, then `du -sb` of its writable layer")
        backend = await self.ns_backend()
        inspect = await anyio.to_thread.run_sync(
            lambda: run_local_podman("image", "inspect", "--format", "{{.Size}}", IMAGE, timeout=60)
        )
        image_bytes = int(inspect.stdout.decode().strip())
        sandbox = await backend.create(self.spec())
        try:
            # The writable layer (overlay upper) of a disk-scratch sandbox, on the node while the sandbox lives.
            upper = Path(backend.config.ns_state_dir) / "boxes" / sandbox.id / "upper"
            fresh = await anyio.to_thread.run_sync(_du_bytes, upper)
            result = await sandbox.exec(NS_EPISODE, 120)
            if result.exit_code != 0 or result.timed_out:
                raise RuntimeError(f"the episode failed ({result.exit_code}): {result.output[-500:]}")
            after = await anyio.to_thread.run_sync(_du_bytes, upper)
        finally:
            await sandbox.destroy()
        self.details.update(
            ns_disk_image_bytes=image_bytes,
            ns_disk_upper_fresh_bytes=fresh,
            ns_disk_upper_after_episode_bytes=after,
            ns_disk_episode=NS_EPISODE,
        )
        self.metrics.update(ns_disk_frac=round(after / image_bytes, 5))

    async def phase_ns_concurrent(self) -> None:
        first, tried = self.sizes.concurrent, max(self.sizes.ns_concurrent, self.sizes.concurrent)
        self.progress(
            f"ns_concurrent: {first} namespace sandboxes (podman's count), exec in each, host memory and processes; "
            f"then up to {tried} ({CREATE_CONCURRENCY} started at once) and one exec in each"
        )
        backend = await self.ns_backend()
        batch = _Batch(backend, self.spec())
        # Children of this process that exist before: not the namespace sandboxes' (a local controller hands the
        # daemon a socket; it spawns nothing per sandbox).
        before = await anyio.to_thread.run_sync(_own_descendants)
        mem_before = mem_used_mib()
        try:
            create_s = await batch.create(first)
            exec_s = await batch.exec_all()
            self.progress(f"ns_concurrent: {len(batch.sandboxes)} created in {create_s:.1f}s, {batch.exec_ok} execs ok")
            step = await self._ns_footprint(backend, batch, before)
            mem_step = mem_used_mib()
            full = step
            if tried > first:
                create_s += await batch.create(tried - first)
                self.progress(f"ns_concurrent: {len(batch.sandboxes)} created; exec('echo ok') in all at once")
                batch.exec_ok = 0
                exec_s = await batch.exec_all()
                full = await self._ns_footprint(backend, batch, before)
            mem_after = mem_used_mib()
        finally:
            self.progress(f"ns_concurrent: destroying {len(batch.sandboxes)} sandboxes")
            self.details["ns_concurrent_destroy_s"] = await batch.destroy_all()
        created = len(batch.sandboxes)
        mem = mem_after - mem_before
        self.details.update(
            ns_concurrent_created=created,
            ns_concurrent_exec_ok=batch.exec_ok,
            ns_concurrent_create_s=round(create_s, 2),
            ns_concurrent_exec_s=round(exec_s, 3),
            ns_concurrent_mem_per_sandbox_mib=round(mem / max(created, 1), 2),
            ns_mem_used_per_sandbox_mib_at_podman_count=round((mem_step - mem_before) / max(step.sandboxes, 1), 2),
            ns_concurrent_problems=batch.problems[:10],
            ns_footprint_at_podman_count=step.record(),
            ns_footprint_at_full_count=full.record(),
        )
        self.metrics.update(
            # Per sandbox at podman's count (the same number of sandboxes as the concurrent phase's).
            ns_mem_per_sandbox_mib=step.pss_per_sandbox_mib,
            ns_host_procs_per_sandbox=max(step.outside_per_sandbox, full.outside_per_sandbox),
            ns_concurrent_ok=batch.exec_ok if batch.exec_ok == tried else 0,
            ns_concurrent_tried=tried,
            ns_concurrent_mem_mib=round(mem, 1),
        )

    async def _ns_footprint(
        self, backend: NamespaceBackend, batch: _Batch, before: set[tuple[int, int]]
    ) -> Footprint:
        """Host processes and PSS of the batch's namespace sandboxes: each one's PID 1 (its exec agent) and
        everything in its PID namespace, plus any process outside them made for them: one naming a sandbox id
        (the SSH path's `attach`, for instance), a child of the nsbox daemon that is no sandbox (a launch
        helper, a scratch cleaner), or a new child of this process. The daemon itself is shared by every
        sandbox on the node: not counted, its PSS is recorded apart."""
        ids = {s.id for s in batch.sandboxes}
        pids = [pid for sandbox_id, pid in (await backend.host_pids()).items() if sandbox_id in ids]
        return await anyio.to_thread.run_sync(_ns_footprint, sorted(ids), pids, before)

    async def phase_ssh(self) -> None:
        self.progress(f"ssh: starting test node {SSH_PREFIX}{SSH_INDEX} (sshd in a network namespace)")

        def start_nodes() -> TestNodes:
            # Stored from the thread: if we are cancelled meanwhile, the caller still finds and stops them.
            self.test_nodes = start_test_nodes(1, prefix=SSH_PREFIX, base_index=SSH_INDEX)
            return self.test_nodes

        try:
            nodes = await anyio.to_thread.run_sync(start_nodes)
            await self._ssh_measure(nodes)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop_test_nodes)

    def stop_test_nodes(self) -> None:
        if self.test_nodes is not None:
            nodes, self.test_nodes = self.test_nodes, None
            stop_test_nodes(nodes)

    async def _ssh_measure(self, nodes: TestNodes) -> None:
        n = self.sizes
        node = nodes.nodes[0]
        cfg = decode_config(tomllib.loads(nodes.cluster_toml()), "<test node>")
        backends = make_backends(cfg)
        backend = backends[0][1]
        try:
            await backend.prepare()
            sandbox = await backend.create(self.spec())
            try:
                self.progress(
                    f"ssh: {n.ssh_exec} x exec('true') over ssh, {n.ssh_rtt} ssh echo round trips, "
                    f"{n.ssh_podman_exec} x `ssh ... podman exec CID true`"
                )
                for _ in range(WARMUP):
                    await _exec_true(sandbox)
                totals, inside = [], []
                for _ in range(n.ssh_exec):
                    start = time.perf_counter_ns()
                    result = await _exec_true(sandbox)
                    totals.append(ms_since(start))
                    inside.append(result.duration_s * 1000)
                ssh_exec = self.summary("ssh_exec_ms", totals)
                self.summary("ssh_exec_inside_agent_ms", inside)
                pings = []
                for _ in range(n.ssh_exec):
                    start = time.perf_counter_ns()
                    await sandbox.ping()
                    pings.append(ms_since(start))
                self.summary("ssh_ping_ms", pings)
                rtt = self.summary("ssh_rtt_ms", await _ssh_echo_rtt(nodes, n.ssh_rtt))
                argv = [
                    "ssh", "-i", nodes.key_path, "-o", f"UserKnownHostsFile={nodes.known_hosts_path}",
                    "-o", "BatchMode=yes", "-p", str(node.port), f"root@{node.host}",
                    "env", f"CONTAINERS_CONF={CONTAINERS_CONF}", "podman", "exec", sandbox.id, "true",
                ]  # fmt: skip
                baseline = self.summary("ssh_podman_exec_ms", await _time_cli(argv, n.ssh_podman_exec, None))
            finally:
                await sandbox.destroy()
        finally:
            await close_backends(backends)
        self.metrics.update(
            ssh_exec_p50_ms=ssh_exec["p50"],
            ssh_podman_exec_p50_ms=baseline["p50"],
            ssh_rtt_ms=rtt["p50"],
            ssh_exec_speedup=round(baseline["p50"] / ssh_exec["p50"], 1),
        )

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
                f"attach processes: {d['concurrent_host_attach_pss_mib'] / max(created, 1):.1f} MiB PSS each), "
                f"destroyed in {d['concurrent_destroy_s']} s"
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
            step, full = d["ns_footprint_at_podman_count"], d["ns_footprint_at_full_count"]
            return (
                f"namespace concurrent: {d['ns_concurrent_created']} created in {d['ns_concurrent_create_s']} s, "
                f"{d['ns_concurrent_exec_ok']} execs ok in {d['ns_concurrent_exec_s']} s, destroyed in "
                f"{d['ns_concurrent_destroy_s']} s; PSS per sandbox {step['pss_per_sandbox_mib']} MiB at "
                f"{step['sandboxes']}, {full['pss_per_sandbox_mib']} MiB at {full['sandboxes']} (the shared nsbox "
                f"daemon: {full['daemon_pss_mib']} MiB, not counted); host memory in use per sandbox "
                f"{d['ns_mem_used_per_sandbox_mib_at_podman_count']} MiB at {step['sandboxes']} (podman: "
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


def _check_warm_hits(stats: Any, n: int) -> None:
    if stats.warm_hits != n:
        raise RuntimeError(
            f"only {stats.warm_hits} of {n} leases came from the warm pool ({stats.cold_starts} cold starts)"
        )


async def _exec_true(sandbox: PodmanSandbox) -> ExecResult:
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


def _children_pss_mib() -> float:
    """Proportional memory of this process's children: the host-side `podman exec -i` attach processes."""
    me, total_kib = str(os.getpid()), 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[1] != me:
                continue
            for row in (entry / "smaps_rollup").read_text().splitlines():
                if row.startswith("Pss:"):
                    total_kib += int(row.split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return total_kib / 1024


class _Batch:
    """Sandboxes of one backend held at once (the concurrency phases): started CREATE_CONCURRENCY at a time,
    then one exec('echo ok') in each, all at once; destroyed CREATE_CONCURRENCY at a time."""

    def __init__(self, backend: PodmanBackend | NamespaceBackend, spec: SandboxSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.sandboxes: list[AgentSandbox] = []
        self.problems: list[str] = []
        self.exec_ok = 0
        self._limiter = anyio.CapacityLimiter(CREATE_CONCURRENCY)

    async def create(self, count: int) -> float:
        """Start ``count`` more sandboxes (failures go to ``problems``); returns the seconds it took."""

        async def create_one() -> None:
            async with self._limiter:
                try:
                    with anyio.fail_after(300):
                        self.sandboxes.append(await self.backend.create(self.spec))
                except (InfraError, TimeoutError) as exc:
                    self.problems.append(f"create: {type(exc).__name__}: {exc}")

        start = time.perf_counter_ns()
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(create_one, name=f"create sandbox {len(self.sandboxes) + i}")
        return ms_since(start) / 1000

    async def exec_all(self) -> float:
        """exec('echo ok') in every sandbox at once, counting successes in ``exec_ok``; returns seconds."""

        async def exec_echo(sandbox: AgentSandbox) -> None:
            try:
                result = await sandbox.exec("echo ok", 60)
            except InfraError as exc:
                self.problems.append(f"exec in {sandbox.name}: {type(exc).__name__}: {exc}")
                return
            if result.exit_code == 0 and result.output == "ok\n":
                self.exec_ok += 1
            else:
                self.problems.append(f"exec in {sandbox.name}: exit {result.exit_code}, output {result.output[:200]!r}")

        start = time.perf_counter_ns()
        async with anyio.create_task_group() as tg:
            for sandbox in self.sandboxes:
                tg.start_soon(exec_echo, sandbox, name=f"exec in {sandbox.name}")
        return ms_since(start) / 1000

    async def destroy_all(self) -> float | None:
        """Destroy them all (shielded, at most CLEANUP_TIMEOUT_S); the seconds it took, None when cut off."""

        async def destroy(sandbox: AgentSandbox) -> None:
            async with self._limiter:
                await sandbox.destroy()

        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
            start = time.perf_counter_ns()
            async with anyio.create_task_group() as tg:
                for sandbox in self.sandboxes:
                    tg.start_soon(destroy, sandbox, name=f"destroy {sandbox.name}")
            return round(ms_since(start) / 1000, 2)
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


def _podman_footprint(cids: list[str]) -> Footprint:
    """Podman containers: found through the processes naming them (the container's conmon, each exec session's
    conmon, the `podman exec -i` attach process); catatonit and the agent are their descendants."""
    return _footprint(cids, [])


def _ns_footprint(ids: list[str], pids: list[int], before: set[tuple[int, int]]) -> Footprint:
    """Namespace sandboxes (their PID 1s' host pids given), see EnvBench._ns_footprint."""
    procs = _processes()
    host_ns = os.readlink("/proc/self/ns/pid")
    daemons = {procs[pid].ppid for pid in pids if pid in procs}
    helpers = [pid for pid, proc in procs.items() if proc.ppid in daemons and proc.pidns == host_ns]
    me = os.getpid()
    new_children = [pid for pid in _descendants(procs, [me]) - {me} if (pid, procs[pid].start) not in before]
    return _footprint(
        ids, [*pids, *helpers, *new_children], procs,
        daemon_pids=sorted(daemons), daemon_pss_mib=round(sum(_pss_kib(pid) for pid in daemons) / 1024, 2),
    )  # fmt: skip


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
        bench.stop_test_nodes()  # only does something if the ssh phase was cut short
        leftovers = remove_leftovers(bench)
        if leftovers:
            bench.progress(f"removed {leftovers} leftover containers of this run")
        if bench.ns_backend_open:  # the in-loop cleanup was cut short (a second Ctrl-C)
            anyio.run(bench.remove_ns_sandboxes, backend="asyncio")
        if bench.ns_leftovers:
            bench.progress(f"removed {bench.ns_leftovers} leftover namespace sandboxes of this run")
    if bench.interrupted:
        bench.progress("interrupted: no results written; everything this run created is removed")
        return 130

    meta = bench.meta(host, version, leftovers)
    path = write_results(SUITE, bench.metrics, meta)
    print(result_table(bench.metrics, bench.goals()))
    print("\n".join(["", *meta["notes"]]))
    for name, error in bench.errors.items():
        print(f"phase {name} failed: {error}")
    print(f"\nwrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
