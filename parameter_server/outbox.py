"""What this server owes other servers (outputs to the next stage, input gradients to the previous
one, replicas): background deliveries retried until taken, stamped with the layout epoch so that a
failover cancels them, and the server's other background work. Must not decide what is owed."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from core.protocol.methods import EPOCHED
from core.protocol.refusals import Refusal
from core.protocol.retry import Attempts, Backoff
from core.protocol.wire import RemoteError

logger = logging.getLogger("hivepipe.server")


class Outbox:
    """A server's deliveries to other servers and its background tasks, given what it reads of its
    server: `layout()` and `epoch()` as they are now (a failover changes both), and `connector`
    (device -> a link to that server, or None where there is none)."""

    def __init__(
        self,
        device_id: str,
        *,
        layout: Callable[[], object],
        epoch: Callable[[], int],
        connector: Callable[[str], object],
    ) -> None:
        self.device_id, self.layout, self.epoch, self.connector = device_id, layout, epoch, connector
        self.background: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)

    def spawn(self, coro) -> None:
        """Run `coro` in the background, held until it is done."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def deliver(self, device: str, method: str, meta: dict, tensors: list, attempts: int = 600):
        """A coroutine that delivers one message, retrying until it is taken. A message of the data
        path is stamped now with this server's layout epoch: after a failover it is refused, not
        retried, since the new epoch runs that work again."""
        if method in EPOCHED:
            meta = dict(meta, epoch=self.epoch())
        return self.deliver_loop(device, method, meta, tensors, attempts)

    async def deliver_loop(self, device: str, method: str, meta: dict, tensors: list, attempts: int) -> bool:
        """True when `device` took the message; False when it is not owed any more or not taken."""
        # (Attempts stops when the server is stopping, also when a call turned the cancellation into an
        # error of its own: else the retries, up to ~10 minutes, would keep the process alive)
        async for _ in Attempts(tries=attempts, pause=Backoff(0.05, 1.0)):
            if not any(device in st.servers for st in self.layout().stages):
                return False  # failed over: whatever it was owed is run again in the new epoch
            link = self.connector(device)
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
