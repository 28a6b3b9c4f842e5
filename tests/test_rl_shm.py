"""The shared-memory sample transport: round trips, segment reuse and growth, reader processes (their exit must
not destroy the writer's segment), stale refs and bad input as TransportError naming the segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from swectl.errors import TransportError
from swectl.rl.batch import TrainBatch, make_batch, pack_sample
from swectl.rl.shm import HEADER_SIZE, BatchReader, BatchRef, BatchWriter, encode_batch, read_batch

REPO = Path(__file__).resolve().parents[1]
DEV_SHM = Path("/dev/shm")


def batch(step: int, samples: int = 4, tokens: int = 100, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    made = []
    for i in range(samples):
        n = tokens + i
        made.append(pack_sample(f"t{i}#0", f"t{i}", rng.integers(0, 50_000, n).tolist(),
                                (rng.random(n) < 0.5).astype(int).tolist(), (-rng.random(n)).tolist(),
                                advantage=0.5 - i, reward=float(i % 2), weight_version=step))
    return make_batch(step, "grpo", made)


def segment_exists(name: str) -> bool:
    return (DEV_SHM / name).exists()


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)


# ---------------------------------------------------------------- one process


def test_round_trip() -> None:
    original = batch(3)
    with BatchWriter() as writer:
        ref = writer.write(original)
        assert ref.step == 3 and ref.offset == HEADER_SIZE and ref.segment == writer.segment
        assert read_batch(ref) == original
    assert not segment_exists(ref.segment), "closing unlinks the segment"


def test_the_segment_is_reused_while_batches_fit() -> None:
    with BatchWriter() as writer:
        first = writer.write(batch(1))
        second = writer.write(batch(2, seed=1))
        assert second.segment == first.segment
        assert read_batch(second) == batch(2, seed=1)
        with pytest.raises(TransportError, match=f"{first.segment}.*now holds step 2"):
            read_batch(first)


def test_the_segment_grows_under_a_new_name() -> None:
    with BatchWriter(initial_size=1) as writer:
        small = writer.write(batch(1, samples=1, tokens=10))
        size = writer.capacity
        big = batch(2, samples=8, tokens=20_000)  # about 1.4 MB, more than the first 1 MiB segment
        ref = writer.write(big)
        assert ref.segment != small.segment and writer.capacity > size
        assert not segment_exists(small.segment), "the old segment is unlinked"
        assert read_batch(ref) == big
        with pytest.raises(TransportError, match=f"{small.segment}.*does not exist"):
            read_batch(small)
        again = writer.write(batch(3))
        assert again.segment == ref.segment, "a smaller batch reuses the grown segment"


def test_write_frame_and_frame_bytes() -> None:
    original = batch(5)
    with BatchWriter() as controller, BatchWriter() as node_leader:
        ref = controller.write(original)
        frame = controller.frame_bytes(ref)
        assert frame == encode_batch(original)
        local = node_leader.write_frame(frame, ref.step)
        assert local.segment != ref.segment and local.length == len(frame)
        assert read_batch(local) == original
        with pytest.raises(TransportError, match="not this writer's"):
            node_leader.frame_bytes(ref)


def test_batch_reader_stays_attached_and_follows_growth() -> None:
    with BatchWriter() as writer, BatchReader() as reader:
        for step in (1, 2):
            assert reader.read(writer.write(batch(step, seed=step))) == batch(step, seed=step)
        big = batch(3, samples=4, tokens=200_000)
        ref = writer.write(big)
        assert reader.read(ref) == big


# ---------------------------------------------------------------- bad input


def test_missing_segment_names_it() -> None:
    ref = BatchRef(segment="swectl_no_such_segment", offset=HEADER_SIZE, length=10, step=1)
    with pytest.raises(TransportError, match="'swectl_no_such_segment' does not exist"):
        read_batch(ref)


def test_bytes_outside_the_segment() -> None:
    with BatchWriter() as writer:
        ref = writer.write(batch(1))
        for bad in (msgspec.structs.replace(ref, length=writer.capacity),
                    msgspec.structs.replace(ref, offset=0),
                    msgspec.structs.replace(ref, length=-1)):
            with pytest.raises(TransportError, match=f"{ref.segment}.*outside the segment"):
                read_batch(bad)


def test_a_wrong_step_or_length_is_refused() -> None:
    with BatchWriter() as writer:
        ref = writer.write(batch(4))
        with pytest.raises(TransportError, match="now holds step 4"):
            read_batch(msgspec.structs.replace(ref, step=3))
        with pytest.raises(TransportError, match="now holds step 4"):
            read_batch(msgspec.structs.replace(ref, length=ref.length - 1))


def test_a_frame_that_is_not_a_batch() -> None:
    with BatchWriter() as writer:
        ref = writer.write_frame(msgspec.msgpack.encode({"step": 1}), 1)
        with pytest.raises(TransportError, match=f"{ref.segment}.*not a TrainBatch"):
            read_batch(ref)


def test_a_closed_writer_refuses_to_write() -> None:
    writer = BatchWriter()
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        writer.write(batch(1))


# ---------------------------------------------------------------- other processes


def test_a_reader_process_exiting_leaves_the_segment_alone() -> None:
    """A rank is a separate program with its own resource tracker (as under torchrun): its exit must not unlink
    the segment, and it must not warn about leaked shared memory."""
    original = batch(7)
    with BatchWriter() as writer:
        ref = writer.write(original)
        encoded = msgspec.json.encode(ref).decode()
        done = run_python(f"""
            import msgspec
            from swectl.rl.shm import BatchReader, BatchRef, read_batch
            ref = msgspec.json.decode({encoded!r}, type=BatchRef)
            batch = read_batch(ref)
            with BatchReader() as reader:
                assert reader.read(ref) == batch
            print(len(batch.samples), batch.loss_tokens)
        """)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [str(len(original.samples)), str(original.loss_tokens)]
        assert done.stderr == ""
        time.sleep(0.2)  # a reader's tracker (if it had one) would unlink right after the reader exits
        assert segment_exists(ref.segment)
        assert read_batch(ref) == original


def test_a_multiprocessing_child_reader_shares_the_tracker_cleanly(tmp_path: Path) -> None:
    """A spawned multiprocessing child shares the writer's resource tracker: reading there must neither drop
    the writer's registration nor make the tracker complain when the writer unlinks."""
    script = tmp_path / "spawn_reader.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        from swectl.rl.batch import make_batch, pack_sample
        from swectl.rl.shm import BatchWriter, read_batch

        def read(ref, out):
            out.put(len(read_batch(ref).samples))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            sample = pack_sample("a#0", "a", [1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.25])
            with BatchWriter() as writer:
                ref = writer.write(make_batch(1, "grpo", [sample, sample]))
                out = ctx.Queue()
                child = ctx.Process(target=read, args=(ref, out))
                child.start()
                print(out.get(timeout=60))
                child.join()
            print(ref.segment)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO,
                          check=False)
    assert done.returncode == 0, done.stderr
    count, name = done.stdout.split()
    assert count == "2"
    assert done.stderr == "", "the resource tracker complained"
    assert not segment_exists(name)


def test_a_killed_writer_does_not_leak_its_segment() -> None:
    """The writer's resource tracker unlinks the segment of a controller killed with SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from swectl.rl.batch import make_batch, pack_sample
        from swectl.rl.shm import BatchWriter
        writer = BatchWriter()
        ref = writer.write(make_batch(1, "sft", [pack_sample("a#0", "a", [1], [1], [0.0])]))
        print(ref.segment, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name and segment_exists(name)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    deadline = time.monotonic() + 10
    while segment_exists(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not segment_exists(name)
