"""The sample transport from the controller to the trainer ranks (docs/architecture.md 8.3): TrainBatch frames in
shared memory.

The controller owns one ``BatchWriter``: a POSIX shared-memory segment reused across steps. ``write`` encodes a
``TrainBatch`` as msgpack (a reused encoder and scratch buffer, then one copy into the segment) and returns a
small ``BatchRef`` (segment name, offset, length, step): only that ref crosses the control channel. Every rank
calls ``read_batch(ref)`` (attach, decode, detach) or keeps a ``BatchReader`` that stays attached between steps.
A trainer node that is not the controller's host gets the frame streamed over its channel
(``BatchWriter.frame_bytes``) and its node leader writes it into that node's own segment with ``write_frame``.

Segment layout: a 32-byte header (magic, frame length, step) at ``offset - HEADER_SIZE``, then the frame. The
writer marks the header invalid while it overwrites the segment and stamps it afterwards, so a rank that reads a
ref after (or while) the writer reused the segment for another step gets a ``TransportError`` instead of another
step's samples. Reuse rule: write the next batch only after every rank has read the previous one (the trainer's
reply to a step says so).

Only the writer registers the segment with multiprocessing's resource tracker (so a crashed controller's segment
is still unlinked). Readers map it read-only without registering: in Python < 3.13 attaching with
``SharedMemory(name)`` registers the segment with the reader's tracker, which unlinks it (with a "leaked
shared_memory" warning) when the reader exits, and unregistering after the attach is wrong as well when the
reader shares its tracker with the writer (a multiprocessing child does): it would drop the writer's entry.
"""

from __future__ import annotations

import _posixshmem  # the shm_open that multiprocessing.shared_memory itself uses (CPython, POSIX)
import mmap
import os
import secrets
import struct
from multiprocessing import shared_memory
from types import TracebackType

import msgspec

from swectl.errors import TransportError
from swectl.rl.batch import TrainBatch

_HEADER = struct.Struct("<8sQq8x")  # magic, frame length, step, padding (frames start 32-byte aligned)
HEADER_SIZE = _HEADER.size
_MAGIC = b"swectlB1"
_WRITING = -(2**63)  # the header's step while a frame is being written
_MIN_SEGMENT = 1 << 20
_DECODER = msgspec.msgpack.Decoder(TrainBatch)


class BatchRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where one step's TrainBatch frame lies: a shared-memory segment, the byte range of the frame, the step."""

    segment: str  # the segment's name (without the leading '/')
    offset: int  # first byte of the msgpack frame
    length: int  # bytes in the frame
    step: int


def encode_batch(batch: TrainBatch) -> bytes:
    """The msgpack frame of ``batch`` (what ``BatchWriter.write_frame`` and ``decode_batch`` take)."""
    return msgspec.msgpack.encode(batch)


def decode_batch(frame: bytes | bytearray | memoryview, *, where: str = "frame") -> TrainBatch:
    """The TrainBatch in a msgpack frame; a frame that is not one raises TransportError naming ``where``."""
    try:
        return _DECODER.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TransportError(f"{where}: not a TrainBatch frame: {exc}") from exc


# ---------------------------------------------------------------- the writer


def _segment_size(needed: int, current: int) -> int:
    """Capacity of a new segment: room for ``needed`` bytes plus a quarter, at least 1.5x the current one,
    rounded up to whole MiB."""
    size = max(needed + needed // 4, current + current // 2, _MIN_SEGMENT)
    return -(-size // _MIN_SEGMENT) * _MIN_SEGMENT


def _reserve(name: str, size: int) -> None:
    """Allocate the segment's pages now, so a full /dev/shm fails here with ENOSPC instead of a SIGBUS on the
    first write into a page it cannot back (Linux; elsewhere the pages come on first touch)."""
    if not hasattr(os, "posix_fallocate"):
        return
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


class BatchWriter:
    """The controller's (or a node leader's) end: one shared-memory segment reused across steps, replaced by a
    bigger one (under a new name; the old one is unlinked) when a frame does not fit. Not thread-safe: one owner.
    ``close`` (or leaving the ``with`` block) unlinks the segment."""

    def __init__(self, initial_size: int = 0, *, prefix: str = "swectl") -> None:
        self._prefix = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
        self._generation = 0
        self._initial_size = initial_size
        self._shm: shared_memory.SharedMemory | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._scratch = bytearray()
        self._closed = False

    # -- context manager

    def __enter__(self) -> BatchWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- public

    @property
    def segment(self) -> str | None:
        """The current segment's name (None before the first write)."""
        return self._shm.name if self._shm is not None else None

    @property
    def capacity(self) -> int:
        """Bytes the current segment holds (0 before the first write)."""
        return self._shm.size if self._shm is not None else 0

    def write(self, batch: TrainBatch) -> BatchRef:
        """Encode ``batch`` into the segment (growing it if needed); the ref every rank reads it by."""
        self._encoder.encode_into(batch, self._scratch)
        return self._put(self._scratch, batch.step)

    def write_frame(self, frame: bytes | bytearray | memoryview, step: int) -> BatchRef:
        """Put an already encoded frame (one streamed from the controller) into the segment. It is not decoded
        here: a frame that is not a TrainBatch fails in ``read_batch``."""
        return self._put(frame, step)

    def frame_bytes(self, ref: BatchRef) -> bytes:
        """A copy of the frame at ``ref`` (to stream it to a trainer node that does not share this memory)."""
        shm = self._open()
        if ref.segment != shm.name:
            raise TransportError(f"shared memory segment {ref.segment!r} is not this writer's (it writes "
                                 f"{shm.name!r}): the ref is from an older segment or another writer")
        _check_header(shm.buf, ref, shm.size)
        return bytes(shm.buf[ref.offset:ref.offset + ref.length])

    def close(self) -> None:
        """Unlink the segment (ranks that still hold it mapped keep their mapping). Idempotent."""
        self._closed = True
        self._drop_segment()

    # -- internals

    def _open(self) -> shared_memory.SharedMemory:
        if self._closed:
            raise TransportError("the BatchWriter is closed")
        if self._shm is None:
            raise TransportError("the BatchWriter has no segment yet: nothing was written")
        return self._shm

    def _put(self, frame: bytes | bytearray | memoryview, step: int) -> BatchRef:
        if self._closed:
            raise TransportError("the BatchWriter is closed")
        length = len(frame) if not isinstance(frame, memoryview) else frame.nbytes
        shm = self._ensure_capacity(HEADER_SIZE + length)
        buf = shm.buf
        _HEADER.pack_into(buf, 0, _MAGIC, length, _WRITING)  # readers of the previous step now fail cleanly
        buf[HEADER_SIZE:HEADER_SIZE + length] = frame
        _HEADER.pack_into(buf, 0, _MAGIC, length, step)
        return BatchRef(segment=shm.name, offset=HEADER_SIZE, length=length, step=step)

    def _ensure_capacity(self, needed: int) -> shared_memory.SharedMemory:
        if self._shm is not None and needed <= self._shm.size:
            return self._shm
        size = _segment_size(max(needed, self._initial_size), self.capacity)
        self._generation += 1
        name = f"{self._prefix}_{self._generation}"
        try:
            fresh = shared_memory.SharedMemory(name=name, create=True, size=size)
        except OSError as exc:
            raise TransportError(f"cannot create shared memory segment {name!r} of {size} bytes: {exc}") from exc
        try:
            _reserve(name, size)
        except OSError as exc:
            fresh.close()
            fresh.unlink()
            raise TransportError(f"cannot reserve {size} bytes for shared memory segment {name!r} ({exc}); "
                                 f"/dev/shm is too small (a container's --shm-size?)") from exc
        self._drop_segment()
        self._shm = fresh
        return fresh

    def _drop_segment(self) -> None:
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        shm.close()
        try:
            shm.unlink()
        except FileNotFoundError:  # someone removed it from /dev/shm already
            pass


# ---------------------------------------------------------------- the readers


def _check_header(buf: memoryview | mmap.mmap, ref: BatchRef, size: int) -> None:
    """The ref's bytes lie inside the segment and the header says the segment holds this step's frame."""
    name = ref.segment
    if ref.offset < HEADER_SIZE or ref.length < 0 or ref.offset + ref.length > size:
        raise TransportError(f"shared memory segment {name!r}: bytes {ref.offset}..{ref.offset + ref.length} "
                             f"of step {ref.step} lie outside the segment ({size} bytes, frames start at "
                             f"{HEADER_SIZE})")
    magic, length, step = _HEADER.unpack_from(buf, ref.offset - HEADER_SIZE)
    if magic != _MAGIC:
        raise TransportError(f"shared memory segment {name!r} holds no batch frame at offset {ref.offset}")
    if step == _WRITING:
        raise TransportError(f"shared memory segment {name!r} is being rewritten: step {ref.step} was replaced "
                             f"before this reader read it (write a batch only after every rank read the last)")
    if step != ref.step or length != ref.length:
        raise TransportError(f"shared memory segment {name!r} now holds step {step} ({length} bytes), not step "
                             f"{ref.step} ({ref.length} bytes): the writer reused it before this reader read it")


class _Mapping:
    """A read-only mapping of a whole segment, attached without the resource tracker."""

    def __init__(self, name: str) -> None:
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
        except FileNotFoundError as exc:
            raise TransportError(f"shared memory segment {name!r} does not exist: its writer closed it, or grew "
                                 f"into a new segment, or runs on another machine") from exc
        except OSError as exc:
            raise TransportError(f"cannot open shared memory segment {name!r}: {exc}") from exc
        try:
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise TransportError(f"shared memory segment {name!r} is empty")
            self.map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.name = name

    def decode(self, ref: BatchRef) -> TrainBatch:
        _check_header(self.map, ref, self.size)
        # Released on the way out even when decoding fails (a traceback holding the view would keep the map open).
        with memoryview(self.map)[ref.offset:ref.offset + ref.length] as frame:
            batch = decode_batch(frame, where=f"shared memory segment {ref.segment!r}, step {ref.step}")
        _check_header(self.map, ref, self.size)  # not overwritten while decoding
        return batch

    def close(self) -> None:
        self.map.close()


class BatchReader:
    """A rank's end that stays attached to the writer's segment between steps (re-attaching when the writer
    moved to a new one), which saves the page faults of a fresh mapping per step. Use as a context manager."""

    def __init__(self) -> None:
        self._mapping: _Mapping | None = None

    def __enter__(self) -> BatchReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def read(self, ref: BatchRef) -> TrainBatch:
        """The TrainBatch at ``ref`` (decoded into this process's memory)."""
        if self._mapping is None or self._mapping.name != ref.segment:
            self.close()
            self._mapping = _Mapping(ref.segment)
        return self._mapping.decode(ref)

    def close(self) -> None:
        """Detach (idempotent)."""
        if self._mapping is not None:
            mapping, self._mapping = self._mapping, None
            mapping.close()


def read_batch(ref: BatchRef) -> TrainBatch:
    """Attach to the segment ``ref`` names, decode its TrainBatch, detach. A missing segment, bytes outside it,
    a frame the writer has replaced since, or bytes that are not a TrainBatch raise TransportError."""
    mapping = _Mapping(ref.segment)
    try:
        return mapping.decode(ref)
    finally:
        mapping.close()
