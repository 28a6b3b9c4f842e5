"""`just bench serve`: `swectl serve` through HTTP, as slime's swe-rl rollouts use it, against the `podman exec`
per command that the swe-rl exec server runs, side by side in one run.

Phases (one `swectl serve` process on this machine, the client here, both on the same cores):

* allocate from the warm pool: ``/allocate`` of the warm image, one at a time, each lease closed and the pool
  refilled before the next (``serve_allocate_p50_ms``);
* unloaded exec: one lease, ``/exec`` one after another, of ``echo ok`` (the mechanism's round trip) and of an
  agent-like step (``ls | head && grep``: four processes of its own work, which both paths pay);
* the baseline: the same commands as ``podman exec CID bash -c CMD``, one process per command (what the swe-rl
  exec server does for every /exec), one after another on an idle machine: the baseline's best case;
* concurrency: N leases (256) allocated, then every lease runs C commands through HTTP with a think time between
  them (the model generating its next turn: uniform 0.5-1.5 s), all leases at once; exec round trip p50/p99
  over every command (the two commands alternate), and how many leases got every call answered
  (``serve_concurrent_ok``).

``serve_exec_speedup`` is the baseline's unloaded p50 over the service's p50 under the 256-lease load (the
service is measured loaded, the baseline idle: the ratio is conservative).

Run: ``.venv/bin/python benchmarks/serve.py [--quick]`` (``--quick``: 32 leases, fewer samples).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
from common import Goal, Progress, host_meta, loadavg, mem_used_mib, ms_since, report, summarize

from swectl.config import DEFAULT_IMAGE
from swectl.remote.nodes.podman import bundled_containers_conf

SUITE = "serve"
REPO = Path(__file__).resolve().parents[1]
IMAGE = DEFAULT_IMAGE
# The round trip is measured with a command that does almost nothing (what the mechanism costs, as `just bench env`
# does with `true`), and next to it with an agent-like step whose own work (four processes) both paths pay.
COMMANDS = {"echo": "echo ok", "agentlike": "ls -la / | head -5 && grep -c root /etc/passwd"}
WARM = 8
START_TIMEOUT_S = 120
ALLOCATE_CONCURRENCY = 16  # allocations in flight while the concurrency phase fills up
THINK_S = (0.5, 1.5)


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(bundled_containers_conf())}


class Service:
    """`swectl serve` on a free port, with a warm pool of IMAGE and room for every lease of the run."""

    def __init__(self, leases: int, out: Path) -> None:
        self.run_id = f"bench-serve-{uuid.uuid4().hex[:8]}"
        self.log = out / f"{self.run_id}.stderr"
        argv = [sys.executable, "-m", "swectl.cli.main", "serve", "--port", "0", "--warm", str(WARM),
                "--set", f"run_id='{self.run_id}'", "--set", f"sandbox.image='{IMAGE}'",
                "--set", f"nodes.0.max_running={leases + WARM + 16}", "--lease-ttl", "600",
                "--out", str(out / self.run_id)]
        out.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + START_TIMEOUT_S
        self.url = ""
        while not self.url:
            text = self.log.read_text(errors="replace")
            if "serving the fleet on " in text:
                self.url = text.split("serving the fleet on ", 1)[1].split()[0]
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"swectl serve did not start:\n{text[-2000:]}")
            else:
                time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        leftover = subprocess.run(["podman", "ps", "-aq", "--filter", f"label=swectl.run={self.run_id}"],
                                  capture_output=True, text=True, env=podman_env(), check=False).stdout.split()
        if leftover:
            subprocess.run(["podman", "rm", "-f", "-t", "0", *leftover], capture_output=True, env=podman_env(),
                           check=False)
        return len(leftover)


class ServeBench:
    def __init__(self, *, quick: bool) -> None:
        self.quick = quick
        self.leases = 32 if quick else 256
        self.commands = 5 if quick else 10  # per lease in the concurrency phase
        self.samples = 30 if quick else 100
        self.progress = Progress(SUITE)
        self.metrics: dict[str, Any] = {}
        self.details: dict[str, Any] = {}
        self.distributions: dict[str, Any] = {}
        self.errors: list[str] = []

    async def run(self, url: str) -> None:
        limits = httpx.Limits(max_connections=self.leases + 32, max_keepalive_connections=self.leases + 32)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
            await self.wait_warm(http)
            await self.phase_allocate(http)
            await self.phase_unloaded(http)
            await self.phase_concurrent(http)

    async def call(self, http: httpx.AsyncClient, path: str, body: dict) -> dict:
        r = await http.post(path, json=body)
        answer = r.json()
        if r.status_code != 200 or not answer.get("ok"):
            raise RuntimeError(f"{path} -> {r.status_code}: {answer}")
        return answer

    async def warm_count(self, http: httpx.AsyncClient) -> int:
        return (await http.get("/status")).json()["pool"]["warm"]

    async def wait_warm(self, http: httpx.AsyncClient) -> None:
        with anyio.fail_after(120):
            while await self.warm_count(http) < WARM:  # noqa: ASYNC110 (polls the service over HTTP)
                await anyio.sleep(0.1)

    async def phase_allocate(self, http: httpx.AsyncClient) -> None:
        n = self.samples // 2
        self.progress(f"allocate: {n} x /allocate from the warm pool ({WARM} warm), each closed and refilled")
        times = []
        for _ in range(n):
            start = time.perf_counter_ns()
            lease = (await self.call(http, "/allocate", {"image": IMAGE}))["lease_id"]
            times.append(ms_since(start))
            await self.call(http, "/close", {"lease_id": lease})
            await self.wait_warm(http)
        self.distributions["allocate_warm_ms"] = summarize(times)
        self.metrics["serve_allocate_p50_ms"] = self.distributions["allocate_warm_ms"]["p50"]

    async def phase_unloaded(self, http: httpx.AsyncClient) -> None:
        n = self.samples
        self.progress(f"unloaded: {n} x /exec on one lease, then {n} x `podman exec CID bash -c CMD` (the baseline), "
                      f"for each of {', '.join(COMMANDS)}")
        allocation = await self.call(http, "/allocate", {"image": IMAGE})
        lease, container = allocation["lease_id"], allocation["container_id"]
        env = podman_env()
        for name, command in COMMANDS.items():
            for _ in range(5):
                await self.call(http, "/exec", {"lease_id": lease, "command": command, "cwd": "/"})
            served = []
            for _ in range(n):
                start = time.perf_counter_ns()
                answer = await self.call(http, "/exec", {"lease_id": lease, "command": command, "cwd": "/"})
                served.append(ms_since(start))
                assert answer["returncode"] == 0, answer
            baseline = []
            for i in range(n + 3):
                start = time.perf_counter_ns()
                done = subprocess.run(["podman", "exec", "-w", "/", container, "bash", "-c", command],  # noqa: ASYNC221
                                      capture_output=True, env=env, timeout=60, check=False)
                if i >= 3:  # warm-up
                    baseline.append(ms_since(start))
                if done.returncode != 0:
                    raise RuntimeError(f"podman exec failed: {done.stderr.decode(errors='replace')}")
            self.distributions[f"exec_unloaded_{name}_ms"] = summarize(served)
            self.distributions[f"podman_exec_{name}_ms"] = summarize(baseline)
        await self.call(http, "/close", {"lease_id": lease})
        d = self.distributions
        self.metrics["serve_exec_unloaded_p50_ms"] = d["exec_unloaded_echo_ms"]["p50"]
        self.metrics["podman_exec_p50_ms"] = d["podman_exec_echo_ms"]["p50"]
        self.metrics["serve_exec_agentlike_unloaded_p50_ms"] = d["exec_unloaded_agentlike_ms"]["p50"]
        self.metrics["podman_exec_agentlike_p50_ms"] = d["podman_exec_agentlike_ms"]["p50"]

    async def phase_concurrent(self, http: httpx.AsyncClient) -> None:
        n, c = self.leases, self.commands
        self.progress(f"concurrent: {n} leases ({ALLOCATE_CONCURRENCY} allocations in flight), then {c} commands "
                      f"each with {THINK_S[0]}-{THINK_S[1]} s think time between them, all leases at once")
        mem_before = mem_used_mib()
        leases: list[str] = []
        failures: list[str] = []
        limiter = anyio.CapacityLimiter(ALLOCATE_CONCURRENCY)
        start = time.perf_counter_ns()

        async def allocate() -> None:
            async with limiter:
                try:
                    leases.append((await self.call(http, "/allocate", {"image": IMAGE}))["lease_id"])
                except (RuntimeError, httpx.HTTPError) as exc:
                    failures.append(f"allocate: {exc}")

        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(allocate)
        self.details["concurrent_allocate_s"] = round(ms_since(start) / 1000, 1)
        self.details["concurrent_mem_per_lease_mib"] = round((mem_used_mib() - mem_before) / max(len(leases), 1), 2)
        took = self.details["concurrent_allocate_s"]
        self.progress(f"concurrent: {len(leases)} leases in {took} s; running commands")
        times: dict[str, list[float]] = {name: [] for name in COMMANDS}
        complete = 0
        rng = random.Random(0)

        async def agent(lease: str) -> None:
            nonlocal complete
            ok = True
            await anyio.sleep(rng.uniform(0, THINK_S[1]))  # episodes are not in lockstep
            for i in range(c):
                name = list(COMMANDS)[i % len(COMMANDS)]
                begin = time.perf_counter_ns()
                try:
                    answer = await self.call(http, "/exec", {"lease_id": lease, "command": COMMANDS[name], "cwd": "/"})
                    times[name].append(ms_since(begin))
                    if answer["returncode"] != 0:
                        ok = False
                        failures.append(f"exec exit {answer['returncode']}: {answer['output'][:200]}")
                except (RuntimeError, httpx.HTTPError) as exc:
                    ok = False
                    failures.append(f"exec: {exc}")
                await self.call(http, "/heartbeat", {"lease_id": lease})
                await anyio.sleep(rng.uniform(*THINK_S))
            complete += ok

        start = time.perf_counter_ns()
        async with anyio.create_task_group() as tg:
            for lease in leases:
                tg.start_soon(agent, lease)
        wall = ms_since(start) / 1000
        commands = sum(len(t) for t in times.values())
        self.progress(f"concurrent: {commands} commands in {wall:.1f} s; closing the leases")
        async with anyio.create_task_group() as tg:
            for lease in leases:
                tg.start_soon(self.call, http, "/close", {"lease_id": lease})
        for name, samples in times.items():
            self.distributions[f"exec_concurrent_{name}_ms"] = summarize(samples)
        self.details.update(concurrent_commands=commands, concurrent_wall_s=round(wall, 1),
                            concurrent_exec_per_s=round(commands / wall, 1), failures=failures[:20],
                            failure_count=len(failures))
        d = self.distributions
        self.metrics.update(
            serve_exec_p50_ms=d["exec_concurrent_echo_ms"].get("p50"),
            serve_exec_p99_ms=d["exec_concurrent_echo_ms"].get("p99"),
            serve_exec_agentlike_p50_ms=d["exec_concurrent_agentlike_ms"].get("p50"),
            serve_exec_agentlike_p99_ms=d["exec_concurrent_agentlike_ms"].get("p99"),
            serve_concurrent_ok=complete if len(leases) == n else 0,
            serve_concurrent_tried=n,
            serve_errors=len(failures),
        )

    def finish(self) -> None:
        m = self.metrics
        for served, base, key in (("serve_exec_p50_ms", "podman_exec_p50_ms", "serve_exec_speedup"),
                                  ("serve_exec_agentlike_p50_ms", "podman_exec_agentlike_p50_ms",
                                   "serve_exec_agentlike_speedup")):
            if m.get(served) and m.get(base):
                m[key] = round(m[base] / m[served], 1)

    def goals(self) -> list[Goal]:
        return [
            Goal("serve_exec_speedup", ">=", 20.0),
            Goal("serve_concurrent_ok", ">=", 256,
                 not_applicable=f"--quick tries {self.leases}" if self.leases < 256 else ""),
            Goal("serve_errors", "<=", 0),
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 leases and fewer samples (about a minute)")
    args = parser.parse_args()
    bench = ServeBench(quick=args.quick)
    host = host_meta()
    bench.progress(f"{'quick' if args.quick else 'full'} run, {host['cpu_count']} cpus, load {host['loadavg_start']}")
    service = Service(bench.leases, REPO / "runs" / "bench-serve")
    bench.progress(f"swectl serve at {service.url} (run {service.run_id})")
    try:
        anyio.run(bench.run, service.url, backend="asyncio")
    except KeyboardInterrupt:
        service.stop()
        return 130
    finally:
        stop_started = time.monotonic()
        leftovers = service.stop()
        bench.details["stop_s"] = round(time.monotonic() - stop_started, 1)
        bench.details["leftover_containers_after_stop"] = leftovers
    bench.finish()
    meta = {**host, "loadavg_end": loadavg(), "quick": args.quick, "image": IMAGE, "commands": COMMANDS,
            "leases": bench.leases, "commands_per_lease": bench.commands, "think_s": list(THINK_S), "warm": WARM,
            "distributions_ms": bench.distributions, "details": bench.details,
            "service_log_tail": service.log.read_text(errors="replace")[-1500:]}
    report(SUITE, bench.metrics, meta, bench.goals())
    print(json.dumps(bench.details, indent=1)[:1500])
    return 0 if not bench.details.get("failure_count") else 1


if __name__ == "__main__":
    sys.exit(main())
