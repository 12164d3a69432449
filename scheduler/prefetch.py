"""When a worker fetches the next parameter version ahead of need: a pure function of the versions
it computed on, so tests can drive it without a network. Here, below the worker, so that the step
model (scheduler/stepsim.py) plays the worker's own rule.

A task of batch t computes on version t - 1, which exists once every server of the stage has applied
batch t - 2. Pulling it when the task arrives put the pull (42-56% of a task's time in a
soak) on the step's critical path. A worker that computed on versions v - 1 and v gets work every
step, so it will need v + 1: it asks the stage's servers for it while it computes (each server
answers when it has made it). A worker that works now and then (more workers than tasks a step)
would fetch versions it never uses, so it does not; and one fetch ahead is in flight at a time.
"""

from __future__ import annotations


def version_to_fetch(worked: set[int], version: int, held, fetching) -> tuple[int | None, set[int]]:
    """(the version to fetch ahead now or None, the versions to remember as worked on) for a worker
    that starts computing on `version`, has worked on `worked`, holds `held` and is fetching
    `fetching` ahead (collections of versions)."""
    recent = {v for v in worked | {version} if v >= version - 1}
    nxt = version + 1
    if version - 1 not in worked or nxt in held or fetching:
        return None, recent
    return nxt, recent
