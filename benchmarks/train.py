"""just bench train: the trainer side of an RL step, part by part (``--parts``; all by default).

- ``transport``: one realistic TrainBatch (64 samples of 4-8k tokens: int32 tokens, uint8 loss mask, float32
  logprobs) from the controller to reader processes (multiprocessing, spawn), end to end: from the controller
  holding the batch until the reader holds it decoded. swectl's way (``BatchWriter`` + a ``BatchReader`` that
  stays attached between steps, as the trainer ranks read; the BatchRef goes over a multiprocessing.Queue like a
  control message) against pickle over a
  multiprocessing.Queue, twice: the samples as lists of Python ints (what a naive system sends; the baseline
  of docs/architecture.md 13.2) and the same TrainBatch with its raw-bytes arrays pickled (the honest comparison). Also:
  ``read_batch``, attaching and detaching per step (``transport_attach_gbps``); two readers (the embedded
  default's 2-rank trainer; shm writes once, a Queue carries one pickle per rank); bare readers that do nothing
  with a batch (readers otherwise collate it like a trainer rank, untimed, which keeps glibc's heap warm).
  Variants alternate within each round; medians.
- ``trainer``: training tokens/s of the Trainer actor (torchrun FSDP2 ranks of remote/programs/trainer.py) on the
  embedded default's tiny model, with 1 rank, 2 ranks (the default) and 1 rank of 2 threads, on GRPO batches of
  16 samples x 1000-2000 tokens (mask 1 on the model turns after a prompt): all tokens / median Trainer.step time,
  after a warm-up step; the three trainers are up together and take turns, one step each per round.
- ``weight_sync``: from "the trainer has new weights" to "every engine serves them": Trainer.save_weights(dir) +
  Engines.update_weights(dir, version) with one CPU engine, for the tiny model (2 ranks) and a randomly initialised
  Qwen3 of Qwen3-0.6B's shape (2 ranks when memory allows, else 1); the split save / reload and, untimed, how long
  writing the same safetensors alone takes. The model folders are made once under benchmarks/results/.cache.
- ``nodes``: the trainer with 2 ranks on one SSH test node against 1 rank on each of two (swectl.testing.nodes),
  on the ``trainer`` part's batch, and the two-node trainer's weights reaching a CPU engine here
  (``train_tokens_per_s_2nodes``, ``train_2nodes_vs_1node``, ``weight_sync_remote_s``). Needs root.

Each part is a function ``(args, progress) -> PartResult`` in ``PARTS``; its metrics, goals and details are
merged into benchmarks/results/train.json (read-modify-write under a lock), so parts can run separately and
each adds its own keys.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import (  # noqa: E402
    RESULTS_DIR,
    Goal,
    Progress,
    host_meta,
    loadavg,
    mem_used_mib,
    result_table,
    summarize,
    write_results,
)

from swectl.rl.batch import TrainBatch, TrainSample, make_batch  # noqa: E402
from swectl.rl.shm import BatchReader, BatchWriter, encode_batch, read_batch  # noqa: E402

SUITE = "train"
VOCAB = 151_936  # Qwen3's vocabulary


@dataclass
class PartResult:
    """What one part measured: metrics (merged into the suite's), its goals, details for ``meta``."""

    metrics: dict[str, Any]
    goals: list[Goal]
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- realistic batches


def realistic_batch(samples: int, min_tokens: int, max_tokens: int, seed: int = 0, vocab: int = VOCAB) -> TrainBatch:
    """A GRPO batch like an agent step's: per sample a prompt (mask 0), then alternating model turns (mask 1,
    with logprobs) and observations (mask 0). Token ids are below ``vocab``."""
    rng = np.random.default_rng(seed)
    made = []
    for i in range(samples):
        n = int(rng.integers(min_tokens, max_tokens + 1))
        mask = _turn_mask(rng, n)
        logprobs = np.where(mask == 1, -rng.exponential(0.3, n), 0.0).astype("<f4")
        made.append(TrainSample(
            uid=f"repo__issue-{i // 8}#{i % 8}", group=f"repo__issue-{i // 8}",
            tokens=rng.integers(0, vocab, n, dtype="<i4").tobytes(), loss_mask=mask.tobytes(),
            logprobs=logprobs.tobytes(), advantage=float(rng.normal()), reward=float(rng.integers(0, 2)),
            weight_version=3, truncated=bool(rng.random() < 0.1)))
    return make_batch(1, "grpo", made)


def _turn_mask(rng: np.random.Generator, n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=np.uint8)
    pos = min(n, int(rng.integers(500, 1500)))  # system prompt and issue text
    emitting = True
    while pos < n:
        run = int(rng.integers(50, 400)) if emitting else int(rng.integers(100, 1200))
        if emitting:
            mask[pos:pos + run] = 1
        pos += run
        emitting = not emitting
    return mask


def as_python_lists(batch: TrainBatch) -> dict[str, Any]:
    """The same batch the naive way: plain dicts with lists of Python ints and floats."""
    return {
        "step": batch.step, "algorithm": batch.algorithm, "loss_tokens": batch.loss_tokens,
        "sequences": batch.sequences,
        "samples": [{
            "uid": s.uid, "group": s.group, "advantage": s.advantage, "reward": s.reward,
            "weight_version": s.weight_version, "truncated": s.truncated,
            "tokens": np.frombuffer(s.tokens, dtype="<i4").tolist(),
            "loss_mask": np.frombuffer(s.loss_mask, dtype=np.uint8).tolist(),
            "logprobs": np.frombuffer(s.logprobs, dtype="<f4").tolist(),
        } for s in batch.samples],
    }


def payload_bytes(batch: TrainBatch) -> int:
    """Bytes of the token arrays (tokens, mask, logprobs): the denominator of every GB/s here."""
    return sum(len(s.tokens) + len(s.loss_mask) + len(s.logprobs) for s in batch.samples)


def tokens_in(received: Any) -> int:
    """Tokens in a received batch, whichever form it came in (the reader's check that it got everything)."""
    if isinstance(received, TrainBatch):
        return sum(s.length for s in received.samples)
    return sum(len(s["tokens"]) for s in received["samples"])


# ---------------------------------------------------------------- transport: the reader process


def now_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process on the machine, so the reader's timestamp compares with
    the writer's."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def collate(received: Any) -> int:
    """What a trainer rank does next with a batch: right-padded int64 token ids and float32 masks (as
    remote/programs/trainer.py does per micro-batch). Runs after the reader's timestamp; it matters because
    freeing these multi-MB arrays makes glibc keep its heap, so the next batch decodes into warm memory."""
    if isinstance(received, TrainBatch):
        rows = [(np.frombuffer(s.tokens, dtype="<i4"), np.frombuffer(s.loss_mask, dtype=np.uint8))
                for s in received.samples]
    else:
        rows = [(s["tokens"], s["loss_mask"]) for s in received["samples"]]
    width = max((len(tokens) for tokens, _ in rows), default=0)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    for row, (tokens, loss_mask) in enumerate(rows):
        ids[row, :len(tokens)] = tokens
        mask[row, :len(loss_mask)] = loss_mask
    return int(mask.sum())


def transport_reader(kind: str, like_trainer: bool, requests: Any, results: Any) -> None:
    """Receive until None; after each batch (and, a trainer-like reader, after collating it) report the time it
    was decoded, the ns spent reading it and its tokens."""
    reader = BatchReader() if kind == "shm_cached" else None
    while True:
        item = requests.get()  # a pickle variant's batch is unpickled in here
        got_ns = now_ns()
        if item is None:
            break
        if kind == "shm":
            item = read_batch(item)
        elif reader is not None:
            item = reader.read(item)
        done_ns = now_ns()
        tokens = tokens_in(item)
        if like_trainer:
            collate(item)
        # Done with the batch before answering, so neither collating nor freeing it overlaps the next measurement.
        item = None
        results.put((done_ns, done_ns - got_ns, tokens))
    if reader is not None:
        reader.close()


@dataclass
class Variant:
    """One way of sending: a kind, its reader processes (one per rank, each with a request and a result queue)
    and what was measured."""

    kind: str
    like_trainer: bool
    ranks: int
    processes: list[Any] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    write_ms: list[float] = field(default_factory=list)
    read_ms: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.kind + ("" if self.like_trainer else "_bare") + ("" if self.ranks == 1 else f"_{self.ranks}ranks")


KINDS = ["shm", "shm_cached", "pickle_bytes", "pickle_lists"]
VARIANT_TEXT = {
    "shm": "BatchWriter + read_batch (attach, decode, detach per step); the BatchRef over a multiprocessing.Queue",
    "shm_cached": "BatchWriter + BatchReader (stays attached between steps)",
    "pickle_bytes": "the same TrainBatch (raw-bytes arrays) pickled over multiprocessing.Queue",
    "pickle_lists": "the samples as lists of Python ints/floats pickled over multiprocessing.Queue",
    "*_bare": "the reader does nothing with a batch (glibc then trims its heap between batches, so every "
              "decode page-faults fresh memory); without _bare it collates each batch like a trainer rank",
    "*_2ranks": "two reader processes (the embedded default's 2-rank trainer), timed until the last holds the "
                "batch: shm writes once, pickle sends one copy per rank",
}


def variants() -> list[Variant]:
    return ([Variant(kind, True, 1) for kind in KINDS] + [Variant(kind, False, 1) for kind in KINDS]
            + [Variant(kind, True, 2) for kind in ("shm", "shm_cached", "pickle_bytes", "pickle_lists")])


@contextmanager
def started(chosen: list[Variant]) -> Iterator[list[Variant]]:
    """Start every variant's reader processes (spawn); stop them on the way out."""
    ctx = mp.get_context("spawn")
    try:
        for var in chosen:
            for _ in range(var.ranks):
                requests, results = ctx.Queue(), ctx.Queue()
                process = ctx.Process(target=transport_reader, args=(var.kind, var.like_trainer, requests, results),
                                      daemon=True)
                process.start()
                var.processes.append(process)
                var.requests.append(requests)
                var.results.append(results)
        yield chosen
    finally:
        for var in chosen:
            for requests in var.requests:
                requests.put(None)
        for var in chosen:
            for process in var.processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()


def send_once(var: Variant, batch: TrainBatch, lists: dict[str, Any], writer: BatchWriter, expect: int,
              record: bool) -> None:
    """One batch to every reader of ``var``, timed end to end: send start -> the last reader's decode."""
    t0 = now_ns()
    write_ns = 0
    if var.kind.startswith("shm"):
        item: Any = writer.write(batch)
        write_ns = now_ns() - t0
    else:
        item = lists if var.kind == "pickle_lists" else batch
    for requests in var.requests:  # a Queue pickles what it is given once per queue: one copy per rank
        requests.put(item)
    answers = [results.get(timeout=120) for results in var.results]
    for _, _, tokens in answers:
        if tokens != expect:
            raise RuntimeError(f"{var.label}: a reader got {tokens} tokens, not {expect}")
    if record:
        var.e2e_ms.append((max(done for done, _, _ in answers) - t0) / 1e6)
        var.write_ms.append(write_ns / 1e6)
        var.read_ms.append(max(read for _, read, _ in answers) / 1e6)


def run_rounds(chosen: list[Variant], batch: TrainBatch, lists: dict[str, Any], rounds: int, warmup: int,
               expect: int) -> None:
    """Every variant once per round, the order rotating so that none always goes first."""
    with BatchWriter() as writer:
        for round_no in range(warmup + rounds):
            shift = round_no % len(chosen)
            for var in chosen[shift:] + chosen[:shift]:
                send_once(var, batch, lists, writer, expect, record=round_no >= warmup)


def transport_metrics(by: dict[str, Variant], payload: int) -> dict[str, Any]:
    medians = {label: statistics.median(var.e2e_ms) for label, var in by.items()}

    def gbps(label: str) -> float:
        return round(payload / (medians[label] / 1e3) / 1e9, 3)

    def speedup(label: str, baseline: str) -> float:
        return round(medians[baseline] / medians[label], 2)

    # The headline is the trainer's own path: its ranks keep a BatchReader attached between steps.
    return {
        "transport_gbps": gbps("shm_cached"),
        "transport_speedup_vs_pickle": speedup("shm_cached", "pickle_lists"),
        "transport_speedup_vs_pickle_bytes": speedup("shm_cached", "pickle_bytes"),
        "transport_ms_p50": round(medians["shm_cached"], 3),
        "transport_cached_gbps": gbps("shm_cached"),
        "transport_attach_gbps": gbps("shm"),  # read_batch: attach, decode, detach per step
        "pickle_bytes_gbps": gbps("pickle_bytes"),
        "pickle_lists_gbps": gbps("pickle_lists"),
        "transport_2ranks_gbps": gbps("shm_cached_2ranks"),
        "transport_2ranks_attach_gbps": gbps("shm_2ranks"),
        "transport_2ranks_speedup_vs_pickle": speedup("shm_cached_2ranks", "pickle_lists_2ranks"),
        "transport_2ranks_speedup_vs_pickle_bytes": speedup("shm_cached_2ranks", "pickle_bytes_2ranks"),
        "transport_bare_reader_gbps": gbps("shm_bare"),
        "transport_bare_reader_speedup_vs_pickle": speedup("shm_bare", "pickle_lists_bare"),
        "transport_bare_reader_speedup_vs_pickle_bytes": speedup("shm_bare", "pickle_bytes_bare"),
        "transport_payload_mb": round(payload / 1e6, 3),
    }


def time_split(by: dict[str, Variant]) -> dict[str, float]:
    """Median ms of the shm path's pieces: write (encode + copy), read (attach + decode), notify (the rest)."""
    out: dict[str, float] = {}
    for label in ("shm", "shm_cached", "shm_bare", "shm_2ranks", "shm_cached_2ranks"):
        var = by[label]
        write, read = statistics.median(var.write_ms), statistics.median(var.read_ms)
        out.update({f"{label}_write": round(write, 3), f"{label}_read": round(read, 3),
                    f"{label}_notify": round(statistics.median(var.e2e_ms) - write - read, 3)})
    return out


def measure_transport(args: argparse.Namespace, progress: Progress) -> PartResult:
    rounds = args.reps or (5 if args.quick else 25)
    warmup = 1 if args.quick else 3
    batch = realistic_batch(args.samples, args.min_tokens, args.max_tokens)
    lists = as_python_lists(batch)
    payload = payload_bytes(batch)
    expect = sum(s.length for s in batch.samples)
    load_before = loadavg()
    with started(variants()) as chosen:
        progress(f"transport: {len(batch.samples)} samples, {expect:,} tokens, {payload / 1e6:.1f} MB of arrays; "
                 f"{warmup} warm-up + {rounds} rounds of {len(chosen)} variants")
        run_rounds(chosen, batch, lists, rounds, warmup, expect)
    by = {var.label: var for var in chosen}
    metrics = transport_metrics(by, payload)
    goals = [
        Goal("transport_gbps", ">=", 1.0),
        Goal("transport_speedup_vs_pickle", ">=", 5.0, text=">= 5 vs pickled lists of ints"),
    ]
    split = time_split(by)
    details = {
        "samples": len(batch.samples), "tokens": expect, "payload_bytes": payload,
        "frame_bytes": len(encode_batch(batch)), "rounds": rounds, "warmup_rounds": warmup,
        "variants": VARIANT_TEXT,
        "distributions_ms": {label: summarize(var.e2e_ms) for label, var in by.items()},
        "shm_time_split_ms_p50": split,
        "loadavg_before": load_before, "loadavg_after": loadavg(),
        "definitions": "end to end = the controller starts sending -> the reader holds the decoded batch (one "
                       "CLOCK_MONOTONIC for both); GB/s = token-array bytes / median end-to-end time (GB = 1e9 B)",
    }
    notes = [
        "transport_speedup_vs_pickle is against pickling the samples as lists of Python ints (the naive "
        "baseline; the reader's list -> array conversion is not counted); against pickling the same raw-bytes "
        f"TrainBatch it is {metrics['transport_speedup_vs_pickle_bytes']}x",
        "readers collate each batch like a trainer rank (untimed); *_2ranks: two readers, until the last has it; "
        "*_bare_reader: readers that do nothing with a batch, so glibc trims their heap and every decode "
        "page-faults",
        f"shm p50 split (ms), BatchReader (the trainer's path): write {split['shm_cached_write']} + notify "
        f"{split['shm_cached_notify']} + read {split['shm_cached_read']}; attach per step (read_batch): read "
        f"{split['shm_read']}; bare reader: read {split['shm_bare_read']}",
        "a shared machine (other jobs running) skews timings: see loadavg_before/after in meta.parts.transport",
    ]
    return PartResult(metrics, goals, details, notes)


# ---------------------------------------------------------------- model folders for trainer and weight_sync

CACHE_DIR = RESULTS_DIR / ".cache"  # model folders made once (a .gitignore of "*" inside keeps them out of git)
TINY_NAME = "tiny-qwen3"
BIG_NAME = "qwen3-0p5b-random"
BIG_MARKER = "bench_model.json"
# Qwen3-0.6B's shape, randomly initialised: ~0.6 B parameters (0.44 B outside the tied 151,936 x 1024 embedding).
BIG_SHAPE: dict[str, Any] = {
    "vocab_size": 151_936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
}
# Host memory that 2 trainer ranks + 1 CPU engine took at their peak with this model (measured: ~10 GB; 1 rank:
# ~6.3 GB), plus a margin for whatever else runs on the machine.
BIG_TWO_RANKS_GIB = 14.0


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive flock on a folder (no lock file to leave behind)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def cache_dir() -> Path:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    ignore = CACHE_DIR / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# model folders made by benchmarks/train.py\n*\n")
    return CACHE_DIR


def tiny_model(progress: Progress) -> Path:
    """The embedded default's policy (``swectl model init`` with its defaults), made once into the cache."""
    import msgspec

    from swectl.model.tiny import ModelInitConfig, init_model, load_provenance

    cfg = ModelInitConfig()
    path = cache_dir() / TINY_NAME
    with folder_lock(CACHE_DIR):
        try:
            if load_provenance(path).config == cfg and (path / "model.safetensors").is_file():
                return path
        except (OSError, msgspec.MsgspecError):
            pass
        progress(f"making the tiny model in {path} (once)")
        init_model(path, cfg, overwrite=True, progress=lambda line: progress(f"model init: {line}"))
    return path


def big_model(tiny: Path, progress: Progress) -> Path:
    """A randomly initialised Qwen3 of BIG_SHAPE (bfloat16 on disk) with the tiny model's tokenizer, made once in a
    child process (its ~4 GB of build-time memory goes back to the OS)."""
    path = cache_dir() / BIG_NAME
    with folder_lock(CACHE_DIR):
        try:
            if json.loads((path / BIG_MARKER).read_text()).get("shape") == BIG_SHAPE:
                return path
        except (OSError, ValueError):
            pass
        progress(f"making a random Qwen3 of ~0.6 B parameters in {path} (once)")
        process = mp.get_context("spawn").Process(target=build_big_model, args=(str(path), str(tiny)))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"building the 0.6 B model failed (exit {process.exitcode})")
    return path


def build_big_model(out: str, tiny: str) -> None:
    """(A child process.) Build, save as a Hugging Face folder at ``out`` (staged, then renamed), add the
    tokenizer files of ``tiny``: its 8k-token tokenizer with a 152k-row embedding, fine for timing weights."""
    import torch

    from swectl.model.tiny import ModelInitConfig, build_model, count_parameters, load_provenance

    ids = load_provenance(Path(tiny)).special_tokens
    model = build_model(ModelInitConfig(**BIG_SHAPE), ids).to(torch.bfloat16)
    target = Path(out)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
    try:
        model.save_pretrained(stage)
        for item in Path(tiny).iterdir():
            if item.is_file() and item.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy2(item, stage / item.name)
        marker = {"shape": BIG_SHAPE, "parameters": count_parameters(model), "dtype": "bfloat16",
                  "tokenizer_from": tiny}
        (stage / BIG_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        stage.chmod(0o755)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def model_parameters(model: Path) -> int:
    """Parameters of a model folder (tied embeddings once), from its safetensors header, without loading it."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(model / "model.safetensors"), framework="np") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            total += math.prod(shape)
    return total


def leaf_error(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, for a one-line report."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class MemoryPeak:
    """Host memory in use (MiB, page cache excluded), sampled every 0.25 s while ``watch`` runs."""

    def __init__(self) -> None:
        self.start = mem_used_mib()
        self.peak = self.start

    async def watch(self) -> None:
        import anyio

        while True:
            self.peak = max(self.peak, mem_used_mib())
            await anyio.sleep(0.25)


# ---------------------------------------------------------------- trainer: tokens/s with 1 and 2 ranks

TRAIN_SAMPLES = 16
TRAIN_MIN_TOKENS = 1000
TRAIN_MAX_TOKENS = 2000


@dataclass
class TrainRun:
    """One trainer configuration and what its steps measured."""

    label: str
    ranks: int
    threads: int  # torch threads per rank
    start_s: float = 0.0
    wall_s: list[float] = field(default_factory=list)  # controller: trainer.step() call to reply
    train_s: list[float] = field(default_factory=list)  # rank 0's own step time (reply.metrics["train_s"])
    micro_batches: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)  # more TrainerSettings fields (compile, micro_batch_tokens)


@dataclass
class TrainHost:
    """What the machine did meanwhile: load average at each round's start, host memory in use."""

    loadavg_per_round: list[list[float]] = field(default_factory=list)
    mem_start_mib: float = 0.0
    mem_peak_mib: float = 0.0


async def run_trainers(runs: list[TrainRun], model: Path, work: Path, samples: list[TrainSample], warmup: int,
                       steps: int, host: TrainHost, progress: Progress) -> None:
    """Start one trainer per run (all up at once; an idle one waits in a blocking receive), then ``warmup + steps``
    rounds: each round every trainer trains one GRPO step on the same samples, in a rotating order, so that load
    from other jobs falls on every configuration alike. The trainers stop (their ranks with them) when this
    returns or fails."""
    import anyio

    from swectl.actors.engines import EngineHost
    from swectl.actors.trainer import Trainer
    from swectl.config import TrainerConfig
    from swectl.rl.wire import TrainerSettings

    expect = sum(s.length for s in samples)
    memory = MemoryPeak()
    async with anyio.create_task_group() as tg:
        try:
            tg.start_soon(memory.watch)
            trainers: dict[str, Trainer] = {}
            for run in runs:
                folder = work / run.label
                settings = TrainerSettings(model=str(model), out_dir=str(folder), algorithm="grpo", lr=1e-5,
                                           total_steps=warmup + steps, threads=run.threads, seed=0,
                                           **run.settings)
                config = TrainerConfig(nproc_per_node=run.ranks, threads_per_rank=run.threads, start_timeout_s=600,
                                       step_timeout_s=1200)
                trainer = Trainer(config, settings, [EngineHost.local()], log_dir=folder / "logs")
                t0 = time.perf_counter()
                ready = await tg.start(trainer.run)
                run.start_s = time.perf_counter() - t0
                if ready.world_size != run.ranks:
                    raise RuntimeError(f"asked for {run.ranks} ranks, the trainer has {ready.world_size}")
                trainers[run.label] = trainer
                progress(f"trainer {run.label}: {run.ranks} rank(s) x {run.threads} thread(s) ready in "
                         f"{run.start_s:.1f} s")
            progress(f"trainer: {warmup} warm-up + {steps} rounds of {len(runs)} trainers")
            with BatchWriter() as writer:
                for round_no in range(warmup + steps):
                    step = round_no + 1
                    host.loadavg_per_round.append(loadavg())
                    shift = round_no % len(runs)
                    for run in runs[shift:] + runs[:shift]:
                        ref = writer.write(make_batch(step, "grpo", samples))
                        t1 = time.perf_counter()
                        reply = await trainers[run.label].step(step, ref)
                        wall = time.perf_counter() - t1
                        if reply.skipped:
                            raise RuntimeError(f"trainer {run.label}: step {step} refused: {reply.reason}")
                        if int(reply.metrics["tokens"]) != expect:
                            raise RuntimeError(f"trainer {run.label}: trained {reply.metrics['tokens']:.0f} "
                                               f"tokens, not {expect}")
                        run.micro_batches = reply.metrics["micro_batches"]
                        progress(f"trainer {run.label}: step {step}{' (warm-up)' if round_no < warmup else ''} "
                                 f"{wall:.2f} s, {expect / wall:,.0f} tokens/s")
                        if round_no >= warmup:
                            run.wall_s.append(wall)
                            run.train_s.append(reply.metrics["train_s"])
        finally:
            tg.cancel_scope.cancel()
    host.mem_start_mib, host.mem_peak_mib = memory.start, memory.peak


def measure_trainer(args: argparse.Namespace, progress: Progress) -> PartResult:
    import anyio

    steps = args.train_steps or (2 if args.quick else 5)
    warmup = 1
    model = tiny_model(progress)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batch = realistic_batch(TRAIN_SAMPLES, TRAIN_MIN_TOKENS, TRAIN_MAX_TOKENS, seed=1, vocab=vocab)
    tokens = sum(s.length for s in batch.samples)
    runs = [TrainRun("1rank", 1, 1), TrainRun("2ranks", 2, 1), TrainRun("1rank_2threads", 1, 2)]
    host = TrainHost()
    progress(f"trainer: {len(batch.samples)} samples, {tokens:,} tokens ({batch.loss_tokens:,} with mask 1), "
             f"tiny model {model_parameters(model):,} parameters")
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="trainer-", dir=cache_dir()) as tmp:
        try:
            anyio.run(run_trainers, runs, model, Path(tmp), list(batch.samples), warmup, steps, host, progress)
        except BaseExceptionGroup as group:
            raise leaf_error(group) from group
    by = {run.label: run for run in runs}

    def rate(label: str) -> float:
        return round(tokens / statistics.median(by[label].wall_s), 1)

    metrics = {
        "train_tokens_per_s_1rank": rate("1rank"),
        "train_tokens_per_s_2ranks": rate("2ranks"),
        "train_2ranks_vs_1rank": round(rate("2ranks") / rate("1rank"), 3),
        "train_tokens_per_s_1rank_2threads": rate("1rank_2threads"),
        "train_step_s_p50_1rank": round(statistics.median(by["1rank"].wall_s), 3),
        "train_step_s_p50_2ranks": round(statistics.median(by["2ranks"].wall_s), 3),
        "train_batch_tokens": tokens,
    }
    details = {
        "model": {"folder": str(model), "parameters": model_parameters(model), "vocab_size": vocab},
        "batch": {"samples": len(batch.samples), "tokens": tokens, "loss_tokens": batch.loss_tokens,
                  "min_tokens": TRAIN_MIN_TOKENS, "max_tokens": TRAIN_MAX_TOKENS, "algorithm": "grpo",
                  "micro_batch_tokens": 8192},
        "rounds": steps, "warmup_rounds": warmup, "cpu_count": os.cpu_count(),
        "runs": {run.label: {
            "ranks": run.ranks, "threads_per_rank": run.threads, "start_s": round(run.start_s, 2),
            "micro_batches_per_rank": run.micro_batches,
            "step_wall_s": summarize(run.wall_s), "rank0_train_s": summarize(run.train_s),
        } for run in runs},
        "loadavg_before": load_before, "loadavg_after": loadavg(), "loadavg_per_round": host.loadavg_per_round,
        "mem_used_mib_start": round(host.mem_start_mib), "mem_used_mib_peak": round(host.mem_peak_mib),
        "definitions": "tokens/s = every token of the batch (prompt and observations too: all go through forward "
                       "and backward) / median wall time of Trainer.step (the controller's call: shm read, "
                       "forward, backward, gradient reduce-scatter, clip, AdamW step, reply); the shm write "
                       "before each call is not counted. The three trainers are up together and take turns, one "
                       "step each per round (rotating order)",
    }
    notes = [
        f"{os.cpu_count()} CPU cores: two ranks of one thread each use both cores, one rank of one thread (the "
        "default threads_per_rank = 1) uses one; 1rank_2threads is one rank with torch using both cores. On a "
        "2-core machine 2 ranks can be slower than one (FSDP all-gathers and gloo reductions on the cores that "
        "compute); on one shared with other jobs they can also be more than 2x faster: with more runnable "
        "processes than cores, two processes get twice one process's share of the CPU",
        f"2 ranks vs 1: {metrics['train_2ranks_vs_1rank']}x; load average {load_before} before, "
        f"{details['loadavg_after']} after (per round in meta.parts.trainer.loadavg_per_round)",
        f"batch: {len(batch.samples)} samples of {TRAIN_MIN_TOKENS}-{TRAIN_MAX_TOKENS} tokens "
        f"({tokens:,} tokens, {batch.loss_tokens:,} with mask 1: model turns after a prompt), tiny model "
        f"({model_parameters(model):,} parameters, vocab {vocab})",
    ]
    return PartResult(metrics, [], details, notes)


# ---------------------------------------------------------------- weight_sync: trainer -> engines


@dataclass
class SyncRun:
    """One weight-sync setup (a model, trainer ranks) and its repetitions."""

    label: str
    model: Path
    ranks: int
    start_s: dict[str, float] = field(default_factory=dict)
    save_s: list[float] = field(default_factory=list)  # controller: trainer.save_weights() call to reply
    trainer_save_s: list[float] = field(default_factory=list)  # the ranks' own time (Done.seconds)
    reload_s: list[float] = field(default_factory=list)  # controller: engines.update_weights() call to return
    total_s: list[float] = field(default_factory=list)
    distributed_s: list[float] = field(default_factory=list)  # trainer.weight_sync = "distributed" (gloo here)
    buckets: int = 0
    weights_bytes: int = 0
    write_reference_s: float = 0.0  # safetensors alone writing the same tensors (untimed in the sync)
    ranks_why: str = ""
    loadavg_before: list[float] = field(default_factory=list)
    loadavg_after: list[float] = field(default_factory=list)
    mem_peak_mib: float = 0.0
    mem_start_mib: float = 0.0


def write_reference_s(weights: str) -> float:
    """(A child process.) Seconds to write the tensors of ``weights`` (read back first, from the page cache) to a
    new model.safetensors beside it, as the trainer's rank 0 does after gathering them: the write share of a
    save."""
    from safetensors.torch import load_file, save_file

    source = Path(weights) / "model.safetensors"
    tensors = load_file(str(source))
    target = source.with_name("write-reference.safetensors")
    try:
        t0 = time.perf_counter()
        save_file(tensors, str(target), metadata={"format": "pt"})
        return time.perf_counter() - t0
    finally:
        target.unlink(missing_ok=True)


def mem_available_gib() -> float:
    for row in Path("/proc/meminfo").read_text().splitlines():
        if row.startswith("MemAvailable:"):
            return int(row.split()[1]) / 2**20
    return 0.0


async def run_weight_sync(run: SyncRun, work: Path, warmup: int, reps: int, progress: Progress) -> None:
    """One CPU engine serving ``run.model`` and a trainer on the same folder; per repetition the trainer writes
    its weights to a fresh folder and the engines load it under a new version, checked on every engine."""
    import anyio

    from swectl.actors.engines import EngineHost, Engines
    from swectl.actors.trainer import Trainer
    from swectl.config import EngineConfig, TrainerConfig
    from swectl.engine.client import SglangClient
    from swectl.rl.wire import TrainerSettings

    engines = Engines(EngineConfig(kind="cpu", start_timeout_s=900), model=str(run.model),
                      hosts=[EngineHost.local()], log_dir=work / "logs")
    settings = TrainerSettings(model=str(run.model), out_dir=str(work), seed=0)
    trainer = Trainer(TrainerConfig(nproc_per_node=run.ranks, start_timeout_s=900, step_timeout_s=1200), settings,
                      [EngineHost.local()], log_dir=work / "logs")
    memory = MemoryPeak()
    async with anyio.create_task_group() as tg:
        try:
            tg.start_soon(memory.watch)
            t0 = time.perf_counter()
            await tg.start(engines.run)
            run.start_s["engine"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            await tg.start(trainer.run)
            run.start_s["trainer"] = round(time.perf_counter() - t0, 2)
            progress(f"weight_sync {run.label}: engine up in {run.start_s['engine']} s, trainer ({run.ranks} "
                     f"rank(s)) in {run.start_s['trainer']} s; {warmup} warm-up + {reps} repetitions")
            previous: Path | None = None
            for rep in range(warmup + reps):
                path = work / "weights" / f"v{rep}"
                version = f"bench-{rep}"
                t1 = time.perf_counter()
                done = await trainer.save_weights(path)
                t2 = time.perf_counter()
                await engines.update_weights(str(path), version)
                t3 = time.perf_counter()
                for url in engines.urls():
                    async with SglangClient(url) as client:
                        served = await client.get_weight_version()
                    if served != version:
                        raise RuntimeError(f"engine {url} serves weight version {served!r}, not {version!r}")
                run.weights_bytes = sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".safetensors")
                progress(f"weight_sync {run.label}: {'warm-up ' if rep < warmup else ''}save {t2 - t1:.2f} s "
                         f"+ reload {t3 - t2:.2f} s = {t3 - t1:.2f} s")
                if rep >= warmup:
                    run.save_s.append(t2 - t1)
                    run.trainer_save_s.append(done.seconds)
                    run.reload_s.append(t3 - t2)
                    run.total_s.append(t3 - t1)
                if previous is not None:  # the engine now serves `path`; the folder before it is no longer read
                    shutil.rmtree(previous, ignore_errors=True)
                previous = path
            await distributed_syncs(run, trainer, engines, warmup, reps, progress)
        finally:
            tg.cancel_scope.cancel()
    run.mem_start_mib, run.mem_peak_mib = memory.start, memory.peak
    if previous is not None:  # after the trainer and engine are gone, so it competes with nothing of ours
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            run.write_reference_s = pool.submit(write_reference_s, str(previous)).result()


async def distributed_syncs(run: SyncRun, trainer: Any, engines: Any, warmup: int, reps: int,
                            progress: Progress) -> None:
    """The same trainer and engine form a weight group (gloo on this CPU machine) and sync by broadcast in 512 MiB
    buckets (trainer.weight_sync = "distributed"), each repetition checked on every engine's weight version."""
    import anyio

    from swectl.rl.weight_sync import plan_buckets

    group = f"bench-{run.label}"
    port = await trainer.free_port()
    async with anyio.create_task_group() as tg:
        tg.start_soon(trainer.join_weight_group, port, engines.weight_group_size(), group, "gloo")
        tg.start_soon(engines.join_weight_group, trainer.weight_group_address, port, group, "gloo")
    buckets = plan_buckets(trainer.params, 512 * 2**20)
    run.buckets = len(buckets)
    for rep in range(warmup + reps):
        t0 = time.perf_counter()
        await engines.update_weights_distributed(buckets, f"dist-{rep}",
                                                 lambda: trainer.broadcast_weights(group, buckets))
        seconds = time.perf_counter() - t0
        progress(f"weight_sync {run.label}: {'warm-up ' if rep < warmup else ''}distributed {seconds:.2f} s "
                 f"({len(buckets)} bucket(s))")
        if rep >= warmup:
            run.distributed_s.append(seconds)


def measure_weight_sync(args: argparse.Namespace, progress: Progress) -> PartResult:
    import anyio

    tiny = tiny_model(progress)
    runs = [SyncRun("tiny", tiny, 2, ranks_why="the embedded default")]
    if not args.quick:
        big = big_model(tiny, progress)
        available = mem_available_gib()
        if args.big_ranks:
            ranks, why = args.big_ranks, "--big-ranks"
        elif available >= BIG_TWO_RANKS_GIB:
            ranks, why = 2, f"auto: {available:.1f} GiB available >= {BIG_TWO_RANKS_GIB} GiB"
        else:
            ranks, why = 1, f"auto: only {available:.1f} GiB available (< {BIG_TWO_RANKS_GIB} GiB for 2 ranks)"
        runs.append(SyncRun("0p5b", big, ranks, ranks_why=why))
    reps = {"tiny": 1 if args.quick else 5, "0p5b": 3}
    warmup = {"tiny": 0 if args.quick else 1, "0p5b": 0}
    with tempfile.TemporaryDirectory(prefix="weight-sync-", dir=cache_dir()) as tmp:
        for run in runs:
            run.loadavg_before = loadavg()
            try:
                anyio.run(run_weight_sync, run, Path(tmp) / run.label, warmup[run.label], reps[run.label], progress)
            except BaseExceptionGroup as group:
                raise leaf_error(group) from group
            run.loadavg_after = loadavg()
    by = {run.label: run for run in runs}

    def median(label: str, what: str) -> float | None:
        run = by.get(label)
        return round(statistics.median(getattr(run, what)), 3) if run is not None else None

    metrics: dict[str, Any] = {}
    for label in ("tiny", "0p5b"):
        metrics.update({
            f"weight_sync_s_{label}": median(label, "total_s"),
            f"weight_sync_distributed_s_{label}": median(label, "distributed_s"),
            f"weight_sync_save_s_{label}": median(label, "save_s"),
            f"weight_sync_reload_s_{label}": median(label, "reload_s"),
            f"weight_sync_mb_{label}": round(by[label].weights_bytes / 1e6, 1) if label in by else None,
        })
    details = {
        "runs": {run.label: {
            "model": str(run.model), "parameters": model_parameters(run.model), "trainer_ranks": run.ranks,
            "engines": 1, "engine_kind": "cpu", "warmup": warmup[run.label], "repetitions": reps[run.label],
            "trainer_ranks_why": run.ranks_why, "start_s": run.start_s, "weights_bytes": run.weights_bytes,
            "write_reference_s": round(run.write_reference_s, 3),
            "total_s": summarize(run.total_s), "save_s": summarize(run.save_s),
            "distributed_s": summarize(run.distributed_s), "distributed_buckets": run.buckets,
            "trainer_save_s": summarize(run.trainer_save_s), "reload_s": summarize(run.reload_s),
            "loadavg_before": run.loadavg_before, "loadavg_after": run.loadavg_after,
            "mem_used_mib_start": round(run.mem_start_mib), "mem_used_mib_peak": round(run.mem_peak_mib),
        } for run in runs},
        "definitions": "weight sync = Trainer.save_weights(dir) (every rank gathers the full state dict, rank 0 "
                       "writes model.safetensors in float32 plus the config and tokenizer files, to dir.tmp, "
                       "renamed) + Engines.update_weights(dir, version) (pause generation, update_weights_from_disk, "
                       "continue) on every engine; medians over repetitions, each to a fresh folder and version; "
                       "after each, every engine's /get_weight_version is checked (untimed)",
    }
    notes = []
    for run in runs:
        save, reload = statistics.median(run.save_s), statistics.median(run.reload_s)
        notes.append(f"{run.label} ({model_parameters(run.model):,} parameters, {run.weights_bytes / 1e6:,.0f} MB "
                     f"of float32 safetensors, {run.ranks} trainer rank(s) ({run.ranks_why}), 1 CPU engine): save "
                     f"{save:.2f} s + reload {reload:.2f} s = {statistics.median(run.total_s):.2f} s (median of "
                     f"{len(run.total_s)}); writing the same tensors with safetensors alone takes "
                     f"{run.write_reference_s:.2f} s, so ~{max(save - run.write_reference_s, 0):.2f} s of the save is "
                     f"gathering the full state dict (and the request round trip); peak host memory in use "
                     f"{run.mem_peak_mib / 1024:.1f} GiB (from {run.mem_start_mib / 1024:.1f} GiB)")
    if args.quick:
        notes.append("--quick: the 0.6 B model is skipped (its keys are null) and the tiny model synced once")
    notes.append("the engine is swectl's CPU engine (update_weights_from_disk = from_pretrained of the new folder "
                 "into a fresh model, then load_state_dict into the served one); a shared machine skews timings: "
                 "see loadavg_before/after per run in meta.parts.weight_sync.runs")
    return PartResult(metrics, [], details, notes)


# ---------------------------------------------------------------- nodes: ranks on one node vs two


async def run_node_trainers(fleet: Any, model: Path, work: Path, samples: list[TrainSample], warmup: int,
                            steps: int, reps: int, progress: Progress) -> dict[str, Any]:
    """On two SSH test nodes: a trainer of 2 ranks on the first node, then one of 1 rank on each node, each
    training ``warmup + steps`` GRPO steps on the same samples (batches streamed over the control channel, as to
    any remote trainer); then the two-node trainer's weights reach a CPU engine on this machine ``reps`` times
    (save_weights into a folder + the engine's reload from it)."""
    import tomllib

    import anyio

    from swectl.actors.engines import EngineHost, Engines, engine_hosts
    from swectl.actors.trainer import Trainer
    from swectl.config import EngineConfig, TrainerConfig, decode_config
    from swectl.rl.wire import TrainerSettings

    config = decode_config(tomllib.loads(fleet.cluster_toml(extra_node_fields="connect_timeout_s = 10")))
    first, second = (config.node(n.name) for n in fleet.nodes)
    expect = sum(smp.length for smp in samples)
    out: dict[str, Any] = {}
    for label, nodes, ranks in (("1node", [first], 2), ("2nodes", [first, second], 1)):
        folder = work / label
        settings = TrainerSettings(model=str(model), out_dir=str(folder), algorithm="grpo", lr=1e-5,
                                   total_steps=warmup + steps + reps, seed=0)
        async with engine_hosts(nodes) as hosts, anyio.create_task_group() as tg:
            trainer = Trainer(TrainerConfig(nproc_per_node=ranks, start_timeout_s=600, step_timeout_s=1200),
                              settings, hosts, log_dir=folder / "logs")
            t0 = time.perf_counter()
            await tg.start(trainer.run)
            row: dict[str, Any] = {"ranks": ranks, "nodes": [n.name for n in nodes],
                                   "start_s": round(time.perf_counter() - t0, 1), "wall_s": []}
            with BatchWriter() as writer:
                for step in range(1, warmup + steps + 1):
                    ref = writer.write(make_batch(step, "grpo", samples))
                    t1 = time.perf_counter()
                    reply = await trainer.step(step, ref, frame_bytes=writer.frame_bytes(ref))
                    wall = time.perf_counter() - t1
                    if reply.skipped or int(reply.metrics["tokens"]) != expect:
                        raise RuntimeError(f"trainer {label}: step {step}: {reply.reason or reply.metrics}")
                    progress(f"nodes {label}: step {step}{' (warm-up)' if step <= warmup else ''} {wall:.2f} s, "
                             f"{expect / wall:,.0f} tokens/s")
                    if step > warmup:
                        row["wall_s"].append(wall)
            if label == "2nodes":
                engines = Engines(EngineConfig(kind="cpu", start_timeout_s=600), model=str(model),
                                  hosts=[EngineHost.local()], log_dir=folder / "logs")
                await tg.start(engines.run)
                row["sync_s"] = []
                for rep in range(1 + reps):
                    path = folder / "weights" / f"v{rep}"
                    t1 = time.perf_counter()
                    await trainer.save_weights(path)
                    await engines.update_weights(str(path), f"nodes-{rep}")
                    seconds = time.perf_counter() - t1
                    progress(f"nodes {label}: {'warm-up ' if rep == 0 else ''}weights to the engine {seconds:.2f} s")
                    if rep:
                        row["sync_s"].append(seconds)
            tg.cancel_scope.cancel()
        out[label] = row
    return out


def measure_nodes(args: argparse.Namespace, progress: Progress) -> PartResult:
    """Trainer ranks on one SSH test node against the same world split over two (swectl.testing.nodes: network
    namespaces that reach each other through this machine, one filesystem), and a remote trainer's weights to an
    engine here. Both trainers stream their batches over the control channel, so the split is the only
    difference; on this one machine the nodes share the CPUs, so the ratio shows the cost of the network path
    (gloo over the veths, the rendezvous), not more compute."""
    import anyio

    from swectl.testing import nodes as testnodes

    reason = testnodes.can_run_test_nodes()
    if reason is not None:
        raise RuntimeError(f"nodes: {reason}")
    steps = args.train_steps or (2 if args.quick else 4)
    model = tiny_model(progress)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batch = realistic_batch(TRAIN_SAMPLES, TRAIN_MIN_TOKENS, TRAIN_MAX_TOKENS, seed=1, vocab=vocab)
    tokens = sum(smp.length for smp in batch.samples)
    load_before = loadavg()
    with testnodes.test_nodes(2, prefix="swb", base_index=221) as fleet, \
            tempfile.TemporaryDirectory(prefix="nodes-", dir=cache_dir()) as tmp:
        try:
            rows = anyio.run(run_node_trainers, fleet, model, Path(tmp), list(batch.samples), 1, steps, 3, progress)
        except BaseExceptionGroup as group:
            raise leaf_error(group) from group

    def rate(label: str) -> float:
        return round(tokens / statistics.median(rows[label]["wall_s"]), 1)

    metrics = {
        "train_tokens_per_s_1node_2ranks": rate("1node"),
        "train_tokens_per_s_2nodes": rate("2nodes"),
        "train_2nodes_vs_1node": round(rate("2nodes") / rate("1node"), 3),
        "weight_sync_remote_s": round(statistics.median(rows["2nodes"]["sync_s"]), 3),
    }
    details = {"batch": {"samples": len(batch.samples), "tokens": tokens}, "runs": rows,
               "loadavg_before": load_before, "loadavg_after": loadavg()}
    notes = ["the two test nodes are network namespaces of this 2-core machine: they share its CPUs and "
             "filesystem, so 2 nodes x 1 rank does the same compute as 1 node x 2 ranks; the ratio is the cost of "
             "the nodes' network path (gloo over veths through this host), not a speed-up",
             "weight_sync_remote_s: the two-node trainer's save_weights (rank 0 on the first node writes the "
             "folder) + a CPU engine here reloading it, tiny model"]
    return PartResult(metrics, [], details, notes)


# ---------------------------------------------------------------- the suite

PARTS: dict[str, Callable[[argparse.Namespace, Progress], PartResult]] = {
    "transport": measure_transport,
    "trainer": measure_trainer,
    "weight_sync": measure_weight_sync,
    "nodes": measure_nodes,
}


@contextmanager
def results_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on the results folder (no lock file to leave behind), so parts running at once do not
    lose each other's keys."""
    with folder_lock(path.parent):
        yield


def merge_results(part: str, result: PartResult, quick: bool, path: Path | None = None) -> Path:
    """Read results/train.json, replace this part's metrics, goals and details, keep every other key; write."""
    path = path or RESULTS_DIR / f"{SUITE}.json"
    with results_lock(path):
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        meta = {k: v for k, v in old.get("meta", {}).items() if k != "format_version"}
        parts = dict(meta.get("parts", {}))
        # This part's keys from its last run go (a renamed metric must not linger), then its new ones come in.
        stale = set(parts.get(part, {}).get("metrics", [])) | set(result.metrics)
        metrics = {k: v for k, v in old.get("metrics", {}).items() if k not in stale} | result.metrics
        goals = [g for g in meta.get("goals", []) if g.get("metric") not in stale]
        goals += [g.record(result.metrics) for g in result.goals]
        parts[part] = {"metrics": list(result.metrics), **result.details, "quick": quick, "notes": result.notes,
                       "host": host_meta()}
        meta.update(host_meta(), goals=goals, parts=parts)
        return write_results(SUITE, metrics, meta, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--samples", type=int, default=64, help="samples per batch")
    parser.add_argument("--min-tokens", type=int, default=4096, help="shortest sample")
    parser.add_argument("--max-tokens", type=int, default=8192, help="longest sample")
    parser.add_argument("--reps", type=int, default=0, help="measured rounds (default 25, --quick 5)")
    parser.add_argument("--train-steps", type=int, default=0, help="trainer: measured steps (default 5, --quick 2)")
    parser.add_argument("--big-ranks", type=int, default=0, choices=(0, 1, 2),
                        help=f"weight_sync: trainer ranks for the 0.6 B model (0 = 2 when {BIG_TWO_RANKS_GIB:g} GiB "
                             "are available, else 1)")
    args = parser.parse_args(argv)
    names = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    progress = Progress(SUITE)
    failed = False
    for name in names:
        try:
            result = PARTS[name](args, progress)
        except Exception as exc:  # one part failing must not lose the others' results
            progress(f"{name} failed: {type(exc).__name__}: {exc}")
            failed = True
            continue
        path = merge_results(name, result, args.quick)
        print(f"\n[{name}]")
        print(result_table(result.metrics, result.goals))
        for note in result.notes:
            print(f"  note: {note}")
        print(f"merged into {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
