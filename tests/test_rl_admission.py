"""Bounded staleness by admission control (swectl/rl/admission.py): the start and train rules by hand, then
in simulated time (swectl/testing/async_sim.py) over many seeds and shapes: no sample is ever trained staler than
max_staleness, none is thrown away, max_staleness 0 is the synchronous loop, and the batches keep the
population's mean reward where a drop-stale policy leans toward fast episodes."""

from __future__ import annotations

import pytest

from swectl.rl.admission import Admission
from swectl.testing.async_sim import SimConfig, simulate


def test_start_rule_counts_running_and_buffered_samples() -> None:
    a = Admission(1, batch=8)
    assert a.limit == 16 and a.room() == 16
    tickets = [a.start(4) for _ in range(4)]
    assert a.room() == 0 and not a.can_start(4)
    with pytest.raises(ValueError, match=r"over the limit 16 = \(max_staleness 1 \+ 1\) x batch 8"):
        a.start(4)
    a.finish(tickets[0])  # buffered: still outstanding
    assert a.room() == 0
    a.finish(tickets[1], trainable=False)  # nothing to train: its room comes back
    assert a.room() == 4
    with pytest.raises(ValueError, match="not running"):
        a.finish(tickets[1])
    with pytest.raises(ValueError, match="larger than a batch"):
        a.start(9)
    with pytest.raises(ValueError, match="max_staleness"):
        Admission(-1, batch=8)


def test_train_rule_takes_oldest_first_and_waits_for_overdue_groups() -> None:
    a = Admission(1, batch=4)
    old = [a.start(2), a.start(2)]  # version 0
    a.finish(old[0])
    a.finish(old[1])
    assert a.ready()
    assert a.take() == old and a.version == 1
    young = [a.start(2), a.start(2)]  # version 1
    a.finish(young[0])
    a.finish(young[1])
    slow = a.start(2)  # version 1, still running
    assert a.ready()  # version 1 - max_staleness 1 = 0: nothing started at version 0 runs
    assert a.take() == young and a.version == 2
    newer = [a.start(2)]  # version 2
    a.finish(newer[0])
    assert a.blocking() == [slow] and not a.ready()  # slow's deadline is version 2: wait for it
    with pytest.raises(ValueError, match="must wait for 1 running group"):
        a.take()
    a.finish(slow)
    assert a.ready() and a.take() == [slow, newer[0]]  # oldest first
    assert a.statistics().buffered_samples == 0


def test_train_rule_keeps_old_groups_from_being_crowded_out() -> None:
    """k = 2, batch 2: three groups start at version 0 (due by version 2). Young groups that finish first may fill
    step 0, but not steps 0 and 1 both: then the three old ones would need step 2 alone."""
    a = Admission(2, batch=2)
    old = [a.start(2) for _ in range(3)]
    a.finish(old[0])
    assert a.take() == [old[0]]  # version 0 -> 1; old[1], old[2] still running, due by 2
    young = a.start(2)  # version 1, due by 3
    a.finish(young)
    assert a.blocking() == old[1:]  # taking young now would leave old[1] and old[2] for step 2 alone
    assert not a.ready()
    a.finish(old[1])
    assert a.ready() and a.take() == [old[1]]
    assert a.blocking() == [old[2]]  # due now: step 2 waits for it though young is buffered
    a.finish(old[2])
    assert a.take() == [old[2]] and a.take() == [young] and a.version == 4


def test_max_staleness_zero_is_synchronous() -> None:
    r = simulate(SimConfig(max_staleness=0, steps=100, seed=3))
    assert r.staleness == {0: 100 * 16}
    assert r.samples_dropped == 0 and r.slot_idle_frac > 0.2  # the slots wait for the slowest episode and the trainer


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("k", "groups", "size", "slots", "sigma"), [
    (1, 4, 4, 8, 1.0), (2, 4, 4, 8, 1.5), (2, 2, 8, 3, 0.5), (3, 3, 2, 32, 2.0), (1, 1, 1, 5, 1.0), (4, 2, 3, 64, 2.5)])
def test_bounded_staleness_never_exceeds_k_and_drops_nothing(seed: int, k: int, groups: int, size: int, slots: int,
                                                               sigma: float) -> None:
    r = simulate(SimConfig(max_staleness=k, steps=150, groups_per_step=groups, group_size=size, slots=slots,
                           sigma=sigma, seed=seed))
    assert max(r.staleness) <= k
    assert r.samples_dropped == 0 and r.samples_trained == 150 * groups * size


def test_async_is_faster_and_unbiased_where_drop_stale_is_biased() -> None:
    def run(policy: str, k: int):  # type: ignore[no-untyped-def]
        return simulate(SimConfig(policy=policy, max_staleness=k, steps=1500, sigma=1.0, failure_slowdown=2.0, seed=1))

    sync, bounded, drop = run("bounded", 0), run("bounded", 2), run("drop_stale", 1)
    assert sync.wall_s / bounded.wall_s > 1.5
    assert abs(bounded.reward_bias) < 0.01
    assert drop.samples_dropped > 0 and drop.reward_bias > 0.02  # fast episodes are mostly the ones that succeed
