"""A server's records in the DHT: its own record under its stage key every announce period (quickly
until it has seen every server of the run), and the run's config record, which carries the current
layout epoch for volunteers that join after a failover."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from core.layout import RunLayout
from core.protocol import record_store, records
from core.protocol.records import JOINING_PERIOD, RecordState
from core.protocol.retry import Attempts

logger = logging.getLogger("hivepipe.serve")


class Announcer:
    """Announces `server` (a parameter_server.service.StageServer) in the DHT and keeps `directory`
    (a peer.directory.Directory) fresh. `record_state` is the state it announces: "joining" until every
    server of the layout has been seen, then "online"; `online` is set at that moment. `on_refresh`
    runs after each round (the host says its state from it). `fenced` holds why the server left the
    run when the others failed it over while it was away; it then announces nothing more."""

    def __init__(self, dht, server, directory, run_cfg, maddrs: list[str], peer_id: str, device: str, compute=None):
        self.dht, self.server, self.directory, self.run_cfg = dht, server, directory, run_cfg
        self.maddrs, self.peer_id, self.device = maddrs, peer_id, device
        self.compute: Callable[[], float] = compute or (lambda: 0.0)
        self.period = run_cfg.announce_period
        self.record_state = RecordState.JOINING
        self.online = asyncio.Event()
        self.fenced: list[str] = []
        self.on_refresh: list[Callable[[], None]] = []
        self.says: Callable[[], str | None] = lambda: None  # the host's state line
        self._config_sent: dict = {"body": None, "at": float("-inf")}

    def record(self, state: str) -> dict:
        servers = set(self.directory.servers.values()) | {self.peer_id}
        announced = self.server.report.announcement(state, self.maddrs, float(self.compute()), servers, self.says())
        return records.record_to_dict(announced)

    async def announce(self, state: str) -> None:
        """This server's record, and the run's config when it changed or a third of its life has
        passed since it was last stored (it is the same for every server and changes only at a
        failover: not every period, each store is a DHT traversal). A server the run failed over
        stores no config: its layout is of an older epoch."""
        ttl = records.record_ttl(self.period)
        if not self.fenced:
            config = self.run_cfg.to_dict() | {"layout": self.server.layout.to_dict(), "epoch": self.server.epoch}
            sent = self._config_sent
            if config != sent["body"] or time.monotonic() - sent["at"] >= ttl / 3:
                if await record_store.publish(self.dht, config, ttl=ttl):
                    sent.update(body=config, at=time.monotonic())
        await record_store.publish(self.dht, self.record(state), ttl=ttl, stage=self.server.stage)

    async def announce_quietly(self, state: str) -> None:
        try:
            await self.announce(state)
        except Exception as e:
            logger.debug("announce failed: %r", e)

    async def failed_over_meanwhile(self) -> str | None:
        """Why this server is out of the run, if a later layout epoch leaves it out: the host's
        start-up check reads the config record once, and the others may fail this server over while
        it resumes (a restart slower than --failover-after)."""
        server = self.server
        if max(self.directory.epochs.values(), default=0) <= server.epoch:
            return None
        config = await record_store.read_config_value(self.dht)
        if not (
            isinstance(config, dict)
            and isinstance(config.get("epoch"), int)
            and config["epoch"] > server.epoch
            and isinstance(config.get("layout"), dict)
        ):
            return None
        later = RunLayout.from_dict(config["layout"], server.cfg.layers)
        if any(self.device in s.servers for s in later.stages):
            return None
        return (
            f"{self.device} was failed over while it was away (the run is at layout epoch {config['epoch']} "
            "without it); it leaves the run: start it under a new device id as a volunteer, or start a new run"
        )

    def everyone_seen(self) -> bool:
        """Every server of the current layout epoch has been seen (a server restarted after a
        failover does not wait for the lost one)."""
        return all(d in self.directory.known for s in self.server.layout.stages for d in s.servers)

    async def run(self, stop: asyncio.Event) -> None:
        def pause() -> float:  # until it has seen every server, quickly: the run starts once all have
            return self.period if self.online.is_set() else min(self.period, JOINING_PERIOD)

        async for _ in Attempts(pause=pause, stop=stop):
            try:
                why = await self.failed_over_meanwhile()
                if why is not None:
                    logger.error("%s", why)
                    self.fenced.append(why)
                    stop.set()
                    break
                await self.announce(self.record_state)
                servers = await self.directory.refresh()
                self.server.directory.update(servers, self.directory.versions, self.directory.epochs)
                if self.record_state == RecordState.JOINING and self.everyone_seen():
                    self.record_state = RecordState.ONLINE
                    self.online.set()
                    self.server.copies.replicate_hosted()  # a server lost before the first step can be failed over
                    await self.announce(self.record_state)  # at once, not a period later: readers date the start by it
            except Exception as e:
                logger.debug("announce failed: %r", e)
            for hook in self.on_refresh:
                hook()
