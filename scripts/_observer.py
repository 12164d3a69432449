"""What the attacker scripts of scripts/bench_trust.py (_hoarder.py, _cycler.py) read of the run they
attack: its config and the version every server announces, through a client-mode DHT node of their own.
Not a tool for users."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--initial-peers", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--after-version", type=int, default=2, help="start once the servers announce this version")
    p.add_argument("--seconds", type=float, default=3600.0)


class RunObserver:
    """A DHT node in the run `a.run_id` (at `a.initial_peers`); `stop` is set on SIGTERM. Use as an
    async context manager; `versions` collects (time, version) from `note_version`."""

    def __init__(self, a):
        self.a = a
        self.stop = asyncio.Event()
        self.versions: list[tuple[float, int | None]] = []
        self.dht = self.run = self.directory = None

    async def __aenter__(self) -> "RunObserver":
        from core.protocol import record_store
        from core.protocol.trust import split_run_id
        from peer.directory import Directory
        from peer.node import start_dht

        self.run_id, run_fp = split_run_id(self.a.run_id)
        self.dht = start_dht([self.a.initial_peers], run_id=self.run_id, run_fp=run_fp, client_mode=True, timeout=60.0)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.stop.set)
        try:
            while self.run is None and not self.stop.is_set():
                self.run = await record_store.read_config(self.dht, self.run_id)
                await asyncio.sleep(0.5)
        except BaseException:
            await self.__aexit__()
            raise
        if self.run is not None:
            self.directory = Directory(self.dht, self.run_id, len(self.run.layout["stages"]))
            self.servers = len([d for st in self.run.layout["stages"] for d in st["frontal"] + st["backward"]])
        return self

    async def __aexit__(self, *exc) -> None:
        from peer.node import stop_dht

        stop_dht(self.dht)

    async def version(self) -> int | None:
        """The lowest version the run's servers announce (None until every server has)."""
        await self.directory.refresh()
        return min(self.directory.versions.values()) if len(self.directory.versions) == self.servers else None

    async def wait_for_start(self) -> bool:
        """Until the servers announce --after-version: True, or False if stopped first."""
        while not self.stop.is_set() and ((await self.version()) or -1) < self.a.after_version:
            await asyncio.sleep(0.25)
        return not self.stop.is_set()

    async def note_version(self) -> bool:
        """Read and keep the run's version; True once it reached the run's last step."""
        v = await self.version()
        self.versions.append((time.time(), v))
        return v is not None and v >= self.run.steps

    async def pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less if stopped meanwhile."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass
