"""Task pools of the frontal and backward servers: micro-batch tasks that volunteers
pull, with leases, deadlines, re-queue and exactly-once completion.

Standard library only; no side effects on import.  See :mod:`taskpool.pool` for the
invariants and :mod:`taskpool.speed` for how deadlines scale with a client's speed.
"""

from .pool import TaskPool
from .types import BACKWARD, FORWARD, Completion, Lease, Task, TaskKind, TaskPoolError

__all__ = ["TaskPool", "Task", "TaskKind", "Lease", "Completion", "TaskPoolError", "FORWARD", "BACKWARD"]
