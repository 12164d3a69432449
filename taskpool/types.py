"""Value types of the task pool: what a task is, what a lease is, what a completion means.

All of them are immutable.  A :class:`Task` checks itself when it is built, so a task that
exists is well formed; the pool never has to re-check one.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class TaskKind(str, enum.Enum):
    """What a task computes: a forward pass of its rows, or a backward pass (on the last stage a
    forward task computes the loss and its backward pass too). Equal to its value as a str, so a kind
    read from the wire compares and hashes the same."""

    FORWARD = "forward"
    BACKWARD = "backward"

    __str__ = str.__str__
    __format__ = str.__format__


FORWARD, BACKWARD = TaskKind.FORWARD, TaskKind.BACKWARD
KINDS = tuple(TaskKind)


class TaskPoolError(ValueError):
    """Misuse of the pool or of a task: the message names what is wrong.

    Every operation that raises it checks before it mutates, so the pool is unchanged.
    """


def check_positive(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite number > 0, else raise TaskPoolError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TaskPoolError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise TaskPoolError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


MICRO_BATCH_LIMIT = 1 << 32
"""micro_batch must be below this (the pool packs the priority into one int)."""


def priority(batch: int, micro_batch: int, kind: str) -> tuple[int, int, bool]:
    """The order in which the pools hand out tasks, smallest first: the oldest batch, then the
    lowest micro-batch, then backward before forward (a backward task frees what its forward pass
    kept). A worker orders the tasks that reached it while it was busy by the same key."""
    return batch, micro_batch, kind != BACKWARD


def _check_index(task_id: str, name: str, value: object, limit: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TaskPoolError(f"task {task_id!r}: {name} must be an int, got {value!r}")
    if value < 0 or (limit is not None and value >= limit):
        bound = f"0 <= {name} < {limit}" if limit is not None else f"{name} >= 0"
        raise TaskPoolError(f"task {task_id!r}: need {bound}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Task:
    """One unit of work: the rows ``[lo, hi)`` of one micro-batch through one stage.

    The pool keeps only this description; ``payload_ref`` points at the tensors (a key in
    the server's buffer, a DHT key, ...), the pool never looks inside it.

    Invariants checked at construction (TaskPoolError otherwise): ``task_id`` is a
    non-empty str, ``kind`` is ``"forward"`` or ``"backward"``, ``batch``,
    ``micro_batch`` and ``stage`` are ints, ``rows`` is a pair of ints with
    ``lo < hi``, ``preferred_client`` is a str or None, ``timeout`` is None (use the
    pool's default) or a finite number > 0.  ``batch``, ``stage`` and both row bounds are
    >= 0 and ``0 <= micro_batch < 2**32``: they are indices, and the pool packs the
    priority into one int.
    """

    task_id: str
    kind: str
    batch: int
    micro_batch: int
    stage: int
    rows: tuple[int, int]
    preferred_client: str | None = None
    payload_ref: object = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.task_id, str) or not self.task_id:
            raise TaskPoolError(f"task_id must be a non-empty str, got {self.task_id!r}")
        if self.kind not in KINDS:
            raise TaskPoolError(f"task {self.task_id!r}: kind must be 'forward' or 'backward', got {self.kind!r}")
        tid = self.task_id
        _check_index(tid, "batch", self.batch)
        _check_index(tid, "micro_batch", self.micro_batch, MICRO_BATCH_LIMIT)
        _check_index(tid, "stage", self.stage)
        rows = self.rows
        if not isinstance(rows, tuple) or len(rows) != 2:
            raise TaskPoolError(f"task {tid!r}: rows must be a (lo, hi) tuple, got {rows!r}")
        _check_index(tid, "rows[0]", rows[0])
        _check_index(tid, "rows[1]", rows[1])
        if rows[0] >= rows[1]:
            raise TaskPoolError(f"task {self.task_id!r}: empty row range {rows!r} (need lo < hi)")
        if self.preferred_client is not None and not isinstance(self.preferred_client, str):
            raise TaskPoolError(
                f"task {self.task_id!r}: preferred_client must be a str or None, got {self.preferred_client!r}"
            )
        if self.timeout is not None:
            check_positive(f"task {self.task_id!r}: timeout", self.timeout)


@dataclass(frozen=True, slots=True)
class Lease:
    """A client's right to work on ``task`` until ``deadline`` (pool clock).

    ``attempt`` is 1 for the first lease of the task and grows by one with every lease
    after a re-queue.  A lease is a snapshot: it stays the same object while it is
    current, and the pool forgets it (``lease_of`` returns another lease or None) once
    the task is completed, re-queued or abandoned.
    """

    task: Task
    client: str
    deadline: float
    attempt: int


class Completion(enum.Enum):
    """What ``TaskPool.complete`` decided about a result."""

    ACCEPTED = "accepted"
    """First completion of the task: the caller must use this result."""

    DUPLICATE = "duplicate"
    """The task was already done (or abandoned): drop the result; it is counted."""
