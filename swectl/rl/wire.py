"""The trainer's control channel: what the controller (actors/trainer.py) and rank 0 of the torchrun workers
(remote/programs/trainer.py) say to each other over one TCP connection.

Frames are a 4-byte big-endian length followed by a msgpack-encoded message. Requests carry ``op``, replies
``kind`` (tagged unions). Samples never travel here: a ``StepRequest`` carries a ``BatchRef`` into shared
memory (docs/architecture.md 8.3). The first request is a ``Hello`` with the run's key; rank 0 closes the
connection on a wrong key.
"""

from __future__ import annotations

import struct
from typing import Any, Literal

import msgspec

from swectl.config import LossConfig, OptimConfig, TrainerConfig
from swectl.rl.shm import BatchRef
from swectl.rl.weight_sync import ParamSpec

FRAME_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


# [train.loss] keys the controller applies when it makes samples (swectl/rl/groups.py), not the ranks
LOSS_MASKS = frozenset({"mask_truncated", "mask_truncated_endings", "mask_format_errors"})


class TrainerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a trainer rank needs to build its model and optimizer; passed as JSON on its command line
    (it holds no secret)."""

    model: str  # Hugging Face model folder (on the trainer node)
    out_dir: str  # the run folder (weights/ and checkpoints/ live there)
    algorithm: Literal["grpo", "sft"] = "grpo"
    lr: float = 1e-4
    warmup_steps: int = 0
    total_steps: int = 1
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    aggregation: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float | None = 2.0
    kl_coef: float = 0.0
    prob_weight: float = 0.0
    micro_batch_tokens: int = 8192
    micro_batch_rows: int | Literal["auto"] = "auto"  # samples per forward at most; auto: 1 on a CPU, else no limit
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile each decoder layer; auto: on a GPU only
    # A world of one keeps its parameters gathered and its gradients unreduced between the micro-batches of a step
    # (FSDP2 all-gathers and reduce-scatters each micro-batch otherwise); False: the old way (`just bench gpu` A/B)
    accumulate_unsharded: bool = True
    threads: int = 1
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    seed: int = 0
    resume: str = ""  # a checkpoint folder to load model, optimizer, scheduler and RNG from
    sync_dtype: str = "auto"  # dtype of floating weights sent to engines by the distributed sync ("auto": as held)

    @classmethod
    def of(cls, trainer: TrainerConfig, optim: OptimConfig, loss: LossConfig, **run: Any) -> TrainerSettings:
        """The settings of a run's ranks: the [trainer] and [train.optim] sections whole, [train.loss] but its
        sample masks (LOSS_MASKS: the controller applies them when it makes the samples), and the run's own fields
        (model, out_dir, algorithm, total_steps, seed, resume, ...) as keywords."""
        policy_loss = {k: v for k, v in msgspec.structs.asdict(loss).items() if k not in LOSS_MASKS}
        return cls(**msgspec.structs.asdict(optim), **policy_loss,
                   micro_batch_tokens=trainer.micro_batch_tokens,
                   micro_batch_rows=trainer.micro_batch_rows, compile=trainer.compile,
                   threads=trainer.threads_per_rank,
                   backend=trainer.backend, sync_dtype=trainer.weight_sync_dtype, **run)


class Hello(msgspec.Struct, frozen=True, tag="hello", tag_field="op"):
    """First request: the run's key."""
    key: str


class StepRequest(msgspec.Struct, frozen=True, tag="step", tag_field="op"):
    """Train one optimizer step on the batch at ``ref``; then write the weights to ``weights_dir`` ("" = don't).
    ``frame``: the batch itself, for a trainer whose rank 0 is not on the controller's machine (rank 0 writes
    it into its own node's shared memory and the ranks read it there)."""
    step: int
    ref: BatchRef
    weights_dir: str = ""
    frame: bytes | None = None


class CheckpointRequest(msgspec.Struct, frozen=True, tag="checkpoint", tag_field="op"):
    """Save model, optimizer, scheduler and RNG states (sharded, torch.distributed.checkpoint) into ``path``."""
    step: int
    path: str


class SaveWeightsRequest(msgspec.Struct, frozen=True, tag="save_weights", tag_field="op"):
    """Write the current weights as a Hugging Face folder at ``path``."""
    path: str


class JoinWeightGroupRequest(msgspec.Struct, frozen=True, tag="join_weight_group", tag_field="op"):
    """Rank 0 hosts the weight group with the engines (remote/programs/weight_group.py) at ``address:port``; the
    engines join it through their ``/init_weights_update_group`` meanwhile."""
    address: str
    port: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float = 300.0


class BroadcastWeightsRequest(msgspec.Struct, frozen=True, tag="broadcast_weights", tag_field="op"):
    """Every rank gathers the full tensors of each bucket in turn; rank 0 broadcasts them over the weight group, in
    the order given (the engines receive the same buckets through ``/update_weights_from_distributed``)."""
    group_name: str
    buckets: list[list[ParamSpec]]


class ShutdownRequest(msgspec.Struct, frozen=True, tag="shutdown", tag_field="op"):
    """Stop every rank cleanly."""


TrainerRequest = (Hello | StepRequest | CheckpointRequest | SaveWeightsRequest | JoinWeightGroupRequest
                  | BroadcastWeightsRequest | ShutdownRequest)


class Ready(msgspec.Struct, frozen=True, tag="ready", tag_field="kind"):
    """Every rank has the model: world size, parameters, the step it resumes after (0 for a fresh start), and the
    tensors a distributed weight sync sends (engine-side names, dtypes as sent, full shapes)."""
    world_size: int
    parameters: int
    step: int
    device: str
    params: list[ParamSpec] = []


class StepReply(msgspec.Struct, frozen=True, tag="step", tag_field="kind"):
    """One step's outcome. ``skipped``: a non-finite loss or gradient; the weights were not changed."""
    step: int
    metrics: dict[str, float]
    weights_dir: str = ""
    skipped: bool = False
    reason: str = ""


class Done(msgspec.Struct, frozen=True, tag="done", tag_field="kind"):
    """A checkpoint or weight save finished (``path``) or the ranks shut down."""
    path: str = ""
    seconds: float = 0.0


class Failed(msgspec.Struct, frozen=True, tag="failed", tag_field="kind"):
    """A request failed on the ranks (disk full, bad batch, ...); the message says why. ``fatal``: the ranks can
    not go on (a collective failed: a peer died, the process group is broken) and exit after this reply.
    ``no_space``: a write found its disk full (ENOSPC), which a restart can get past once there is space."""
    message: str
    fatal: bool = False
    no_space: bool = False


TrainerReply = Ready | StepReply | Done | Failed

_request_decoder = msgspec.msgpack.Decoder(TrainerRequest)
_reply_decoder = msgspec.msgpack.Decoder(TrainerReply)
_encoder = msgspec.msgpack.Encoder()


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return FRAME_HEADER.pack(len(body)) + body


def decode_request(body: bytes) -> TrainerRequest:
    return _request_decoder.decode(body)


def decode_reply(body: bytes) -> TrainerReply:
    return _reply_decoder.decode(body)
