"""A stage server's periodic work, every MAINTENANCE_PERIOD: its pools' timeouts and the batches it
may start (StageServer.maintenance / maybe_start_batches), its departed clients (a client whose
connection closed has left: SIGKILL closes it), and once a minute the C heap's free pages back to
the system."""

from __future__ import annotations

import asyncio
import logging
import time

from core.protocol.retry import Attempts
from peer.runtime import trim_heap

logger = logging.getLogger("hivepipe.serve")

MAINTENANCE_PERIOD = 0.2  # seconds between two passes
# seconds between two reads of the node's connections (departed clients): every pass
# (parameter_server.clients.DISCONNECT_GRACE)
CONNECTION_READ_PERIOD = 0.2
HEAP_TRIM_PERIOD = 60.0  # seconds between two returns of the C heap's free pages (peer.runtime.trim_heap)


class Maintenance:
    """The maintenance loop of `server` on `p2p` (whose list_peers gives the connected peers), a pass
    every `period` seconds."""

    def __init__(self, server, p2p, device: str, clock=time.monotonic, period: float = MAINTENANCE_PERIOD):
        self.server, self.p2p, self.device, self.clock, self.period = server, p2p, device, clock, period
        self._next_read = 0.0
        self._next_trim = clock() + HEAP_TRIM_PERIOD

    async def once(self) -> None:
        if self.clock() >= self._next_trim:
            self._next_trim = self.clock() + HEAP_TRIM_PERIOD
            trim_heap()
        try:
            self.server.maintenance()
            self.server.maybe_start_batches()
        except Exception:
            logger.exception("%s: maintenance failed", self.device)
        if self.clock() >= self._next_read:
            self._next_read = self.clock() + CONNECTION_READ_PERIOD
            try:
                peers = await asyncio.wait_for(self.p2p.list_peers(), 5.0)
                self.server.registry.drop_disconnected_clients({str(info.peer_id) for info in peers})
            except Exception as e:
                logger.debug("%s: reading the node's connections failed: %r", self.device, e)

    async def run(self, stop: asyncio.Event) -> None:
        async for _ in Attempts(pause=self.period, stop=stop):
            await self.once()
