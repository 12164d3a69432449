"""A peer's state, said once when it changes: the one line an operator reads to know what a server or a
volunteer is doing (and the state it announces, which the dashboard shows).

Every peer (peer/host/server.py `ServerHost`, peer/host/volunteer.py `VolunteerSession`) goes
through these states; each change prints one line on stdout, and a state that waits on others
(`WAITING`, `STOPPED`) says so again once a minute while it lasts, with how long it has lasted. While
serving, a server says its progress once a minute too (`progress: step 120/1500, loss 2.9134, ...`)."""

from __future__ import annotations

import enum
import logging
import os
import sys
import time
from typing import Callable, TextIO

from peer.errors import UsageError

logger = logging.getLogger("hivepipe.state")


class PeerState(enum.Enum):
    STARTING = "starting"  # its DHT node and p2p daemon start, it checks that others can reach it
    WAITING = "waiting"  # for the run's servers (which ones, for how long)
    SERVING = "serving"  # a server serves its stage; a volunteer computes tasks
    STOPPED = "stopped"  # the run is stopped (a role lost its last server): why, and what brings it back
    FINISHED = "finished"  # the run reached its last step
    LEAVING = "leaving"  # a signal, a refusal or an error: the peer hands back what it holds and exits


REMIND_EVERY = 60.0  # seconds between two reminders of a waiting or stopped state
REMIND_ENV = "HIVEPIPE_REMIND_EVERY"  # overrides REMIND_EVERY (seconds) for every peer of a machine


def remind_every_default() -> float:
    """REMIND_EVERY, or the positive number of seconds in $HIVEPIPE_REMIND_EVERY (a bad value is an
    error naming the variable, not a silent default)."""
    raw = os.environ.get(REMIND_ENV)
    if raw is None or raw == "":
        return REMIND_EVERY
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UsageError(f"{REMIND_ENV}={raw!r} is not a positive number of seconds")
    return value


class StateLine:
    """Prints `<who>: <state>: <detail>` when the state (or, for a waiting state, what it waits for)
    changes, and a reminder with the time spent once every `remind_every` seconds while a waiting
    state lasts. `clock` is injected for the tests."""

    WAITS = (PeerState.WAITING, PeerState.STOPPED)

    def __init__(
        self,
        who: str,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        remind_every: float | None = None,
    ):
        self.who, self._out, self.clock = who, out, clock
        self.remind_every = remind_every_default() if remind_every is None else remind_every
        self.state: PeerState | None = None
        self.detail = ""
        self.since = clock()
        self._reminded = self.since
        self._progressed = float("-inf")
        self.history: list[tuple[PeerState, str]] = []

    def waiting_for_initial_peers(self, why: str) -> None:
        """What a peer says while none of its initial peers answers yet (peer.node.start_dht's on_wait)."""
        self.say(PeerState.WAITING, f"for the initial peers to answer: {why}")

    def say(self, state: PeerState, detail: str = "") -> bool:
        """Enter `state` (with `detail`); True if a line was printed (a change), False if it was the
        same state and detail, which is then only reminded of once a minute."""
        now = self.clock()
        if state == self.state and detail == self.detail:
            if state in self.WAITS and now - self._reminded >= self.remind_every:
                self._reminded = now
                self._print(f"{state.value}: still {detail} ({now - self.since:.0f} s)")
            return False
        self.state, self.detail, self.since, self._reminded = state, detail, now, now
        self.history.append((state, detail))
        self._print(f"{state.value}: {detail}" if detail else state.value)
        return True

    def progress(self, text: str) -> bool:
        """A progress line (`<who>: progress: <text>`) while serving, at most once every
        `remind_every` seconds (the first one a period after serving began); True if printed."""
        now = self.clock()
        if self.state is not PeerState.SERVING or now - self._progressed < self.remind_every:
            return False
        if now - self.since < self.remind_every:
            return False
        self._progressed = now
        self._print(f"progress: {text}")
        return True

    def line(self) -> str | None:
        """The current state as its line says it (without the peer's name), None before the first."""
        if self.state is None:
            return None
        return f"{self.state.value}: {self.detail}" if self.detail else self.state.value

    def _print(self, text: str) -> None:
        print(f"{self.who}: {text}", file=self._out or sys.stdout, flush=True)

    async def wait_for(self, stop, what: str, check, poll: float = 0.5):
        """Poll `check()` (a coroutine returning a value, or None to keep waiting) until it gives a
        value or `stop` is set (then None). The line says what it waits for, once at the start and
        once a minute; a network failure inside `check` is waiting too, never an exit."""
        from core.protocol.retry import Attempts
        from core.protocol.trust import AmbiguousRunKey

        async for _ in Attempts(pause=poll, stop=stop):
            try:
                value = await check()
            except UsageError:
                raise
            except AmbiguousRunKey as e:  # nothing to wait for: the user must say which run
                raise UsageError(str(e)) from None
            except Exception as e:
                logger.debug("while waiting for %s: %r", what, e)
                value = None
            if value is not None:
                return value
            self.say(PeerState.WAITING, f"for {what}")
        return None
