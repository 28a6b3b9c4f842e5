"""The trainer on two SSH test nodes that reach each other as a fleet's nodes do (swectl.testing.nodes): torchrun's
rendezvous on the first node, one rank on each, the golden losses of the one-node run, a checkpoint written across
the nodes and resumed, batches passed from rank 0 to the other node's rank with the request; and a node that cannot
reach the rendezvous named within seconds, by the trainer and by `swectl nodes check`."""

from __future__ import annotations

import json
import os
import re
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from swectl.actors.engines import engine_hosts
from swectl.actors.trainer import Trainer, TrainerLostError
from swectl.config import TrainerConfig, decode_config
from swectl.rl.shm import BatchWriter
from swectl.rl.wire import TrainerSettings
from swectl.testing import nodes as testnodes
from swectl.testing.batches import synthetic_batch

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
GOLDEN = Path(__file__).parent.parent / "golden" / "train_losses.json"
TOLERANCE = 1e-4  # as the one-node golden test: the same world size gives the same sums


@pytest.fixture(scope="module")
def fleet() -> Iterator[testnodes.TestNodes]:
    reason = testnodes.can_run_test_nodes()
    if reason is not None:
        pytest.skip(reason)
    with testnodes.test_nodes(2, prefix="swm", base_index=231) as nodes:
        yield nodes


def _settings(model: Path, out: Path, **kw: object) -> TrainerSettings:
    return TrainerSettings(**{"model": str(model), "out_dir": str(out), "lr": 1e-3, "total_steps": 8,
                              "micro_batch_tokens": 128, "seed": 0, **kw})  # type: ignore[arg-type]


def _vocab(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def _ranks(marker: str) -> dict[int, str]:
    """The running trainer ranks whose command line holds ``marker``: pid -> network namespace (by name)."""
    names = {os.stat(f"/run/netns/{n}").st_ino: n for n in os.listdir("/run/netns")}
    found = {}
    for pid in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"swectl.remote.programs.trainer" in argv and b"torch.distributed.run" not in argv \
                    and not argv[0].endswith(b"sh") and marker.encode() in b" ".join(argv):
                found[int(pid)] = names.get(os.stat(f"/proc/{pid}/ns/net").st_ino, "host")
        except (OSError, ValueError):
            continue
    return found


def _trainer_lost(raised: BaseException) -> TrainerLostError:
    """The TrainerLostError inside what a task group raised (its first leaf), or an AssertionError."""
    error = raised
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, TrainerLostError), repr(raised)
    return error


def _netns_of_ranks(marker: str) -> set[str]:
    return set(_ranks(marker).values())


async def _run(fleet: testnodes.TestNodes, body, settings: TrainerSettings,  # type: ignore[no-untyped-def]
               said: list[str] | None = None, ranks: int | list[int] = 1) -> None:
    """A trainer with ``ranks`` on each test node (one count, or one per node); ``body(trainer, ready)`` runs once
    it is ready; its progress lines go to ``said``."""
    config = decode_config(tomllib.loads(fleet.cluster_toml(extra_node_fields="connect_timeout_s = 5")))
    async with engine_hosts([config.node(n.name) for n in fleet.nodes]) as hosts:
        trainer = Trainer(TrainerConfig(nproc_per_node=ranks, start_timeout_s=300, step_timeout_s=300), settings,
                          hosts, log_dir=Path(settings.out_dir), progress=None if said is None else said.append)
        async with anyio.create_task_group() as tg:
            ready = await tg.start(trainer.run)
            await body(trainer, ready)
            tg.cancel_scope.cancel()


async def test_two_nodes_train_the_golden_steps_and_resume(model: Path, fleet: testnodes.TestNodes,
                                                           tmp_path: Path) -> None:
    vocab = _vocab(model)
    golden = json.loads(GOLDEN.read_text())
    ckpt = tmp_path / "ckpt"
    seen: dict[str, float] = {}

    async def straight(trainer: Trainer, ready) -> None:  # type: ignore[no-untyped-def]
        assert ready.world_size == 2
        assert trainer.stream_frames  # no shared memory spans two nodes
        assert _netns_of_ranks(str(tmp_path / "a")) == {n.netns for n in fleet.nodes}  # one rank on each node
        with BatchWriter() as writer:
            for step, algorithm in ((1, "sft"), (2, "sft"), (3, "grpo"), (4, "grpo")):
                ref = writer.write(synthetic_batch(step, algorithm, vocab, seed=step))
                reply = await trainer.step(step, ref, frame_bytes=writer.frame_bytes(ref))
                assert not reply.skipped, reply.reason
                seen[f"{algorithm}_{step}"] = reply.metrics["loss"]
                seen[f"grad_norm_{step}"] = reply.metrics["grad_norm"]
                if step == 2:
                    done = await trainer.checkpoint(2, ckpt)
                    assert Path(done.path) == ckpt

    async def resumed(trainer: Trainer, ready) -> None:  # type: ignore[no-untyped-def]
        assert ready.step == 2
        with BatchWriter() as writer:
            ref = writer.write(synthetic_batch(3, "grpo", vocab, seed=3))
            reply = await trainer.step(3, ref, frame_bytes=writer.frame_bytes(ref))
        seen["resumed_grpo_3"] = reply.metrics["loss"]

    said: list[str] = []
    with anyio.fail_after(600):
        await _run(fleet, straight, _settings(model, tmp_path / "a"), said)
    first, second = fleet.nodes
    assert sorted(said) == [f"trainer: rank 0 is up on {first.name} (1 of 2 ranks)",
                            f"trainer: rank 1 is up on {second.name} (2 of 2 ranks)"] or sorted(said) == [
        f"trainer: rank 0 is up on {first.name} (2 of 2 ranks)",
        f"trainer: rank 1 is up on {second.name} (1 of 2 ranks)"], said
    with anyio.fail_after(600):
        await _run(fleet, resumed, _settings(model, tmp_path / "b", resume=str(ckpt)))
    for key, value in golden.items():
        assert seen[key] == pytest.approx(value, rel=TOLERANCE, abs=1e-7), (key, seen[key], value)
    assert seen["resumed_grpo_3"] == pytest.approx(seen["grpo_3"], rel=1e-5)
    assert not _netns_of_ranks(str(tmp_path))


async def test_two_ranks_on_one_node_and_one_on_the_other_match_three_ranks_on_one(
        model: Path, fleet: testnodes.TestNodes, tmp_path: Path) -> None:
    """trainer.nproc_per_node = [2, 1]: a world of three over two nodes gives the losses of three ranks on this
    machine (the same world size gives the same sums)."""
    vocab = _vocab(model)
    steps = ((1, "sft"), (2, "grpo"))

    async def losses(trainer: Trainer, frames: bool) -> list[float]:
        out = []
        with BatchWriter() as writer:
            for step, algorithm in steps:
                ref = writer.write(synthetic_batch(step, algorithm, vocab, seed=step))
                reply = await trainer.step(step, ref, frame_bytes=writer.frame_bytes(ref) if frames else None)
                assert not reply.skipped, reply.reason
                out.append(reply.metrics["loss"])
        return out

    split: list[float] = []
    said: list[str] = []

    async def across(trainer: Trainer, ready) -> None:  # type: ignore[no-untyped-def]
        assert ready.world_size == 3
        where = sorted(_ranks(str(tmp_path / "split")).values())
        assert where == sorted([fleet.nodes[0].netns, fleet.nodes[0].netns, fleet.nodes[1].netns]), where
        split.extend(await losses(trainer, True))

    with anyio.fail_after(600):
        await _run(fleet, across, _settings(model, tmp_path / "split"), said, ranks=[2, 1])
    assert any(line.endswith("(3 of 3 ranks)") for line in said), said
    local: list[float] = []
    async with engine_hosts([decode_config({}).nodes[0]]) as hosts:
        trainer = Trainer(TrainerConfig(nproc_per_node=3, start_timeout_s=300, step_timeout_s=300),
                          _settings(model, tmp_path / "local"), hosts, log_dir=tmp_path / "local")
        with anyio.fail_after(600):
            async with anyio.create_task_group() as tg:
                await tg.start(trainer.run)
                local.extend(await losses(trainer, trainer.stream_frames))
                tg.cancel_scope.cancel()
    assert split == pytest.approx(local, rel=TOLERANCE, abs=1e-7), (split, local)


async def test_a_node_that_cannot_reach_the_rendezvous_is_named_at_once(model: Path, fleet: testnodes.TestNodes,
                                                                         tmp_path: Path) -> None:
    first, second = fleet.nodes
    # the second node loses its route to the others (what the test nodes lacked before they were a fleet)
    await anyio.run_process(["ip", "-n", second.netns, "route", "del", testnodes.FLEET_NET])
    try:
        started = time.monotonic()
        with pytest.raises(BaseException) as caught, anyio.fail_after(120):
            await _run(fleet, None, _settings(model, tmp_path))
        took = time.monotonic() - started
    finally:
        await anyio.run_process(["ip", "-n", second.netns, "route", "add", testnodes.FLEET_NET, "via",
                                 f"10.200.{second.index}.1"])
    error = _trainer_lost(caught.value)
    message = str(error)
    assert f"{second.name} cannot reach {first.name}'s rendezvous {first.host}:" in message, message
    assert "unreachable" in message.lower(), message
    assert took < 60, took  # not trainer.start_timeout_s
    assert not _netns_of_ranks(str(tmp_path))  # no rank was started


async def test_a_node_that_loses_its_network_mid_run_is_named_and_the_checkpoint_stays(
        model: Path, fleet: testnodes.TestNodes, tmp_path: Path) -> None:
    """The second node's network goes (packets vanish, nothing closes) after a checkpoint: the next step ends in
    TrainerLostError naming that node within a minute, and the checkpoint written before is whole."""
    vocab = _vocab(model)
    second = fleet.nodes[1]
    ckpt = tmp_path / "ckpt"
    config = decode_config(tomllib.loads(fleet.cluster_toml(
        extra_node_fields="connect_timeout_s = 5\nkeepalive_interval_s = 1\nkeepalive_count_max = 3")))
    started = 0.0
    try:
        with pytest.raises(BaseException) as caught, anyio.fail_after(400):
            async with engine_hosts([config.node(n.name) for n in fleet.nodes]) as hosts:
                trainer = Trainer(TrainerConfig(nproc_per_node=1, start_timeout_s=300, step_timeout_s=120),
                                  _settings(model, tmp_path / "run"), hosts, log_dir=tmp_path)
                async with anyio.create_task_group() as tg:
                    await tg.start(trainer.run)
                    with BatchWriter() as writer:
                        ref = writer.write(synthetic_batch(1, "sft", vocab, seed=1))
                        await trainer.step(1, ref, frame_bytes=writer.frame_bytes(ref))
                        await trainer.checkpoint(1, ckpt)
                        await anyio.to_thread.run_sync(second.cut_network)
                        started = time.monotonic()
                        ref = writer.write(synthetic_batch(2, "sft", vocab, seed=2))
                        await trainer.step(2, ref, frame_bytes=writer.frame_bytes(ref))
    finally:
        await anyio.to_thread.run_sync(second.restore_network)
    took = time.monotonic() - started
    error = _trainer_lost(caught.value)
    assert second.name in str(error), str(error)
    assert took < 90, took
    assert (ckpt / ".metadata").is_file() or any(ckpt.rglob(".metadata")), sorted(ckpt.rglob("*"))


async def test_nodes_whose_clocks_differ_train_the_golden_steps(model: Path, fleet: testnodes.TestNodes,
                                                                 tmp_path: Path) -> None:
    """The second node's trainer processes run two hours ahead (libfaketime, through trainer.python): nothing in
    the rendezvous, the steps or the checkpoint compares wall clocks across nodes, so the losses are the golden
    ones."""
    import shutil
    import sys

    faketime = shutil.which("faketime")
    assert faketime, "faketime comes from scripts/setup.sh (apt)"
    second = fleet.nodes[1]
    marker = tmp_path / "skewed"
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh
if [ "$(ip netns identify $$)" = "{second.netns}" ]; then
    touch {marker}
    exec {faketime} -f "+2h" {sys.executable} "$@"
fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    vocab = _vocab(model)
    golden = json.loads(GOLDEN.read_text())
    seen: dict[str, float] = {}
    config = decode_config(tomllib.loads(fleet.cluster_toml(extra_node_fields="connect_timeout_s = 5")))
    with anyio.fail_after(600):
        async with engine_hosts([config.node(n.name) for n in fleet.nodes]) as hosts:
            trainer = Trainer(TrainerConfig(nproc_per_node=1, python=str(python), start_timeout_s=300,
                                            step_timeout_s=300), _settings(model, tmp_path / "run"), hosts,
                              log_dir=tmp_path)
            async with anyio.create_task_group() as tg:
                await tg.start(trainer.run)
                with BatchWriter() as writer:
                    for step, algorithm in ((1, "sft"), (2, "sft")):
                        ref = writer.write(synthetic_batch(step, algorithm, vocab, seed=step))
                        reply = await trainer.step(step, ref, frame_bytes=writer.frame_bytes(ref))
                        seen[f"{algorithm}_{step}"] = reply.metrics["loss"]
                await trainer.checkpoint(2, tmp_path / "ckpt")
                tg.cancel_scope.cancel()
    assert marker.exists()  # the second node's ranks did run skewed
    for key, value in seen.items():
        assert value == pytest.approx(golden[key], rel=TOLERANCE, abs=1e-7), (key, value, golden[key])


async def test_a_rendezvous_port_that_is_taken_is_named_at_once(model: Path, fleet: testnodes.TestNodes,
                                                                 tmp_path: Path) -> None:
    """trainer.rdzv_port fixed to a port something else holds on the first node: one line naming it, no rank."""
    import sys

    first = fleet.nodes[0]
    holder = await anyio.open_process(["ip", "netns", "exec", first.netns, sys.executable, "-c",
                                       "import socket, time; s = socket.create_server(('0.0.0.0', 0)); "
                                       "print(s.getsockname()[1], flush=True); time.sleep(600)"])
    try:
        assert holder.stdout is not None
        with anyio.fail_after(30):
            port = int((await holder.stdout.receive()).decode().split()[0])
        config = decode_config(tomllib.loads(fleet.cluster_toml(extra_node_fields="connect_timeout_s = 5")))
        async with engine_hosts([config.node(n.name) for n in fleet.nodes]) as hosts:
            trainer = Trainer(TrainerConfig(nproc_per_node=1, rdzv_port=port, start_timeout_s=300), _settings(
                model, tmp_path), hosts, log_dir=tmp_path)
            started = time.monotonic()
            with pytest.raises(BaseException) as caught, anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    await tg.start(trainer.run)
            took = time.monotonic() - started
    finally:
        holder.kill()
        await holder.aclose()
    error = _trainer_lost(caught.value)
    assert f"{first.name} cannot listen on the rendezvous port {port}" in str(error), str(error)
    assert "Address already in use" in str(error), str(error)
    assert took < 60, took
    assert not _netns_of_ranks(str(tmp_path))


async def test_nodes_check_reports_trainer_nodes_that_cannot_reach_each_other(fleet: testnodes.TestNodes) -> None:
    from swectl.cli.nodes import check_nodes

    first, second = fleet.nodes
    names = ", ".join(f'"{n.name}"' for n in fleet.nodes)
    toml = fleet.cluster_toml(extra_node_fields="connect_timeout_s = 5") + f"\n[trainer]\nnodes = [{names}]\n"
    config = decode_config(tomllib.loads(toml))
    with anyio.fail_after(300):
        reports = {r.node: r for r in await check_nodes(config)}
    assert not any("rendezvous" in p for r in reports.values() for p in r.problems), reports
    await anyio.run_process(["ip", "-n", second.netns, "route", "del", testnodes.FLEET_NET])
    try:
        with anyio.fail_after(300):
            reports = {r.node: r for r in await check_nodes(config)}
    finally:
        await anyio.run_process(["ip", "-n", second.netns, "route", "add", testnodes.FLEET_NET, "via",
                                 f"10.200.{second.index}.1"])
    assert not reports[second.name].ok
    problem = next(p for p in reports[second.name].problems if "rendezvous" in p)
    assert f"{second.name} cannot reach {first.name}'s rendezvous {first.host}:" in problem, problem
    assert not any("rendezvous" in p for p in reports[first.name].problems)


async def test_a_rank_killed_on_the_second_node_is_noticed_at_once(model: Path, fleet: testnodes.TestNodes,
                                                                    tmp_path: Path) -> None:
    second = fleet.nodes[1]
    killed_at = 0.0

    async def body(trainer: Trainer, ready) -> None:  # type: ignore[no-untyped-def]
        nonlocal killed_at
        on_second = [pid for pid, netns in _ranks(str(tmp_path)).items() if netns == second.netns]
        assert len(on_second) == 1, _ranks(str(tmp_path))
        os.kill(on_second[0], 9)
        killed_at = time.monotonic()
        await anyio.sleep_forever()

    with pytest.raises(BaseException) as caught, anyio.fail_after(240):
        await _run(fleet, body, _settings(model, tmp_path))
    noticed = time.monotonic() - killed_at
    error = _trainer_lost(caught.value)
    assert "exited with" in str(error), str(error)
    assert noticed < 60, noticed  # torchrun's agent on the first node may see it first: either node is named
    assert not _ranks(str(tmp_path))  # both nodes' ranks are gone


def test_one_swectl_up_across_nodes_trains_and_resumes(model: Path, fleet: testnodes.TestNodes,
                                                       tmp_path: Path) -> None:
    """Sandboxes on both nodes, the engine on the first, one trainer rank on each: `swectl up` trains two steps,
    then --resume goes on to a third; swectl.log says where each part ran."""
    import subprocess
    import sys

    first, second = fleet.nodes
    names = f'["{first.name}", "{second.name}"]'
    config = tmp_path / "cluster.toml"
    config.write_text(f'out_dir = "{tmp_path / "runs"}"\nrun_id = "fleet"\n\n'
                      + fleet.cluster_toml(extra_node_fields="connect_timeout_s = 5") + f"""
[sandbox]
backend = "podman"

[env_pool]
nodes = {names}
warm = 0

[engine]
nodes = ["{first.name}"]

[trainer]
nodes = {names}
nproc_per_node = 1
start_timeout_s = 300

[rollout]
step_limit = 1
max_tokens = 16

[train]
model = "{model}"
steps = 2
save_every = 1
concurrency = 4

[train.sampling]
tasks_per_step = 2
n_samples = 2
dynamic_sampling = false
""")
    run = tmp_path / "runs" / "fleet"
    cli = [sys.executable, "-m", "swectl.cli.main", "-v", "up", str(config)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == 2
    said = done.stderr
    assert f"trainer: rank 0 is up on {first.name}" in said and f"trainer: rank 1 is up on {second.name}" in said, said
    again = subprocess.run([*cli, "--resume", str(run), "--steps", "3"], capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming after step 2" in again.stderr, again.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "steps.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    log = (run / "swectl.log").read_text()  # where each part ran
    assert f"podman sandboxes on 2 node(s): {first.name}, {second.name}" in log, log
    assert re.search(rf"engine server 0 \(cpu\) is up on {first.name} at http://{re.escape(first.host)}:", log), log
    assert f"rank 1 is up on {second.name}" in log, log
    leases = re.findall(rf"leases per node: {first.name} (\d+), {second.name} (\d+)", log)
    assert leases and all(int(a) + int(b) > 0 for a, b in leases), log

    # a rank killed on the second node: the run restarts the trainer on both nodes from the last checkpoint
    readies = (run / "swectl.log").read_text().count("trainer ready")
    proc = subprocess.Popen([*cli, "--resume", str(run), "--steps", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        victims: list[int] = []
        while not victims and time.monotonic() < deadline and proc.poll() is None:
            if (run / "swectl.log").read_text().count("trainer ready") > readies:  # past start: a loss to restart
                victims = [pid for pid, netns in _ranks(str(run)).items() if netns == second.netns]
            time.sleep(0.2)
        assert victims, "no rank came up on the second node"
        os.kill(victims[0], 9)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert "trainer lost" in err and "restart 1/" in err, err[-4000:]
    steps = [json.loads(line)["step"] for line in (run / "steps.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert not _ranks(str(run))
