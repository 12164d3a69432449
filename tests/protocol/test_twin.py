"""peer.host.twin.live_holder on an injected clock: a record under this server's own identity that is
re-announced while it watches is a live twin's, found within a period or so; one that stays as it was
is a crashed predecessor's, and the start goes on after the watch; a read that misses the record or
fails (a loaded DHT) does not end the watch early."""

from __future__ import annotations

import asyncio

from core.protocol import records
from peer.host.twin import live_holder

PERIOD = 2.0
WATCH = records.stale_after(PERIOD) + PERIOD


class World:
    """The run's records as time passes: ours announced every `every` seconds (None: never again)."""

    def __init__(self, every: float | None, last_write: float, missed_reads: int = 0, failed_reads: int = 0):
        self.now, self.every, self.last_write = 1000.0, every, last_write
        self.missed, self.failed = missed_reads, failed_reads
        self.slept = 0.0

    def ours(self) -> dict | None:
        if self.last_write is None:
            return None
        if self.every is not None:
            while self.last_write + self.every <= self.now:
                self.last_write += self.every
        return {"kind": "server", "device": "s0b0", "time": self.last_write, "maddrs": ["/ip4/127.0.0.1/tcp/1"]}

    async def read(self):
        if self.failed:
            self.failed -= 1
            raise TimeoutError("a loaded DHT")
        other = ("peer-other", {"kind": "server", "device": "s0f0", "time": self.now}, None)
        if self.missed:
            self.missed -= 1
            return [other]
        ours = self.ours()
        return [other] + ([("peer-me", ours, None)] if ours else [])

    async def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s

    def holder(self):
        return asyncio.run(live_holder(self.read, "peer-me", PERIOD, monotonic=lambda: self.now, sleep=self.sleep))


def test_a_twin_that_re_announces_is_found_within_a_period_or_so():
    world = World(every=PERIOD, last_write=999.5)
    found = world.holder()
    assert found is not None and found["time"] > 999.5 and found["device"] == "s0b0"
    assert world.slept <= PERIOD + 1e-9


def test_a_twin_is_found_though_the_first_reads_miss_its_record_or_fail():
    world = World(every=PERIOD, last_write=999.5, missed_reads=2, failed_reads=1)
    assert world.holder() is not None and world.slept < WATCH


def test_a_crashed_predecessors_record_or_none_is_watched_for_the_whole_window_then_let_be():
    for world in (World(every=None, last_write=999.0), World(every=None, last_write=None)):
        assert world.holder() is None
        assert abs(world.slept - WATCH) < 1e-9
