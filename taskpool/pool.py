"""The task pool of one frontal or backward server: leases, deadlines, re-queue,
exactly-once completion.

Every task added to the pool is, at any moment, in exactly one of four states::

    queued  --take-->  leased  --complete-->  done
      ^  |               |  |
      |  +--complete-----+--+---------------> done      (a late result still counts)
      +---expire / fail / client_left--+
    queued, leased --abandon--> abandoned

so ``queued + leased + done + abandoned == added`` always.  ``done`` and ``abandoned``
are final: their ids are kept (taskpool/closed.py) so that the id cannot be added again and a
later result for it is answered DUPLICATE and counted, until the owner calls
``forget_closed(batch)`` for the batches it will never see a result of again.  A leased task has
exactly one holder, and the holder's :class:`~taskpool.speed.ClientRecord` lists it.  A queued task
is either *open* (any client may take it) or *preferred* (only its preferred client may,
until the grace period ends or that client leaves).

The parts: each task's mutable record (taskpool/entry.py), the heaps that order the queued tasks
and the leases' deadlines, O(log n) per operation (taskpool/queues.py), what a client has earned
(taskpool/standing.py) and how fast it is (taskpool/speed.py), backup leases and ghosts
(taskpool/backups.py), the closed ids (taskpool/closed.py).

The pool never blocks, sleeps, or starts threads, and uses no locks: call it from one
asyncio loop (or one thread).
"""

from __future__ import annotations

from collections.abc import Callable

from .backups import Backups
from .closed import ClosedIds
from .entry import CLOSED, LEASED, OPEN, PREF, SEQ_BITS, Entry
from .leases import Leases
from .queues import MIN_STALE, Queues
from .speed import SpeedBook
from .standing import Standing
from .types import Completion, Lease, Task, TaskPoolError, check_positive

_ACCEPTED = Completion.ACCEPTED
_DUPLICATE = Completion.DUPLICATE


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TaskPoolError(f"{name} must be an int >= 1, got {value!r}")
    return value


class TaskPool:
    """Micro-batch tasks that volunteers pull, with leases and exactly-once completion.

    ``clock`` is the only source of time (inject a fake one in tests).  Tasks are
    leased best first: lower batch, then lower micro-batch, then backward before
    forward, then insertion order.  A task with a ``preferred_client`` can be taken only
    by that client for ``preference_grace`` seconds after it was added (or until that
    client leaves), then by anyone; the preferred client still gets the best task it may
    take, so priority order holds for it too.  A client holds at most
    ``max_leases_per_client`` leases, and fewer while it has not earned them (``start_leases``,
    :mod:`taskpool.standing`); a task whose lease ran out goes to another client first (for
    ``preference_grace``), and an unproven client's leases are cut short (``probation_factor``).
    With ``backups``, a proven client that finds nothing to take stands in for an unproven one
    that is slow to take or deliver (:mod:`taskpool.backups`).
    A lease's deadline is ``now + timeout * factor``,
    where the factor (in [0.5, 4], 1.0 when unknown) compares the client's speed with
    the median client's; see :mod:`taskpool.speed`.  ``compact_min_stale``: stale heap items
    allowed beyond the live ones before a compaction (:mod:`taskpool.queues`).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        default_timeout: float = 30.0,
        max_leases_per_client: int = 1,
        preference_grace: float = 1.0,
        throughput_halflife: float = 30.0,
        start_leases: int | None = None,
        probation_factor: float | None = None,
        probation_floor: float = 1.0,
        backups: bool = False,
        compact_min_stale: int = MIN_STALE,
    ) -> None:
        if not callable(clock):
            raise TaskPoolError(f"clock must be callable, got {clock!r}")
        self._default_timeout = check_positive("default_timeout", default_timeout)
        _check_count("max_leases_per_client", max_leases_per_client)
        if preference_grace != 0:
            check_positive("preference_grace", preference_grace)
        self._clock = clock
        if start_leases is not None:
            _check_count("start_leases", start_leases)
        if probation_factor is not None:
            check_positive("probation_factor", probation_factor)
        # what each client has earned here (taskpool/standing.py): strikes, allowance, proven, probation cap
        self.standing = Standing(
            start=start_leases,
            most=max_leases_per_client,
            probation_factor=probation_factor,
            probation_floor=check_positive("probation_floor", probation_floor),
        )
        self._grace = float(preference_grace)
        self._speed = SpeedBook(check_positive("throughput_halflife", throughput_halflife))
        self._clients = self._speed.clients
        self._q = Queues(_check_count("compact_min_stale", compact_min_stale))
        self._by_key = self._q.by_key
        self._backups = Backups(self._q, self.standing, self._grace, self._clients, enabled=bool(backups))
        self._tasks: dict[str, Entry] = {}  # the queued and leased tasks
        self._leases = Leases(self._tasks, self._q, self._speed, self.standing, self._backups, self._grace)
        self._closed = ClosedIds()
        self._seq = 0

        self._ndone = 0
        self._nabandoned = 0
        self._added = 0
        self._reopened = 0  # done tasks queued again: their results never arrived (reopen)
        self._duplicates = 0

    # ------------------------------------------------------------------ adding and taking

    def add(self, task: Task) -> None:
        """Queue a new task.  Its id must never have been added before."""
        if not isinstance(task, Task):
            raise TaskPoolError(f"add() needs a Task, got {type(task).__name__}")
        tid = task.task_id
        closed = self._closed
        if tid in self._tasks or tid in closed.done or tid in closed.abandoned:
            raise TaskPoolError(f"add: task id {tid!r} was already added")
        seq = self._seq + 1
        if seq >> SEQ_BITS:
            raise TaskPoolError(f"add: this pool has taken 2**{SEQ_BITS} tasks, make a new one")
        now = self._clock()
        self._seq = seq
        entry = Entry(task, seq, self._default_timeout if task.timeout is None else task.timeout, now, self._grace)
        self._tasks[tid] = entry
        self._by_key[entry.key] = entry
        self._added += 1
        self._q.enqueue(entry, now, len(self._tasks) - self._leases.count)

    def take(self, client: str) -> Lease | None:
        """Lease the best task this client may have, or None (nothing for it, or it
        already holds ``max_leases_per_client`` leases)."""
        now = self._clock()
        rec = self._clients.get(client)  # (_room_for, inlined: take is half of the hot path)
        if rec is None:
            rec = self._speed.get(client, now)
        elif len(rec.leases) >= self.standing.allowance(client):
            return None
        entry = self._q.pop_best(client, now, self._grace, self.standing)
        if entry is not None:
            return self._leases.grant(entry, client, rec, now)
        backups = self._backups
        if backups.enabled and self.standing.proven(client) and (backups.unproven or self._q.pending):
            return self._backup_for(client, rec, now)
        return None

    def _backup_for(self, client: str, rec, now: float) -> Lease | None:
        """For proven `client` that found nothing: a task kept for a slow unproven client, else a
        backup lease of one an unproven client has held too long, else None (taskpool/backups.py)."""
        backups = self._backups
        kept = backups.kept_for(client, now)
        if kept is not None:
            backups.count += 1
            return self._leases.grant(kept, client, rec, now)
        entry = backups.to_back_up(now)
        if entry is None:
            return None
        return backups.back_up(entry, client, rec, self._leases.deadline(entry, client, rec, now), now)

    def adopt(self, client: str, task_id: str) -> Lease | None:
        """Lease a queued task to the client that says it already holds it: a server that restarted
        lost its leases (they are not in its request log) and queued their tasks again while their
        holders still work on them; another client would take them and the work be done twice.
        None when the task is not queued (leased, done, unknown) or the client holds its maximum."""
        entry = self._tasks.get(task_id)
        if entry is None or entry.state not in (OPEN, PREF) or entry.shun == client:
            return None  # (not a task whose lease ran out on this very client)
        now = self._clock()
        rec = self._room_for(client, now)
        if rec is None:
            return None
        return self._leases.grant(entry, client, rec, now)  # (its stale heap items are skipped by take)

    def _room_for(self, client: str, now: float):
        """The client's record, or None when it holds as many leases as it may already."""
        rec = self._clients.get(client)
        if rec is None:
            return self._speed.get(client, now)
        return None if len(rec.leases) >= self.standing.allowance(client) else rec

    # ------------------------------------------------------------------ results

    def complete(self, task_id: str, client: str) -> Completion:
        """Report a result.  The first completion of a task wins, whoever sends it and
        whatever the task's state (queued again after an expiry, or leased to someone
        else, whose lease is then void): ACCEPTED.  Any later one, or one for an
        abandoned task, is DUPLICATE and counted.  An id never added is misuse.  (A server
        takes a completion only from a client that held the task: ``ever_held``.)"""
        entry = self._tasks.pop(task_id, None)
        if entry is None:
            if task_id in self._closed:
                self._duplicates += 1
                self._backups.delivered(task_id, client, self._clock())
                return _DUPLICATE
            raise TaskPoolError(f"complete: unknown task id {task_id!r}")
        now = self._clock()
        lease, since = self._leases.close(entry, client, now)
        entry.state = CLOSED
        del self._by_key[entry.key]
        closed = self._closed
        closed.done.add(task_id)
        closed.by_batch.setdefault(entry.task.batch, []).append(task_id)
        self._ndone += 1
        rec = self._clients.get(client)
        if rec is not None and rec.done:
            rec.record_completion(now, self._speed.decay)
        else:  # first completion: the set of measured clients changes
            self._speed.completed(client, now)
            rec = self._clients.get(client)
        if lease is not None and lease.client == client and rec is not None:
            lo, hi = entry.task.rows
            rec.record_busy(since, now, hi - lo, self._speed.decay)
        return _ACCEPTED

    def fail(self, task_id: str, client: str) -> None:
        """The holder gives its lease back (error, out of memory, ...): re-queue now."""
        entry = self._tasks.get(task_id)
        if entry is None:
            raise TaskPoolError(f"fail: task {task_id!r} is {self._closed.state(task_id)}")
        lease = entry.lease
        if lease is None:
            raise TaskPoolError(f"fail: task {task_id!r} is queued, {client!r} holds no lease of it")
        if lease.client != client and not entry.holds_backup(client):
            raise TaskPoolError(f"fail: task {task_id!r} is leased to {lease.client!r}, not to {client!r}")
        self._leases.release(entry, client, self._clock())

    def reclaim(self, client: str, holding, min_age: float) -> list[Task]:
        """Re-queue now the leases of ``client`` that it says it does not hold (``holding``: the
        task ids it works on or keeps), among those leased at least ``min_age`` ago (a younger one
        may still be on its way to it). A lease whose answer was lost, or whose hand-back was, would
        otherwise wait out its whole timeout. Returns the re-queued tasks."""
        rec = self._clients.get(client)
        if rec is None:
            return []
        now = self._clock()
        keep = set(holding)
        lost = [e for tid, e in rec.leases.items() if tid not in keep and now - e.since(client) >= min_age]
        for entry in lost:
            self._leases.release(entry, client, now)
        return [e.task for e in lost]

    def abandon(self, task_id: str) -> None:
        """Drop a queued or leased task without completing it (no-requeue mode).  A later
        result for it is answered DUPLICATE."""
        entry = self._tasks.pop(task_id, None)
        if entry is None:
            raise TaskPoolError(f"abandon: task {task_id!r} is {self._closed.state(task_id)}")
        self._leases.end(entry)
        entry.state = CLOSED
        del self._by_key[entry.key]
        self._closed.add_abandoned(task_id, entry.task.batch)
        self._nabandoned += 1

    def abandon_before(self, before_batch: int) -> list[str]:
        """Abandon every open (queued or leased) task of batches < ``before_batch``: for an owner
        whose batches end, their work done by then (a re-queued copy of a finished task, one whose
        result was credited under another id), so that no worker is handed one again. Returns the
        ids abandoned. O(open tasks)."""
        ids = [tid for tid, entry in self._tasks.items() if entry.task.batch < before_batch]
        for tid in ids:
            self.abandon(tid)
        return ids

    def reopen(self, task: Task) -> bool:
        """Queue again a task that was completed: its owner found that the results it owes never
        arrived (completed without them, or they were lost). False when the task is not done here
        (queued, leased, abandoned, forgotten or unknown): there is nothing to reopen."""
        if not self._closed.undo_done(task.task_id, task.batch):
            return False
        self._ndone -= 1
        self._reopened += 1
        self.add(task)
        self._added -= 1  # (counted once, when it was first added)
        return True

    def forget_closed(self, before_batch: int) -> list[str]:
        """Forget the ids of the done and abandoned tasks of batches < ``before_batch``: the
        counters stay, but a later result for one of them is then an unknown id (misuse) and the
        id may be added again. For an owner whose batches end (applied, out of every window), so
        that a run of days keeps ids of its recent batches only. Returns the ids forgotten."""
        return self._closed.forget(before_batch)

    # ------------------------------------------------------------------ time and churn

    def expire(self, now: float | None = None) -> list[Task]:
        """Re-queue every lease whose deadline is <= ``now`` (default: the clock; a lease with
        a backup passes to the backup's holder instead); return the tasks whose lease ran
        out, earliest deadline first, then those of leases that ran out unanswered after
        another client completed their task (each a strike for its holder, as any lease
        that runs out)."""
        return self._leases.expire(self._clock() if now is None else now)

    def client_left(self, client: str) -> list[Task]:
        """The client is gone: re-queue all its leases now, open the tasks that were
        waiting for it to everyone, and forget its statistics.  Returns the re-queued
        tasks."""
        rec = self._clients.get(client)
        held = list(rec.leases.values()) if rec is not None else []
        now = self._clock()
        for entry in held:
            self._leases.release(entry, client, now)
        self._speed.forget(client)
        self.standing.forget(client)
        self._q.open_preferred(client)
        return [entry.task for entry in held]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a current lease (when ``expire`` has work), or None."""
        return self._q.next_deadline()

    def set_client_speed(self, client: str, relative_speed: float) -> None:
        """Seed a client's speed (its registered compute power, in any unit shared by
        all clients).  Sets its deadline factor until it has a measured throughput."""
        speed = check_positive(f"relative_speed of {client!r}", relative_speed)
        self._speed.seed(client, speed, self._clock())

    # ------------------------------------------------------------------ queries

    def is_done(self, task_id: str) -> bool:
        return task_id in self._closed.done

    def ever_held(self, task_id: str, client: str) -> bool | None:
        """Whether `client` holds or held a lease of the open task `task_id` (a lease that ran
        out or was re-queued counts: its holder may still have done the work); None when the task
        is not open (done, abandoned or unknown: `complete` says which)."""
        entry = self._tasks.get(task_id)
        if entry is None:
            return None
        return entry.holders is not None and client in entry.holders

    def lease_of(self, task_id: str) -> Lease | None:
        entry = self._tasks.get(task_id)
        return entry.lease if entry is not None else None

    def leases_of(self, client: str) -> list[Lease]:
        rec = self._clients.get(client)
        if rec is None:
            return []
        return [e.backup if e.holds_backup(client) else e.lease for e in rec.leases.values()]

    def open_tasks(self, batch: int) -> list[tuple[str, str | None, float]]:
        """The tasks of ``batch`` not done yet: (task id, holder or None when queued, seconds
        since it was leased, or since it was added when queued), longest first.  O(tasks in the pool): for a report of
        what a step waits for, not for a hot path."""
        now = self._clock()
        out = []
        for entry in self._tasks.values():
            if entry.task.batch != batch:
                continue
            held = entry.state == LEASED
            since = entry.leased_at if held else entry.added_at
            out.append((entry.task.task_id, entry.lease.client if held else None, max(0.0, now - since)))
        return sorted(out, key=lambda x: -x[2])

    def __len__(self) -> int:
        return len(self._tasks)

    def queued(self) -> int:
        """Tasks waiting for a lease (open, or preferred for some client)."""
        return len(self._tasks) - self._leases.count

    def stats(self) -> dict:
        """Counters and per-client figures, as a plain JSON-able dict.

        ``added`` is there too, so that ``queued + leased + done + abandoned == added``
        can be checked from the dict alone.  ``oldest_queued_age`` (seconds since the
        oldest queued task was added) is 0.0 when nothing is queued; ``throughput`` is
        0.0 for a client without a measurement; so is ``capacity`` (rows a second while the client
        holds a lease: `ClientRecord.capacity`)."""
        now = self._clock()
        oldest = self._q.oldest_added()
        return {
            "queued": self.queued(),
            "leased": self._leases.count,
            "done": self._ndone,
            "requeued": self._leases.requeued,
            "reopened": self._reopened,
            "duplicates": self._duplicates,
            "backups": self._backups.count,
            "abandoned": self._nabandoned,
            "added": self._added,
            "oldest_queued_age": max(0.0, now - oldest) if oldest is not None else 0.0,
            "clients": self._speed.figures(now, self.standing.allowance),
        }

    def heap_items(self) -> dict[str, int]:
        """Items in the pool's heaps, live and stale (taskpool/queues.py): what compaction bounds."""
        return self._q.items()
