"""Leases are earned (taskpool/standing.py): a client starts with few, gains one per task delivered on
time, loses half at each lease it lets run out; a task whose lease ran out goes to another client first;
an unproven client's leases are cut short. On a fake clock."""

from __future__ import annotations

import pytest

from taskpool import TaskPool, TaskPoolError
from tests.taskpool.test_pool import FakeClock, task


def earning_pool(clock, **kw) -> TaskPool:
    return TaskPool(
        clock=clock, default_timeout=10.0, max_leases_per_client=8, preference_grace=1.0, start_leases=2, **kw
    )


def fill(pool: TaskPool, n: int, **kw) -> None:
    for i in range(n):
        pool.add(task(f"t{i}", mb=i, **kw))


def test_a_new_client_holds_few_leases_and_earns_more_by_delivering():
    clock = FakeClock()
    pool = earning_pool(clock)
    fill(pool, 20)
    held = [pool.take("a"), pool.take("a")]
    assert all(held) and pool.take("a") is None and pool.standing.allowance("a") == 2
    clock.now = 1.0
    assert pool.complete(held[0].task.task_id, "a").value == "accepted"  # on time: one more
    assert pool.standing.allowance("a") == 3
    assert pool.take("a") is not None and pool.take("a") is not None and pool.take("a") is None
    for _ in range(10):  # up to the most, never past it
        lease = pool.leases_of("a")[0]
        pool.complete(lease.task.task_id, "a")
        while pool.take("a") is not None:
            pass
    assert pool.standing.allowance("a") == 8 and len(pool.leases_of("a")) == 8


def test_leases_that_run_out_halve_the_allowance_and_count_as_strikes_until_one_is_delivered():
    clock = FakeClock()
    pool = earning_pool(clock)
    fill(pool, 30)
    for _ in range(6):  # earn: 2 -> 8
        lease = pool.take("h")
        pool.complete(lease.task.task_id, "h")
    assert pool.standing.allowance("h") == 8
    for _ in range(8):
        pool.take("h")
    clock.now = 100.0
    assert len(pool.expire()) == 8
    # each expiry halves: 8 -> 4 -> 2 -> 1 -> 1 ...; one round of leases run out is one strike
    assert pool.standing.allowance("h") == 1 and pool.standing.strikes("h") == 1
    clock.now = 102.0  # past the shun
    lease = pool.take("h")
    pool.complete(lease.task.task_id, "h")
    assert pool.standing.strikes("h") == 0 and pool.standing.allowance("h") == 2


def test_a_task_whose_lease_ran_out_goes_to_another_client_first_and_is_no_longer_preferred():
    clock = FakeClock()
    pool = earning_pool(clock)
    pool.add(task("t0", preferred_client="h"))
    assert pool.take("h").task.task_id == "t0"
    clock.now = 20.0
    assert [t.task_id for t in pool.expire()] == ["t0"]
    assert pool.take("h") is None  # its own expired task: others first, for the grace period
    assert pool.adopt("h", "t0") is None  # nor handed back by saying it still holds it
    assert pool.take("honest").task.task_id == "t0"
    pool.complete("t0", "honest")
    pool.add(task("t1", preferred_client="h"))
    assert pool.take("h").task.task_id == "t1"
    clock.now = 40.0
    pool.expire()
    clock.now = 41.5  # the grace is over and nobody took it: anyone, the same client too
    assert pool.take("h").task.task_id == "t1"


def test_an_unproven_clients_leases_are_cut_short_once_the_typical_lease_is_known():
    clock = FakeClock()
    pool = earning_pool(clock, probation_factor=4.0, probation_floor=2.0)
    fill(pool, 10)
    first = pool.take("new")  # nothing known yet of how long a lease takes here: the full timeout
    assert first.deadline == pytest.approx(10.0)
    lease = pool.take("honest")
    clock.now = 0.5
    pool.complete(lease.task.task_id, "honest")  # typical lease 0.5 s
    clock.now = 1.5  # (past the grace in which open tasks wait for proven clients)
    assert pool.take("honest").deadline == pytest.approx(11.5)  # proven: full timeout
    assert pool.take("stranger").deadline == pytest.approx(1.5 + 2.0)  # 4 x 0.5 s, floored at 2 s
    assert pool.take("new").deadline == pytest.approx(1.5 + 2.0)
    pool.standing.trust("server-worker")
    assert pool.take("server-worker").deadline == pytest.approx(11.5)
    assert pool.standing.allowance("server-worker") == 8


def test_a_late_result_of_an_expired_lease_still_counts_but_earns_nothing():
    clock = FakeClock()
    pool = earning_pool(clock)
    fill(pool, 2)
    lease = pool.take("slow")
    clock.now = 20.0
    pool.expire()
    assert pool.complete(lease.task.task_id, "slow").value == "accepted"
    # delivered, late: slow, not hoarding (its strike goes), but nothing earned
    assert (
        pool.standing.strikes("slow") == 0 and pool.standing.allowance("slow") == 1 and not pool.standing.proven("slow")
    )


def test_the_plain_pool_is_unchanged_and_bad_settings_are_named():
    clock = FakeClock()
    pool = TaskPool(clock=clock, default_timeout=10.0, max_leases_per_client=3)
    fill(pool, 5)
    assert [pool.take("a") is not None for _ in range(4)] == [True, True, True, False]
    clock.now = 20.0
    pool.expire()
    assert pool.take("a") is not None and pool.standing.allowance("a") == 3  # no shun, nothing halved
    with pytest.raises(TaskPoolError, match="start_leases"):
        TaskPool(clock=clock, start_leases=0)
    with pytest.raises(TaskPoolError, match="probation_factor"):
        TaskPool(clock=clock, probation_factor=-1.0)


def test_a_new_open_task_waits_for_the_clients_that_have_delivered_then_anyone_takes_it():
    clock = FakeClock()
    pool = earning_pool(clock)
    pool.add(task("t0"))
    assert pool.take("first").task.task_id == "t0"  # nobody has delivered yet: no wait
    pool.complete("t0", "first")
    pool.add(task("t1"))
    pool.add(task("t2", mb=1, preferred_client="newcomer"))
    assert pool.take("newcomer").task.task_id == "t2"  # its own preferred task: at once
    assert pool.take("stranger") is None  # t1 is new: the proven first
    clock.now = 1.0  # the grace is over
    assert pool.take("stranger").task.task_id == "t1"


def test_a_slow_newcomer_that_delivers_late_is_not_dropped_and_its_probation_leases_grow():
    clock = FakeClock()
    pool = earning_pool(clock, probation_factor=2.0, probation_floor=0.25)
    fill(pool, 6)
    lease = pool.take("fast")
    clock.now = 0.1
    pool.complete(lease.task.task_id, "fast")  # the typical lease: 0.1 s
    clock.now = 2.0
    first = pool.take("slow")
    assert first.deadline == pytest.approx(2.0 + 0.25)
    clock.now = 2.5
    pool.expire()
    assert pool.standing.strikes("slow") == 1
    assert pool.take("fast").task.task_id == first.task.task_id  # its expired task: others first
    second = pool.take("slow")
    assert second.deadline == pytest.approx(2.5 + 0.5)  # its probation lease doubled after a strike
    clock.now = 2.7
    assert pool.complete(first.task.task_id, "slow").value == "accepted"  # late, and first: it counts
    assert pool.standing.strikes("slow") == 0 and not pool.standing.proven("slow")  # slow, not hoarding; nothing earned


def test_leases_taken_before_a_strike_add_none_and_each_later_round_adds_one():
    """A newcomer that took its two leases at once and was slow with the first: both run out under the
    same short deadline, one strike; a hoarder still gains a strike each round and is dropped after
    three (the pool's owner drops it: parameter_server/clients.py)."""
    clock = FakeClock()
    pool = earning_pool(clock, probation_factor=2.0, probation_floor=0.25)
    fill(pool, 10)
    lease = pool.take("fast")
    clock.now = 0.1
    pool.complete(lease.task.task_id, "fast")
    clock.now = 2.0
    a, b = pool.take("hoarder"), pool.take("hoarder")
    assert a and b and a.deadline == b.deadline == pytest.approx(2.25)
    clock.now = 2.3
    assert len(pool.expire()) == 2 and pool.standing.strikes("hoarder") == 1
    for round_ in (2, 3):
        clock.now += 1.1  # (past the grace in which open tasks wait for proven clients)
        lease = pool.take("hoarder")
        assert lease.deadline == pytest.approx(clock.now + 0.25 * 2 ** (round_ - 1))  # doubled at each strike
        clock.now = lease.deadline + 0.01
        pool.expire()
        assert pool.standing.strikes("hoarder") == round_


def test_probation_leases_follow_what_newcomers_needed_not_what_proven_clients_take():
    """A newcomer's first task also fetches the parameters and builds its slice: its cap comes from
    the first leases that unproven clients delivered on time, not from the proven clients' quick ones."""
    clock = FakeClock()
    pool = earning_pool(clock, probation_factor=2.0, probation_floor=0.25)
    fill(pool, 20)
    first = pool.take("a")
    clock.now = 1.0
    pool.complete(first.task.task_id, "a")  # a newcomer's first lease: 1 s
    for _ in range(5):  # then a's own, proven, leases: 0.1 s each
        lease = pool.take("a")
        clock.now += 0.1
        pool.complete(lease.task.task_id, "a")
    clock.now += 2.0  # (past the grace in which open tasks wait for proven clients)
    newcomer = pool.take("b")
    assert newcomer.deadline == pytest.approx(clock.now + 2.0 * 1.0)  # 2 x the typical first lease, not 2 x 0.1 s
