"""How often a working volunteer reads the run's records (the config and the servers' records).

Every peer reading every stage's servers' key each few seconds is what the DHT's key holders serve
most of: it grows with the volunteers. A volunteer that works on a stage whose servers all answer it
learns from those answers what the records would tell it (a new layout epoch: a `stale epoch`
refusal, then `get_layout`; the run's end: a heartbeat's answer), so it reads the records only every
CALM_READ_PERIOD_S. It looks every two announce periods while it does not work yet, while the run is
stopped, and while a server of its stage fails to answer (a restarted server announces new
addresses; a lost one is failed over), as before. docs/scale.md counts what this saves."""

from __future__ import annotations

import time
from typing import Callable, Iterable

CALM_READ_PERIOD_S = 60.0


def links_answer(links: Iterable) -> bool:
    """Every link (to a server of the volunteer's stage) got its last call through."""
    return all(getattr(link, "health", None) is None or link.health.failing_since is None for link in links)


def calm(worker, halt) -> bool:
    """A volunteer works (`worker`, its StageWorker, is not None), the run is not stopped (`halt`,
    its HaltNotice, gives no reason) and every server of its stage answers."""
    halted = halt is not None and halt.reason is not None
    return worker is not None and not halted and links_answer(worker.links.values())


class ReadSchedule:
    """Looked at every `look` seconds (two announce periods); `due(calm)` says whether to read the
    records now: always when not calm, else once every `calm_period` seconds."""

    def __init__(
        self,
        announce_period: float,
        calm_period: float = CALM_READ_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.look = 2 * announce_period
        self.calm_period = max(calm_period, self.look)
        self.clock = clock
        self.last: float | None = None  # when the records were last read
        self.reads = 0

    def due(self, calm: bool) -> bool:
        now = self.clock()
        if calm and self.last is not None and now - self.last < self.calm_period:
            return False
        self.last, self.reads = now, self.reads + 1
        return True
