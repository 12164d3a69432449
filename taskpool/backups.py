"""Backups: a stranger that takes tasks and never answers holds up no batch while a proven client is
idle. A proven client that finds nothing to take gets a task kept for an unproven client that has not
taken it within the typical lease, or else a *backup* lease of a task an unproven client has held
longer than that (one per task); the first result wins, as always, and the original lease runs on and
expires as before, with its strike.

Ghosts: a lease whose task another client completed first is still its holder's to deliver by its
deadline; delivered on time it counts for the holder as on time, and run out it is a strike like any
lease that runs out (taskpool/standing.py)."""

from __future__ import annotations

from heapq import heappop, heappush

from .entry import LEASED, PREF, Entry, new_lease
from .queues import Queues
from .standing import Standing
from .types import Lease, Task


class Backups:
    """The backup leases (when `enabled`) and ghosts of one pool: `queues` and `clients` (client -> ClientRecord, whose
    `leases` maps the task ids it holds to their entries) are the pool's own."""

    __slots__ = ("queues", "standing", "grace", "clients", "enabled", "unproven", "ghosts", "ghost_deadlines", "count")

    def __init__(self, queues: Queues, standing: Standing, grace: float, clients: dict, enabled: bool) -> None:
        self.queues, self.standing, self.grace, self.clients = queues, standing, grace, clients
        self.enabled = enabled  # backups are leased (ghosts are kept either way)
        self.unproven: list[tuple[float, int]] = []  # (backup_at, key) of leases held by unproven clients
        # (task id, client) -> (deadline, leased at, task) of the ghosts, and their deadlines in a heap
        self.ghosts: dict[tuple[str, str], tuple[float, float, Task]] = {}
        self.ghost_deadlines: list[tuple[float, str, str]] = []
        self.count = 0  # backups leased: kept tasks handed to a proven client, and backup leases

    def patience(self) -> float:
        """How long an unproven client has for a task before a proven one may stand in: the typical
        lease (on-time completions here), or the probation floor while none is known."""
        typical = self.standing.typical
        return self.standing.probation_floor if typical is None else typical

    def watch(self, entry: Entry, client: str, now: float) -> None:
        """`entry` was just leased to `client`: an unproven one's lease may be backed up after the
        typical lease."""
        entry.backup_at = None
        if self.enabled and self.standing.earning and not self.standing.proven(client):
            entry.backup_at = now + self.patience()
            heappush(self.unproven, (entry.backup_at, entry.key))

    def kept_for(self, client: str, now: float) -> Entry | None:
        """For proven `client`: the best task kept for an unproven client that has not taken it
        within the typical lease (a hoarder at its allowance never does), or None."""
        by_key, standing, patience = self.queues.by_key, self.standing, self.patience()
        kept = None
        for open_at, key in self.queues.pending:  # (tasks in their grace: two batches' worth at most)
            entry = by_key.get(key)
            if entry is None or entry.state != PREF or entry.open_at != open_at:
                continue
            waiting_for = entry.task.preferred_client
            if waiting_for == client or standing.proven(waiting_for) or now < open_at - self.grace + patience:
                continue
            if kept is None or entry.key < kept.key:
                kept = entry
        return kept

    def to_back_up(self, now: float) -> Entry | None:
        """The lease an unproven client has held longest past the typical lease, not backed up yet,
        or None."""
        heap, by_key, standing = self.unproven, self.queues.by_key, self.standing
        while heap:
            ready, key = heap[0]
            entry = by_key.get(key)
            if (
                entry is None
                or entry.state != LEASED
                or entry.backup is not None
                or entry.backup_at != ready
                or standing.proven(entry.lease.client)
            ):
                heappop(heap)  # stale: closed, re-queued, backed up already, or its holder proven since
                continue
            if ready > now:
                return None
            heappop(heap)
            return entry
        return None

    def back_up(self, entry: Entry, client: str, rec, deadline: float, now: float) -> Lease:
        """A backup lease of `entry`'s task for `client` (its record `rec`) until `deadline`."""
        entry.attempts += 1
        entry.holders.add(client)
        lease = entry.backup = new_lease(entry.task, client, deadline, entry.attempts)
        entry.backup_since = now
        rec.leases[entry.task.task_id] = entry
        self.count += 1
        return lease

    def drop(self, entry: Entry) -> None:
        """The backup of `entry` is void (its holder let go of it, or the task is closed)."""
        rec = self.clients.get(entry.backup.client)
        if rec is not None:
            rec.leases.pop(entry.task.task_id, None)
        entry.backup = None

    def ghost(self, entry: Entry, lease: Lease, since: float) -> None:
        """`lease`'s task was completed by another client: its holder still has until its deadline."""
        if not self.standing.earning:
            return
        tid = entry.task.task_id
        self.ghosts[(tid, lease.client)] = (lease.deadline, since, entry.task)
        heappush(self.ghost_deadlines, (lease.deadline, tid, lease.client))

    def delivered(self, task_id: str, client: str, now: float) -> None:
        """`client` delivered a task already done: on time for its own lease (second only to a
        backup), it delivered as asked."""
        ghost = self.ghosts.pop((task_id, client), None)
        if ghost is not None and now <= ghost[0]:
            self.standing.on_time(client, now - ghost[1])

    def expire(self, now: float) -> list[Task]:
        """The tasks of the ghosts that ran out by `now` unanswered (each a strike for its holder)."""
        out = []
        ghosts = self.ghost_deadlines
        while ghosts and ghosts[0][0] <= now:
            _, tid, client = heappop(ghosts)
            ghost = self.ghosts.pop((tid, client), None)
            if ghost is not None and client in self.clients:  # (not delivered, not gone)
                self.standing.expired(client, ghost[1], now)
                out.append(ghost[2])
        return out
