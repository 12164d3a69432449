"""The task pool of one frontal or backward server: leases, deadlines, re-queue,
exactly-once completion.

Every task added to the pool is, at any moment, in exactly one of four states::

    queued  --take-->  leased  --complete-->  done
      ^  |               |  |
      |  +--complete-----+--+---------------> done      (a late result still counts)
      +---expire / fail / client_left--+
    queued, leased --abandon--> abandoned

so ``queued + leased + done + abandoned == added`` always.  ``done`` and ``abandoned``
are final: their ids are kept (two sets) so that the id cannot be added again and a
later result for it is answered DUPLICATE and counted, until the owner calls
``forget_closed(batch)`` for the batches it will never see a result of again (a run lasts
days: kept for ever, the ids would grow by every task).  A leased task has exactly one
holder, and the holder's :class:`~taskpool.speed.ClientRecord` lists it.  A queued task
is either *open* (any client may take it) or *preferred* (only its preferred client may,
until the grace period ends or that client leaves).

Data structures (O(log n) per operation; heaps with lazy deletion):

* ``_tasks``: task id -> :class:`_Entry`, and ``_by_key``: priority key -> the same
  entry, for queued and leased tasks;
* ``_open``: keys of the open tasks; ``_pref[c]``: keys of the tasks that prefer
  client ``c``; ``_pending``: ``(end of grace, key)`` of the preferred tasks;
* ``_deadlines``: ``(deadline, key)`` of the leases; ``_oldest``: ``(added at, key)``
  of the queued tasks (for the age statistic).

The key of a task is one int that orders tasks best first (lower batch, lower
micro-batch, backward before forward, insertion order) and is unique, so the heaps hold
plain ints (fast to compare).  An item is live iff its entry is still in ``_by_key`` in
the state the heap is for (and, for a deadline, the lease has that deadline); other
items are stale and are dropped when they reach the top, or all at once by a compaction
when they outnumber the live ones (amortized O(1)).  A task may have two identical live
items in one heap (it left and came back before the first one reached the top): the
first one popped changes its state and makes the other stale.

The pool never blocks, sleeps, or starts threads, and uses no locks: call it from one
asyncio loop (or one thread).
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heapify, heappop, heappush

from .speed import SpeedBook
from .standing import Standing
from .types import Completion, Lease, Task, TaskPoolError, check_positive, priority

_ACCEPTED = Completion.ACCEPTED
_DUPLICATE = Completion.DUPLICATE

# Entry states.  Done and abandoned tasks have no entry.
_OPEN, _PREF, _LEASED, _CLOSED = 0, 1, 2, 3

# key = batch | micro_batch | backward-first bit | insertion number, high to low bits
_SEQ_BITS = 48
_MB_BITS = 32

# A group of heaps is compacted when it holds more than SLACK x live + MIN_STALE items.
_SLACK = 4
_MIN_STALE = 4096

# Lease is a frozen dataclass; building one through its generated __init__ costs four
# object.__setattr__ calls.  take() fills the slots directly (same object, half the time).
_new_lease = object.__new__
_set_task = Lease.task.__set__
_set_client = Lease.client.__set__
_set_deadline = Lease.deadline.__set__
_set_attempt = Lease.attempt.__set__


class _Entry:
    """The pool's mutable record of one queued or leased task.

    ``lease`` is the current Lease iff ``state == _LEASED``; ``attempts`` counts the
    leases so far; ``holders`` is every client that held one (None before the first);
    ``open_at`` is when a preferred task becomes open to everyone.
    """

    __slots__ = (
        "task",
        "key",
        "state",
        "lease",
        "attempts",
        "holders",
        "timeout",
        "added_at",
        "open_at",
        "leased_at",
        "shun",
        "shun_until",
        "backup",
        "backup_since",
        "backup_at",
    )

    def __init__(self, task: Task, key: int, timeout: float, now: float, grace: float) -> None:
        self.task = task
        self.key = key
        self.state = _CLOSED  # set by _enqueue
        self.lease: Lease | None = None
        self.attempts = 0
        self.holders: set[str] | None = None
        self.timeout = timeout
        self.added_at = now
        self.open_at = now + grace if task.preferred_client is not None else now
        self.leased_at = now
        self.shun: str | None = None  # the client whose lease of it ran out: others take it first
        self.shun_until = 0.0
        self.backup: Lease | None = None  # a second lease, of a proven client, beside an unproven one's
        self.backup_since = 0.0  # when the backup was leased
        self.backup_at: float | None = None  # from when a backup may be leased (the lease is an unproven client's)


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
    With ``backups``, a proven client that finds nothing to take gets a task kept for an unproven
    client that has not taken it within the typical lease, or else a *backup* lease of a task that
    an unproven client has held longer than that (one per task): the first result wins, as always,
    so a stranger that takes tasks and never answers holds up no batch while a proven client is
    idle (the original lease runs on and expires as before, with its strike).
    A lease's deadline is ``now + timeout * factor``,
    where the factor (in [0.5, 4], 1.0 when unknown) compares the client's speed with
    the median client's; see :mod:`taskpool.speed`.
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
    ) -> None:
        if not callable(clock):
            raise TaskPoolError(f"clock must be callable, got {clock!r}")
        self._default_timeout = check_positive("default_timeout", default_timeout)
        if (
            isinstance(max_leases_per_client, bool)
            or not isinstance(max_leases_per_client, int)
            or max_leases_per_client < 1
        ):
            raise TaskPoolError(f"max_leases_per_client must be an int >= 1, got {max_leases_per_client!r}")
        if preference_grace != 0:
            check_positive("preference_grace", preference_grace)
        self._clock = clock
        self._k = max_leases_per_client
        if start_leases is not None and (
            isinstance(start_leases, bool) or not isinstance(start_leases, int) or start_leases < 1
        ):
            raise TaskPoolError(f"start_leases must be an int >= 1, got {start_leases!r}")
        if probation_factor is not None:
            check_positive("probation_factor", probation_factor)
        self._standing = Standing(
            start=start_leases,
            most=max_leases_per_client,
            probation_factor=probation_factor,
            probation_floor=check_positive("probation_floor", probation_floor),
        )
        self._grace = float(preference_grace)
        self._backups = bool(backups)
        self._unproven: list[tuple[float, int]] = []  # (backup_at, key) of leases held by unproven clients
        # leases whose task another holder completed first, each still its holder's to deliver by its
        # deadline: (task id, client) -> (deadline, leased at, task); ran out there, a strike like any
        self._ghosts: dict[tuple[str, str], tuple[float, float, Task]] = {}
        self._ghost_deadlines: list[tuple[float, str, str]] = []
        self._nbackups = 0
        self._speed = SpeedBook(check_positive("throughput_halflife", throughput_halflife))
        self._clients = self._speed.clients

        self._tasks: dict[str, _Entry] = {}
        self._by_key: dict[int, _Entry] = {}
        self._done: set[str] = set()
        self._abandoned: set[str] = set()
        self._closed_by_batch: dict[int, list[str]] = {}  # batch -> ids done or abandoned, to forget
        self._seq = 0

        self._open: list[int] = []
        self._pref: dict[str, list[int]] = {}
        self._pending: list[tuple[float, int]] = []
        self._oldest: list[tuple[float, int]] = []
        self._pref_items = 0  # items in all the _pref heaps together
        self._deadlines: list[tuple[float, int]] = []
        self._min_stale = _MIN_STALE  # tests lower it to exercise compaction

        self._leased = 0  # queued = len(self._tasks) - self._leased
        self._ndone = 0
        self._nabandoned = 0
        self._added = 0
        self._requeued = 0
        self._reopened = 0  # done tasks queued again: their results never arrived (reopen)
        self._duplicates = 0

    # ------------------------------------------------------------------ adding and taking

    def add(self, task: Task) -> None:
        """Queue a new task.  Its id must never have been added before."""
        if not isinstance(task, Task):
            raise TaskPoolError(f"add() needs a Task, got {type(task).__name__}")
        tid = task.task_id
        if tid in self._tasks or tid in self._done or tid in self._abandoned:
            raise TaskPoolError(f"add: task id {tid!r} was already added")
        seq = self._seq + 1
        if seq >> _SEQ_BITS:
            raise TaskPoolError(f"add: this pool has taken 2**{_SEQ_BITS} tasks, make a new one")
        now = self._clock()
        self._seq = seq
        batch, micro, forward = priority(task.batch, task.micro_batch, task.kind)
        key = (((batch << _MB_BITS | micro) << 1 | forward) << _SEQ_BITS) | seq
        entry = _Entry(task, key, self._default_timeout if task.timeout is None else task.timeout, now, self._grace)
        self._tasks[tid] = entry
        self._by_key[key] = entry
        self._added += 1
        self._enqueue(entry, now)

    def take(self, client: str) -> Lease | None:
        """Lease the best task this client may have, or None (nothing for it, or it
        already holds ``max_leases_per_client`` leases)."""
        now = self._clock()
        rec = self._room_for(client, now)
        if rec is None:
            return None
        pending = self._pending
        if pending and pending[0][0] <= now:
            self._promote(now)

        by_key = self._by_key
        heap = self._open
        while heap:
            entry = by_key.get(heap[0])
            if entry is not None and entry.state == _OPEN:
                break
            heappop(heap)
        else:
            entry = None
        if entry is not None and (
            (entry.shun == client and now < entry.shun_until)
            or (now < entry.open_at + self._grace and self._standing.waits(client))
        ):
            # a task whose lease this client let run out goes to others first; a newly open task goes to
            # the clients that have delivered first (taskpool/standing.py); its own preferred tasks it may take
            entry = None
        if self._pref:
            pref = self._pref.get(client)
            while pref:
                pentry = by_key.get(pref[0])
                if pentry is not None and pentry.state == _PREF:
                    if entry is None or pentry.key < entry.key:
                        entry, heap = pentry, pref
                        self._pref_items -= 1
                    break
                heappop(pref)
                self._pref_items -= 1
        if entry is None:
            if self._backups and self._standing.proven(client) and (self._unproven or self._pending):
                return self._backup_for(client, rec, now)
            return None
        heappop(heap)
        return self._lease(entry, client, rec, now)

    def _patience(self) -> float:
        """How long an unproven client has for a task before a proven one may stand in: the typical
        lease (on-time completions here), or the probation floor while none is known."""
        typical = self._standing.typical
        return self._standing.probation_floor if typical is None else typical

    def _backup_for(self, client: str, rec, now: float) -> Lease | None:
        """For proven `client` that found nothing: the best task kept for an unproven client that
        has not taken it within the typical lease (a hoarder at its allowance never does), else a
        backup lease of the task an unproven client has held longest past the typical lease, else
        None."""
        by_key, standing, patience = self._by_key, self._standing, self._patience()
        kept = None
        for open_at, key in self._pending:  # (tasks in their grace: two batches' worth at most)
            entry = by_key.get(key)
            if entry is None or entry.state != _PREF or entry.open_at != open_at:
                continue
            waiting_for = entry.task.preferred_client
            if waiting_for == client or standing.proven(waiting_for) or now < open_at - self._grace + patience:
                continue
            if kept is None or entry.key < kept.key:
                kept = entry
        if kept is not None:
            self._nbackups += 1
            return self._lease(kept, client, rec, now)
        heap = self._unproven
        while heap:
            ready, key = heap[0]
            entry = by_key.get(key)
            if (
                entry is None
                or entry.state != _LEASED
                or entry.backup is not None
                or entry.backup_at != ready
                or standing.proven(entry.lease.client)
            ):
                heappop(heap)  # stale: closed, re-queued, backed up already, or its holder proven since
                continue
            if ready > now:
                return None
            heappop(heap)
            entry.attempts += 1
            entry.holders.add(client)
            lease = entry.backup = self._new_lease(
                entry, client, self._deadline(entry, client, rec, now), entry.attempts
            )
            entry.backup_since = now
            rec.leases[entry.task.task_id] = entry
            self._nbackups += 1
            return lease
        return None

    def adopt(self, client: str, task_id: str) -> Lease | None:
        """Lease a queued task to the client that says it already holds it: a server that restarted
        lost its leases (they are not in its request log) and queued their tasks again while their
        holders still work on them; another client would take them and the work be done twice.
        None when the task is not queued (leased, done, unknown) or the client holds its maximum."""
        entry = self._tasks.get(task_id)
        if entry is None or entry.state not in (_OPEN, _PREF) or entry.shun == client:
            return None  # (not a task whose lease ran out on this very client)
        now = self._clock()
        rec = self._room_for(client, now)
        if rec is None:
            return None
        return self._lease(entry, client, rec, now)  # (its stale heap items are skipped by take)

    def _room_for(self, client: str, now: float):
        """The client's record, or None when it holds as many leases as it may already."""
        rec = self._clients.get(client)
        if rec is None:
            return self._speed.get(client, now)
        return None if len(rec.leases) >= self._standing.allowance(client) else rec

    def _lease(self, entry: _Entry, client: str, rec, now: float) -> Lease:
        entry.state = _LEASED
        entry.leased_at = now
        self._leased += 1
        attempt = entry.attempts = entry.attempts + 1
        if entry.holders is None:
            entry.holders = {client}
        else:
            entry.holders.add(client)
        deadline = self._deadline(entry, client, rec, now)
        lease = entry.lease = self._new_lease(entry, client, deadline, attempt)
        rec.leases[entry.task.task_id] = entry
        deadlines = self._deadlines
        heappush(deadlines, (deadline, entry.key))
        if len(deadlines) > _SLACK * self._leased + self._min_stale:
            self._compact_deadlines()
        entry.backup_at = None
        if self._backups and self._standing.earning and not self._standing.proven(client):
            entry.backup_at = now + self._patience()
            heappush(self._unproven, (entry.backup_at, entry.key))
        return lease

    def _deadline(self, entry: _Entry, client: str, rec, now: float) -> float:
        speed = self._speed
        if not speed.any_speed:
            deadline = now + entry.timeout
        elif rec.factor_version == speed.version and 0 <= now - rec.factor_time < speed.refresh:
            deadline = now + entry.timeout * rec.factor  # cached; see SpeedBook.factor
        else:
            deadline = now + entry.timeout * speed.factor(rec, now)
        cap = self._standing.probation_cap(client, (deadline - now) / entry.timeout)
        if cap is not None and deadline > now + cap:
            deadline = now + cap
        return deadline

    @staticmethod
    def _new_lease(entry: _Entry, client: str, deadline: float, attempt: int) -> Lease:
        lease = _new_lease(Lease)
        _set_task(lease, entry.task)
        _set_client(lease, client)
        _set_deadline(lease, deadline)
        _set_attempt(lease, attempt)
        return lease

    # ------------------------------------------------------------------ results

    def complete(self, task_id: str, client: str) -> Completion:
        """Report a result.  The first completion of a task wins, whoever sends it and
        whatever the task's state (queued again after an expiry, or leased to someone
        else, whose lease is then void): ACCEPTED.  Any later one, or one for an
        abandoned task, is DUPLICATE and counted.  An id never added is misuse.  (A server
        takes a completion only from a client that held the task: ``ever_held``.)"""
        entry = self._tasks.pop(task_id, None)
        if entry is None:
            if task_id in self._done or task_id in self._abandoned:
                self._duplicates += 1
                ghost = self._ghosts.pop((task_id, client), None)
                if ghost is not None and self._clock() <= ghost[0]:
                    # its own lease, on time, second only to a backup: it delivered as asked
                    self._standing.on_time(client, self._clock() - ghost[1])
                return _DUPLICATE
            raise TaskPoolError(f"complete: unknown task id {task_id!r}")
        # _close(entry), inlined: this is half of the hot path
        now = self._clock()
        lease = entry.lease if entry.state == _LEASED else None
        backup = entry.backup
        if self._holds_backup(entry, client):  # the backup's holder was first
            lease, since = backup, entry.backup_since
        else:
            since = entry.leased_at
        if lease is not None and lease.client == client and now <= lease.deadline:
            self._standing.on_time(client, now - since)
        elif entry.holders is not None and client in entry.holders:
            self._standing.delivered_late(client)
        if backup is not None:
            if backup.client != client and now < backup.deadline:
                self._ghost(entry, backup, entry.backup_since)
            self._drop_backup(entry)
        if entry.state == _LEASED:
            if entry.lease.client != client and now < entry.lease.deadline:
                self._ghost(entry, entry.lease, entry.leased_at)
            del self._clients[entry.lease.client].leases[task_id]
            self._leased -= 1
            entry.lease = None
        entry.state = _CLOSED
        del self._by_key[entry.key]
        self._done.add(task_id)
        self._closed_by_batch.setdefault(entry.task.batch, []).append(task_id)
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
            raise TaskPoolError(f"fail: task {task_id!r} is {self._closed_state(task_id)}")
        lease = entry.lease
        if lease is None:
            raise TaskPoolError(f"fail: task {task_id!r} is queued, {client!r} holds no lease of it")
        if lease.client != client and not self._holds_backup(entry, client):
            raise TaskPoolError(f"fail: task {task_id!r} is leased to {lease.client!r}, not to {client!r}")
        self._release(entry, client, self._clock())

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
        lost = [e for tid, e in rec.leases.items() if tid not in keep and now - self._since(e, client) >= min_age]
        for entry in lost:
            self._release(entry, client, now)
        return [e.task for e in lost]

    def abandon(self, task_id: str) -> None:
        """Drop a queued or leased task without completing it (no-requeue mode).  A later
        result for it is answered DUPLICATE."""
        entry = self._tasks.pop(task_id, None)
        if entry is None:
            raise TaskPoolError(f"abandon: task {task_id!r} is {self._closed_state(task_id)}")
        self._close(entry)
        self._abandoned.add(task_id)
        self._closed_by_batch.setdefault(entry.task.batch, []).append(task_id)
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
        tid = task.task_id
        if tid not in self._done:
            return False
        self._done.discard(tid)
        closed = self._closed_by_batch.get(task.batch)
        if closed is not None and tid in closed:
            closed.remove(tid)
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
        gone: list[str] = []
        for batch in [b for b in self._closed_by_batch if b < before_batch]:
            ids = self._closed_by_batch.pop(batch)
            for tid in ids:
                self._done.discard(tid)
                self._abandoned.discard(tid)
            gone += ids
        return gone

    # ------------------------------------------------------------------ time and churn

    def expire(self, now: float | None = None) -> list[Task]:
        """Re-queue every lease whose deadline is <= ``now`` (default: the clock; a lease with
        a backup passes to the backup's holder instead); return the tasks whose lease ran
        out, earliest deadline first, then those of leases that ran out unanswered after
        another client completed their task (each a strike for its holder, as any lease
        that runs out)."""
        if now is None:
            now = self._clock()
        deadlines = self._deadlines
        by_key = self._by_key
        out = []
        while deadlines and deadlines[0][0] <= now:
            deadline, key = heappop(deadlines)
            entry = by_key.get(key)
            if entry is not None and entry.state == _LEASED and entry.lease.deadline == deadline:
                holder = entry.lease.client
                self._standing.expired(holder, entry.leased_at, now)
                if self._standing.earning:
                    entry.shun, entry.shun_until = holder, now + self._grace
                    if entry.task.preferred_client == holder:
                        entry.open_at = now  # no longer kept for it
                self._release(entry, holder, now)
                out.append(entry.task)
        ghosts = self._ghost_deadlines
        while ghosts and ghosts[0][0] <= now:
            _, tid, client = heappop(ghosts)
            ghost = self._ghosts.pop((tid, client), None)
            if ghost is not None and client in self._clients:  # (not delivered, not gone)
                self._standing.expired(client, ghost[1], now)
                out.append(ghost[2])
        return out

    def client_left(self, client: str) -> list[Task]:
        """The client is gone: re-queue all its leases now, open the tasks that were
        waiting for it to everyone, and forget its statistics.  Returns the re-queued
        tasks."""
        rec = self._clients.get(client)
        held = list(rec.leases.values()) if rec is not None else []
        now = self._clock()
        for entry in held:
            self._release(entry, client, now)
        self._speed.forget(client)
        self._standing.forget(client)
        pref = self._pref.pop(client, None)
        if pref:
            self._pref_items -= len(pref)
            by_key = self._by_key
            for key in pref:
                entry = by_key.get(key)
                if entry is not None and entry.state == _PREF:
                    self._push_open(entry)
        return [entry.task for entry in held]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a current lease (when ``expire`` has work), or None."""
        deadlines = self._deadlines
        while deadlines and not self._live_deadline(deadlines[0]):
            heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def set_client_speed(self, client: str, relative_speed: float) -> None:
        """Seed a client's speed (its registered compute power, in any unit shared by
        all clients).  Sets its deadline factor until it has a measured throughput."""
        speed = check_positive(f"relative_speed of {client!r}", relative_speed)
        self._speed.seed(client, speed, self._clock())

    # ------------------------------------------------------------------ queries

    def is_done(self, task_id: str) -> bool:
        return task_id in self._done

    def ever_held(self, task_id: str, client: str) -> bool | None:
        """Whether `client` holds or held a lease of the open task `task_id` (a lease that ran
        out or was re-queued counts: its holder may still have done the work); None when the task
        is not open (done, abandoned or unknown: `complete` says which)."""
        entry = self._tasks.get(task_id)
        if entry is None:
            return None
        return entry.holders is not None and client in entry.holders

    def strikes(self, client: str) -> int:
        """Leases of `client` that ran out in a row, unanswered (:mod:`taskpool.standing`)."""
        return self._standing.strikes(client)

    def probation_cap(self, client: str) -> float | None:
        """The longest a new lease of `client` may last now (its probation deadline at a deadline
        factor of 1), or None when its leases are not cut short (:mod:`taskpool.standing`)."""
        return self._standing.probation_cap(client, 1.0)

    def allowance(self, client: str) -> int:
        """How many leases `client` may hold at once now."""
        return self._standing.allowance(client)

    def proven(self, client: str) -> bool:
        """Whether `client` has delivered a task on time here since its last lease ran out (or is
        trusted): :mod:`taskpool.standing`."""
        return self._standing.proven(client)

    def trust(self, client: str) -> None:
        """`client` need not earn its leases (:mod:`taskpool.standing`): it may hold
        ``max_leases_per_client`` at once, each for its full timeout, until it leaves."""
        self._standing.trust(client)

    def lease_of(self, task_id: str) -> Lease | None:
        entry = self._tasks.get(task_id)
        return entry.lease if entry is not None else None

    def leases_of(self, client: str) -> list[Lease]:
        rec = self._clients.get(client)
        if rec is None:
            return []
        return [e.backup if self._holds_backup(e, client) else e.lease for e in rec.leases.values()]

    def open_tasks(self, batch: int) -> list[tuple[str, str | None, float]]:
        """The tasks of ``batch`` not done yet: (task id, holder or None when queued, seconds
        since it was leased, or since it was added when queued), longest first.  O(tasks in the pool): for a report of
        what a step waits for, not for a hot path."""
        now = self._clock()
        out = []
        for entry in self._tasks.values():
            if entry.task.batch != batch:
                continue
            held = entry.state == _LEASED
            since = entry.leased_at if held else entry.added_at
            out.append((entry.task.task_id, entry.lease.client if held else None, max(0.0, now - since)))
        return sorted(out, key=lambda x: -x[2])

    def __len__(self) -> int:
        return len(self._tasks)

    def queued(self) -> int:
        """Tasks waiting for a lease (open, or preferred for some client)."""
        return len(self._tasks) - self._leased

    def stats(self) -> dict:
        """Counters and per-client figures, as a plain JSON-able dict.

        ``added`` is there too, so that ``queued + leased + done + abandoned == added``
        can be checked from the dict alone.  ``oldest_queued_age`` (seconds since the
        oldest queued task was added) is 0.0 when nothing is queued; ``throughput`` is
        0.0 for a client without a measurement; so is ``capacity`` (rows a second while the client
        holds a lease: `ClientRecord.capacity`)."""
        now = self._clock()
        oldest = self._oldest
        by_key = self._by_key
        while oldest:
            entry = by_key.get(oldest[0][1])
            if entry is not None and entry.state <= _PREF:
                break
            heappop(oldest)
        decay = self._speed.decay
        return {
            "queued": self.queued(),
            "leased": self._leased,
            "done": self._ndone,
            "requeued": self._requeued,
            "reopened": self._reopened,
            "duplicates": self._duplicates,
            "backups": self._nbackups,
            "abandoned": self._nabandoned,
            "added": self._added,
            "oldest_queued_age": max(0.0, now - oldest[0][0]) if oldest else 0.0,
            "clients": {
                name: {
                    "throughput": rec.rate(now, decay) or 0.0,
                    "capacity": rec.capacity() or 0.0,
                    "done": rec.done,
                    "leases": len(rec.leases),
                    "allowance": self._standing.allowance(name),
                }
                for name, rec in self._clients.items()
            },
        }

    # ------------------------------------------------------------------ internals

    def _enqueue(self, entry: _Entry, now: float) -> None:
        """Queue a task (new, or back from a lease): preferred while in grace, else open."""
        entry.lease = None
        key = entry.key
        heappush(self._oldest, (entry.added_at, key))
        preferred = entry.task.preferred_client
        if preferred is not None and now < entry.open_at:
            entry.state = _PREF
            heappush(self._pref.setdefault(preferred, []), key)
            heappush(self._pending, (entry.open_at, key))
            self._pref_items += 1
        else:
            entry.state = _OPEN
            heappush(self._open, key)
        if (
            len(self._open) + len(self._oldest) + len(self._pending) + self._pref_items
            > _SLACK * (len(self._tasks) - self._leased) + self._min_stale
        ):
            self._compact_queues()

    def _push_open(self, entry: _Entry) -> None:
        entry.state = _OPEN
        heappush(self._open, entry.key)

    def _promote(self, now: float) -> None:
        """Preferred tasks whose grace period is over become open to every client."""
        pending = self._pending
        by_key = self._by_key
        while pending and pending[0][0] <= now:
            entry = by_key.get(heappop(pending)[1])
            if entry is not None and entry.state == _PREF:
                self._push_open(entry)

    def _ghost(self, entry: _Entry, lease: Lease, since: float) -> None:
        """`lease`'s task was completed by another client: its holder still has until its deadline."""
        if not self._standing.earning:
            return
        tid = entry.task.task_id
        self._ghosts[(tid, lease.client)] = (lease.deadline, since, entry.task)
        heappush(self._ghost_deadlines, (lease.deadline, tid, lease.client))

    @staticmethod
    def _holds_backup(entry: _Entry, client: str) -> bool:
        """Whether `client`'s lease of the task is its backup (not the lease it was first given)."""
        return entry.backup is not None and entry.backup.client == client

    def _since(self, entry: _Entry, client: str) -> float:
        """When `client`'s lease of the task began (its backup's, if it holds that)."""
        return entry.backup_since if self._holds_backup(entry, client) else entry.leased_at

    def _drop_backup(self, entry: _Entry) -> None:
        rec = self._clients.get(entry.backup.client)
        if rec is not None:
            rec.leases.pop(entry.task.task_id, None)
        entry.backup = None

    def _release(self, entry: _Entry, client: str, now: float) -> None:
        """`client` lets go of its lease of a leased task (it ran out, failed, was lost, or the client
        left): a backup's holder just drops its backup; the holder of a lease with a backup passes the
        task to the backup's holder (whose lease it becomes); else the task is queued again."""
        backup = entry.backup
        if backup is None:
            self._requeue(entry, now)
            return
        if self._holds_backup(entry, client):
            self._drop_backup(entry)
            return
        del self._clients[entry.lease.client].leases[entry.task.task_id]
        entry.lease, entry.leased_at, entry.backup, entry.backup_at = backup, entry.backup_since, None, None
        heappush(self._deadlines, (backup.deadline, entry.key))

    def _requeue(self, entry: _Entry, now: float) -> None:
        del self._clients[entry.lease.client].leases[entry.task.task_id]
        self._leased -= 1
        self._requeued += 1
        self._enqueue(entry, now)

    def _close(self, entry: _Entry) -> None:
        """Take a task, already out of ``_tasks``, out of the queue or its lease."""
        if entry.backup is not None:
            self._drop_backup(entry)
        if entry.state == _LEASED:
            del self._clients[entry.lease.client].leases[entry.task.task_id]
            self._leased -= 1
            entry.lease = None
        entry.state = _CLOSED
        del self._by_key[entry.key]

    def _closed_state(self, task_id: str) -> str:
        if task_id in self._done:
            return "already done"
        if task_id in self._abandoned:
            return "abandoned"
        return "unknown"

    def _live_deadline(self, item: tuple[float, int]) -> bool:
        entry = self._by_key.get(item[1])
        return entry is not None and entry.state == _LEASED and entry.lease.deadline == item[0]

    # Compactions: drop the stale items (see the module docstring) and re-heapify.  Each
    # runs when stale items are at least 3/4 of its heaps, so its cost, paid once per
    # item dropped, is amortized O(1) per operation.

    def _compact_deadlines(self) -> None:
        get = self._by_key.get
        heap = self._deadlines
        heap[:] = [
            item
            for item in heap
            if (e := get(item[1])) is not None and e.state == _LEASED and e.lease.deadline == item[0]
        ]
        heapify(heap)

    def _compact_queues(self) -> None:
        get = self._by_key.get

        def keep(heap: list, state: int) -> None:
            heap[:] = [key for key in heap if (e := get(key)) is not None and e.state == state]
            heapify(heap)

        def keep_timed(heap: list, lo: int, hi: int) -> None:
            heap[:] = [item for item in heap if (e := get(item[1])) is not None and lo <= e.state <= hi]
            heapify(heap)

        keep(self._open, _OPEN)
        keep_timed(self._pending, _PREF, _PREF)
        keep_timed(self._oldest, _OPEN, _PREF)
        self._pref_items = 0
        for client in list(self._pref):
            heap = self._pref[client]
            keep(heap, _PREF)
            if heap:
                self._pref_items += len(heap)
            else:
                del self._pref[client]
