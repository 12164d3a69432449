"""The pool's mutable record of one queued or leased task (`Entry`), the states it moves through, the
one-int priority key it is ordered by, and the fast way a Lease is built on the hot path."""

from __future__ import annotations

from .types import Lease, Task, priority

# An entry's state. Done and abandoned tasks have no entry (taskpool/closed.py keeps their ids).
# Plain ints, not an enum: they are compared on every take and complete.
OPEN = 0  # queued, any client may take it
PREF = 1  # queued, only its preferred client may take it until its grace ends
LEASED = 2  # one client holds it
CLOSED = 3  # out of the pool (done, abandoned): items of it left in a heap are stale

# An entry's key: one int that orders tasks best first (lower batch, lower micro-batch, backward
# before forward, insertion order) and is unique, so the heaps hold plain ints, fast to compare:
# batch | micro_batch | backward-first bit | insertion number (below 2**SEQ_BITS), high to low bits
SEQ_BITS = 48
MB_BITS = 32


# Lease is a frozen dataclass; building one through its generated __init__ costs four
# object.__setattr__ calls. new_lease fills the slots directly (same object, half the time).
_new = object.__new__
_set_task = Lease.task.__set__
_set_client = Lease.client.__set__
_set_deadline = Lease.deadline.__set__
_set_attempt = Lease.attempt.__set__


def new_lease(task: Task, client: str, deadline: float, attempt: int) -> Lease:
    lease = _new(Lease)
    _set_task(lease, task)
    _set_client(lease, client)
    _set_deadline(lease, deadline)
    _set_attempt(lease, attempt)
    return lease


class Entry:
    """One queued or leased task.

    ``lease`` is the current Lease iff ``state == LEASED``; ``attempts`` counts the leases so far;
    ``holders`` is every client that held one (None before the first); ``open_at`` is when a
    preferred task becomes open to everyone.
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

    def __init__(self, task: Task, seq: int, timeout: float, now: float, grace: float) -> None:
        batch, micro, forward = priority(task.batch, task.micro_batch, task.kind)
        self.task = task
        self.key = (((batch << MB_BITS | micro) << 1 | forward) << SEQ_BITS) | seq  # `seq`: its insertion number
        self.state = CLOSED  # set when it is queued
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

    def holds_backup(self, client: str) -> bool:
        """Whether `client`'s lease of the task is its backup (not the lease it was first given)."""
        return self.backup is not None and self.backup.client == client

    def since(self, client: str) -> float:
        """When `client`'s lease of the task began (its backup's, if it holds that)."""
        return self.backup_since if self.holds_backup(client) else self.leased_at
