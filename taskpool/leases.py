"""The leases of one pool: granting one (its deadline from the client's speed, cut short while the
client is on probation), letting one go (the task queued again, or passed to the holder of its
backup), and those whose deadline has passed (each a strike for its holder, taskpool/standing.py)."""

from __future__ import annotations

from heapq import heappop, heappush

from .backups import Backups
from .entry import LEASED, Entry, new_lease
from .queues import Queues
from .speed import SpeedBook
from .standing import Standing
from .types import Lease, Task


class Leases:
    """`tasks` (task id -> Entry of the queued and leased tasks), `queues`, `speed`, `standing` and
    `backups` are the pool's own; `count` is how many tasks are leased."""

    __slots__ = ("tasks", "queues", "speed", "standing", "backups", "clients", "grace", "count", "requeued")

    def __init__(
        self, tasks: dict, queues: Queues, speed: SpeedBook, standing: Standing, backups: Backups, grace: float
    ) -> None:
        self.tasks, self.queues, self.speed, self.standing, self.backups = tasks, queues, speed, standing, backups
        self.clients = speed.clients
        self.grace = grace
        self.count = 0  # leased tasks: queued = len(tasks) - count
        self.requeued = 0  # leases let go of with their task queued again

    def grant(self, entry: Entry, client: str, rec, now: float) -> Lease:
        """Lease the queued task `entry` to `client` (its record `rec`) now."""
        entry.state = LEASED
        entry.leased_at = now
        self.count += 1
        attempt = entry.attempts = entry.attempts + 1
        if entry.holders is None:
            entry.holders = {client}
        else:
            entry.holders.add(client)
        deadline = self.deadline(entry, client, rec, now)
        lease = entry.lease = new_lease(entry.task, client, deadline, attempt)
        rec.leases[entry.task.task_id] = entry
        self.queues.push_deadline(deadline, entry.key, self.count)
        self.backups.watch(entry, client, now)
        return lease

    def deadline(self, entry: Entry, client: str, rec, now: float) -> float:
        """``now + timeout x the client's speed factor`` (taskpool/speed.py), at most its probation cap."""
        speed = self.speed
        if not speed.any_speed:
            deadline = now + entry.timeout
        elif rec.factor_version == speed.version and 0 <= now - rec.factor_time < speed.refresh:
            deadline = now + entry.timeout * rec.factor  # cached; see SpeedBook.factor
        else:
            deadline = now + entry.timeout * speed.factor(rec, now)
        cap = self.standing.probation_cap(client, (deadline - now) / entry.timeout)
        if cap is not None and deadline > now + cap:
            deadline = now + cap
        return deadline

    def release(self, entry: Entry, client: str, now: float) -> None:
        """`client` lets go of its lease of a leased task (it ran out, failed, was lost, or the client
        left): a backup's holder just drops its backup; the holder of a lease with a backup passes the
        task to the backup's holder (whose lease it becomes); else the task is queued again."""
        backup = entry.backup
        if backup is None:
            del self.clients[entry.lease.client].leases[entry.task.task_id]
            self.count -= 1
            self.requeued += 1
            self.queues.enqueue(entry, now, len(self.tasks) - self.count)
            return
        if backup.client == client:
            self.backups.drop(entry)
            return
        del self.clients[entry.lease.client].leases[entry.task.task_id]
        entry.lease, entry.leased_at, entry.backup, entry.backup_at = backup, entry.backup_since, None, None
        heappush(self.queues.deadlines, (backup.deadline, entry.key))

    def close(self, entry: Entry, client: str, now: float) -> tuple[Lease | None, float]:
        """`client` completed the task of `entry` first, now: what it earned (on time, or late,
        taskpool/standing.py), the other leases of the task void (each a ghost while its deadline is
        ahead, taskpool/backups.py). Returns the lease `client` completed it under (None when it held
        none then) and when that lease began."""
        lease = entry.lease if entry.state == LEASED else None
        backup = entry.backup
        if backup is not None and backup.client == client:  # the backup's holder was first
            lease, since = backup, entry.backup_since
        else:
            since = entry.leased_at
        if lease is not None and lease.client == client and now <= lease.deadline:
            self.standing.on_time(client, now - since)
        elif entry.holders is not None and client in entry.holders:
            self.standing.delivered_late(client)
        if backup is not None:
            if backup.client != client and now < backup.deadline:
                self.backups.ghost(entry, backup, entry.backup_since)
            self.backups.drop(entry)
        if entry.state == LEASED:
            if entry.lease.client != client and now < entry.lease.deadline:
                self.backups.ghost(entry, entry.lease, entry.leased_at)
            del self.clients[entry.lease.client].leases[entry.task.task_id]
            self.count -= 1
            entry.lease = None
        return lease, since

    def end(self, entry: Entry) -> None:
        """The task of `entry` leaves the pool (abandoned): its lease and backup are void."""
        if entry.backup is not None:
            self.backups.drop(entry)
        if entry.state == LEASED:
            del self.clients[entry.lease.client].leases[entry.task.task_id]
            self.count -= 1
            entry.lease = None

    def expire(self, now: float) -> list[Task]:
        """Let go of every lease whose deadline is <= `now`; returns their tasks, earliest deadline
        first, then those of ghosts that ran out (taskpool/backups.py)."""
        deadlines = self.queues.deadlines
        by_key = self.queues.by_key
        standing = self.standing
        out = []
        while deadlines and deadlines[0][0] <= now:
            deadline, key = heappop(deadlines)
            entry = by_key.get(key)
            if entry is not None and entry.state == LEASED and entry.lease.deadline == deadline:
                holder = entry.lease.client
                standing.expired(holder, entry.leased_at, now)
                if standing.earning:  # others take it first
                    entry.shun, entry.shun_until = holder, now + self.grace
                    if entry.task.preferred_client == holder:
                        entry.open_at = now  # no longer kept for it
                self.release(entry, holder, now)
                out.append(entry.task)
        out += self.backups.expire(now)
        return out
