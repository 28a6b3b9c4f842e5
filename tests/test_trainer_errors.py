"""How the training worker words its failures for the controller (remote/programs/trainer.py): a failed
collective is fatal (the process group is broken: the controller restarts the workers from the checkpoint), a
failed checkpoint names the first rank's cause, other errors are refused requests."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from torch.distributed.checkpoint.api import CheckpointException

from swectl.remote.programs.trainer import collective_failed, describe, out_of_space


@pytest.mark.parametrize("message", [
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4",
    "NCCL error in: ProcessGroupNCCL.cpp:1234, remote process exited or there was a network error",
    "Connection reset by peer",
])
def test_a_broken_process_group_is_fatal(message: str) -> None:
    assert collective_failed(RuntimeError(message))


@pytest.mark.parametrize("exc", [ValueError("the batch has 0 samples"), OSError(28, "No space left on device"),
                                 RuntimeError("CUDA out of memory")])
def test_other_failures_leave_the_ranks_up(exc: Exception) -> None:
    assert not collective_failed(exc)


def test_a_checkpoint_failure_names_the_first_ranks_cause() -> None:
    failures = {1: (OSError(28, "No space left on device"), []), 0: (RuntimeError("unexpected pos 704 vs 598"), [])}
    text = describe(CheckpointException("failed", failures))
    assert text == "checkpoint failed on ranks [0, 1]: rank 0: RuntimeError: unexpected pos 704 vs 598"
    assert describe(ValueError("bad batch")) == "ValueError: bad batch"


TORCHRUN_OUTPUT = """\
Traceback (most recent call last):
  File "/x/swectl/remote/programs/trainer.py", line 103, in _device
    raise RuntimeError(f"local rank {local} has no GPU of its own: ...")
RuntimeError: local rank 1 has no GPU of its own: this node has 1 GPU(s)
W1126 16:22:27.095000 994 torch/distributed/elastic/multiprocessing/api.py:1012] Sending process 1020 closing signal
Traceback (most recent call last):
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/run.py", line 994, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
""" + "  rank      : 0 (local_rank: 0)\n" * 40


def test_a_lost_trainer_quotes_the_ranks_exception_that_torchruns_summary_pushed_out_of_the_tail(tmp_path) -> None:
    """Seen on a one-GPU machine: the cause scrolled out of the 40-line tail behind torchrun's ChildFailedError."""
    import anyio

    from swectl.actors.engines import EngineHost
    from swectl.actors.trainer import TAIL_LINES, Trainer, _Launch, exception_line
    from swectl.config import TrainerConfig
    from swectl.rl.wire import TrainerSettings

    assert exception_line("[rank1]: ValueError: bad") and exception_line("torch.OutOfMemoryError: CUDA out of memory")
    assert not exception_line("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
    assert not exception_line("  raise RuntimeError(f'x')") and not exception_line("step 3: Error rate 2%")
    launch = _Launch(EngineHost.local(), 0, anyio.Event())
    for line in TORCHRUN_OUTPUT.splitlines():
        launch.on_line(line)
    assert not any("no GPU of its own" in line for line in launch.tail) and len(launch.tail) == TAIL_LINES
    trainer = Trainer(TrainerConfig(), TrainerSettings(model="m", out_dir=str(tmp_path)), [EngineHost.local()],
                      log_dir=tmp_path)
    message = str(trainer._lost(launch, "exited with 1 while starting"))
    assert "error: RuntimeError: local rank 1 has no GPU of its own" in message
    assert "ChildFailedError" not in message.split("last output:")[0]


def test_the_ready_line_is_found_when_another_ranks_line_shares_it() -> None:
    """Seen in CI: rank 1's progress line landed right after rank 0's ready line, before its newline."""
    import anyio

    from swectl.actors.engines import EngineHost
    from swectl.actors.trainer import _Launch

    ups: list[tuple[int, str]] = []
    launch = _Launch(EngineHost.local(), 0, anyio.Event(), rank_up=lambda rank, node: ups.append((rank, node)))
    launch.on_line("swectl-trainer ready on 0.0.0.0:41493swectl-trainer rank 1: up on vm (cpu): model loaded")
    assert launch.ready == ("0.0.0.0", 41493) and [rank for rank, _ in ups] == [1]
    launch.on_line("swectl-trainer ready on :::5071")
    assert launch.ready == ("::", 5071)


def _chained(outer: Exception, inner: BaseException) -> Exception:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize("exc", [
    OSError(28, "No space left on device"),
    _chained(RuntimeError("saving the weights failed"), OSError(28, "No space left on device")),
    # safetensors' Rust error is no OSError; the soak's step 5 failed with this text
    Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
    CheckpointException("checkpoint", {1: (OSError(28, "No space left on device"), None)}),
])
def test_a_full_disk_is_named_so_the_controller_can_wait_it_out(exc: BaseException) -> None:
    assert out_of_space(exc)


@pytest.mark.parametrize("exc", [OSError(13, "Permission denied"), ValueError("the batch has 0 samples"),
                                 CheckpointException("checkpoint", {0: (OSError(5, "Input/output error"), None)})])
def test_other_write_failures_are_not_a_full_disk(exc: BaseException) -> None:
    assert not out_of_space(exc)
