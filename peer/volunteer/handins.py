"""The tasks a stage worker has finished and not yet handed in (a part of peer/volunteer/worker.py's
StageWorker). A task whose results every server credited is not completed with a call of its own:
it is listed with the next `take` or heartbeat to the server that leased it, and stays listed (and
held) until an answer to a call that carried it arrives. A call in flight keeps the ids it carries
to itself: two calls that carried the same id had the server count the second a duplicate."""

from __future__ import annotations

from core.protocol.leases import MAX_COMPLETE


class HandIns:
    def __init__(self):
        # server device -> ids of tasks leased there and finished, not known to have arrived
        self.finished: dict[str, list[str]] = {}
        # of them, the ones a call now in flight carries (not put in another call until it answers)
        self.carried: dict[str, set[str]] = {}

    def add(self, device: str, task_id: str) -> None:
        """Task `task_id`, leased from `device`, is finished."""
        self.finished.setdefault(device, []).append(task_id)

    def listed(self, device: str) -> list[str]:
        """The finished tasks of `device` not known to have arrived (still held by the worker)."""
        return list(self.finished.get(device, []))

    def devices(self) -> list[str]:
        """The servers that have finished tasks to be handed in."""
        return list(self.finished)

    def take(self, device: str) -> list[str]:
        """Up to MAX_COMPLETE finished tasks of `device` that no call in flight carries, for a call
        about to be made; they are carried until `release`."""
        busy = self.carried.setdefault(device, set())
        done = [t for t in self.finished.get(device, []) if t not in busy][:MAX_COMPLETE]
        busy.update(done)
        return done

    def release(self, device: str, done: list[str]) -> None:
        """The call that carried `done` answered or failed: another call may carry what is left of them."""
        busy = self.carried.get(device)
        if busy is not None:
            busy.difference_update(done)

    def arrived(self, device: str, done: list[str]) -> None:
        """`device` answered a call that carried `done`: it has them."""
        if done and device in self.finished:
            got = set(done)
            left = [t for t in self.finished[device] if t not in got]
            if left:
                self.finished[device] = left
            else:
                del self.finished[device]

    def clear(self) -> None:
        """Forget everything (a new layout epoch: the old epoch's leases are gone)."""
        self.finished.clear()
        self.carried.clear()
