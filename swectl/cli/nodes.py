"""`swectl nodes check`: connect to every node and report what it has and what is wrong, with hints."""

from __future__ import annotations

import argparse
import sys

import anyio
import msgspec

from swectl.actors.engine_kinds import KINDS, engine_kind
from swectl.actors.engines import engine_hosts
from swectl.actors.trainer import check_rendezvous, pick_port
from swectl.cli.common import config_args
from swectl.config import ClusterConfig, SshNodeConfig, load_config
from swectl.errors import InfraError
from swectl.images.store import store_for
from swectl.remote.nodes.backends import AnyBackend, close_backends, make_backends, namespace_probe
from swectl.sandbox import LABEL_MANAGED
from swectl.schema import NodeReport, SandboxSpec

LOW_DISK_GB = 10.0



def add_parser(sub: argparse._SubParsersAction) -> None:
    nodes = sub.add_parser("nodes", help="inspect and clean container nodes")
    nodes_sub = nodes.add_subparsers(dest="nodes_command", required=True, metavar="ACTION")
    check = nodes_sub.add_parser(
        "check", help="connect to every node; report podman version, images, disk, the images' disk and budget, "
        "swectl sandboxes, whether it can run namespace sandboxes, whether the trainer's nodes reach each other, "
        "problems"
    )
    config_args(check)
    check.add_argument("--json", action="store_true", help="print the reports as JSON")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    reports = anyio.run(check_nodes, config)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(reports)).decode() + "\n")
    else:
        print(format_reports(reports))
    return 0 if all(r.ok for r in reports) else 1


async def check_nodes(config: ClusterConfig, *, timeout_s: float = 60.0) -> list[NodeReport]:
    backends = make_backends(config)
    reports: dict[str, NodeReport] = {}
    try:
        async with anyio.create_task_group() as tg:
            for node_config, backend in backends:
                tg.start_soon(_check_one, config, node_config, backend, reports, timeout_s)
    finally:
        await close_backends(backends)
    ordered = [reports[node.name] for node, _ in backends]
    ordered = await _check_engine_kinds(config, ordered, timeout_s)
    if len(config.trainer_nodes()) > 1:
        ordered = await _check_trainer_reach(config, ordered, timeout_s)
    return ordered


# exit 0 when every module named in argv can be found (nothing is imported: a check of a few milliseconds)
_FIND_MODULES = ("import importlib.util, sys; "
                 "sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 3)")


async def _check_engine_kinds(config: ClusterConfig, reports: list[NodeReport], timeout_s: float
                              ) -> list[NodeReport]:
    """Whether each node can run each engine kind with the interpreter [engine] would start it with; a node of
    engine.nodes that cannot run engine.kind gets a problem."""
    engine_nodes = {n.name for n in config.engine_nodes()}
    found: dict[str, dict[str, str]] = {}
    try:
        with anyio.fail_after(timeout_s):
            async with engine_hosts(config.nodes) as hosts:
                for host in hosts:
                    kinds = found.setdefault(host.node.name, {})
                    for name, kind in KINDS.items():
                        python = kind.python(config.engine)
                        out = await host.node.run([python, "-c", _FIND_MODULES, *kind.modules])
                        kinds[name] = ("yes" if out.exit_code == 0 else
                                       f"no: {python} lacks {' or '.join(kind.modules)}" if out.exit_code == 3 else
                                       f"no: {python} does not run")
    except (InfraError, TimeoutError):
        return reports  # the sandbox checks already report an unreachable node
    updated = []
    for report in reports:
        kinds = found.get(report.node, {})
        problems = list(report.problems)
        verdict = kinds.get(config.engine.kind, "yes")
        if report.node in engine_nodes and verdict != "yes":
            hint = engine_kind(config.engine.kind).setup_hint
            problems.append(f"cannot run engine.kind = {config.engine.kind!r} ({verdict}) -- hint: {hint}")
        updated.append(msgspec.structs.replace(report, engine_kinds=kinds, problems=problems,
                                               ok=report.ok and not problems))
    return updated


async def _check_trainer_reach(config: ClusterConfig, reports: list[NodeReport], timeout_s: float
                               ) -> list[NodeReport]:
    """The trainer's nodes must reach the first one's rendezvous (torchrun's store): each that cannot gets a
    problem naming the address and the error (the check the trainer runs before it starts ranks)."""
    python = config.trainer.python or sys.executable
    problems: dict[str, list[str]] = {}
    try:
        with anyio.fail_after(timeout_s):
            async with engine_hosts(config.trainer_nodes()) as hosts:
                port = config.trainer.rdzv_port or await pick_port(hosts[0], python)
                failures = await check_rendezvous(hosts, port, python)
    except (InfraError, TimeoutError) as exc:
        failures = [f"{config.trainer_nodes()[0].name} the trainer's reachability check failed: {exc or 'timed out'}"]
    for line in failures:
        problems.setdefault(line.split(" ", 1)[0], []).append(
            f"{line} -- hint: trainer nodes must reach each other (routes, firewalls; trainer.rdzv_port)")
    by_name = {r.node: r for r in reports}
    for name, lines in problems.items():
        report = by_name.get(name) or NodeReport(node=name, ok=False)
        by_name[name] = msgspec.structs.replace(report, ok=False, problems=[*report.problems, *lines])
    return list(by_name.values())


async def _check_one(
    config: ClusterConfig,
    node_config,
    backend: AnyBackend,
    out: dict[str, NodeReport],
    timeout_s: float,
) -> None:
    report = dict(node=node_config.name, ok=False, problems=[], backend=config.sandbox.backend,
                  image_disk_budget_gb=node_config.image_disk_gb)
    problems: list[str] = report["problems"]
    with anyio.move_on_after(timeout_s) as scope:
        try:
            await _check_namespace_support(config, backend, report)
            await backend.prepare()
            await backend.probe()
            report["podman_version"] = await backend.cli.version()
        except InfraError as exc:
            problems.append(f"{exc} -- hint: {_connect_hint(node_config, str(exc))}")
            out[node_config.name] = NodeReport(**report)
            return
        try:
            report["images"] = images = await backend.cli.images()
            if config.sandbox.image not in images:
                problems.append(
                    f"image {config.sandbox.image} is missing -- hint: run `bash scripts/setup.sh` on the node "
                    "(builds the base image offline) or set sandbox.image"
                )
            report["free_disk_gb"] = free = round(await backend.cli.free_disk_gb(), 1)
            if free < LOW_DISK_GB:
                problems.append(f"only {free} GB free for containers -- hint: `podman system prune`")
            report["image_disk_gb"] = await _image_disk_gb(backend)
            containers = await backend.list({LABEL_MANAGED: "1"})
            report["swectl_containers"] = len(containers)
            if config.sandbox.image in images:
                sandbox = await backend.create(
                    SandboxSpec(image=config.sandbox.image, labels={LABEL_MANAGED: "1", "swectl.check": "1"})
                )
                try:
                    result = await sandbox.exec("echo swectl-ok", 30)
                    report["exec_ok"] = result.exit_code == 0 and "swectl-ok" in result.output
                    if not sandbox.uses_agent:
                        problems.append("image has no python3: commands use slow `podman exec` per call")
                finally:
                    await sandbox.destroy()
                if not report["exec_ok"]:
                    problems.append(f"a test command failed in a sandbox: {result.output[-500:]}")
        except InfraError as exc:
            problems.append(f"{exc} -- hint: see docs/sandboxes.md (podman, runc, the bundled containers.conf)")
    if scope.cancelled_caught:
        problems.append(f"check did not finish within {timeout_s}s -- hint: is the node overloaded?")
    report["ok"] = not problems
    out[node_config.name] = NodeReport(**report)


async def _check_namespace_support(
    config: ClusterConfig, backend: AnyBackend, report: dict
) -> None:
    """Whether the node could run namespace sandboxes, and why not (for every backend: it is a choice)."""
    await backend.node.connect()
    try:
        support = await namespace_probe(backend.node, config).check()
    except InfraError as exc:
        report["namespace"] = f"no: the check did not run ({exc})"
        return
    report["namespace"] = "yes" if support["ok"] else "no: " + "; ".join(support["problems"])
    report["unenforced_limits"] = support["unenforced_limits"]
    if backend.own_cgroup_limits and support["unenforced_limits"]:
        report["problems"].append(
            f"namespace sandboxes here cannot enforce {', '.join(support['unenforced_limits'])} limits (no cgroup "
            "controller for them) -- hint: enable the controllers, or use sandbox.backend = \"podman\""
        )


async def _image_disk_gb(backend: AnyBackend) -> float | None:
    """What the node's images take (GB, each shared layer once); None when its store does not say."""
    store = store_for(backend, None)
    if store is None:
        return None
    try:
        return round(await store.disk_bytes() / 1e9, 3)
    except InfraError:
        return None


def _image_disk(report: NodeReport) -> str:
    used = "?" if report.image_disk_gb is None else f"{report.image_disk_gb:g} GB"
    budget = f"budget {report.image_disk_budget_gb:g} GB" if report.image_disk_budget_gb else "no budget"
    return f"images take {used} ({budget})"


def _connect_hint(node_config, message: str) -> str:
    if isinstance(node_config, SshNodeConfig):
        if "host key" in message or "known_hosts" in message:
            return "verify the node's host key and add it to known_hosts"
        if "permission denied" in message:
            return f"authorize {node_config.identity_file}.pub for {node_config.user} on the node"
        return f"is sshd running on {node_config.host}:{node_config.port}, and is the address right?"
    if "not found" in message or "127" in message:
        return "install podman: `bash scripts/setup.sh`"
    return "run `bash scripts/setup.sh` (installs and configures podman)"


def _engine_kinds(report: NodeReport) -> str:
    """``cpu yes, sglang no, vllm yes``: which engine kinds the node can run (the reasons are in --json)."""
    return ", ".join(f"{kind} {verdict.split(':')[0]}" for kind, verdict in report.engine_kinds.items()) or "?"


def format_reports(reports: list[NodeReport]) -> str:
    lines = []
    for r in reports:
        status = "ok" if r.ok else "PROBLEM"
        disk = f"{r.free_disk_gb} GB free" if r.free_disk_gb is not None else "disk ?"
        lines.append(
            f"{r.node:<12} {status:<8} podman {r.podman_version or '?':<8} {len(r.images)} images  {disk}  "
            f"{_image_disk(r)}  "
            f"{r.swectl_containers} swectl sandboxes  exec on {r.backend} {'ok' if r.exec_ok else 'FAILED'}  "
            f"namespace sandboxes: {r.namespace or '?'}  engines: {_engine_kinds(r)}"
        )
        lines += [f"    - {p}" for p in r.problems]
    return "\n".join(lines)
