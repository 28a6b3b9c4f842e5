"""just bench gpu: swectl's GPU paths, checked and timed on a machine with CUDA (the device machine some sessions
are lent; CI has no GPU). Every check runs swectl's real actors: the Trainer actor's torchrun FSDP2 workers
(remote/programs/trainer.py: NCCL, bf16 mixed precision) and the Engines actor's CPU engine servers placed on the
GPU (``--device cuda:0``).

Checks (``--checks``; all by default), each recorded as ok / failed with what it measured:

- ``golden``: one rank on the GPU trains the four steps of the golden-loss test (tests/integration/test_trainer.py:
  2 SFT then 2 GRPO steps on ``synthetic_batch``) on the same tiny model; its losses and gradient norms must agree
  with tests/golden/train_losses.json (fp32 on 2 CPU ranks) within ``--tolerance`` (bf16 compute on the GPU).
- ``resume``: a checkpoint written on the GPU, loaded by fresh workers, gives the straight run's next step.
- ``engine``: a trained step's weights reach a GPU engine from disk (``update_weights_from_disk``) and over a weight
  group (``update_weights_from_distributed``): NCCL when a second GPU holds the engine, otherwise gloo from the GPU
  trainer to the GPU engine (NCCL puts one rank per GPU); the engine then holds the weights the trainer saved.
- ``one_gpu_two_ranks``: on a one-GPU machine, ``nproc_per_node = 2`` fails at start with the trainer's clear error.
- ``throughput``: training tokens/s of one rank on a randomly initialised Qwen3 of Qwen3-0.6B's shape, GRPO batches
  of 16 x 1-2k tokens (benchmarks/train.py's trainer batch) and 64 x 4-8k tokens (its transport batch).
- ``profile``: where one micro-batch's time goes on that model (4096 and 8192 tokens): the worker's loss + backward,
  the bare model's forward + backward with and without the attention mask, the forward alone; peak GPU memory.

    python benchmarks/gpu.py --tiny MODEL_DIR --out benchmarks/results/gpu.json

``MODEL_DIR`` is the golden test's model (``swectl model init --vocab 600 --layers 2 --hidden 64
--corpus-max-bytes 300000``); made here when missing. Without CUDA the checks run on the CPU (gloo, one rank: the
script's own test; ``golden`` then holds to 1e-4) and ``one_gpu_two_ranks`` is not run.

On the device machine (torch, transformers, safetensors, numpy and httpx are the machine's own; nothing can be
downloaded there): the cp312 wheels of msgspec, anyio, asyncssh, cryptography, cffi, pycparser, starlette, uvicorn,
trio, outcome and sniffio in ``.gpu/whl`` and the tiny model in ``.gpu/tiny`` (``.gpu`` carried), then

    pip install --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
    mkdir /tmp/pkg; cp -r swectl /tmp/pkg/; cp -r actors /tmp/pkg/swectl/; cp -r remote /tmp/pkg/swectl/
    export PYTHONPATH=/tmp/site:/tmp/pkg; R=$PWD; cd /tmp    # not the checkout: its swectl/ has no actors or remote
    python3 $R/benchmarks/gpu.py --tiny $R/.gpu/tiny --out $OUT/gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import RESULTS_DIR, Progress, host_meta, summarize, write_results  # noqa: E402

SUITE = "gpu"
GOLDEN = REPO / "tests" / "golden" / "train_losses.json"
GOLDEN_STEPS = ((1, "sft"), (2, "sft"), (3, "grpo"), (4, "grpo"))
TINY_INIT = ["--vocab", "600", "--layers", "2", "--hidden", "64", "--corpus-max-bytes", "300000"]
COMPARED = ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight")


class CheckFailed(Exception):
    """A check ran and its result is wrong (as opposed to a crash)."""


@dataclass
class Context:
    tiny: Path
    work: Path
    cuda: bool
    gpus: int
    tolerance: float
    steps: int
    progress: Progress
    throughput_model: Path | None = None
    trainer_settings: dict[str, Any] = field(default_factory=dict)  # throughput: TrainerSettings beyond the defaults


def settings(model: Path, out: Path, **kw: Any) -> Any:
    from swectl.rl.wire import TrainerSettings

    return TrainerSettings(**{"model": str(model), "out_dir": str(out), "lr": 1e-3, "total_steps": 8, "seed": 0,
                              "threads": 4, **kw})


async def with_trainer(ctx: Context, out: Path, body: Callable[[Any, Any], Awaitable[Any]], *, ranks: int = 1,
                       model: Path | None = None, micro_batch_tokens: int = 8192, **kw: Any) -> Any:
    """Start the Trainer actor (``ranks`` torchrun workers on this machine), run ``body(trainer, ready)``, stop."""
    from swectl.actors.engines import EngineHost
    from swectl.actors.trainer import Trainer
    from swectl.config import TrainerConfig
    from swectl.testing import trainers as trainers

    config = TrainerConfig(nproc_per_node=ranks, threads_per_rank=4, start_timeout_s=300, step_timeout_s=600)
    trainer = Trainer(config, settings(model or ctx.tiny, out, micro_batch_tokens=micro_batch_tokens, **kw),
                      [EngineHost.local()], log_dir=out)
    return await trainers.with_trainer(trainer, body)


def vocab(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def expect_device(ctx: Context, ready: Any) -> None:
    want = "cuda" if ctx.cuda else "cpu"
    if not ready.device.startswith(want):
        raise CheckFailed(f"the trainer runs on {ready.device}, not {want}")


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# ---------------------------------------------------------------- checks


async def check_golden(ctx: Context) -> dict[str, Any]:
    from swectl.rl.shm import BatchWriter
    from swectl.testing.batches import synthetic_batch

    losses: dict[str, float] = {}
    step_s: list[float] = []

    async def body(trainer: Any, ready: Any) -> str:
        expect_device(ctx, ready)
        with BatchWriter() as writer:
            for step, algorithm in GOLDEN_STEPS:
                batch = synthetic_batch(step, algorithm, vocab(ctx.tiny), seed=step)  # type: ignore[arg-type]
                t0 = time.perf_counter()
                reply = await trainer.step(step, writer.write(batch))
                step_s.append(time.perf_counter() - t0)
                if reply.skipped:
                    raise CheckFailed(f"step {step} refused: {reply.reason}")
                losses[f"{algorithm}_{step}"] = reply.metrics["loss"]
                losses[f"grad_norm_{step}"] = reply.metrics["grad_norm"]
        return ready.device

    device = await with_trainer(ctx, ctx.work / "golden", body, micro_batch_tokens=128,
                                compile=ctx.trainer_settings.get("compile", "auto"))
    golden = json.loads(GOLDEN.read_text())
    diffs = {key: rel_diff(value, golden[key]) for key, value in losses.items()}
    worst = max(diffs, key=diffs.__getitem__)
    result = {"device": device, "losses": losses, "golden": golden, "rel_diff": diffs,
              "max_rel_diff": diffs[worst], "worst": worst, "tolerance": ctx.tolerance, "step_s": step_s}
    if not all(math.isfinite(v) for v in losses.values()) or diffs[worst] > ctx.tolerance:
        raise CheckFailed(f"{worst}: {losses[worst]} vs golden {golden[worst]} (relative {diffs[worst]:.2e} > "
                          f"{ctx.tolerance:g}); all: {json.dumps(result)}")
    return result


async def check_resume(ctx: Context) -> dict[str, Any]:
    from swectl.rl.shm import BatchWriter
    from swectl.testing.batches import synthetic_batch

    ckpt = ctx.work / "resume" / "ckpt"
    seen: dict[str, float] = {}
    n = vocab(ctx.tiny)

    async def straight(trainer: Any, ready: Any) -> None:
        expect_device(ctx, ready)
        with BatchWriter() as writer:
            await trainer.step(1, writer.write(synthetic_batch(1, "grpo", n, seed=11)))
            await trainer.checkpoint(1, ckpt)
            reply = await trainer.step(2, writer.write(synthetic_batch(2, "grpo", n, seed=12)))
            seen["straight"], seen["straight_norm"] = reply.metrics["loss"], reply.metrics["grad_norm"]

    async def resumed(trainer: Any, ready: Any) -> None:
        if ready.step != 1:
            raise CheckFailed(f"resumed at step {ready.step}, not 1")
        with BatchWriter() as writer:
            reply = await trainer.step(2, writer.write(synthetic_batch(2, "grpo", n, seed=12)))
            seen["resumed"], seen["resumed_norm"] = reply.metrics["loss"], reply.metrics["grad_norm"]

    await with_trainer(ctx, ctx.work / "resume" / "a", straight, micro_batch_tokens=128)
    await with_trainer(ctx, ctx.work / "resume" / "b", resumed, micro_batch_tokens=128, resume=str(ckpt))
    diffs = {"loss": rel_diff(seen["resumed"], seen["straight"]),
             "grad_norm": rel_diff(seen["resumed_norm"], seen["straight_norm"])}
    result = {**seen, "rel_diff": diffs}
    if max(diffs.values()) > 1e-3:
        raise CheckFailed(f"the resumed step differs from the straight one: {json.dumps(result)}")
    return result


async def compare_engine(engines: Any, saved: Path, version: str) -> dict[str, float]:
    """The engine's first 64 values of a few tensors against the saved folder's; its weight version."""
    from safetensors.torch import load_file

    want = load_file(str(saved / "model.safetensors"))
    worst: dict[str, float] = {}
    for server in engines._servers:
        client = server.client
        got_version = await client.get_weight_version()
        if got_version != version:
            raise CheckFailed(f"engine {server.name} serves weight version {got_version!r}, not {version!r}")
        for name in COMPARED:
            got = await client.get_weights_by_name(name, 64)
            ref = want[name].float().reshape(-1)[:64].tolist()
            worst[name] = max(abs(a - b) for a, b in zip(got, ref, strict=True))
            if worst[name] > 1e-6 + 1e-5 * max(abs(x) for x in ref):
                raise CheckFailed(f"engine {server.name}: {name} differs from the saved weights by {worst[name]:.3e}")
    return worst


async def check_engine(ctx: Context) -> dict[str, Any]:
    import anyio

    from swectl.actors.engines import Engines
    from swectl.config import EngineConfig
    from swectl.engine.wire import GenerateRequest, SamplingParams
    from swectl.rl.shm import BatchWriter
    from swectl.rl.weight_sync import plan_buckets
    from swectl.testing.batches import synthetic_batch

    second_gpu = ctx.gpus >= 2
    backend = "nccl" if second_gpu else "gloo"
    device = "cuda:1" if second_gpu else ("cuda:0" if ctx.cuda else "cpu")
    engines = Engines(EngineConfig(replicas=1, extra_args=["--device", device], health_interval_s=0.5,
                                   start_timeout_s=300), model=str(ctx.tiny), log_dir=ctx.work / "engine" / "logs")
    request = GenerateRequest(input_ids=[5, 6, 7, 8], sampling_params=SamplingParams(max_new_tokens=4, temperature=0))
    result: dict[str, Any] = {"engine_device": device, "weight_group_backend": backend}
    n = vocab(ctx.tiny)

    async def body(trainer: Any, ready: Any) -> None:
        expect_device(ctx, ready)
        result["trainer_device"] = ready.device
        async with anyio.create_task_group() as tg:
            await tg.start(engines.run)
            with BatchWriter() as writer:
                await trainer.step(1, writer.write(synthetic_batch(1, "sft", n, seed=1)))
                disk = ctx.work / "engine" / "step_1"
                await trainer.save_weights(disk)
                result["disk_s"] = await engines.update_weights(str(disk), "1")
                result["disk_max_abs_diff"] = await compare_engine(engines, disk, "1")
                answer = await engines.route("k").generate(request)
                result["generated_after_disk"] = {"tokens": answer.output_ids, "version": answer.weight_version}
                if answer.weight_version != "1":
                    raise CheckFailed(f"generation after the disk sync reports version {answer.weight_version!r}")

                await trainer.step(2, writer.write(synthetic_batch(2, "grpo", n, seed=2)))
                group, port = "swectl-gpu-check", await trainer.free_port()
                with anyio.fail_after(180):
                    async with anyio.create_task_group() as join:
                        join.start_soon(trainer.join_weight_group, port, engines.weight_group_size(), group, backend)
                        join.start_soon(engines.join_weight_group, trainer.weight_group_address, port, group, backend)
                buckets = plan_buckets(trainer.params, 64 * 1024)
                result["buckets"] = len(buckets)
                result["distributed_s"] = await engines.update_weights_distributed(
                    buckets, "2", lambda: trainer.broadcast_weights(group, buckets))
                saved = ctx.work / "engine" / "step_2"
                await trainer.save_weights(saved)
                result["distributed_max_abs_diff"] = await compare_engine(engines, saved, "2")
                answer = await engines.route("k").generate(request)
                result["generated_after_distributed"] = {"tokens": answer.output_ids, "version": answer.weight_version}
            tg.cancel_scope.cancel()

    await with_trainer(ctx, ctx.work / "engine" / "trainer", body, micro_batch_tokens=128)
    return result


async def check_one_gpu_two_ranks(ctx: Context) -> dict[str, Any]:
    import anyio

    if not ctx.cuda or ctx.gpus != 1:
        raise CheckFailed(f"needs exactly one GPU (this machine: {ctx.gpus})")

    async def body(trainer: Any, ready: Any) -> None:
        raise CheckFailed(f"2 ranks started on one GPU ({ready.device})")

    try:
        with anyio.fail_after(240):
            await with_trainer(ctx, ctx.work / "two-ranks", body, ranks=2)
    except CheckFailed:
        raise
    except BaseException as exc:  # the Trainer actor's error (an ExceptionGroup around it, from the task group)
        text = "".join(traceback.format_exception(exc))
        if "has no GPU of its own" not in text:
            raise CheckFailed(f"failed, but without the trainer's message: {text[-3000:]}") from exc
        return {"error": type(exc).__name__, "says": next(line.strip(" |") for line in text.splitlines()
                                                          if "has no GPU of its own" in line)}
    raise CheckFailed("unreachable")


def throughput_model(ctx: Context) -> Path:
    """``--throughput-model``, else benchmarks/train.py's random Qwen3 of Qwen3-0.6B's shape (made once into
    results/.cache)."""
    import train as bench_train

    return ctx.throughput_model or bench_train.big_model(ctx.tiny, ctx.progress)


async def check_throughput(ctx: Context) -> dict[str, Any]:
    import train as bench_train

    big = throughput_model(ctx)
    result: dict[str, Any] = {"parameters": bench_train.model_parameters(big)}
    for label, samples, lo, hi in (("16x1-2k", 16, 1000, 2000), ("64x4-8k", 64, 4096, 8192)):
        batch = bench_train.realistic_batch(samples, lo, hi, seed=1, vocab=vocab(big))
        tokens = sum(s.length for s in batch.samples)
        run = bench_train.TrainRun(label, 1, 4, settings=ctx.trainer_settings)
        host = bench_train.TrainHost()
        await bench_train.run_trainers([run], big, ctx.work / "throughput", list(batch.samples), 1, ctx.steps, host,
                                       ctx.progress)
        wall_s = statistics.median(run.wall_s)
        result[label] = {"tokens": tokens, "loss_tokens": batch.loss_tokens, "start_s": round(run.start_s, 1),
                         "tokens_per_s": round(tokens / wall_s),
                         "step_wall_s": summarize(run.wall_s), "rank0_train_s": summarize(run.train_s),
                         "micro_batches": run.micro_batches}
        flops = train_flops(big, [s.length for s in batch.samples])
        peak = peak_flops()
        if peak:
            result[label]["mfu"] = round(flops / wall_s / peak, 4)
            result[label]["model_tflops_per_s"] = round(flops / wall_s / 1e12, 1)
    return result


# Dense bf16 tensor-core peak (no sparsity), by the name CUDA reports.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def peak_flops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def train_flops(model: Path, lengths: list[int]) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward) over samples of ``lengths``: 6 x the
    matmul parameters (tied embeddings count once, as the output head) per token, plus causal attention's
    QK^T and AV (2 x 2 x L x heads*head_dim x s^2 / 2 forward). MFU uses these, not what recomputation adds."""
    cfg = json.loads((model / "config.json").read_text())
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    inter, vocab_size = cfg["intermediate_size"], cfg["vocab_size"]
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter
    matmul_params = layers * per_layer + vocab_size * hidden
    total = 0.0
    for s in lengths:
        total += 6 * matmul_params * s + 3 * 2 * layers * heads * head_dim * s * s
    return total


PROFILE_LENGTHS = (4096, 8192)


def profile_one(trainer: Any, device: Any, sample: Any, batch: Any, reps: int = 3) -> dict[str, float]:
    """Median seconds of each way to run one micro-batch of ``sample`` (after a warm-up each)."""
    import torch

    mb = {k: v.to(device) for k, v in trainer._collate([sample]).items()}
    ones = torch.ones_like(mb["input_ids"])  # the all-ones attention mask (the worker itself passes none)

    def timed(fn: Callable[[], None]) -> float:
        seconds = _median_time(fn, device, reps)
        trainer.optimizer.zero_grad(set_to_none=True)
        return seconds

    def real() -> None:
        loss, _ = trainer._micro_loss(mb, batch)
        loss.backward()

    def bare(mask: bool) -> Callable[[], None]:
        def run() -> None:
            out = trainer.model(input_ids=mb["input_ids"], attention_mask=ones if mask else None)
            out.logits[..., :1].float().sum().backward()
        return run

    def forward() -> None:
        with torch.no_grad():
            trainer.model(input_ids=mb["input_ids"])

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row = {"micro_loss_and_backward_s": timed(real), "model_fwd_bwd_s": timed(bare(True)),
           "model_fwd_bwd_no_mask_s": timed(bare(False)), "model_forward_s": timed(forward)}
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return row


def _join_world_of_one(backend: str) -> None:
    """This process as the only rank of a process group (a free port on loopback)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(backend=backend)


def _random_sample(model: Path, rng: Any, length: int) -> Any:
    """A GRPO sample of ``length`` random tokens: a quarter prompt (mask 0), the rest trained (mask 1)."""
    from swectl.rl.batch import pack_sample

    prompt = length // 4
    return pack_sample("p", "g", rng.integers(3, vocab(model), size=length).tolist(),
                       [0] * prompt + [1] * (length - prompt),
                       [0.0] * prompt + [-2.0] * (length - prompt), advantage=1.0, reward=1.0)


def profile_micro_batch(ctx: Context, model: Path) -> dict[str, Any]:
    """Where one micro-batch's time goes, in this process: the worker's own Trainer (one rank, world of one) on the
    throughput model; per length, median seconds of the real ``_micro_loss`` + backward, and of the bare model
    (forward + backward of a trivial loss) with and without the all-ones attention mask, and a forward alone."""
    import numpy as np
    import torch.distributed as dist

    from swectl.remote.programs import trainer as worker
    from swectl.rl.batch import make_batch

    s = settings(model, ctx.work / "profile", algorithm="grpo", lr=1e-6)
    device, backend = worker._device(s)
    _join_world_of_one(backend)
    try:
        trainer = worker.Trainer(s)

        result: dict[str, Any] = {"device": str(device)}
        rng = np.random.default_rng(0)
        for length in PROFILE_LENGTHS:
            sample = _random_sample(model, rng, length)
            row = profile_one(trainer, device, sample, make_batch(1, "grpo", [sample]))
            row["tokens_per_s_micro_loss"] = round(length / row["micro_loss_and_backward_s"])
            result[str(length)] = row
            ctx.progress(f"profile {length} tokens: {json.dumps(row)}")
        del trainer
        result["plain_bf16"] = plain_model_rows(model, device, rng)
        return result
    finally:
        dist.destroy_process_group()


def plain_model_rows(model: Path, device: Any, rng: Any) -> dict[str, Any]:
    """The same model without FSDP (bf16 weights, no sharding hooks, no mixed-precision casts): median seconds of a
    bare forward + backward and of a forward alone per length, and on a GPU the summed kernel time of one forward +
    backward next to its wall time (kernels far below wall: the host's launches are the limit, not the GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.bfloat16, local_files_only=True).to(device)
    plain.config.use_cache = False
    rows = {str(length): _plain_row(plain, torch.from_numpy(rng.integers(3, vocab(model), size=(1, length)))
                                    .to(device), device) for length in PROFILE_LENGTHS}
    del plain
    return rows


def _plain_row(plain: Any, ids: Any, device: Any) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    def fwd_bwd() -> None:
        plain(input_ids=ids).logits[..., :1].float().sum().backward()

    def forward() -> None:
        with torch.no_grad():
            plain(input_ids=ids)

    row = {"fwd_bwd_s": _median_time(fwd_bwd, device), "forward_s": _median_time(forward, device)}
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fwd_bwd()
            torch.cuda.synchronize()
        kernel_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
        row["fwd_bwd_kernel_s"] = round(kernel_us / 1e6, 4)
    plain.zero_grad(set_to_none=True)
    return row


def _median_time(fn: Callable[[], None], device: Any, reps: int = 3) -> float:
    import torch

    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 4)


async def check_profile(ctx: Context) -> dict[str, Any]:
    return profile_micro_batch(ctx, throughput_model(ctx))


VARIANT_ROWS = (1, 2, 4)  # rows of 8192 tokens in one micro-batch


def _kernel_table(trainer: Any, mb: dict[str, Any], batch: Any) -> dict[str, Any]:
    """torch.profiler over one micro-batch's loss + backward: wall, summed GPU kernel time, the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss, _ = trainer._micro_loss(mb, batch)
        loss.backward()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    trainer.optimizer.zero_grad(set_to_none=True)
    kernels = sorted(((e.key, getattr(e, "self_device_time_total", 0.0)) for e in prof.key_averages()),
                     key=lambda kv: -kv[1])
    gpu_us = sum(t for _, t in kernels)
    return {"wall_ms": round(wall * 1e3, 1), "gpu_kernel_ms": round(gpu_us / 1e3, 1),
            "top": [[k[:90], round(t / 1e3, 2)] for k, t in kernels[:15]]}


def variants_micro_batch(ctx: Context, model: Path) -> dict[str, Any]:
    """Micro-batch tokens/s of the worker's own loss + backward on the throughput model, eager and with each
    decoder layer compiled, at 1, 2 and 4 rows of 8192 tokens; and a kernel table of the eager 8192 case."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from swectl.remote.programs import trainer as worker
    from swectl.rl.batch import make_batch

    rng = np.random.default_rng(0)
    length = 8192
    samples = [_random_sample(model, rng, length) for _ in range(max(VARIANT_ROWS))]
    result: dict[str, Any] = {}
    _join_world_of_one(worker._device(settings(model, ctx.work / "variants"))[1])
    try:
        for compiled in (False, True):
            name = "compiled" if compiled else "eager"
            s = settings(model, ctx.work / f"variants-{name}", algorithm="grpo", lr=1e-6,
                         compile="on" if compiled else "off")
            device, _ = worker._device(s)
            trainer = worker.Trainer(s)
            result.setdefault("attn_implementation", getattr(trainer.model.config, "_attn_implementation", "?"))
            for rows in VARIANT_ROWS:
                chosen = samples[:rows]
                batch = make_batch(1, "grpo", chosen)
                mb = {k: v.to(device) for k, v in trainer._collate(chosen).items()}
                t0 = time.perf_counter()
                try:
                    first = _timed_loss(trainer, mb, batch, device)
                    times = [_timed_loss(trainer, mb, batch, device) for _ in range(3)]
                except torch.OutOfMemoryError as exc:
                    result[f"{name}_{rows}x{length}"] = {"error": f"out of memory: {str(exc)[:200]}"}
                    torch.cuda.empty_cache()
                    continue
                tokens = rows * length
                row = {"first_s": round(first, 3), "warmup_s": round(time.perf_counter() - t0, 1),
                       "s": round(statistics.median(times), 4),
                       "tokens_per_s": round(tokens / statistics.median(times))}
                if device.type == "cuda":
                    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
                    torch.cuda.reset_peak_memory_stats()
                    peak = peak_flops()
                    if peak:
                        flops = train_flops(model, [length] * rows)
                        row["mfu"] = round(flops / statistics.median(times) / peak, 4)
                result[f"{name}_{rows}x{length}"] = row
                ctx.progress(f"variants {name} {rows}x{length}: {json.dumps(row)}")
                if rows == 1 and device.type == "cuda":
                    result[f"{name}_kernels_1x{length}"] = _kernel_table(trainer, mb, batch)
            del trainer
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return result
    finally:
        dist.destroy_process_group()


def _timed_loss(trainer: Any, mb: dict[str, Any], batch: Any, device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss, _ = trainer._micro_loss(mb, batch)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


async def check_variants(ctx: Context) -> dict[str, Any]:
    return variants_micro_batch(ctx, throughput_model(ctx))


CHECKS: dict[str, Callable[[Context], Awaitable[dict[str, Any]]]] = {
    "golden": check_golden, "resume": check_resume, "engine": check_engine,
    "one_gpu_two_ranks": check_one_gpu_two_ranks, "throughput": check_throughput, "profile": check_profile,
    "variants": check_variants,
}


# ---------------------------------------------------------------- main


def tiny_model(path: Path, progress: Progress) -> Path:
    if (path / "model.safetensors").is_file():
        return path
    from swectl.cli.main import main as swectl_main

    progress(f"making the golden test's tiny model in {path}")
    if swectl_main(["model", "init", "--out", str(path), *TINY_INIT]) != 0:
        raise SystemExit("swectl model init failed")
    return path


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    import anyio

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of: {', '.join(CHECKS)}")
    parser.add_argument("--tiny", type=Path, default=None, help="the golden test's model folder (made when missing)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"{SUITE}.json", help="results JSON")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="golden: relative difference allowed (default 3e-2 on a GPU: bf16; 1e-4 on the CPU)")
    parser.add_argument("--throughput-model", type=Path, default=None,
                        help="throughput: this model folder instead of a random Qwen3 of Qwen3-0.6B's shape")
    parser.add_argument("--steps", type=int, default=3, help="throughput: measured steps after one warm-up")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="golden and throughput: compile each decoder layer ([trainer] compile; auto: on a GPU)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192, help="throughput: the trainer's budget")
    parser.add_argument("--sync-every-micro-batch", action="store_true",
                        help="throughput: reduce gradients after every micro-batch (the trainer before 2026-11-28)")
    args = parser.parse_args(argv)
    names = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    progress = Progress(SUITE)
    env = environment()
    progress(f"environment: {json.dumps(env)}")
    cuda = bool(env["cuda_available"])
    if not cuda and "one_gpu_two_ranks" in names:
        names.remove("one_gpu_two_ranks")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="swectl-gpu-") as tmp:
        work = args.work or Path(tmp)
        ctx = Context(tiny=tiny_model(args.tiny or work / "tiny", progress), work=work, cuda=cuda, gpus=env["gpus"],
                      tolerance=args.tolerance or (3e-2 if cuda else 1e-4), steps=args.steps, progress=progress,
                      throughput_model=args.throughput_model,
                      trainer_settings={"compile": args.compile, "micro_batch_tokens": args.micro_batch_tokens,
                                        "accumulate_unsharded": not args.sync_every_micro_batch})
        for name in names:
            progress(f"check {name}")
            t0 = time.perf_counter()
            try:
                outcome = anyio.run(CHECKS[name], ctx)
                results[name] = {"ok": True, **outcome}
            except CheckFailed as exc:
                results[name] = {"ok": False, "failed": str(exc)}
            except BaseException as exc:  # a crash in one check must not lose the others
                if isinstance(exc, KeyboardInterrupt):
                    raise
                results[name] = {"ok": False, "error": "".join(traceback.format_exception(exc))[-6000:]}
            results[name]["seconds"] = round(time.perf_counter() - t0, 1)
            progress(f"check {name}: {'ok' if results[name]['ok'] else 'FAILED'} in {results[name]['seconds']} s: "
                     f"{json.dumps(results[name])[:1500]}")
    metrics = {f"{name}_ok": r["ok"] for name, r in results.items()}
    for label in ("16x1-2k", "64x4-8k"):
        if label in results.get("throughput", {}):
            metrics[f"train_tokens_per_s_0p6b_{label}"] = results["throughput"][label]["tokens_per_s"]
    path = write_results(SUITE, metrics, {**host_meta(), "environment": env, "checks": results}, path=args.out)
    print(json.dumps(metrics, indent=1))
    print(f"written to {path}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
