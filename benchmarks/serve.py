"""`just bench serve`: `swectl serve` through HTTP, as slime's swe-rl rollouts use it, against the `podman exec`
per command that the swe-rl exec server runs, side by side in one run.

Phases (one `swectl serve` process on this machine, the client here, both on the same cores):

* allocate from the warm pool: ``/allocate`` of the warm image, one at a time, each lease closed and the pool
  refilled before the next (``serve_allocate_p50_ms``);
* unloaded exec: one lease, ``/exec`` one after another, of ``echo ok`` (the mechanism's round trip) and of an
  agent-like step (``ls | head && grep``: four processes of its own work, which both paths pay);
* the baseline: the same commands as ``podman exec CID bash -lc CMD``, one process per command (what the swe-rl
  exec server does for every /exec), one after another on an idle machine: the baseline's best case;
* concurrency: N leases (256) allocated, then three rounds over all of them at once, each lease running C commands
  (echo and the agent-like step alternating) with a think time between them (the model generating its next turn):
  ``rollout/serve`` at the rollout pace (2-10 s) through HTTP; ``stress/serve`` at a stress pace (0.5-1.5 s)
  through HTTP, to show where this machine saturates; ``rollout/podman`` the rollout pace with one ``podman exec``
  process per command instead (the swe-rl exec server's way; at most 64 at once, queueing counted).

``serve_exec_speedup``: the baseline's unloaded p50 over the service's p50 at the rollout pace with 256 leases (the
service measured loaded, the baseline idle: conservative); ``serve_exec_speedup_loaded``: both at the rollout pace.
The bench's HTTP client is a minimal keep-alive connection per lease (``Connection``), so that the numbers are
the service's, not a client library's.

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
import anyio.abc
import anyio.to_thread
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
# Think time between one lease's commands: the model generating its next turn. In an RL rollout of a 7-32B
# policy on SGLang a turn of a few hundred tokens takes seconds (tens of tokens/s per sequence at a large batch):
# 2-10 s is the rollout pace; 0.5-1.5 s is a stress pace (a very fast policy).
THINK_S = (2.0, 10.0)
STRESS_THINK_S = (0.5, 1.5)
SETTLE_IDLE = 0.85  # a timed phase starts once the CPUs are this idle (over 2 s) ...
SETTLE_MAX_S = 120.0  # ... or after this long (recorded either way)
PODMAN_INFLIGHT = 64  # the baseline's `podman exec` processes at once (each ~40 MB; 256 would risk the machine)


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(bundled_containers_conf())}


class Service:
    """`swectl serve` on a free port, with a warm pool of IMAGE and room for every lease of the run."""

    def __init__(self, leases: int, out: Path) -> None:
        self.run_id = f"bench-serve-{uuid.uuid4().hex[:8]}"
        self.log = out / f"{self.run_id}.stderr"
        argv = [sys.executable, "-m", "swectl.cli.main", "serve", "--port", "0", "--warm", str(WARM),
                "--set", f"run_id='{self.run_id}'", "--set", f"sandbox.image='{IMAGE}'",
                "--set", "sandbox.backend='podman'",  # the baseline runs `podman exec` in the same containers
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


class Connection:
    """One keep-alive HTTP/1.1 connection speaking just enough HTTP for JSON POSTs: what one rollout worker holds.

    The concurrency phase uses it instead of one shared httpx pool, whose bookkeeping with 256 connections cost
    about 9 ms of CPU per request here (as much as the service and the sandbox together): the bench measures the
    service, not its client."""

    def __init__(self, stream: anyio.abc.ByteStream, host: str) -> None:
        self._stream = stream
        self._host = host
        self._buffer = b""

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stream = await anyio.connect_tcp(host, int(port))
        return cls(stream, f"{host}:{port}")

    async def post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self._host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        await self._stream.send(head + data)
        while b"\r\n\r\n" not in self._buffer:
            self._buffer += await self._stream.receive()
        header, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        status = int(header.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in header.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(self._buffer) < length:
            self._buffer += await self._stream.receive()
        payload, self._buffer = self._buffer[:length], self._buffer[length:]
        answer = json.loads(payload)
        if status != 200 or not answer.get("ok"):
            raise RuntimeError(f"{path} -> {status}: {answer}")
        return answer

    async def aclose(self) -> None:
        await self._stream.aclose()


def cpu_idle_fraction(seconds: float) -> float:
    """The share of the machine's CPU time that was idle over the next ``seconds`` (from /proc/stat)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return (idle1 - idle0) / max(total1 - total0, 1)


class ServeBench:
    def __init__(self, *, quick: bool) -> None:
        self.quick = quick
        self.leases = 32 if quick else 256
        self.commands = 4 if quick else 6  # per lease and round in the concurrency phase
        self.samples = 30 if quick else 100
        self.progress = Progress(SUITE)
        self.metrics: dict[str, Any] = {}
        self.details: dict[str, Any] = {}
        self.distributions: dict[str, Any] = {}
        self.failures: list[str] = []

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
        """Through httpx (allocations are few; its own cost is in the number)."""
        await self.settle("allocate")
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
        await self.settle("unloaded")
        n = self.samples
        self.progress(f"unloaded: {n} x /exec on one lease, then {n} x `podman exec CID bash -lc CMD` (the baseline), "
                      f"for each of {', '.join(COMMANDS)}")
        allocation = await self.call(http, "/allocate", {"image": IMAGE})
        lease, container = allocation["lease_id"], allocation["container_id"]
        env = podman_env()
        for name, command in COMMANDS.items():
            connection = await Connection.open(str(http.base_url).rstrip("/"))
            for _ in range(5):
                await connection.post("/exec", {"lease_id": lease, "command": command, "cwd": "/"})
            served = []
            for _ in range(n):
                start = time.perf_counter_ns()
                answer = await connection.post("/exec", {"lease_id": lease, "command": command, "cwd": "/"})
                served.append(ms_since(start))
                assert answer["returncode"] == 0, answer
            await connection.aclose()
            baseline = []
            for i in range(n + 3):
                start = time.perf_counter_ns()
                done = subprocess.run(["podman", "exec", "-w", "/", container, "bash", "-lc", command],  # noqa: ASYNC221
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
        n = self.leases
        self.progress(f"concurrent: allocating {n} leases ({ALLOCATE_CONCURRENCY} allocations in flight)")
        mem_before = mem_used_mib()
        leases: list[dict] = []
        limiter = anyio.CapacityLimiter(ALLOCATE_CONCURRENCY)
        start = time.perf_counter_ns()

        async def allocate() -> None:
            async with limiter:
                try:
                    leases.append(await self.call(http, "/allocate", {"image": IMAGE}))
                except (RuntimeError, httpx.HTTPError) as exc:
                    self.failures.append(f"allocate: {exc}")

        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(allocate)
        self.details["concurrent_allocate_s"] = round(ms_since(start) / 1000, 1)
        self.details["concurrent_mem_per_lease_mib"] = round((mem_used_mib() - mem_before) / max(len(leases), 1), 2)
        complete = {}
        # The podman round last: its processes leave the machine loaded for a while after it.
        for round_name, think, via in (("rollout", THINK_S, "serve"), ("stress", STRESS_THINK_S, "serve"),
                                       ("rollout", THINK_S, "podman")):
            complete[(round_name, via)] = await self.concurrent_round(http, leases, round_name, think, via)
        self.progress(f"concurrent: closing {len(leases)} leases")
        async with anyio.create_task_group() as tg:
            for lease in leases:
                tg.start_soon(self.call, http, "/close", {"lease_id": lease["lease_id"]})
        d = self.distributions
        self.metrics.update(
            serve_exec_p50_ms=d["rollout_serve_echo_ms"].get("p50"),
            serve_exec_p99_ms=d["rollout_serve_echo_ms"].get("p99"),
            podman_exec_loaded_p50_ms=d["rollout_podman_echo_ms"].get("p50"),
            serve_exec_agentlike_p50_ms=d["rollout_serve_agentlike_ms"].get("p50"),
            serve_exec_agentlike_p99_ms=d["rollout_serve_agentlike_ms"].get("p99"),
            podman_exec_agentlike_loaded_p50_ms=d["rollout_podman_agentlike_ms"].get("p50"),
            serve_exec_stress_p50_ms=d["stress_serve_echo_ms"].get("p50"),
            serve_exec_stress_p99_ms=d["stress_serve_echo_ms"].get("p99"),
            serve_concurrent_ok=min(complete[("rollout", "serve")], complete[("stress", "serve")])
            if len(leases) == n else 0,
            serve_concurrent_tried=n,
            serve_errors=len(self.failures),
        )

    async def settle(self, phase: str) -> None:
        """Wait (up to SETTLE_MAX_S) until the machine is quiet: what the previous phase started (256 containers,
        podman processes) keeps the CPUs busy for a while after it, and a timed round must not pay for it."""
        started = time.monotonic()
        idle = 0.0
        while time.monotonic() - started < SETTLE_MAX_S:
            idle = await anyio.to_thread.run_sync(cpu_idle_fraction, 2.0)
            if idle >= SETTLE_IDLE:
                break
        self.details.setdefault("settle", {})[phase] = {"waited_s": round(time.monotonic() - started, 1),
                                                        "idle": round(idle, 2)}

    async def concurrent_round(self, http: httpx.AsyncClient, leases: list[dict], round_name: str,
                               think: tuple[float, float], via: str) -> int:
        """Every lease runs ``self.commands`` commands (echo and agent-like alternating) with ``think`` seconds
        between them, all leases at once: through the service (``via="serve"``) or as one ``podman exec`` process
        per command (``"podman"``, the swe-rl exec server's way; at most PODMAN_INFLIGHT at once, queueing
        counted, so the machine survives). Returns how many leases got every command answered."""
        c = self.commands
        await self.settle(f"{round_name}/{via}")
        self.progress(f"{round_name}/{via}: {len(leases)} leases x {c} commands, think {think[0]}-{think[1]} s "
                      f"(machine {self.details['settle'][f'{round_name}/{via}']['idle']:.0%} idle at the start)")
        times: dict[str, list[float]] = {name: [] for name in COMMANDS}
        complete = 0
        rng = random.Random(0)
        podman_slots = anyio.CapacityLimiter(PODMAN_INFLIGHT)
        env = podman_env()

        async def run(connection: Connection | None, lease: dict, command: str) -> int:
            if connection is not None:
                # Every call keeps the lease alive; a client heartbeats on a timer only through long silences.
                answer = await connection.post("/exec", {"lease_id": lease["lease_id"], "command": command, "cwd": "/"})
                return answer["returncode"]
            async with podman_slots:
                done = await anyio.run_process(["podman", "exec", "-w", "/", lease["container_id"], "bash", "-lc",
                                                command], env=env, check=False)
            return done.returncode

        async def agent(lease: dict) -> None:
            nonlocal complete
            ok = True
            await anyio.sleep(rng.uniform(0, think[1]))  # episodes are not in lockstep
            connection = await Connection.open(str(http.base_url).rstrip("/")) if via == "serve" else None
            try:
                for i in range(c):
                    name = list(COMMANDS)[i % len(COMMANDS)]
                    begin = time.perf_counter_ns()
                    try:
                        code = await run(connection, lease, COMMANDS[name])
                        times[name].append(ms_since(begin))
                        if code != 0:
                            ok = False
                            self.failures.append(f"{round_name}/{via}: exit {code}")
                    except (RuntimeError, OSError, anyio.EndOfStream) as exc:
                        ok = False
                        self.failures.append(f"{round_name}/{via}: {exc!r}")
                        break
                    await anyio.sleep(rng.uniform(*think))
            finally:
                if connection is not None:
                    await connection.aclose()
            complete += ok

        start = time.perf_counter_ns()
        async with anyio.create_task_group() as tg:
            for lease in leases:
                tg.start_soon(agent, lease)
        wall = ms_since(start) / 1000
        commands = sum(len(t) for t in times.values())
        for name, samples in times.items():
            self.distributions[f"{round_name}_{via}_{name}_ms"] = summarize(samples)
        self.details[f"{round_name}_{via}"] = {"commands": commands, "wall_s": round(wall, 1),
                                               "exec_per_s": round(commands / wall, 1), "leases_complete": complete}
        self.progress(f"{round_name}/{via}: {commands} commands in {wall:.1f} s, p50 "
                      f"{self.distributions[f'{round_name}_{via}_echo_ms'].get('p50')} ms (echo)")
        return complete

    def finish(self) -> None:
        m = self.metrics
        for served, base, key in (("serve_exec_p50_ms", "podman_exec_p50_ms", "serve_exec_speedup"),
                                  ("serve_exec_agentlike_p50_ms", "podman_exec_agentlike_p50_ms",
                                   "serve_exec_agentlike_speedup"),
                                  ("serve_exec_p50_ms", "podman_exec_loaded_p50_ms", "serve_exec_speedup_loaded")):
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
            "leases": bench.leases, "commands_per_lease": bench.commands, "think_s": list(THINK_S),
            "stress_think_s": list(STRESS_THINK_S), "podman_inflight": PODMAN_INFLIGHT, "warm": WARM,
            "failures": bench.failures[:20],
            "distributions_ms": bench.distributions, "details": bench.details,
            "service_log_tail": service.log.read_text(errors="replace")[-1500:]}
    report(SUITE, bench.metrics, meta, bench.goals())
    print(json.dumps(bench.details, indent=1)[:1500])
    return 0 if not bench.failures else 1


if __name__ == "__main__":
    sys.exit(main())
