"""The training worker: one process per rank under ``torchrun``, FSDP2 over a Hugging Face causal LM.

    torchrun --nproc_per_node 2 -m swectl.remote.programs.trainer --settings JSON --listen 127.0.0.1

Every rank loads the model folder with transformers, shards it with ``fully_shard`` (each decoder layer, then
the root; gloo on CPU, NCCL with bf16 mixed precision on GPU) and builds AdamW with a warmup + constant/cosine
schedule. A world of one on the CPU trains the plain module: there FSDP2 shards nothing, and its hooks around every
layer's forward and backward took a tenth of an SFT step of the tiny model (1.77 s against 1.60 s).

Rank 0 listens on ``--listen`` (port 0: it prints ``swectl-trainer ready on HOST:PORT``), accepts the controller's
connection (the first frame must carry the key from ``$SWECTL_ENGINE_API_KEY``, which the node supervisor sets from
the channel's stdin) and then serves requests (swectl/rl/wire.py): each one is broadcast to every rank over a gloo
group and executed by all of them together.

A step reads the TrainBatch from shared memory (every rank attaches to the segment the ``BatchRef`` names),
splits it into per-rank micro-batches packed by a token budget (swectl/rl/packing.py; every rank runs the
same number of forward passes, padded with empty ones, because FSDP's collectives run per forward), computes
the loss of swectl/rl/losses.py with the *global* batch denominators, accumulates gradients, clips them, and
steps only when the loss and the gradient norm are finite (otherwise the step is refused and reported, and
nothing is written). FSDP averages gradients over ranks; the loss is multiplied by the world size so that
the result is the sum the global denominators expect.

Weights for the engines go to ``weights_dir`` as a Hugging Face folder (safetensors + the model folder's
config and tokenizer files), written to ``<dir>.tmp`` and renamed, so a reader never sees half a folder.
Checkpoints (model, optimizer, scheduler, step, RNG) are torch.distributed.checkpoint folders, also written
to ``.tmp`` and renamed by rank 0 after every rank finished.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import math
import os
import shutil
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from swectl.model.logit_transforms import logit_transforms
from swectl.rl.batch import TrainBatch, TrainSample
from swectl.rl.losses import (
    policy_loss,
    predicting_positions,
    row_entropy,
    row_logprobs,
    sft_loss,
    spread,
    targets_at,
    token_entropy,
    token_logprobs,
)
from swectl.rl.packing import plan_micro_batches
from swectl.rl.shm import BatchReader, BatchWriter, decode_batch
from swectl.rl.weight_sync import ParamSpec, engine_name, sync_dtype
from swectl.rl.wire import (
    FRAME_HEADER,
    MAX_FRAME,
    BroadcastWeightsRequest,
    CheckpointRequest,
    Done,
    Failed,
    Hello,
    JoinWeightGroupRequest,
    Ready,
    SaveWeightsRequest,
    ShutdownRequest,
    StepReply,
    StepRequest,
    TrainerRequest,
    TrainerSettings,
    decode_request,
    frame,
)

KEY_ENV = "SWECTL_ENGINE_API_KEY"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
MAX_KEYS = ("ratio_max", "tis_max", "logprob_gap_max")  # statistics reduced with MAX over micro-batches and ranks


def say_line(text: str, stream: TextIO) -> None:
    """One line in one write: the ranks share the output pipe, and print's separate write of the newline (unbuffered
    streams) let another rank's line land in between ('... ready on 0.0.0.0:41493swectl-trainer rank 1: ...')."""
    stream.write(text + "\n")
    stream.flush()


def log(message: str) -> None:
    say_line(f"swectl-trainer rank {os.environ.get('RANK', '?')}: {message}", sys.stderr)


# ---------------------------------------------------------------- model, optimizer, schedule


def lr_factor(step: int, s: TrainerSettings) -> float:
    """The learning-rate multiplier after ``step`` optimizer steps: linear warmup, then constant or cosine."""
    if s.warmup_steps and step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.schedule == "constant":
        return 1.0
    span = max(s.total_steps - s.warmup_steps, 1)
    progress = min(max(step - s.warmup_steps, 0) / span, 1.0)
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _device(s: TrainerSettings) -> tuple[torch.device, str]:
    backend = s.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        gpus = torch.cuda.device_count()
        if local >= gpus:  # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): say so before it does
            raise RuntimeError(f"local rank {local} has no GPU of its own: this node has {gpus} GPU(s) and NCCL puts "
                               f"one rank on each; set [trainer] nproc_per_node to at most {gpus} (or backend = "
                               f"\"gloo\" to train on the CPU)")
        torch.cuda.set_device(local)
        return torch.device("cuda", local), backend
    return torch.device("cpu"), backend


def is_sharded(device: torch.device) -> bool:
    """Whether the model is wrapped with FSDP2: always but in a world of one on the CPU (module docstring)."""
    return device.type != "cpu" or dist.get_world_size() > 1


def build_model(s: TrainerSettings, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(s.model, torch_dtype=torch.float32, local_files_only=True)
    model.to(device)
    model.config.use_cache = False
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None and (s.compile == "on" or (s.compile == "auto" and device.type == "cuda")):
        # Each decoder layer compiled on its own (FSDP2's hooks stay outside the compiled code): fused norms,
        # activations and rotary embeddings instead of one kernel launch each. The layers share one code object:
        # room in dynamo's cache for each of them and a few shapes
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(layers))
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer)
    sharded = is_sharded(device)
    if sharded:
        for layer in layers or []:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    _add_selected_logits(model, sharded=sharded)
    return model


def _add_selected_logits(model: torch.nn.Module, *, sharded: bool) -> None:
    """Give ``model`` a forward method ``selected_logits(input_ids, attention_mask, rows, cols)``: the decoder's
    hidden states at ``(rows, cols)`` only, through the output projection (``[N, V]``). The loss reads the logits
    that predict mask-1 tokens (a quarter of an SFT batch's positions), and the ``[B, T, V]`` logits were half of a
    step's time on the CPU (their projection, its backward, two full-vocabulary softmaxes).

    On a ``sharded`` model it is registered with FSDP2 (``register_fsdp_forward_method``) so the root unit's
    parameters (embeddings, final norm, output projection) are all-gathered around it as around ``forward``. Kept
    when the model has the standard decoder + output-projection shape, no logit transform, and a check on a short
    input gives the same logits as ``forward``; otherwise the model has no such method and the trainer computes
    full logits, as before (logged)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    transforms = logit_transforms(model.config)
    if decoder is None or head is None or transforms:
        log(f"full logits: {'logit transform ' + ', '.join(transforms) if transforms else 'no decoder/output head'}")
        return

    def selected_logits(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor,
                        cols: torch.Tensor) -> torch.Tensor:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return head(hidden[rows, cols])

    model.selected_logits = selected_logits
    if sharded:
        register_fsdp_forward_method(model, "selected_logits")
    param = next(model.parameters())
    vocab = int(model.config.vocab_size)
    ids = (torch.arange(16, device=param.device).reshape(2, 8) * 7919 + 3) % vocab
    attention = torch.ones_like(ids)
    attention[1, 6:] = 0
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attention).logits.float()
        rows, cols = attention.nonzero(as_tuple=True)
        chosen = model.selected_logits(ids, attention, rows, cols).float()
    # FSDP2 keeps the root unit's parameters gathered after a forward (a backward would free them): free them here on
    # every rank, or a rank that frees them later (a weight save) all-gathers when the others do not
    if sharded:
        model.reshard()
    gap = float((full[rows, cols] - chosen).abs().max())
    if gap > 1e-3 * max(1.0, float(full.abs().max())):
        log(f"full logits: the selected-logits path differs from forward by {gap:.3g} on a check input")
        del model.selected_logits


class Trainer:
    """One rank's model, optimizer and schedule, and the requests they serve."""

    def __init__(self, s: TrainerSettings) -> None:
        self.s = s
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # Stays attached to the controller's segment between steps (re-attaching when it moves to a new one):
        # a fresh mapping per step paid its page faults every time (just bench train: transport).
        self.batches = BatchReader()
        self.device, _ = _device(s)
        torch.manual_seed(s.seed)
        self.model = build_model(s, self.device)
        self.ref_model = build_model(s, self.device) if s.kl_coef > 0 else None
        if self.ref_model is not None:
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=s.lr, betas=s.betas,
                                           weight_decay=s.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda n: lr_factor(n, s))
        self.step = 0
        self.weight_groups: dict[str, Any] = {}  # rank 0: weight groups with engines, by name
        self._writer: BatchWriter | None = None
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        if s.resume:
            self.load_checkpoint(Path(s.resume))

    @property
    def one_node(self) -> bool:
        """Every rank runs on this node (torchrun's LOCAL_WORLD_SIZE is the world): they share its memory."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world)) == self.world

    @property
    def max_rows(self) -> int | None:
        """Samples per forward at most (None: as many as the token budget holds)."""
        if self.s.micro_batch_rows == "auto":
            return 1 if self.device.type == "cpu" else None
        return self.s.micro_batch_rows

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------ one step

    def _collate(self, samples: list[TrainSample]) -> dict[str, torch.Tensor]:
        """Right-padded tensors of one micro-batch (an empty one: a single pad token with mask 0)."""
        if not samples:
            one = torch.full((1, 1), self.pad_id, dtype=torch.long)
            zero = torch.zeros((1, 1))
            return {"input_ids": one, "mask": zero,
                    "rollout_logp": zero, "advantages": zero}
        width = max(s.length for s in samples)
        ids = np.full((len(samples), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(samples), width), dtype=np.float32)
        lp = np.zeros((len(samples), width), dtype=np.float32)
        adv = np.zeros((len(samples), width), dtype=np.float32)
        for row, sample in enumerate(samples):
            n = sample.length
            ids[row, :n] = np.frombuffer(sample.tokens, dtype="<i4")
            mask[row, :n] = np.frombuffer(sample.loss_mask, dtype=np.uint8)
            lp[row, :n] = np.frombuffer(sample.logprobs, dtype="<f4")
            adv[row, :n] = sample.advantage
        return {k: torch.from_numpy(v) for k, v in
                (("input_ids", ids), ("mask", mask), ("rollout_logp", lp),
                 ("advantages", adv))}

    def _token_logprobs(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``[B, T]`` logprobs of the micro-batch's tokens (0 where not needed), the logits they came from and
        where those sit: on the selected-logits path only the rows that predict mask-1 tokens (``[N, V]``, with
        their ``(rows, cols)``), else ``[B, T, V]`` (and None)."""
        # No attention mask: the rows are right-padded, so causal attention already keeps every real token from the
        # pads after it (and positions count from 0 either way); a padding mask only sends attention down its
        # slower masked path (CPU: the decoder's forward + backward took 1.45x as long)
        ids = mb["input_ids"]
        if hasattr(model, "selected_logits"):
            rows, cols = predicting_positions(mb["mask"])
            logits = model.selected_logits(ids, None, rows, cols)
            logp = spread(row_logprobs(logits, targets_at(ids, rows, cols)), rows, cols, ids.shape)
            return logp, logits, (rows, cols)
        # bf16 on a GPU: token_logprobs and token_entropy cast chunk by chunk; a whole float32 copy of [B, T, V] would
        # be the largest tensor of the step (5 GB for 8192 tokens of a 152k vocabulary)
        logits = model(input_ids=ids).logits
        return token_logprobs(logits, ids), logits, None

    @staticmethod
    def _entropy_sum(logits: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor] | None,
                     mask: torch.Tensor) -> torch.Tensor:
        """The entropies of the distributions that predicted the mask-1 tokens, weighted by the mask and summed."""
        with torch.no_grad():
            if where is None:
                return (token_entropy(logits.detach()) * mask).sum()
            return (spread(row_entropy(logits.detach()), *where, mask.shape) * mask).sum()

    def _accumulate(self, *, last: bool) -> None:
        """In a world of one, only the step's last micro-batch reduces its gradients and reshards after its backward
        (the optimizer then updates the sharded parameters and the next forward gathers them afresh); the others add
        to unreduced gradients and leave the parameters gathered for the next forward. With several ranks every
        micro-batch syncs: unreduced gradients there would cost each rank a whole model's gradients in memory.
        (Keeping the parameters gathered from forward to backward as well, ``reshard_after_forward=False``, changed
        the second step's losses in a world of one on torch 2.13: not done.)"""
        if self.s.accumulate_unsharded and self.world == 1 and is_sharded(self.device):
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

    def _micro_loss(self, mb: dict[str, torch.Tensor], batch: TrainBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        s = self.s
        mb = {k: v.to(self.device) for k, v in mb.items()}
        logp, logits, where = self._token_logprobs(self.model, mb)
        mask = mb["mask"]
        denominator = float(batch.loss_tokens if s.aggregation == "token_mean" else batch.sequences) or 1.0
        if batch.algorithm == "sft":
            loss, stats = sft_loss(logp, mask, denominator=denominator, aggregation=s.aggregation)
        else:
            ref_logp = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logp, _, _ = self._token_logprobs(self.ref_model, mb)
            loss, stats = policy_loss(logp, logp.detach(), mb["rollout_logp"], mb["advantages"], mask,
                                      denominator=denominator, aggregation=s.aggregation, eps_low=s.eps_low,
                                      eps_high=s.eps_high, tis_cap=s.tis_cap, ref_logp=ref_logp,
                                      kl_coef=s.kl_coef, prob_weight=s.prob_weight)
        stats = {k: v.detach().float() for k, v in stats.items()}
        stats["entropy_sum"] = self._entropy_sum(logits, where, mask).float()
        return loss, stats

    def train_step(self, req: StepRequest) -> StepReply:
        t0 = time.perf_counter()
        # A batch that came with its frame (ranks on several nodes: no shared memory spans them) is decoded by
        # each rank; otherwise every rank reads it from this node's shared memory
        batch = decode_batch(req.frame, where="step frame") if req.frame is not None else self.batches.read(req.ref)
        t_read = time.perf_counter() - t0
        plan = plan_micro_batches([smp.length for smp in batch.samples], ranks=self.world,
                                  token_budget=self.s.micro_batch_tokens, max_rows=self.max_rows)[self.rank]
        self.model.train()
        sums: dict[str, torch.Tensor] = {}
        maxes: dict[str, torch.Tensor] = {}
        tokens = 0
        for index, indices in enumerate(plan):
            self._accumulate(last=index == len(plan) - 1)
            chosen = [batch.samples[i] for i in indices]
            tokens += sum(smp.length for smp in chosen)
            loss, stats = self._micro_loss(self._collate(chosen), batch)
            (loss * self.world).backward()
            for key, value in stats.items():
                if key in MAX_KEYS:
                    maxes[key] = torch.maximum(maxes[key], value) if key in maxes else value
                else:
                    sums[key] = sums[key] + value if key in sums else value
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        totals = _reduce(sums, dist.ReduceOp.SUM, self.device)
        peaks = _reduce(maxes, dist.ReduceOp.MAX, self.device)
        tokens_all = _reduce({"t": torch.tensor(float(tokens))}, dist.ReduceOp.SUM, self.device)["t"]
        lr = self.scheduler.get_last_lr()[0]
        metrics = _metrics(totals, peaks, batch)
        metrics.update(grad_norm=float(grad_norm), lr=lr, tokens=float(tokens_all),
                       micro_batches=float(len(plan)), read_s=t_read)
        finite = math.isfinite(metrics.get("loss", 0.0)) and math.isfinite(float(grad_norm))
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            reason = f"non-finite loss ({metrics.get('loss')}) or grad norm ({float(grad_norm)}): step refused"
            metrics["train_s"] = time.perf_counter() - t0
            return StepReply(step=req.step, metrics=metrics, skipped=True, reason=reason)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = req.step
        metrics["train_s"] = time.perf_counter() - t0
        metrics["train_tokens_per_s"] = float(tokens_all) / max(metrics["train_s"], 1e-9)
        weights = ""
        if req.weights_dir:
            t1 = time.perf_counter()
            weights = self.save_weights(Path(req.weights_dir))
            metrics["save_weights_s"] = time.perf_counter() - t1
        return StepReply(step=req.step, metrics=metrics, weights_dir=weights)

    def localize(self, req: StepRequest) -> StepRequest:
        """A batch streamed over the control channel goes into this node's shared memory (rank 0 only)."""
        if self._writer is None:
            self._writer = BatchWriter()
        ref = self._writer.write_frame(req.frame, req.step)
        return msgspec.structs.replace(req, ref=ref, frame=None)

    # ------------------------------------------------------------ weights and checkpoints

    def save_weights(self, path: Path) -> str:
        """All ranks gather the full state dict; rank 0 writes a Hugging Face folder at ``path`` (atomically)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            write_hf_folder(self.model, state, Path(self.s.model), path)
        dist.barrier()
        return str(path)

    # ---- the distributed weight sync (rank 0 and the engines form the weight group)

    def _sync_state(self) -> dict[str, tuple[str, torch.Tensor]]:
        """engine-side name -> (state-dict key, tensor) of what a weight sync sends (as write_hf_folder: a tied
        lm_head is not sent)."""
        out: dict[str, tuple[str, torch.Tensor]] = {}
        for key, value in self.model.state_dict().items():
            name = engine_name(key)
            if name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
                continue
            out[name] = (key, value)
        return out

    def weight_specs(self) -> list[ParamSpec]:
        return [ParamSpec(name=name, dtype=sync_dtype(str(t.dtype), self.s.sync_dtype), shape=list(t.shape))
                for name, (_, t) in self._sync_state().items()]

    def join_weight_group(self, req: JoinWeightGroupRequest) -> str:
        if self.rank == 0:
            from swectl.remote.programs import weight_group

            self.weight_groups[req.group_name] = weight_group.join(req.address, req.port, 0, req.world_size,
                                                                   req.group_name, req.backend, req.timeout_s)
        return req.group_name

    def broadcast_weights(self, req: BroadcastWeightsRequest) -> str:
        """Each bucket: every rank gathers its tensors (FSDP's all-gather), rank 0 casts and broadcasts them."""
        from torch.distributed.tensor import DTensor

        from swectl.remote.programs import weight_group

        group = self.weight_groups.get(req.group_name) if self.rank == 0 else None
        if self.rank == 0 and group is None:
            raise ValueError(f"no weight group {req.group_name!r} (joined: {', '.join(self.weight_groups) or 'none'})")
        state = self._sync_state()
        unknown = [spec.name for bucket in req.buckets for spec in bucket if spec.name not in state]
        if unknown:
            raise ValueError(f"the model has no parameters named {', '.join(unknown[:5])}")
        device = self.device if _group_backend(group) == "nccl" else torch.device("cpu")
        with torch.no_grad():
            for bucket in req.buckets:
                tensors = []
                for spec in bucket:
                    value = state[spec.name][1]
                    full = value.full_tensor() if isinstance(value, DTensor) else value  # a collective: all ranks
                    if group is not None:
                        tensors.append(full.to(device=device, dtype=getattr(torch, spec.dtype)).contiguous())
                if group is not None:
                    weight_group.broadcast(tensors, group)
                del tensors
        return req.group_name

    def save_checkpoint(self, req: CheckpointRequest) -> str:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        final = Path(req.path)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        except CheckpointException as exc:  # every rank gets it (the save gathers their results): free the disk
            free = shutil.disk_usage(final.parent).free  # before the partial folder goes
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"{describe(exc)} ({free / 2**20:.1f} MiB free on the disk of {final.parent}"
                               f"{': full' if free < 2**20 else ''})") from None
        torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state()}, tmp / f"rng{self.rank}.pt")
        if self.rank == 0:
            state = {"step": req.step, "scheduler": self.scheduler.state_dict(), "world_size": self.world,
                     "settings": msgspec.to_builtins(self.s)}
            (tmp / "trainer.json").write_text(json.dumps(state, indent=1))
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        dist.barrier()
        return str(final)

    def load_checkpoint(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        state = json.loads((path / "trainer.json").read_text())
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        both = {"model": model_sd, "optim": optim_sd}
        dcp.load(both, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self._apply_settings_after_resume(state.get("settings", {}))
        rng_file = path / f"rng{self.rank}.pt"
        if rng_file.exists() and state.get("world_size") == self.world:
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])


    def _apply_settings_after_resume(self, saved: dict) -> None:
        """The run's optimizer settings win over the checkpoint's: loading the optimizer and scheduler state brings
        back the lr, weight decay and betas they were saved with, so a resumed run's ``--set train.optim.lr=...`` would
        be ignored. The moments, the step count and the schedule's position stay the checkpoint's."""
        lr = self.s.lr * lr_factor(self.scheduler.last_epoch, self.s)
        self.scheduler.base_lrs = [self.s.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group.update(initial_lr=self.s.lr, lr=lr, weight_decay=self.s.weight_decay, betas=tuple(self.s.betas))
        self.scheduler._last_lr = [lr for _ in self.optimizer.param_groups]  # what get_last_lr() reports
        changed = {key: (saved[key], now) for key, now in (("lr", self.s.lr), ("weight_decay", self.s.weight_decay),
                                                          ("betas", list(self.s.betas)))
                   if key in saved and saved[key] != now}
        if changed and self.rank == 0:
            say_line("resumed with new optimizer settings: " + ", ".join(f"{k} {old} -> {new}" for k, (old, new)
                                                                        in changed.items()), sys.stderr)


def write_hf_folder(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path, path: Path) -> None:
    """``state`` as ``model.safetensors`` plus the source folder's config and tokenizer files, at ``path``."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and item.name not in WEIGHT_FILES and not item.name.endswith((".safetensors", ".bin")):
            shutil.copy2(item, tmp / item.name)
    tensors = {k: v.detach().to(torch.float32 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in state.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _reduce(values: dict[str, torch.Tensor], op: dist.ReduceOp, device: torch.device) -> dict[str, float]:
    """All-reduce a dict of scalars (the same keys on every rank) in one collective, on ``device``: the default
    group's (NCCL reduces only CUDA tensors, gloo CPU ones)."""
    keys = sorted(values)
    if not keys:
        return {}
    flat = torch.stack([values[k].detach().float().reshape(()).to(device) for k in keys])
    dist.all_reduce(flat, op=op)
    return {k: float(v) for k, v in zip(keys, flat.tolist(), strict=True)}


def _metrics(sums: dict[str, float], peaks: dict[str, float], batch: TrainBatch) -> dict[str, float]:
    """Per-token means of the summed statistics."""
    tokens = max(sums.get("tokens", 0.0), 1.0)
    out: dict[str, float] = {"loss_tokens": float(batch.loss_tokens), "sequences": float(batch.sequences),
                             "samples": float(len(batch.samples))}
    if "loss_sum" in sums:
        out["loss"] = sums["loss_sum"] / tokens
    out["entropy"] = sums.get("entropy_sum", 0.0) / tokens
    for key in ("clipped_low", "clipped_high", "tis_clipped"):
        if key in sums:
            out[key.replace("clipped", "clip_frac") if key != "tis_clipped" else "tis_clip_frac"] = sums[key] / tokens
    for key in ("ratio_sum", "tis_sum", "kl_sum"):
        if key in sums:
            out[key.replace("_sum", "_mean")] = sums[key] / tokens
    out.update(peaks)
    return out


# ---------------------------------------------------------------- the control channel (rank 0)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    parts = []
    while n:
        chunk = conn.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the controller closed the connection")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def receive(conn: socket.socket) -> TrainerRequest:
    (length,) = FRAME_HEADER.unpack(_recv_exact(conn, FRAME_HEADER.size))
    if length > MAX_FRAME:
        raise ConnectionError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return decode_request(_recv_exact(conn, length))


def accept_controller(listen: str) -> socket.socket:
    server = socket.create_server((listen, 0))
    host, port = server.getsockname()[:2]
    say_line(f"swectl-trainer ready on {host}:{port}", sys.stdout)
    key = os.environ.get(KEY_ENV, "")
    while True:
        conn, _ = server.accept()
        try:
            hello = receive(conn)
        except (ConnectionError, msgspec.DecodeError, msgspec.ValidationError):
            conn.close()
            continue
        if isinstance(hello, Hello) and hello.key == key:
            server.close()
            return conn
        conn.close()


def serve(trainer: Trainer, conn: socket.socket | None, control: Any) -> None:
    """Rank 0 reads requests and broadcasts them; every rank executes them together."""
    rank0 = trainer.rank == 0
    handlers: dict[type, Callable[[Any], Any]] = {
        StepRequest: trainer.train_step,
        CheckpointRequest: lambda r: Done(path=trainer.save_checkpoint(r)),
        SaveWeightsRequest: lambda r: Done(path=trainer.save_weights(Path(r.path))),
        JoinWeightGroupRequest: lambda r: Done(path=trainer.join_weight_group(r)),
        BroadcastWeightsRequest: lambda r: Done(path=trainer.broadcast_weights(r)),
    }
    while True:
        box: list[Any] = [None]
        if rank0:
            assert conn is not None
            try:
                box[0] = receive(conn)
            except ConnectionError as exc:
                log(f"{exc}; stopping")
                box[0] = ShutdownRequest()
            if isinstance(box[0], StepRequest) and box[0].frame is not None and trainer.one_node:
                box[0] = trainer.localize(box[0])  # else the frame goes to every rank with the request
        dist.broadcast_object_list(box, src=0, group=control)
        request = box[0]
        if isinstance(request, ShutdownRequest):
            if rank0 and conn is not None:
                _send(conn, Done())
            return
        t0 = time.perf_counter()
        try:
            reply = handlers[type(request)](request)
        except (Exception, CheckpointException) as exc:  # reported to the controller; the ranks stay up for it
            log(traceback.format_exc())
            reply = Failed(message=describe(exc), fatal=collective_failed(exc), no_space=out_of_space(exc))
        if isinstance(reply, Done) and not reply.seconds:
            reply = Done(path=reply.path, seconds=time.perf_counter() - t0)
        if rank0 and conn is not None:
            _send(conn, reply)
        if isinstance(reply, Failed) and reply.fatal:  # the process group is broken: torchrun tears the rest down
            raise SystemExit(f"swectl-trainer: a collective failed ({reply.message}); exiting")


def _group_backend(group: Any) -> str:
    if group is None:
        return ""
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return ""


def describe(exc: BaseException) -> str:
    """One line for the controller. torch.distributed.checkpoint gathers every rank's failure into a
    CheckpointException (a BaseException, not an Exception) whose text is only the ranks: name the first cause."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, cause = next(iter(sorted(exc.failures.items())))
        original = _rank_cause(cause)
        original = _os_error_within(original) or original  # "No space left on device" under a serializer's error
        return f"checkpoint failed on ranks {sorted(exc.failures)}: rank {rank}: {type(original).__name__}: {original}"
    return f"{type(exc).__name__}: {exc}"


def _rank_cause(cause: Any) -> BaseException:
    """A CheckpointException's failure of one rank: a WRAPPED_EXCEPTION (exc, traceback) tuple or the exception."""
    original = getattr(cause, "exc", cause)
    return original[0] if isinstance(original, tuple) else original


def _os_error_within(exc: BaseException) -> OSError | None:
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 10:
        if isinstance(current, OSError):
            return current
        current, seen = current.__cause__ or current.__context__, seen + 1
    return None


def out_of_space(exc: BaseException) -> bool:
    """True when ``exc`` is a write that found its disk full: an OSError with ENOSPC in its chain (also under a
    CheckpointException's rank failures), or a serializer's error that quotes it (safetensors' Rust I/O error is no
    OSError: "I/O error: No space left on device (os error 28)")."""
    causes = [exc, *(_rank_cause(c) for c in exc.failures.values())] if isinstance(exc, CheckpointException) else [exc]
    for cause in causes:
        os_error = _os_error_within(cause)
        if os_error is not None and os_error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(cause) or "os error 28" in str(cause):
            return True
    return False


def collective_failed(exc: BaseException) -> bool:
    """True when ``exc`` comes from the process group itself (a peer died, a transport closed), after which no
    collective can succeed: gloo and NCCL raise RuntimeErrors (or DistError subclasses) naming themselves."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset by peer"))


def _send(conn: socket.socket, message: msgspec.Struct) -> None:
    try:
        conn.sendall(frame(message))
    except OSError as exc:
        log(f"cannot answer the controller: {exc}")


def _pick_gloo_interface() -> None:
    """Gloo connects the ranks at the address their hostname resolves to; where that is a loopback address (Debian's
    127.0.1.1, a container's localhost) ranks on other nodes cannot reach it. On several nodes, and unless the user
    chose (GLOO_SOCKET_IFNAME), gloo uses the interface that routes to the rendezvous (MASTER_ADDR)."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    master = os.environ.get("MASTER_ADDR", "")
    if "GLOO_SOCKET_IFNAME" in os.environ or not master or not local or local == world:
        return
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # no packet is sent: the kernel picks the route and the source address
            address = probe.getsockname()[0]
    except OSError as exc:
        log(f"cannot find the interface that reaches {master} ({exc}); gloo picks its own")
        return
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            log(f"gloo on {name} ({address}), the interface that reaches the rendezvous {master}")
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="swectl's torchrun training worker (started by `swectl up`)")
    parser.add_argument("--settings", required=True, help="TrainerSettings as JSON")
    parser.add_argument("--listen", default="127.0.0.1", help="address rank 0 listens on for the controller")
    args = parser.parse_args(argv)
    settings = msgspec.json.decode(args.settings.encode(), type=TrainerSettings)
    torch.set_num_threads(settings.threads)
    device, backend = _device(settings)
    _pick_gloo_interface()
    dist.init_process_group(backend=backend)
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    trainer: Trainer | None = None
    try:
        trainer = Trainer(settings)
        log(f"up on {socket.gethostname()} ({device}): model loaded")  # the controller's progress line
        conn = accept_controller(args.listen) if trainer.rank == 0 else None
        if conn is not None:
            _send(conn, Ready(world_size=trainer.world, parameters=trainer.parameters, step=trainer.step,
                              params=trainer.weight_specs(),
                              device=str(device)))
        serve(trainer, conn, control)
    finally:
        if trainer is not None:
            trainer.batches.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
