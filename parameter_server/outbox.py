"""What this server owes other servers (outputs to the next stage, input gradients to the previous
one, replicas): background deliveries retried until taken, stamped with the layout epoch so that a
failover cancels them. Must not decide what is owed."""

from __future__ import annotations

import asyncio
import logging

from core.protocol.methods import EPOCHED
from core.protocol.refusals import Refusal
from core.protocol.retry import Attempts, Backoff
from core.protocol.wire import RemoteError

logger = logging.getLogger("hivepipe.server")


class Outbox:
    """StageServer's background deliveries to other servers (a part of parameter_server.service.StageServer)."""

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def deliver(self, device: str, method: str, meta: dict, tensors: list, attempts: int = 600):
        """A coroutine that delivers one message, retrying until it is taken. A message of the data
        path is stamped now with this server's layout epoch: after a failover it is refused, not
        retried, since the new epoch runs that work again."""
        if method in EPOCHED:
            meta = dict(meta, epoch=self.epoch)
        return self._deliver_loop(device, method, meta, tensors, attempts)

    async def _deliver_loop(self, device: str, method: str, meta: dict, tensors: list, attempts: int) -> bool:
        """True when `device` took the message; False when it is not owed any more or not taken."""
        # (Attempts stops when the server is stopping, also when a call turned the cancellation into an
        # error of its own: else the retries, up to ~10 minutes, would keep the process alive)
        async for _ in Attempts(tries=attempts, pause=Backoff(0.05, 1.0)):
            if not any(device in st.servers for st in self.layout.stages):
                return False  # failed over: whatever it was owed is run again in the new epoch
            link = self.connector(device) if self.connector else None
            if link is not None:
                try:
                    await link.call(method, meta, tensors, timeout=30.0)
                    return True
                except RemoteError as e:
                    if e.refusal in (Refusal.ALREADY_APPLIED, Refusal.STALE_EPOCH):
                        return False
                    logger.debug("%s: %s to %s refused: %s", self.device_id, method, device, e)
                except Exception as e:
                    logger.debug("%s: %s to %s failed: %r", self.device_id, method, device, e)
        logger.warning("%s: gave up delivering %s to %s", self.device_id, method, device)
        return False
