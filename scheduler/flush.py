"""When a worker pushes the gradients it has summed per batch: a pure function of what it holds,
the task it is about to compute and the time, so tests can drive it without a network. Here, below
the worker, so that the step model (scheduler/stepsim.py) plays the worker's own rule.

A worker sums the parameter gradients of the tasks of one batch and keeps their leases until every
server has credited the sum. It pushes a batch's sum:
- when it goes idle (no next task) or holds `max_pending` leases or more;
- before a task that may wait on it: the task's parameters need every batch < its batch - 1
  applied; a task that carries gradients itself (a backward task, or any task of the last stage)
  pushes every older batch first;
- when a lease it holds enters the last third of its time (so the lease does not expire with the
  work done).
"""
from __future__ import annotations


def batches_to_push(pending: dict[int, list[tuple[float, float]]], task: dict | None, now: float,
                    max_pending: int, last_stage: bool) -> list[int]:
    """The batches to push now, in order. `pending` maps a batch to its held leases as (deadline,
    lease seconds); `task` is the next task's metadata ("batch", "kind") or None when idle."""
    held = sum(len(leases) for leases in pending.values())
    due = []
    for b, leases in pending.items():
        if task is None or held >= max_pending:
            due.append(b)
        elif b < task["batch"] - 1 or (b < task["batch"] and (last_stage or task["kind"] == "backward")):
            due.append(b)
        elif any(now > deadline - length / 3 for deadline, length in leases):
            due.append(b)
    return sorted(due)
