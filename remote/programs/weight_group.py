"""The weight group: a torch.distributed process group of trainer rank 0 (rank 0) and the engines (ranks 1..),
apart from the trainer's own world, over which new weights are broadcast (docs/architecture.md 5.3).

Formed the way SGLang's ``/init_weights_update_group`` forms its side: a TCPStore at
``master_address:master_port`` hosted by rank 0 (what ``rendezvous("tcp://...")`` makes), prefixed with the group's
name, and a process group built on it (NCCL on GPU, gloo on CPU). Both swectl programs use this module: the
trainer worker (remote/programs/trainer.py) as rank 0 and the CPU engine (remote/programs/cpu_engine.py) as an
engine, so the whole path runs on CPU with gloo; against real SGLang servers the trainer side is the same.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from swectl.rl.weight_sync import ParamSpec


def join(address: str, port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
         ) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) the weight group; returns once every member has joined or after ``timeout_s``."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight group backend {backend!r}: use gloo or nccl")
    timeout = datetime.timedelta(seconds=timeout_s)
    # The store rendezvous("tcp://...") would make, built directly: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
    # rendezvous() turns rank 0 into a client of the agent's store, and nobody would host this one.
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    store = c10d.PrefixStore(group_name, store)
    # torch has no public call for a group outside the default world; SGLang, verl and slime use this one too
    group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                              timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are global ranks here
    return group


def leave(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Rank 0 sends ``tensors`` in order (each must be contiguous and on the group's device)."""
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()


def receive(specs: list[ParamSpec], group: dist.ProcessGroup, device: torch.device) -> list[torch.Tensor]:
    """An engine's side of ``broadcast``: one tensor per spec, in order."""
    tensors = [torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device) for spec in specs]
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    return tensors
