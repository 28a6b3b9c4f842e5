"""The CPU engine's batch math (remote/programs/cpu_engine.py serves it): the model and its tokenizer, one request
being decoded (``Seq``) and the rows decoded together (``Batch``), and the forwards over them.

``prefill`` runs new sequences through the model, left-padded with an attention mask and explicit position ids;
a sequence that begins the way a finished one did reuses that one's KV from the prefix store (``extend``;
remote/programs/kv_cache.py). ``merge`` stacks the rows of several batches into one (their caches left-padded to
the widest) and ``join`` prefills newcomers into a running batch, in place where its cache has room (``take``), else
by a merge; ``step`` picks every row's next token,
retires finished rows (keeping their KV in the prefix store) and runs the others one position further;
``trim_padding`` drops the leading padding that rows which left the batch leave behind. Decode steps run through
remote/programs/lean_decode.py where it fits the model (``Model.lean``), else through transformers' forward. The
per-token logprobs follow SGLang's convention: ``log_softmax(logits)`` when greedy (temperature 0), else
``log_softmax(logits / temperature)`` before top-k/top-p/min-p truncation; sampling uses the request's own
torch.Generator. The scheduler (remote/programs/engine_scheduler.py) runs the forwards here in its worker thread,
one call at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from swectl.engine.wire import SamplingParams
from swectl.remote.programs.kv_cache import ROW_SPARE, PrefixStore, SpareRoomLayer, decode_cache
from swectl.remote.programs.lean_decode import LeanDecode

LOGPROB_FLOOR = -1e30  # JSON has no -inf; SGLang clamps to the dtype's minimum likewise

# ---------------------------------------------------------------- the model


def _eos_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    found: set[int] = set()
    for value in (
        getattr(model.generation_config, "eos_token_id", None),
        model.config.eos_token_id,
        tokenizer.eos_token_id,
    ):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
    return frozenset(found)


def _load_causal_lm(path: Path, attn_implementation: str, device: torch.device) -> Any:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    return model.to(device).eval()


class Model:
    """The model and its tokenizer. Used by the scheduler's worker thread only, one call at a time."""

    def __init__(self, path: Path, *, attn_implementation: str, device: str = "cpu", kv_cache: str = "in-place",
                 prefix_cache_bytes: int = 0, decode: str = "lean", log: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.attn_implementation = attn_implementation
        self.kv_cache = kv_cache  # in-place (remote/programs/kv_cache.py) | concat (transformers' DynamicCache)
        self.prefixes = PrefixStore(prefix_cache_bytes)  # finished sequences' KV, for requests that begin the same way
        self.device = torch.device(device)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path)
        self.net = _load_causal_lm(path, attn_implementation, self.device)
        self.eos_ids = _eos_ids(self.net, self.tokenizer)
        self.vocab_size: int = self.net.get_input_embeddings().num_embeddings
        self.context_length: int = int(getattr(self.net.config, "max_position_embeddings", 0) or 1 << 30)
        # decode steps: remote/programs/lean_decode.py where it fits the model (else None: transformers' forward)
        self.lean = LeanDecode.build(self.net, log) if decode == "lean" and self.device.type == "cpu" else None

    def new_cache(self) -> DynamicCache:
        if self.kv_cache == "concat":
            return DynamicCache(config=self.net.config)
        return decode_cache(self.net.config)

    def load_weights(self, path: Path) -> None:
        """Copy the weights of another folder of the same architecture in (SGLang's update_weights_from_disk)."""
        fresh = _load_causal_lm(path, self.attn_implementation, torch.device("cpu"))
        if type(fresh) is not type(self.net):
            raise ValueError(f"{path} holds a {type(fresh).__name__}, the engine serves a {type(self.net).__name__}")
        self.prefixes.clear()
        self.net.load_state_dict(fresh.state_dict(), strict=True)
        self.path = path
        if self.lean is not None:
            self.lean.refresh()

    def load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy received tensors into the parameters of those names (update_weights_from_distributed); checks every
        name and shape before changing anything."""
        state = self.net.state_dict()
        unknown = [name for name, _ in named if name not in state]
        if unknown:
            raise ValueError(f"the model has no parameters named {', '.join(unknown[:5])}")
        wrong = [f"{name} {list(t.shape)} (the model's: {list(state[name].shape)})" for name, t in named
                 if t.shape != state[name].shape]
        if wrong:
            raise ValueError(f"shapes differ: {'; '.join(wrong[:5])}")
        self.prefixes.clear()
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor)
        if self.lean is not None:
            self.lean.refresh()


# ---------------------------------------------------------------- one request, one batch


@dataclass(eq=False)
class Seq:
    """One request being decoded: its prompt, sampling parameters and output so far."""
    rid: str
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    max_new: int
    stop_ids: frozenset[int]
    stop_strs: tuple[str, ...]
    generator: torch.Generator
    created: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    abort_message: str | None = None  # set by abort_all while the sequence runs; honoured at the next step
    finished_at: float = 0.0
    weight_version: str = ""
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(eq=False)
class Batch:
    """The sequences decoded together, with their shared KV cache and padding mask."""
    seqs: list[Seq]  # live rows, in row order
    cache: DynamicCache
    mask: torch.Tensor  # [rows, positions]: 1 for real tokens, 0 for left padding
    next_pos: torch.Tensor  # [rows]: position id of each row's next token
    logits: torch.Tensor  # [rows, vocab]: logits of each row's next token


def prefill(model: Model, seqs: Sequence[Seq]) -> Batch:
    """The batch of ``seqs`` (prompt + output so far) with its KV cache: a sequence that begins the way a
    finished one did reuses that one's KV and computes the rest alone (``extend``); the others run through the
    model together, left-padded (``prefill_rows``); the parts are then merged."""
    fresh: list[Seq] = []
    parts: list[Batch] = []
    for seq in seqs:
        found = model.prefixes.longest(seq.prompt + seq.output) if model.prefixes.enabled else None
        if found is None:
            fresh.append(seq)
        else:
            parts.append(extend(model, seq, *found))
    if fresh:
        parts.insert(0, prefill_rows(model, fresh))
    return parts[0] if len(parts) == 1 else merge(model, parts)


def prefill_rows(model: Model, seqs: Sequence[Seq]) -> Batch:
    """Left-pad the sequences (prompt + output so far) and run them through the model in one forward."""
    contexts = [s.prompt + s.output for s in seqs]
    width = max(len(c) for c in contexts)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        mask[row, width - len(context) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = model.new_cache()
    out = model.net(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    lengths = torch.tensor([len(c) for c in contexts], dtype=torch.long, device=model.device)
    # Sampling runs on the CPU (per-request CPU generators), so logits come back to it.
    return Batch(list(seqs), out.past_key_values, mask, lengths, out.logits[:, -1, :].float().cpu())


def extend(model: Model, seq: Seq, reused: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
    """One row whose first ``reused`` positions come from a stored KV (``kv``, per layer); the model reads only
    the rest of the sequence."""
    context = seq.prompt + seq.output
    cache = model.new_cache()
    for layer, (keys, values) in zip(cache.layers, kv, strict=True):
        layer.update(keys[..., :reused, :], values[..., :reused, :])
    mask = torch.ones((1, len(context)), dtype=torch.long, device=model.device)
    out = model.net(
        input_ids=torch.tensor([context[reused:]], dtype=torch.long, device=model.device),
        attention_mask=mask,
        position_ids=torch.arange(reused, len(context), device=model.device)[None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    lengths = torch.tensor([len(context)], dtype=torch.long, device=model.device)
    return Batch([seq], out.past_key_values, mask, lengths, out.logits[:, -1, :].float().cpu())


def keep_prefix(model: Model, batch: Batch, row: int) -> None:
    """Store a finished row's KV (the positions the model has read: all its tokens but the last) for later
    requests that begin the same way."""
    seq = batch.seqs[row]
    length = int(batch.mask[row].sum())
    width = batch.mask.shape[1]
    kv = [(layer.keys[row : row + 1, :, width - length :, :].clone(),
           layer.values[row : row + 1, :, width - length :, :].clone()) for layer in batch.cache.layers]
    model.prefixes.put((seq.prompt + seq.output)[:length], kv)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros before its entries along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def trim_padding(batch: Batch) -> None:
    """Drop the leading positions that are padding in every row (left behind by rows that left the batch), so a
    batch that keeps taking newcomers does not keep growing wider."""
    used = batch.mask.any(dim=0).nonzero()
    first = int(used[0]) if len(used) else 0
    if first == 0:
        return
    for layer in batch.cache.layers:
        if isinstance(layer, SpareRoomLayer):
            layer.drop_front(first)
        else:
            layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
    batch.mask = batch.mask[:, first:]


def row_moves(keep: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Where the kept rows (``keep``, ascending) go when the others leave: the rows already among the first
    ``len(keep)`` stay, and each slot there that a leaving row held takes a kept row from beyond them. Returns the new
    row order (new row ``i`` is old row ``order[i]``) and the ``(slot, old row)`` moves."""
    count = len(keep)
    kept = set(keep)
    holes = [row for row in range(count) if row not in kept]
    movers = [row for row in keep if row >= count]
    order = list(range(count))
    for hole, row in zip(holes, movers, strict=True):
        order[hole] = row
    return order, list(zip(holes, movers, strict=True))


def drop_rows(model: Model, batch: Batch, keep: Sequence[int]) -> list[int]:
    """Keep only the rows ``keep`` (ascending) of ``batch``, copying into the leavers' slots only the kept rows that
    move there (``row_moves``); returns the new row order as old row indices."""
    order, moves = row_moves(keep)
    index = torch.tensor(order, dtype=torch.long, device=model.device)
    for layer in batch.cache.layers:
        if isinstance(layer, SpareRoomLayer):
            layer.keep_rows(moves, len(order))
        else:
            layer.batch_select_indices(index)
    batch.seqs = [batch.seqs[row] for row in order]
    batch.mask = batch.mask[index]
    batch.next_pos = batch.next_pos[index]
    return order


def can_join(batch: Batch) -> bool:
    """Whether new rows can be merged into this batch's cache (full-attention layers only)."""
    return all(type(layer) in (DynamicLayer, SpareRoomLayer) for layer in batch.cache.layers)


def join(model: Model, batch: Batch, seqs: Sequence[Seq]) -> Batch:
    """Prefill ``seqs`` and add them to the running ``batch``: in place where its cache has the room (``take``),
    else by merging the two into a new one."""
    fresh = prefill(model, seqs)
    return batch if take(batch, fresh) else merge(model, [batch, fresh])


def take(batch: Batch, fresh: Batch) -> bool:
    """Add the rows of ``fresh`` to ``batch`` in place when every cache layer of ``batch`` has room for them (spare
    rows, and room on the left for a wider newcomer's positions): copies the newcomers' KV only. False, and nothing
    changed, otherwise."""
    layers = batch.cache.layers
    width = max(batch.mask.shape[1], fresh.mask.shape[1])
    rows = len(fresh.seqs)
    if not all(isinstance(layer, SpareRoomLayer) and layer.can_take(rows, width) for layer in layers):
        return False
    for layer, theirs in zip(layers, fresh.cache.layers, strict=True):
        layer.take_rows(theirs.keys, theirs.values, width)
    batch.seqs = [*batch.seqs, *fresh.seqs]
    batch.mask = torch.cat([_left_pad(batch.mask, width, 1), _left_pad(fresh.mask, width, 1)])
    batch.next_pos = torch.cat([batch.next_pos, fresh.next_pos])
    batch.logits = torch.cat([batch.logits, fresh.logits])
    return True


def merge(model: Model, parts: Sequence[Batch]) -> Batch:
    """One batch of the rows of ``parts``: their caches and masks left-padded to the widest one's positions (the
    padding is masked out; keys keep their rotary positions) and stacked row-wise."""
    width = max(part.mask.shape[1] for part in parts)
    cache = model.new_cache()
    for index, merged in enumerate(cache.layers):
        layers = [part.cache.layers[index] for part in parts]
        if isinstance(merged, SpareRoomLayer):
            merged.fill_rows([(layer.keys, layer.values) for layer in layers], width, row_spare=ROW_SPARE)
            continue
        merged.update(torch.cat([_left_pad(layer.keys, width, -2) for layer in layers]),
                      torch.cat([_left_pad(layer.values, width, -2) for layer in layers]))
    return Batch([seq for part in parts for seq in part.seqs], cache,
                 torch.cat([_left_pad(part.mask, width, 1) for part in parts]),
                 torch.cat([part.next_pos for part in parts]), torch.cat([part.logits for part in parts]))


def _truncate(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p, then min-p, on one row of probabilities (unnormalised afterwards)."""
    if 0 < params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=0) - ordered
        ordered = torch.where(before > params.top_p * ordered.sum(), 0.0, ordered)
        probs = torch.zeros_like(probs).scatter(0, order, ordered)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row of ``probs`` (``[rows, vocab]``, unnormalised, each row with some mass), drawn with that
    row's generator: the first token whose running sum passes a uniform draw times the row's total. One uniform per
    row and one batched search: ``torch.multinomial``, one call a row, took a noticeable share of the engine's time
    (docs/results.md, "Figures the code relies on")."""
    cdf = probs.double().cumsum(dim=-1)
    uniform = torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in generators])
    found = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    last = probs.shape[1] - 1 - torch.argmax((probs.flip(1) > 0).int(), dim=1)  # the last token with mass per row
    return torch.minimum(found, last).tolist()


def choose_tokens(logits: torch.Tensor, seqs: Sequence[Seq]) -> tuple[list[int], list[float]]:
    """Next token of every row, and its logprob under SGLang's convention (see the module docstring)."""
    temperatures = torch.tensor([s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs])
    logp = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    tokens = torch.argmax(logp, dim=-1).tolist()
    sampled = [row for row, seq in enumerate(seqs) if seq.params.temperature > 0]
    if sampled:
        probs = logp[sampled].exp()
        for i, row in enumerate(sampled):
            probs[i] = _truncate(probs[i], seqs[row].params)
        for row, token in zip(sampled, draw(probs, [seqs[row].generator for row in sampled]), strict=True):
            tokens[row] = token
    picked = logp[torch.arange(len(seqs)), torch.tensor(tokens)].tolist()
    return tokens, [max(lp, LOGPROB_FLOOR) for lp in picked]


def _finish_reason(seq: Seq, token: int, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any] | None:
    if len(seq.output) >= seq.max_new:
        return {"type": "length", "length": seq.max_new}
    if token in seq.stop_ids:
        return {"type": "stop", "matched": token}
    if seq.stop_strs:
        window = max(len(s) for s in seq.stop_strs) + 8
        tail = tokenizer.decode(seq.output[-window:], skip_special_tokens=seq.params.skip_special_tokens)
        for stop in seq.stop_strs:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    return None


def step(model: Model, batch: Batch) -> list[Seq]:
    """Pick every row's next token, retire finished rows, and run the others one position further."""
    tokens, logprobs = choose_tokens(batch.logits, batch.seqs)
    keep: list[int] = []
    finished: list[Seq] = []
    for row, (seq, token, logprob) in enumerate(zip(batch.seqs, tokens, logprobs, strict=True)):
        seq.output.append(token)
        seq.logprobs.append(logprob)
        seq.finish = _finish_reason(seq, token, model.tokenizer)
        if seq.finish is None:
            keep.append(row)
        else:
            finished.append(seq)
            if model.prefixes.enabled and can_join(batch):
                keep_prefix(model, batch, row)
    if len(keep) < len(batch.seqs):
        if not keep:
            batch.seqs = []
            return finished
        keep = drop_rows(model, batch, keep)
        trim_padding(batch)
    batch.mask = torch.cat([batch.mask, torch.ones((len(keep), 1), dtype=torch.long, device=model.device)], dim=1)
    chosen = torch.tensor([tokens[row] for row in keep], dtype=torch.long, device=model.device)
    if model.lean is not None:
        batch.logits = model.lean.forward(chosen, batch.mask, batch.next_pos, batch.cache).float().cpu()
    else:
        out = model.net(
            input_ids=chosen[:, None],
            attention_mask=batch.mask,
            position_ids=batch.next_pos[:, None],
            past_key_values=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.cache = out.past_key_values
        batch.logits = out.logits[:, -1, :].float().cpu()
    batch.next_pos = batch.next_pos + 1
    return finished
