"""One way to do something again: a call until it is answered, or a look every period until a stop.

    async for attempt in Attempts(within=30.0, pause=Backoff(0.05, 1.0), stop=stopping):
        try:
            return await link.call(...)
        except ConnectionError as e:
            if attempt.last:
                raise
            attempt.failed(e)

`Attempts` owns what every such loop needs and each used to write for itself: the stop event (the
loop ends when it is set, also during a pause), cancellation (a call that turned a cancellation into
an error of its own does not make the loop go on: `check_cancelled` before every attempt, see aio.py),
the budget (a count of attempts, a deadline, or neither), the pause between two attempts (fixed, or
a backoff) and a log of failures that says the first and then at most one a `log_every` seconds.
A periodic loop is the same thing with no budget: `async for _ in Attempts(pause=period, stop=stop)`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from core.protocol.aio import check_cancelled

logger = logging.getLogger("hivepipe.retry")


@dataclass(frozen=True)
class Backoff:
    """A pause that starts at `first` seconds and grows by `factor` each attempt, up to `most`."""

    first: float
    most: float
    factor: float = 2.0

    def after(self, attempt: int) -> float:
        """The pause after attempt `attempt` (1 for the first)."""
        return min(self.most, self.first * self.factor ** (attempt - 1))


class Attempts:
    """An async iterator of attempts (see the module's doc). `tries`: at most that many attempts;
    `within`: an attempt that ends (or asks `last`) that many seconds after the first began is the
    last (the deadline is read once an attempt, so one told it is not the last is followed by another,
    and a pause is cut to what is left of it); `pause`: seconds between two
    attempts, a Backoff, or a function that says them each time; `stop`: the loop ends when it is set. The first attempt begins at once.
    Each item is the iterator itself: `number` (1 for the first), `last` and `failed`."""

    def __init__(
        self,
        what: str = "",
        *,
        tries: int | None = None,
        within: float | None = None,
        pause: float | Backoff | Callable[[], float] = 0.5,
        stop: asyncio.Event | None = None,
        log: logging.Logger = logger,
        log_every: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if tries is not None and tries < 1:
            raise ValueError(f"tries must be at least 1, got {tries}")
        self.what, self.tries, self.pause, self.stop = what, tries, pause, stop
        self.log, self.log_every, self.clock = log, log_every, clock
        self.deadline = None if within is None else clock() + within
        self.number = 0
        self._final: bool | None = None  # whether the budget was spent at this attempt, once asked
        self._said_at: float | None = None
        self._failures = 0

    def __aiter__(self) -> "Attempts":
        return self

    async def __anext__(self) -> "Attempts":
        check_cancelled()
        if self.stop is not None and self.stop.is_set():
            raise StopAsyncIteration
        if self.number > 0:
            if self._spent():
                raise StopAsyncIteration
            await self._wait(self._pause_now())
            check_cancelled()
            if self.stop is not None and self.stop.is_set():
                raise StopAsyncIteration
        self.number += 1
        self._final = None
        return self

    @property
    def last(self) -> bool:
        """Whether no attempt follows this one (its budget is spent, or the stop is set)."""
        return self._spent() or (self.stop is not None and self.stop.is_set())

    def failed(self, error: BaseException) -> None:
        """Note this attempt's failure: logged at debug, the first and then one a `log_every`
        seconds at info with the count since."""
        self._failures += 1
        now = self.clock()
        if self._said_at is None or now - self._said_at >= self.log_every:
            self.log.info("%s: %r (%d failed so far); trying again", self.what, error, self._failures)
            self._said_at = now
        else:
            self.log.debug("%s: %r; trying again", self.what, error)

    def _spent(self) -> bool:
        """Whether the budget is spent after this attempt: decided once an attempt (by `last` or by
        the next step), so that an attempt told it was not the last is always followed by another."""
        if self._final is None:
            self._final = (self.tries is not None and self.number >= self.tries) or (
                self.deadline is not None and self.clock() >= self.deadline
            )
        return self._final

    def _pause_now(self) -> float:
        if isinstance(self.pause, Backoff):
            pause = self.pause.after(self.number)
        else:
            pause = self.pause() if callable(self.pause) else self.pause
        if self.deadline is not None:
            pause = min(pause, max(0.0, self.deadline - self.clock()))
        return pause

    async def _wait(self, seconds: float) -> None:
        if self.stop is None:
            await asyncio.sleep(seconds)
            return
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass
