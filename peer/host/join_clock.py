"""Where a volunteer's join went: the seconds from `peer join`'s start to its first task, step by
step, said in one line (INFO, `-v`) when the first task arrives and kept for its summary.

Under churn a volunteer that takes longer to join than it lives never computes: the join's length is
what sets how much of a stage's capacity is there at all, and this line is how an operator (and the
soak, scripts/soak.py) sees which step of it to shorten."""

from __future__ import annotations

import math
import time
from typing import Callable

# the steps in the order a join passes them; a step's seconds run from the previous mark to its own
STEPS = {
    "dht": "DHT node",
    "run": "run record",
    "servers": "servers' records",
    "stage": "stage choice",
    "compute": "compute measured",
    "registered": "registered",
    "warmed": "warm-up",
    "first_task": "first task",
}


class JoinClock:
    """Marks of a join's steps (monotonic seconds); `clock` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.start = clock()
        self.marks: dict[str, float] = {}

    def mark(self, step: str) -> None:
        """`step` ended now (the first time only: a volunteer that moves stage joins once)."""
        if step not in STEPS:
            raise ValueError(f"unknown join step {step!r}: one of {', '.join(STEPS)}")
        self.marks.setdefault(step, self.clock())

    def seconds(self) -> dict[str, float]:
        """Each marked step's seconds (from the mark before it), in the order of STEPS."""
        out, before = {}, self.start
        for step in STEPS:
            if step in self.marks:
                out[step] = max(0.0, self.marks[step] - before)
                before = self.marks[step]
        return out

    def total(self) -> float | None:
        """Seconds from the start to the first task (None until it came)."""
        end = self.marks.get("first_task")
        return None if end is None else end - self.start

    def said(self) -> str:
        """The line: each step's hundredths are the difference of the rounded times from the start at
        its two marks, so the steps said add up to the total said, to the hundredth."""
        cents, parts, before = 0, [], 0
        for step in STEPS:
            if step in self.marks:
                cents = max(cents, _hundredths(self.marks[step] - self.start))
                parts.append(f"{STEPS[step]} {(cents - before) / 100:.2f} s")
                before = cents
        head = f"joined in {cents / 100:.2f} s" if "first_task" in self.marks else "joining"
        return f"{head}: {', '.join(parts)}" if parts else head


def _hundredths(seconds: float) -> int:
    return int(math.floor(seconds * 100 + 0.5))
