"""How the training worker words its failures for the controller (remote/programs/trainer.py): a failed
collective is fatal (the process group is broken: the controller restarts the workers from the checkpoint), a
failed checkpoint names the first rank's cause, other errors are refused requests."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from torch.distributed.checkpoint.api import CheckpointException

from swectl.remote.programs.trainer import collective_failed, describe


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
