"""A task asked to stop must stop, also when the call it was awaiting did not say so.

`Task.cancel()` normally reaches a loop as CancelledError. But a call can turn the cancellation into
an error of its own: `asyncio.wait_for` may hand back the inner call's result or error when both
happen at once, and a stream closed under a cancelled call reports a closed connection. A loop that
catches errors and tries again (a worker's take, an announcer's round, a delivery retried) then goes
on for ever, and whoever cancelled it (a server's stop on SIGTERM, the event loop's own shutdown)
waits for ever. Every such loop calls `check_cancelled()` once a turn: `Attempts` (retry.py), which
the loops that try again or look every period are built on, does it before each attempt."""

from __future__ import annotations

import asyncio


def cancel_requested() -> bool:
    """Whether the running task has been asked to stop (Python >= 3.11 counts the requests; on older
    versions a cancellation is always raised, and this says False)."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


def check_cancelled() -> None:
    """Raise CancelledError if the running task has been asked to stop."""
    if cancel_requested():
        raise asyncio.CancelledError
