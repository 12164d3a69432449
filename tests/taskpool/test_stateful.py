"""Random interleavings of every pool operation against a plain model of the semantics.

The model is deliberately naive (dicts and linear scans); after every step the pool must
agree with it: who holds which lease, what ``take`` hands out, what ``expire`` and
``client_left`` re-queue, and every counter.  Compaction thresholds are lowered so the
lazy-deletion heaps are rebuilt often.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from taskpool import Completion, Task, TaskPool, TaskPoolError
from taskpool.queues import MIN_STALE

CLIENTS = ["a", "b", "c", "d"]
K = 2
GRACE = 1.0
DEFAULT_TIMEOUT = 4.0

clients = st.sampled_from(CLIENTS)
picks = st.integers(min_value=0, max_value=10_000)
steps = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 9.0])
task_specs = st.tuples(
    st.sampled_from(["forward", "backward"]),
    st.integers(0, 2),
    st.integers(0, 2),
    st.none() | clients,
    st.none() | st.sampled_from([1.0, 3.0, 8.0]),
)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pool = self.new_pool(MIN_STALE)
        self.tasks: dict[str, Task] = {}
        self.order: dict[str, int] = {}
        self.state: dict[str, str] = {}  # queued | leased | done | abandoned
        self.holder: dict[str, str] = {}
        self.deadline: dict[str, float] = {}
        self.added_at: dict[str, float] = {}
        self.opened: set[str] = set()  # preferred tasks opened early by their client leaving
        self.attempts: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.duplicates = 0
        self.requeued = 0

    def new_pool(self, min_stale: int) -> TaskPool:
        return TaskPool(
            clock=lambda: self.now,
            default_timeout=DEFAULT_TIMEOUT,
            max_leases_per_client=K,
            preference_grace=GRACE,
            throughput_halflife=3.0,
            compact_min_stale=min_stale,
        )

    # ---------------------------------------------------------------- model helpers

    def ids_in(self, *states: str) -> list[str]:
        return [tid for tid, s in self.state.items() if s in states]

    def pick(self, i: int, *states: str) -> str:
        ids = self.ids_in(*states) if states else list(self.state)
        return ids[i % len(ids)]

    def held_by(self, client: str) -> set[str]:
        return {tid for tid, c in self.holder.items() if c == client}

    def requeue(self, tid: str) -> None:
        self.state[tid] = "queued"
        del self.holder[tid]
        del self.deadline[tid]
        self.opened.discard(tid)
        self.requeued += 1

    def close(self, tid: str, state: str) -> None:
        if self.state[tid] == "leased":
            del self.holder[tid]
            del self.deadline[tid]
        self.state[tid] = state
        self.opened.discard(tid)

    def available_to(self, client: str) -> list[str]:
        out = []
        for tid in self.ids_in("queued"):
            pref = self.tasks[tid].preferred_client
            if pref is None or pref == client or tid in self.opened or self.now >= self.added_at[tid] + GRACE:
                out.append(tid)
        return out

    def priority(self, tid: str) -> tuple:
        t = self.tasks[tid]
        return (t.batch, t.micro_batch, t.kind != "backward", self.order[tid])

    def assert_misuse(self, call, *args) -> None:
        before = self.pool.stats()
        leases = {c: self.pool.leases_of(c) for c in CLIENTS}
        try:
            call(*args)
        except TaskPoolError:
            pass
        else:
            raise AssertionError(f"{call.__name__}{args} should have raised TaskPoolError")
        assert self.pool.stats() == before
        assert {c: self.pool.leases_of(c) for c in CLIENTS} == leases

    # ---------------------------------------------------------------- rules

    @initialize(min_stale=st.sampled_from([2, 64]))
    def compaction_threshold(self, min_stale):
        """Rebuild the lazy heaps often (2), or let stale items pile up (64)."""
        self.pool = self.new_pool(min_stale)  # (nothing added yet)

    @rule(specs=st.lists(task_specs, min_size=1, max_size=4))
    def add(self, specs):
        for kind, batch, micro_batch, pref, timeout in specs:
            tid = f"t{len(self.tasks)}"
            task = Task(tid, kind, batch, micro_batch, 0, (0, 4), preferred_client=pref, timeout=timeout)
            self.pool.add(task)
            self.tasks[tid] = task
            self.order[tid] = len(self.order)
            self.state[tid] = "queued"
            self.added_at[tid] = self.now

    @precondition(lambda self: self.tasks)
    @rule(i=picks)
    def add_existing_id(self, i):
        tid = self.pick(i)
        self.assert_misuse(self.pool.add, Task(tid, "forward", 0, 0, 0, (0, 1)))

    @rule(takers=st.lists(clients, min_size=1, max_size=4))
    def take(self, takers):
        for client in takers:
            self.take_one(client)

    def take_one(self, client):
        lease = self.pool.take(client)
        available = self.available_to(client)
        if len(self.held_by(client)) >= K or not available:
            assert lease is None
            return
        best = min(available, key=self.priority)
        assert lease is not None and lease.task.task_id == best, (lease, best)
        assert lease.client == client
        self.attempts[best] += 1
        assert lease.attempt == self.attempts[best]
        timeout = self.tasks[best].timeout or DEFAULT_TIMEOUT
        assert self.now + 0.5 * timeout - 1e-9 <= lease.deadline <= self.now + 4 * timeout + 1e-9
        self.state[best] = "leased"
        self.holder[best] = client
        self.deadline[best] = lease.deadline

    @precondition(lambda self: self.holder)
    @rule(i=picks)
    def complete_by_holder(self, i):
        tid = self.pick(i, "leased")
        assert self.pool.complete(tid, self.holder[tid]) is Completion.ACCEPTED
        self.accepted[tid] += 1
        self.close(tid, "done")

    @precondition(lambda self: self.tasks)
    @rule(i=picks, client=clients)
    def complete_by_anyone(self, i, client):
        """Late, duplicate, or stolen results: the first one wins whoever sends it."""
        tid = self.pick(i)
        result = self.pool.complete(tid, client)
        if self.state[tid] in ("done", "abandoned"):
            assert result is Completion.DUPLICATE
            self.duplicates += 1
        else:
            assert result is Completion.ACCEPTED
            self.accepted[tid] += 1
            self.close(tid, "done")

    @rule(client=clients)
    def complete_unknown(self, client):
        self.assert_misuse(self.pool.complete, "never-added", client)

    @rule(dt=steps)
    def advance(self, dt):
        self.now += dt

    @rule(dt=steps, explicit=st.booleans())
    def advance_and_expire(self, dt, explicit):
        self.now += dt
        expired = self.pool.expire(self.now) if explicit else self.pool.expire()
        expected = [tid for tid, d in self.deadline.items() if d <= self.now]
        assert sorted(t.task_id for t in expired) == sorted(expected)
        assert len(expired) == len(expected)
        for tid in expected:
            self.requeue(tid)

    @rule(client=clients)
    def client_left(self, client):
        gone = self.pool.client_left(client)
        expected = self.held_by(client)
        assert sorted(t.task_id for t in gone) == sorted(expected)
        for tid in expected:
            self.requeue(tid)
        for tid in self.ids_in("queued"):
            if self.tasks[tid].preferred_client == client:
                self.opened.add(tid)

    @precondition(lambda self: self.holder)
    @rule(i=picks)
    def fail_by_holder(self, i):
        tid = self.pick(i, "leased")
        self.pool.fail(tid, self.holder[tid])
        self.requeue(tid)

    @precondition(lambda self: self.tasks)
    @rule(i=picks, client=clients)
    def fail_by_anyone(self, i, client):
        tid = self.pick(i)
        if self.holder.get(tid) == client:
            self.pool.fail(tid, client)
            self.requeue(tid)
        else:
            self.assert_misuse(self.pool.fail, tid, client)

    @precondition(lambda self: self.tasks)
    @rule(i=picks)
    def abandon(self, i):
        tid = self.pick(i)
        if self.state[tid] in ("queued", "leased"):
            self.pool.abandon(tid)
            self.close(tid, "abandoned")
        else:
            self.assert_misuse(self.pool.abandon, tid)

    @rule(client=clients, speed=st.sampled_from([0.1, 1.0, 3.0, 50.0]))
    def set_speed(self, client, speed):
        self.pool.set_client_speed(client, speed)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def counters_add_up(self):
        s = self.pool.stats()
        count = Counter(self.state.values())
        assert s["queued"] == count["queued"]
        assert s["leased"] == count["leased"]
        assert s["done"] == count["done"]
        assert s["abandoned"] == count["abandoned"]
        assert s["added"] == len(self.tasks)
        assert s["queued"] + s["leased"] + s["done"] + s["abandoned"] == s["added"]
        assert s["duplicates"] == self.duplicates
        assert s["requeued"] == self.requeued
        assert len(self.pool) == count["queued"] + count["leased"]
        queued_at = [self.added_at[tid] for tid in self.ids_in("queued")]
        assert s["oldest_queued_age"] == (self.now - min(queued_at) if queued_at else 0.0)

    @invariant()
    def one_holder_per_task(self):
        seen: dict[str, str] = {}
        for client in CLIENTS:
            leases = self.pool.leases_of(client)
            assert len(leases) <= K
            for lease in leases:
                tid = lease.task.task_id
                assert tid not in seen, f"{tid} leased to {seen[tid]} and {client}"
                seen[tid] = client
                assert self.pool.lease_of(tid) is lease
                assert lease.deadline == self.deadline[tid]
        assert seen == self.holder
        for tid, state in self.state.items():
            if state != "leased":
                assert self.pool.lease_of(tid) is None
            assert self.pool.is_done(tid) == (state == "done")
        assert self.pool.next_deadline() == min(self.deadline.values(), default=None)

    @invariant()
    def done_at_most_once(self):
        assert all(n <= 1 for n in self.accepted.values())

    def teardown(self):
        """Complete everything still open: every task not abandoned ends done exactly once."""
        for tid in self.ids_in("queued", "leased"):
            assert self.pool.complete(tid, "finisher") is Completion.ACCEPTED
            self.accepted[tid] += 1
            self.close(tid, "done")
        for tid, state in self.state.items():
            if state == "abandoned":
                assert tid not in self.accepted and not self.pool.is_done(tid)
            else:
                assert self.accepted[tid] == 1 and self.pool.is_done(tid)
            assert self.pool.complete(tid, "late") is Completion.DUPLICATE
        s = self.pool.stats()
        assert s["queued"] == s["leased"] == 0 and len(self.pool) == 0
        assert s["done"] + s["abandoned"] == s["added"] == len(self.tasks)
        assert s["duplicates"] == self.duplicates + len(self.tasks)
        assert self.pool.next_deadline() is None


PoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=80, deadline=None, derandomize=True, database=None
)
TestPoolMachine = PoolMachine.TestCase
