"""When a worker pushes the gradients it has summed per batch: a pure function of what it holds,
the task it is about to compute and the time, so tests can drive it without a network. Here, below
the worker, so that the step model (scheduler/stepsim.py) plays the worker's own rule.

A worker sums the parameter gradients of the tasks of one batch and keeps their leases until every
server has credited the sum. It pushes a batch's sum:
- when it goes idle (no next task) or holds `max_pending` leases or more; but an idle worker holds
  for up to `hold` seconds a batch it is owed tasks of (it ran forward passes of the batch whose
  backward tasks are offered it first, or its frontal server said it cuts more of the batch's
  micro-batches for it): the batch cannot step before those tasks' gradients are in, and pushing
  the sum before them pushes the whole stage's gradient twice;
- before a task that may wait on it: the task's parameters need every batch < its batch - 1
  applied; a task that carries gradients itself (a backward task, or any task of the last stage)
  pushes every older batch first;
- when a lease it holds enters the last third of its time (so the lease does not expire with the
  work done).
"""

from __future__ import annotations

# how long an idle worker holds the gradient sum of a batch whose tasks it is owed (offered to it
# first for their server's preference grace, 0.5 s by default) before pushing it without them
IDLE_HOLD_S = 1.0


def owed_after(owed: set[int], batch: int, more: bool) -> set[int]:
    """The batches a worker is owed forward tasks of, after a forward task of `batch` whose server
    said (`more`) that it cuts more of the batch's micro-batches for this worker; batches two behind
    are dropped."""
    return {b for b in owed if b >= batch - 1 and b != batch} | ({batch} if more else set())


def awaiting_after(awaiting: dict[int, float], owed: set[int], now: float) -> dict[int, float]:
    """When an idle worker began to hold each batch it is `owed` tasks of (kept from `awaiting`)."""
    return {b: awaiting.get(b, now) for b in owed}


def hold_ends(awaiting: dict[int, float], pending, hold: float = IDLE_HOLD_S) -> float | None:
    """When the first batch an idle worker still holds (in `pending`) falls due: `since + hold`, the
    very sum batches_to_push compares the time with; None when it holds none."""
    ends = [since + hold for b, since in awaiting.items() if b in pending]
    return min(ends) if ends else None


def batches_to_push(
    pending: dict[int, list[tuple[float, float]]],
    task: dict | None,
    now: float,
    max_pending: int,
    last_stage: bool,
    awaiting: dict[int, float] | None = None,
    hold: float = 0.0,
) -> list[int]:
    """The batches to push now, in order. `pending` maps a batch to its held leases as (deadline,
    lease seconds); `task` is the next task's metadata ("batch", "kind") or None when idle;
    `awaiting` maps a batch the worker is owed tasks of to when it went idle holding it."""
    held = sum(len(leases) for leases in pending.values())
    due = []
    for b, leases in pending.items():
        late = any(now > deadline - length / 3 for deadline, length in leases)
        if held >= max_pending:
            due.append(b)
        elif task is None:
            # (since + hold, as a caller computes when the hold ends: an event at exactly that time
            # must find it over, or a simulation waits for that instant forever)
            if late or not awaiting or b not in awaiting or now >= awaiting[b] + hold:
                due.append(b)
        elif b < task["batch"] - 1 or (b < task["batch"] and (last_stage or task["kind"] == "backward")):
            due.append(b)
        elif late:
            due.append(b)
    return sorted(due)
