"""Unit tests of the task pool: one behaviour each, on a fake clock."""

from __future__ import annotations

import json
import random

import pytest

from taskpool import BACKWARD, FORWARD, Completion, Lease, Task, TaskPool, TaskPoolError
from taskpool.types import priority


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_pool(clock: FakeClock, **kw) -> TaskPool:
    return TaskPool(clock=clock, **kw)


def task(tid: str, kind: str = FORWARD, batch: int = 0, mb: int = 0, **kw) -> Task:
    return Task(tid, kind, batch, mb, 0, (0, 8), **kw)


def take_id(pool: TaskPool, client: str) -> str | None:
    lease = pool.take(client)
    return lease.task.task_id if lease is not None else None


# ------------------------------------------------------------------------ priority


def test_priority_older_batch_then_micro_batch_then_backward_then_insertion(clock):
    specs = [(b, mb, kind, n) for b in range(3) for mb in range(3) for kind in (FORWARD, BACKWARD) for n in range(2)]
    random.Random(0).shuffle(specs)
    pool = make_pool(clock)
    order = {}
    for i, (b, mb, kind, n) in enumerate(specs):
        tid = f"{b}-{mb}-{kind}-{n}"
        pool.add(task(tid, kind, b, mb))
        order[tid] = (b, mb, kind != BACKWARD, i)
        # taskpool.types.priority, by which a worker orders the tasks parked with it, is this order
        assert priority(b, mb, kind) == order[tid][:3]
    taken = []
    while (tid := take_id(pool, "c")) is not None:
        taken.append(tid)
        assert pool.complete(tid, "c") is Completion.ACCEPTED
    assert taken == sorted(order, key=order.__getitem__)


def test_requeued_task_keeps_its_place(clock):
    pool = make_pool(clock, max_leases_per_client=2)
    for tid in ("a", "b", "c"):
        pool.add(task(tid))
    assert take_id(pool, "x") == "a"
    assert take_id(pool, "x") == "b"
    pool.fail("a", "x")
    assert take_id(pool, "y") == "a"
    assert pool.lease_of("a").attempt == 2
    assert take_id(pool, "y") == "c"


# ------------------------------------------------------------------------ preferred client


def test_preferred_task_waits_for_its_client_during_grace(clock):
    pool = make_pool(clock, preference_grace=1.0)
    pool.add(task("p", preferred_client="owner"))
    assert pool.take("other") is None
    clock.now = 0.999
    assert pool.take("other") is None
    assert take_id(pool, "owner") == "p"


def test_preferred_task_open_to_anyone_when_grace_ends(clock):
    pool = make_pool(clock, preference_grace=1.0)
    pool.add(task("p", preferred_client="owner"))
    clock.now = 1.0  # the boundary counts as over
    assert take_id(pool, "other") == "p"
    assert pool.take("owner") is None


def test_others_get_open_tasks_while_a_better_one_waits(clock):
    pool = make_pool(clock)
    pool.add(task("p", BACKWARD, preferred_client="owner"))
    pool.add(task("f", FORWARD, batch=5))
    assert take_id(pool, "other") == "f"
    assert take_id(pool, "owner") == "p"


def test_preferred_client_still_takes_best_task_first(clock):
    pool = make_pool(clock, max_leases_per_client=2)
    pool.add(task("p", FORWARD, batch=1, preferred_client="owner"))
    pool.add(task("old", FORWARD, batch=0))
    assert take_id(pool, "owner") == "old"
    assert take_id(pool, "owner") == "p"


def test_client_left_opens_its_preferred_tasks_at_once(clock):
    pool = make_pool(clock, preference_grace=10.0)
    pool.add(task("p", preferred_client="owner"))
    assert pool.take("other") is None
    assert pool.client_left("owner") == []
    assert take_id(pool, "other") == "p"


def test_zero_grace_means_no_waiting(clock):
    pool = make_pool(clock, preference_grace=0)
    pool.add(task("p", preferred_client="owner"))
    assert take_id(pool, "other") == "p"


# ------------------------------------------------------------------------ K leases


def test_client_holds_at_most_k_leases(clock):
    pool = make_pool(clock, max_leases_per_client=2)
    for i in range(5):
        pool.add(task(f"t{i}"))
    assert take_id(pool, "a") == "t0"
    assert take_id(pool, "a") == "t1"
    assert pool.take("a") is None
    assert take_id(pool, "b") == "t2"  # the limit is per client
    pool.complete("t0", "a")
    assert take_id(pool, "a") == "t3"
    assert [lease.task.task_id for lease in pool.leases_of("a")] == ["t1", "t3"]
    assert pool.stats()["clients"]["a"]["leases"] == 2


def test_take_on_empty_pool_is_none(clock):
    assert make_pool(clock).take("a") is None


# ------------------------------------------------------------------------ deadlines


def test_deadline_from_default_and_per_task_timeout(clock):
    pool = make_pool(clock, default_timeout=30.0, max_leases_per_client=2)
    clock.now = 5.0
    pool.add(task("d"))
    pool.add(task("t", timeout=2.5))
    assert pool.take("a").deadline == 35.0
    assert pool.take("a").deadline == 7.5
    assert pool.next_deadline() == 7.5


def _measured_pool(clock):
    """Clients a, b, c complete 4, 2, 1 tasks over 10 s: 0.4, 0.2, 0.1 tasks/s."""
    pool = make_pool(clock, default_timeout=30.0, max_leases_per_client=10, throughput_halflife=1e9)
    n = 0
    for client, count in (("a", 4), ("b", 2), ("c", 1)):
        for _ in range(count):
            pool.add(task(f"w{n}"))
            n += 1
            assert pool.take(client) is not None
    clock.now = 10.0
    for client in ("a", "b", "c"):
        for lease in pool.leases_of(client):
            pool.complete(lease.task.task_id, client)
    for i in range(4):
        pool.add(task(f"next{i}"))
    return pool


def test_deadline_scales_with_measured_throughput(clock):
    pool = _measured_pool(clock)
    clients = pool.stats()["clients"]
    assert clients["a"]["throughput"] == pytest.approx(0.4)
    assert clients["c"]["throughput"] == pytest.approx(0.1)
    # median 0.2: a is twice as fast, c twice as slow, a new client is unknown (1.0)
    assert pool.take("a").deadline == pytest.approx(10.0 + 30.0 * 0.5)
    assert pool.take("b").deadline == pytest.approx(10.0 + 30.0)
    assert pool.take("c").deadline == pytest.approx(10.0 + 30.0 * 2.0)
    assert pool.take("new").deadline == pytest.approx(10.0 + 30.0)


def test_seeded_speed_scales_and_is_clamped(clock):
    pool = make_pool(clock, default_timeout=10.0)
    for client, speed in (("fast", 2.0), ("mid", 1.0), ("slow", 0.5), ("crawl", 0.01), ("rocket", 100.0)):
        pool.set_client_speed(client, speed)
    for i in range(6):
        pool.add(task(f"t{i}"))
    # median of the seeds is 1.0
    assert pool.take("fast").deadline == pytest.approx(5.0)
    assert pool.take("mid").deadline == pytest.approx(10.0)
    assert pool.take("slow").deadline == pytest.approx(20.0)
    assert pool.take("crawl").deadline == pytest.approx(40.0)  # 100 clamped to 4
    assert pool.take("rocket").deadline == pytest.approx(5.0)  # 0.01 clamped to 0.5
    assert pool.take("unknown").deadline == pytest.approx(10.0)


def test_measured_throughput_overrides_seed(clock):
    pool = _measured_pool(clock)
    pool.set_client_speed("a", 0.001)  # would give factor 4 among seeds; a is measured
    assert pool.take("a").deadline == pytest.approx(10.0 + 30.0 * 0.5)


def test_throughput_is_a_moving_average(clock):
    pool = make_pool(clock, throughput_halflife=10.0, max_leases_per_client=100)
    for i in range(20):
        pool.add(task(f"t{i}"))
    assert pool.take("a") is not None
    for i in range(1, 20):  # one completion per second for 20 s
        clock.now = float(i)
        pool.complete(f"t{i - 1}", "a")
        pool.take("a")
    clock.now = 20.0
    pool.complete("t19", "a")
    at_20 = pool.stats()["clients"]["a"]["throughput"]
    assert at_20 == pytest.approx(1.0, rel=0.05)
    clock.now = 30.0
    # a silent half-life halves the weighted count, while the weight of the observed
    # time grows from 1 - 2**-2 to 1 - 2**-3 (no warm-up bias)
    expected = at_20 * 0.5 * (1 - 2**-2) / (1 - 2**-3)
    assert pool.stats()["clients"]["a"]["throughput"] == pytest.approx(expected)


# ------------------------------------------------------------------------ expiry and churn


def test_expire_requeues_overdue_leases_only(clock):
    pool = make_pool(clock, default_timeout=5.0, max_leases_per_client=3)
    pool.add(task("short", timeout=1.0))
    pool.add(task("long"))
    pool.take("a")
    pool.take("a")
    assert pool.expire(0.5) == []
    assert [t.task_id for t in pool.expire(1.0)] == ["short"]  # deadline reached counts
    assert pool.lease_of("short") is None
    assert pool.next_deadline() == 5.0
    clock.now = 6.0
    assert [t.task_id for t in pool.expire()] == ["long"]
    assert pool.next_deadline() is None
    assert pool.stats()["requeued"] == 2
    assert pool.leases_of("a") == []


def test_stale_deadline_does_not_expire_a_newer_lease(clock):
    pool = make_pool(clock, default_timeout=5.0)
    pool.add(task("t"))
    pool.take("a")  # deadline 5
    clock.now = 2.0
    pool.fail("t", "a")
    lease = pool.take("b")  # deadline 7
    assert lease.deadline == 7.0 and lease.attempt == 2
    assert pool.expire(6.0) == []
    assert pool.lease_of("t") is lease
    assert pool.next_deadline() == 7.0


def test_client_left_requeues_all_its_leases(clock):
    pool = make_pool(clock, max_leases_per_client=3)
    for i in range(4):
        pool.add(task(f"t{i}"))
    for _ in range(3):
        pool.take("a")
    pool.take("b")
    left = pool.client_left("a")
    assert [t.task_id for t in left] == ["t0", "t1", "t2"]
    assert pool.leases_of("a") == []
    assert "a" not in pool.stats()["clients"]
    assert take_id(pool, "c") == "t0"
    assert pool.client_left("nobody") == []


def test_fail_requeues_at_once(clock):
    pool = make_pool(clock)
    pool.add(task("t"))
    pool.take("a")
    pool.fail("t", "a")
    assert pool.stats()["queued"] == 1 and pool.stats()["requeued"] == 1
    assert pool.take("a").attempt == 2


# ------------------------------------------------------------------------ exactly once


def test_late_completion_after_expiry_wins_over_the_new_lease(clock):
    pool = make_pool(clock, default_timeout=1.0)
    pool.add(task("t"))
    pool.take("slow")
    clock.now = 2.0
    pool.expire()
    assert pool.take("fast").attempt == 2
    assert pool.complete("t", "slow") is Completion.ACCEPTED
    assert pool.is_done("t")
    assert pool.lease_of("t") is None and pool.leases_of("fast") == []
    assert pool.complete("t", "fast") is Completion.DUPLICATE
    assert pool.complete("t", "slow") is Completion.DUPLICATE
    s = pool.stats()
    assert (s["done"], s["duplicates"], s["leased"], s["queued"]) == (1, 2, 0, 0)
    assert s["clients"]["slow"]["done"] == 1 and s["clients"]["fast"]["done"] == 0
    assert pool.take("fast") is None


def test_late_completion_while_requeued_leaves_the_queue(clock):
    pool = make_pool(clock, default_timeout=1.0)
    pool.add(task("t"))
    pool.take("slow")
    pool.expire(5.0)
    assert pool.stats()["queued"] == 1
    assert pool.complete("t", "slow") is Completion.ACCEPTED
    assert pool.take("other") is None
    assert len(pool) == 0


def test_ever_held_names_every_client_that_held_a_lease_of_an_open_task(clock):
    """What a server asks before it takes a completion: a stranger never held the task; a holder
    whose lease ran out (or was re-queued) still did; a closed task is not open (None)."""
    pool = make_pool(clock, default_timeout=1.0)
    pool.add(task("t"))
    assert pool.ever_held("t", "slow") is False  # queued, never leased
    pool.take("slow")
    assert pool.ever_held("t", "slow") is True and pool.ever_held("t", "stranger") is False
    pool.expire(5.0)  # re-queued: its first holder may still hand the work in
    assert pool.ever_held("t", "slow") is True
    pool.take("fast")
    assert pool.ever_held("t", "fast") is True and pool.ever_held("t", "stranger") is False
    assert pool.complete("t", "slow") is Completion.ACCEPTED
    assert pool.ever_held("t", "slow") is None and pool.ever_held("nope", "slow") is None


def test_abandon_drops_the_task_and_late_results(clock):
    pool = make_pool(clock)
    pool.add(task("q"))
    pool.add(task("l"))
    pool.take("a")
    pool.abandon("l")
    pool.abandon("q")
    assert pool.leases_of("a") == [] and len(pool) == 0
    assert pool.complete("l", "a") is Completion.DUPLICATE
    assert not pool.is_done("l")
    s = pool.stats()
    assert (s["abandoned"], s["duplicates"], s["done"]) == (2, 1, 0)


def test_forget_closed_drops_the_ids_of_old_batches_only(clock):
    pool = make_pool(clock)
    for b in range(3):
        pool.add(task(f"d{b}", batch=b))
        pool.add(task(f"x{b}", batch=b, mb=1))
        pool.complete(f"d{b}", "a")
        pool.abandon(f"x{b}")
    pool.add(task("live", batch=0, mb=2))  # not closed: never forgotten
    assert sorted(pool.forget_closed(2)) == ["d0", "d1", "x0", "x1"]
    assert pool.forget_closed(2) == []
    # a late result for a forgotten id is an unknown id; the recent batch's ids are kept
    with pytest.raises(TaskPoolError, match="unknown task id"):
        pool.complete("d1", "a")
    assert pool.complete("d2", "a") is Completion.DUPLICATE and pool.is_done("d2")
    assert pool.lease_of("live") is None and take_id(pool, "a") == "live"
    s = pool.stats()  # the counters stay
    assert (s["done"], s["abandoned"], s["added"]) == (3, 3, 7)


def test_abandon_before_closes_the_open_tasks_of_old_batches_only(clock):
    """An owner whose batches end abandons their tasks still open (queued, leased, or re-queued after
    a lost lease): none is handed out again, a late result for one is a duplicate, and the ids then
    go with the batch's closed ones."""
    pool = make_pool(clock, default_timeout=5.0)
    pool.add(task("q0", batch=0))
    pool.add(task("l0", batch=0, mb=1))
    pool.add(task("r1", batch=1))
    pool.add(task("d1", batch=1, mb=1))
    pool.add(task("q2", batch=2))
    assert take_id(pool, "a") == "q0" and take_id(pool, "b") == "l0"
    pool.complete("d1", "b")
    clock.now += 10.0
    assert sorted(t.task_id for t in pool.expire()) == ["l0", "q0"]  # both leases lost: queued again
    assert take_id(pool, "c") == "q0"  # and one of them leased again
    assert sorted(pool.abandon_before(2)) == ["l0", "q0", "r1"]
    assert pool.abandon_before(2) == []
    assert pool.leases_of("c") == [] and take_id(pool, "a") == "q2" and take_id(pool, "b") is None
    assert pool.complete("r1", "a") is Completion.DUPLICATE
    assert sorted(pool.forget_closed(2)) == ["d1", "l0", "q0", "r1"]


def test_a_long_run_that_forgets_its_batches_keeps_ids_of_recent_ones_only(clock):
    pool = make_pool(clock)
    for b in range(500):
        for m in range(8):
            pool.add(task(f"{b}/{m}", batch=b, mb=m))
            pool.complete(take_id(pool, "a"), "a")
        pool.forget_closed(b - 1)
    assert sum(pool.is_done(f"{b}/{m}") for b in range(500) for m in range(8)) == 16  # batches 498 and 499


# ------------------------------------------------------------------------ misuse


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(kind="sideways"), "kind"),
        (dict(rows=(3, 3)), "empty row range"),
        (dict(rows=(4, 2)), "empty row range"),
        (dict(rows=(0, 1, 2)), "rows"),
        (dict(timeout=0.0), "timeout"),
        (dict(timeout=-1.0), "timeout"),
        (dict(timeout=float("nan")), "timeout"),
        (dict(task_id=""), "task_id"),
        (dict(batch=-1), "batch"),
        (dict(micro_batch=2**32), "micro_batch"),
        (dict(stage=1.5), "stage"),
        (dict(preferred_client=7), "preferred_client"),
    ],
)
def test_bad_task_is_refused(kwargs, word):
    fields = dict(task_id="t", kind=FORWARD, batch=0, micro_batch=0, stage=0, rows=(0, 1))
    fields.update(kwargs)
    with pytest.raises(TaskPoolError, match=word):
        Task(**fields)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(default_timeout=0), "default_timeout"),
        (dict(default_timeout=-3.0), "default_timeout"),
        (dict(max_leases_per_client=0), "max_leases_per_client"),
        (dict(max_leases_per_client=1.5), "max_leases_per_client"),
        (dict(preference_grace=-1.0), "preference_grace"),
        (dict(throughput_halflife=0), "throughput_halflife"),
    ],
)
def test_bad_pool_settings_are_refused(clock, kwargs, word):
    with pytest.raises(TaskPoolError, match=word):
        make_pool(clock, **kwargs)


def _busy_pool(clock):
    pool = make_pool(clock, max_leases_per_client=2)
    for tid in ("queued", "leased", "done", "abandoned"):
        pool.add(task(tid, batch=["leased", "done", "queued", "abandoned"].index(tid)))
    assert take_id(pool, "a") == "leased"
    assert take_id(pool, "b") == "done"
    pool.complete("done", "b")
    pool.abandon("abandoned")
    return pool


@pytest.mark.parametrize(
    "op, args, word",
    [
        ("complete", ("nope", "a"), "unknown task id 'nope'"),
        ("add", (task("queued"),), "already added"),
        ("add", (task("leased"),), "already added"),
        ("add", (task("done"),), "already added"),
        ("add", (task("abandoned"),), "already added"),
        ("add", ("not a task",), "needs a Task"),
        ("fail", ("leased", "b"), "leased to 'a', not to 'b'"),
        ("fail", ("queued", "a"), "queued"),
        ("fail", ("done", "b"), "already done"),
        ("fail", ("abandoned", "a"), "abandoned"),
        ("fail", ("nope", "a"), "unknown"),
        ("abandon", ("done",), "already done"),
        ("abandon", ("abandoned",), "abandoned"),
        ("abandon", ("nope",), "unknown"),
        ("set_client_speed", ("a", 0.0), "relative_speed"),
        ("set_client_speed", ("a", -2.0), "relative_speed"),
    ],
)
def test_misuse_raises_and_leaves_the_pool_unchanged(clock, op, args, word):
    pool = _busy_pool(clock)
    before = (pool.stats(), len(pool), pool.leases_of("a"), pool.leases_of("b"), pool.next_deadline())
    with pytest.raises(TaskPoolError, match=word):
        getattr(pool, op)(*args)
    assert (pool.stats(), len(pool), pool.leases_of("a"), pool.leases_of("b"), pool.next_deadline()) == before
    # and the pool still works
    assert take_id(pool, "b") == "queued"
    assert pool.complete("leased", "a") is Completion.ACCEPTED


def test_task_pool_error_is_a_value_error():
    assert issubclass(TaskPoolError, ValueError)


# ------------------------------------------------------------------------ stats


def test_stats_shape_and_json(clock):
    pool = make_pool(clock, max_leases_per_client=2)
    empty = pool.stats()
    assert empty == {
        "queued": 0,
        "leased": 0,
        "done": 0,
        "requeued": 0,
        "reopened": 0,
        "duplicates": 0,
        "backups": 0,
        "abandoned": 0,
        "added": 0,
        "oldest_queued_age": 0.0,
        "clients": {},
    }
    pool.add(task("a"))
    clock.now = 2.0
    pool.add(task("b"))
    pool.add(task("c"))
    clock.now = 3.0
    pool.take("x")
    pool.complete("a", "x")
    clock.now = 7.0
    s = pool.stats()
    assert json.loads(json.dumps(s)) == s
    assert set(s) == {
        "queued",
        "leased",
        "done",
        "requeued",
        "reopened",
        "backups",
        "duplicates",
        "abandoned",
        "added",
        "oldest_queued_age",
        "clients",
    }
    assert (s["queued"], s["leased"], s["done"], s["added"]) == (2, 0, 1, 3)
    assert s["oldest_queued_age"] == 5.0  # b, added at 2.0
    assert set(s["clients"]["x"]) == {"throughput", "capacity", "done", "leases", "allowance"}
    assert s["clients"]["x"]["done"] == 1 and s["clients"]["x"]["throughput"] > 0
    assert len(pool) == 2


def test_lease_and_task_are_immutable(clock):
    pool = make_pool(clock)
    pool.add(task("t"))
    lease = pool.take("a")
    assert isinstance(lease, Lease)
    assert lease == Lease(task("t"), "a", 30.0, 1)
    with pytest.raises(AttributeError):
        lease.client = "b"
    with pytest.raises(AttributeError):
        lease.task.batch = 3


# ------------------------------------------------------------------------ lazy heaps stay small


def test_stale_heap_items_are_compacted(clock):
    pool = make_pool(clock, max_leases_per_client=1, compact_min_stale=16)
    for i in range(2000):
        pool.add(task(f"t{i}", preferred_client="p" if i % 3 else None))
        pool.take("p")
        pool.complete(f"t{i}", "p")
        items = pool.heap_items()
        assert items["deadlines"] <= 4 * 1 + 16 + 1
        assert items["queues"] <= 25
    assert pool.stats()["done"] == 2000


def test_reclaim_requeues_the_leases_a_client_does_not_know_it_holds():
    """A lease whose `take` answer was lost would wait out its timeout; the client's heartbeat lists
    what it holds, and the pool re-queues the rest once they are old enough to have arrived."""
    now = [0.0]
    pool = TaskPool(clock=lambda: now[0], default_timeout=60.0, max_leases_per_client=3)
    for i in range(3):
        pool.add(Task(task_id=f"t{i}", kind="forward", batch=0, micro_batch=i, stage=0, rows=(0, 1)))
    a, b = pool.take("c"), pool.take("c")
    now[0] = 1.0
    c = pool.take("c")
    now[0] = 6.0
    # the client knows a and nothing else; c is only 5 s old, b 6 s
    lost = pool.reclaim("c", [a.task.task_id], min_age=5.5)
    assert [t.task_id for t in lost] == [b.task.task_id]
    assert {lease.task.task_id for lease in pool.leases_of("c")} == {a.task.task_id, c.task.task_id}
    assert pool.stats()["requeued"] == 1
    again = pool.take("other")
    assert again is not None and again.task.task_id == b.task.task_id and again.attempt == 2
    assert pool.reclaim("nobody", [], min_age=0.0) == []


def test_adopt_leases_a_queued_task_to_the_client_that_holds_it(clock):
    """A restarted server queued again the tasks its clients still work on; a client's heartbeat
    lists them and the pool leases each back to it: nobody else takes it, its result completes it."""
    pool = make_pool(clock, max_leases_per_client=2)
    for i in range(4):
        pool.add(task(f"t{i}", mb=i, preferred_client="p" if i == 3 else None))
    lease = pool.adopt("c", "t2")
    assert lease is not None and lease.client == "c" and lease.task.task_id == "t2" and lease.attempt == 1
    assert pool.adopt("d", "t2") is None  # leased already
    assert pool.adopt("c", "t3") is not None  # a preferred (someone else's grace) task too
    assert pool.adopt("c", "t1") is None  # c holds its maximum of 2
    assert pool.adopt("c", "nope") is None
    assert [take_id(pool, "d") for _ in range(2)] == ["t0", "t1"]  # the adopted ones are skipped
    assert take_id(pool, "e") is None
    assert pool.complete("t2", "c") is Completion.ACCEPTED
    assert pool.adopt("c", "t2") is None  # done
    assert pool.stats()["leased"] == 3


def test_open_tasks_of_a_batch_name_holders_and_ages_longest_first_and_leave_done_ones_out(clock):
    pool = make_pool(clock)
    for tid, b in (("a", 0), ("b", 0), ("d", 1)):
        pool.add(task(tid, batch=b))
    clock.now = 1.0
    pool.add(task("c", batch=0))
    assert take_id(pool, "w1") == "a"  # leased at 1.0
    clock.now = 2.0
    assert take_id(pool, "w2") == "b"
    pool.complete("b", "w2")
    clock.now = 4.5
    pool.add(task("e", batch=0))
    assert pool.open_tasks(0)[-1] == ("e", None, 0.0)  # longest first
    assert sorted(pool.open_tasks(0)) == [("a", "w1", 3.5), ("c", None, 3.5), ("e", None, 0.0)]
    assert pool.open_tasks(1) == [("d", None, 4.5)]
    assert pool.open_tasks(7) == []


def test_capacity_is_rows_a_busy_second_whatever_work_the_client_was_given(clock):
    """Two clients of the same speed (2 s an 8-row task), one handed four tasks in a row, the other
    one: their throughputs (tasks a second) differ, their capacity (rows a second while holding a
    lease) is the same 4 rows/s; a client holding two leases at once is busy once, not twice."""
    pool = TaskPool(clock=clock, default_timeout=30.0, max_leases_per_client=4)
    for i in range(6):
        pool.add(task(f"t{i}", mb=i))
    lease = pool.take("idle")  # its one task first, then nothing while "busy" is handed four
    clock.now += 2.0
    pool.complete(lease.task.task_id, "idle")
    for _ in range(4):
        lease = pool.take("busy")
        clock.now += 2.0
        pool.complete(lease.task.task_id, "busy")
    clients = pool.stats()["clients"]
    assert clients["busy"]["throughput"] > 2 * clients["idle"]["throughput"]
    assert clients["busy"]["capacity"] == pytest.approx(4.0, rel=0.02)
    assert clients["idle"]["capacity"] == pytest.approx(4.0, rel=0.02)
    pool.add(task("u0", mb=10))
    pool.add(task("u1", mb=11))
    start = clock.now
    a, b = pool.take("pair"), pool.take("pair")
    clock.now = start + 2.0
    pool.complete(a.task.task_id, "pair")
    clock.now = start + 4.0
    pool.complete(b.task.task_id, "pair")
    assert pool.stats()["clients"]["pair"]["capacity"] == pytest.approx(16 / 4.0, rel=0.02)


# ------------------------------------------------------------------------ backups


def backup_pool(clock: FakeClock) -> TaskPool:
    """A pool where 'p' is proven (it delivered on time, 2 s a task: the typical lease) and a backup
    of an unproven client's lease may be leased once that lease is older than the typical one."""
    pool = make_pool(
        clock, default_timeout=30.0, max_leases_per_client=3, start_leases=1, probation_factor=3.0, backups=True
    )
    pool.add(task("warm"))
    assert take_id(pool, "p") == "warm"
    clock.now += 2.0
    assert pool.complete("warm", "p") is Completion.ACCEPTED and pool.standing.proven("p")
    return pool


def counts_add_up(pool: TaskPool) -> None:
    st = pool.stats()
    assert st["queued"] + st["leased"] + st["done"] + st["abandoned"] == st["added"]


def test_an_idle_proven_client_backs_up_a_strangers_lease_and_the_first_result_wins(clock):
    pool = backup_pool(clock)
    pool.add(task("t"))
    clock.now += 1.5  # (a new task waits its grace for the proven clients first)
    assert take_id(pool, "stranger") == "t" and not pool.standing.proven("stranger")
    assert pool.take("p") is None  # not before the stranger has had the typical lease (2 s)
    clock.now += 2.5
    backup = pool.take("p")
    assert backup is not None and backup.task.task_id == "t" and backup.client == "p" and backup.attempt == 2
    assert pool.take("q") is None  # one backup a task
    assert [lease.task.task_id for lease in pool.leases_of("p")] == ["t"]
    assert pool.complete("t", "p") is Completion.ACCEPTED
    assert pool.leases_of("p") == [] and pool.leases_of("stranger") == []
    assert pool.complete("t", "stranger") is Completion.DUPLICATE
    assert pool.stats()["backups"] == 1
    counts_add_up(pool)


def test_a_lease_that_runs_out_passes_to_its_backups_holder_with_the_strike(clock):
    pool = backup_pool(clock)
    pool.add(task("t"))
    clock.now += 1.5
    stranger = pool.take("stranger")
    clock.now += 2.5
    assert pool.take("p") is not None
    clock.now = stranger.deadline + 0.1
    assert [t.task_id for t in pool.expire()] == ["t"]
    assert pool.standing.strikes("stranger") == 1 and pool.leases_of("stranger") == []
    assert pool.lease_of("t").client == "p" and pool.stats()["queued"] == 0  # not queued again
    assert pool.complete("t", "p") is Completion.ACCEPTED
    counts_add_up(pool)


def test_the_strangers_result_first_drops_the_backup_and_a_backup_holder_that_leaves_drops_only_it(clock):
    pool = backup_pool(clock)
    pool.add(task("a"))
    pool.add(task("b"))
    clock.now += 1.5
    assert take_id(pool, "s1") == "a" and take_id(pool, "s2") == "b"
    clock.now += 2.5
    assert take_id(pool, "p") == "a"
    assert pool.complete("a", "s1") is Completion.ACCEPTED  # the slow newcomer was first after all
    assert pool.leases_of("p") == [] and pool.standing.proven("s1")
    assert pool.complete("a", "p") is Completion.DUPLICATE
    assert take_id(pool, "p") == "b"
    assert pool.client_left("p") == [pool.lease_of("b").task]  # its backup goes; s2's lease runs on
    assert pool.lease_of("b").client == "s2" and pool.stats()["queued"] == 0
    assert pool.complete("b", "s2") is Completion.ACCEPTED
    counts_add_up(pool)


def test_no_backups_unless_asked_for_and_none_of_a_proven_clients_lease(clock):
    pool = backup_pool(clock)
    pool.add(task("warm2"))
    clock.now += 1.5
    assert take_id(pool, "r") == "warm2" and pool.complete("warm2", "r") is Completion.ACCEPTED
    pool.add(task("t"))
    assert take_id(pool, "p") == "t"
    clock.now += 10.0
    assert pool.standing.proven("r") and pool.take("r") is None  # p is proven: no backup of its lease
    plain = make_pool(clock, start_leases=1, probation_factor=3.0, max_leases_per_client=3)
    plain.add(task("warm"))
    take_id(plain, "p")
    clock.now += 2.0
    plain.complete("warm", "p")
    plain.add(task("u"))
    clock.now += 1.5
    assert take_id(plain, "stranger") == "u"
    clock.now += 5.0
    assert plain.take("p") is None


def test_a_task_kept_for_a_stranger_that_does_not_take_it_goes_to_an_idle_proven_client(clock):
    """A task cut for an unproven client waits its grace for it; one that does not take it within the
    typical lease (a hoarder at its allowance cannot) loses it to a proven client with nothing to do.
    One kept for a proven client waits its whole grace."""
    pool = make_pool(
        clock,
        default_timeout=30.0,
        max_leases_per_client=3,
        start_leases=1,
        probation_factor=3.0,
        preference_grace=5.0,
        backups=True,
    )
    pool.add(task("warm"))
    assert take_id(pool, "p") == "warm"
    clock.now += 2.0
    pool.complete("warm", "p")
    pool.add(task("held"))
    clock.now += 5.1
    assert take_id(pool, "stranger") == "held"  # its allowance: one lease
    pool.add(task("kept", preferred_client="stranger"))
    pool.add(task("mine", preferred_client="q"))
    pool.set_client_speed("q", 1.0)
    assert take_id(pool, "stranger") is None
    clock.now += 1.0
    assert take_id(pool, "p") is None  # within the typical lease (2 s): still the stranger's
    clock.now += 1.5
    assert take_id(pool, "p") == "kept"
    assert pool.stats()["backups"] == 1 and pool.lease_of("mine") is None
    counts_add_up(pool)


def test_a_lease_beaten_by_its_backup_still_runs_out_for_its_holder_unless_it_delivers_in_time(clock):
    """When a backup's result comes first, the original holder still owes its result until its own
    deadline: delivered by then (a slow newcomer) it counts on time and proves the client; never
    delivered (a hoarder) it runs out, a strike as any lease that runs out."""
    pool = backup_pool(clock)
    for tid in ("a", "b"):
        pool.add(task(tid))
    clock.now += 1.5
    slow, hoarder = pool.take("slow"), pool.take("hoarder")
    clock.now += 2.5
    for _ in range(2):
        backup = pool.take("p")
        assert pool.complete(backup.task.task_id, "p") is Completion.ACCEPTED
    assert pool.complete(slow.task.task_id, "slow") is Completion.DUPLICATE
    assert pool.standing.proven("slow") and pool.standing.strikes("slow") == 0
    clock.now = hoarder.deadline + 0.1
    assert [t.task_id for t in pool.expire()] == [hoarder.task.task_id]
    assert pool.standing.strikes("hoarder") == 1 and not pool.standing.proven("hoarder")
    assert pool.expire() == []
    counts_add_up(pool)


def test_a_done_task_whose_results_never_arrived_is_reopened_once(clock):
    """reopen: a completed task goes back to the queue (its owner found its results missing) and is
    leased and completed again; a task that is not done (queued, leased, unknown) is not reopened."""
    pool = make_pool(clock)
    a, b = task("a"), task("b", batch=1)
    pool.add(a)
    pool.add(b)
    assert take_id(pool, "x") == "a" and pool.complete("a", "x") is Completion.ACCEPTED
    assert not pool.reopen(b) and not pool.reopen(task("never"))  # queued; unknown
    assert pool.reopen(a) and not pool.reopen(a)  # (queued again now: once)
    s = pool.stats()
    assert (s["done"], s["reopened"], s["added"], s["queued"]) == (0, 1, 2, 2)
    assert take_id(pool, "y") == "a" and pool.complete("a", "y") is Completion.ACCEPTED
    assert pool.is_done("a") and pool.forget_closed(1) == ["a"]
