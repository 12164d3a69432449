"""Which servers of the run are lost, and their failover: once the run is online, a server of the
current layout silent in the DHT (no new record for records.stale_after(period)) for
`failover_after` seconds more (30 s when failover is off), that does not answer a direct ping either,
is lost. The first remaining server of the run fails it over (the others adopt the layout epoch it
sends them); a role's last server cannot be, so every server announces that the run is stopped until
it comes back."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from core.layout import halt_reason
from core.protocol import records
from core.protocol.retry import Attempts

logger = logging.getLogger("hivepipe.serve")

PROBE_S = 5.0  # seconds a liveness probe of a server that seems lost may take, dial and retries included
OFF_AFTER = 30.0  # seconds after which a silent server stops the run when failover is off


class FailureDetector:
    """Watches `server`'s layout through `directory` (silent_for(device) in seconds) and
    `answers(device)` (an awaitable liveness probe). `halt` (a peer.directory.HaltNotice) says when the
    run stops and goes on. `clock` is injected for the tests."""

    def __init__(
        self,
        server,
        directory,
        device: str,
        period: float,
        failover_after: float,
        answers: Callable[[str], Awaitable[bool]],
        halt=None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.server, self.directory, self.device = server, directory, device
        self.period, self.failover_after = period, failover_after
        self.answers, self.halt, self.clock = answers, halt, clock
        self.missing_since: dict[str, float] = {}
        self.record: dict | None = None  # the layout epoch record of this server's last failover

    async def check(self) -> list[str]:
        """One look; returns the servers this server failed over in it."""
        server = self.server
        now = self.clock()
        # a server that said the run finished has left because it is over, not lost
        done = getattr(self.directory, "finished", set())
        current = [d for s in server.layout.stages for d in s.servers if d not in done]
        for d in current:
            if d == self.device or self.directory.silent_for(d) <= records.stale_after(self.period):
                self.missing_since.pop(d, None)
            else:
                self.missing_since.setdefault(d, now)
        after = self.failover_after or OFF_AFTER
        lost = sorted(d for d, t0 in self.missing_since.items() if d in current and now - t0 >= after)
        # silent in the DHT is not enough (a busy DHT node's read can miss records for seconds): it
        # must not answer a direct call either. All probed at once: a DHT read under load can miss
        # several live servers' records, and each probe of a frozen one costs PROBE_S
        for d, up in zip(list(lost), await asyncio.gather(*(self.answers(d) for d in lost))):
            if up:
                lost.remove(d)
                self.missing_since.pop(d, None)
        alive = [d for d in current if d not in lost]
        if self.failover_after > 0:
            stranded = server.layout.stranded(lost)
        else:
            stranded = [server.layout.locate(d)[:2] + ((d,),) for d in lost]
        server.halted = halt_reason(stranded, failover=self.failover_after > 0)
        if self.halt is not None:
            self.halt.update(server.halted)
        lost = [d for d in lost if not any(d in devs for _, _, devs in stranded)]
        if not (lost and alive and alive[0] == self.device):
            return []
        try:
            record = await server.epochs.fail_over(lost)
        except Exception as e:
            logger.error("%s: cannot fail over %s: %s", self.device, lost, e)
            for d in lost:  # try again after another failover_after
                self.missing_since[d] = now
            return []
        self.record = record
        logger.warning(
            "%s: failed over %s: layout epoch %d from batch %d",
            self.device,
            lost,
            record["epoch"],
            record["from_batch"],
        )
        return lost

    async def run(self, stop: asyncio.Event, online: asyncio.Event) -> None:
        """Looks once a period, from the moment the run is online; apart from the announcer, whose
        records must not wait for the calls of a liveness check or a failover."""
        await online.wait()
        async for _ in Attempts(pause=self.period, stop=stop):
            try:
                await self.check()
            except Exception as e:
                logger.info("%s: checking for lost servers failed: %r", self.device, e)
