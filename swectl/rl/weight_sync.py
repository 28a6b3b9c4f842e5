"""The pure half of the distributed weight sync (docs/architecture.md 5.3, the GPU fast path): what the trainer
broadcasts to the engines' ``update_weights_from_distributed``, in which order and in which buckets.

The trainer announces its parameters once (``ParamSpec``: the engine-side name, the dtype sent and the global
shape); the controller plans buckets of at most ``bucket_bytes`` (``plan_buckets``), and for each bucket, in
order, posts the names, dtypes and shapes to every engine while trainer rank 0 broadcasts the same tensors, in the
same order, over the weight group (NCCL on GPU, gloo on CPU). Only the last bucket carries the new weight version,
so an engine reports the version only once every bucket has landed (``stale_servers`` checks that handshake).
No torch here: the worker (remote/programs/trainer.py) and the CPU engine do the tensor work.
"""

from __future__ import annotations

import math

import msgspec

# bytes per element of the dtypes a weight sync may send (torch's names without the "torch." prefix)
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}
FLOATING = frozenset({"float64", "float32", "bfloat16", "float16"})
# prefixes that wrappers put in front of a module's parameter names (torch.compile, FSDP1, activation
# checkpointing, DDP); FSDP2's fully_shard keeps the names of the Hugging Face module
WRAPPER_PREFIXES = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module.")


class ParamSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a weight sync: the name the engine loads it under, the dtype it is sent in, its full shape."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def engine_name(name: str) -> str:
    """The Hugging Face name of a parameter whose module was wrapped (``_orig_mod.model.x`` -> ``model.x``)."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
        name = name.replace("._fsdp_wrapped_module.", ".").replace("._checkpoint_wrapped_module.", ".")
    return name


def sync_dtype(param_dtype: str, wanted: str) -> str:
    """The dtype a parameter travels in: ``wanted`` ("auto" = as the trainer holds it) for floating parameters;
    integer and bool buffers keep theirs."""
    param_dtype = param_dtype.removeprefix("torch.")
    if param_dtype not in DTYPE_BYTES:
        raise ValueError(f"cannot send a {param_dtype} tensor (known: {', '.join(sorted(DTYPE_BYTES))})")
    if wanted == "auto" or param_dtype not in FLOATING:
        return param_dtype
    if wanted not in FLOATING:
        raise ValueError(f"weight sync dtype {wanted!r} is not a floating dtype ({', '.join(sorted(FLOATING))})")
    return wanted


def plan_buckets(specs: list[ParamSpec], bucket_bytes: int) -> list[list[ParamSpec]]:
    """Consecutive runs of ``specs`` of at most ``bucket_bytes`` each (a larger tensor goes alone), in order: the
    engines allocate one bucket at a time, so this bounds their extra memory during a sync."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names repeat: {', '.join(dup[:5])}")
    buckets: list[list[ParamSpec]] = []
    current: list[ParamSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def stale_servers(expected: str, reported: dict[str, str]) -> list[str]:
    """The servers (url -> the weight version each reports) that do not serve ``expected`` after a sync."""
    return sorted(url for url, version in reported.items() if version != expected)
