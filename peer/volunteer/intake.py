"""A stage worker's intake of tasks (a part of peer/volunteer/worker.py's StageWorker): which server
it asks next (backward servers first, the start rotating), the long-polled takes an idle worker leaves
open at every server of its stage at once, the tasks that arrive while it is busy (taken in the
pools' own order), and a task handed back undone."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from core.protocol.refusals import Refusal
from core.protocol.wire import RemoteError, StreamCut
from peer.volunteer.membership import Membership
from taskpool.types import priority

logger = logging.getLogger("hivepipe.worker")

# how long an idle worker's take waits at a server for a task (the server caps it at MAX_TAKE_WAIT)
TAKE_WAIT = 3.0


class Intake:
    """`links` (device -> link), `stage()` the worker's stage in the layout now (a failover changes
    it), `epoch()` its layout epoch now, `call` its request (StageWorker.call), `member` its
    Membership, `poll` the pause after an answer that came at once."""

    def __init__(
        self,
        *,
        device_id: str,
        links: dict,
        stage: Callable,
        epoch: Callable[[], int],
        call,
        member: Membership,
        poll: float,
    ):
        self.device_id, self.links, self.stage, self.epoch = device_id, links, stage, epoch
        self.call, self.member, self.poll = call, member, poll
        # an idle worker waits for a task at every server of its stage at once (long-polled `take`s, at
        # most one per server); a task that arrives while it works on another waits here, leased to it
        self.waiting: dict[str, asyncio.Future] = {}
        # server device -> whether its last take answer said tasks were queued there ("more"): one
        # that said none is asked again only by a waiting take, once this worker is idle, or after a
        # task went back undone (`undone`)
        self.more: dict[str, bool] = {}
        self.unready: str | None = None  # the server whose last task went back undone
        self.ready: list[tuple] = []  # (link, meta, tensors)
        self._turn = 0

    def arrived_from(self, device: str) -> list[str]:
        """The ids of the tasks leased from `device` that arrived and wait to be worked on."""
        self.harvest()
        return [meta["task"] for link, meta, _ in self.ready if link.device == device]

    async def stop_waiting(self) -> None:
        """Cancel the waiting takes and hand back the tasks that arrived but were never started."""
        for fut in self.waiting.values():
            fut.cancel()
        await asyncio.gather(*self.waiting.values(), return_exceptions=True)
        self.waiting.clear()
        ready, self.ready = self.ready, []
        await asyncio.gather(
            *(self.member.hand_back(link, meta["task"], meta.get("epoch", 0)) for link, meta, _ in ready)
        )

    async def undone(self, link, meta: dict) -> None:
        """Hand back a task this worker could not work on (a version the stage has not reached, a
        refusal, a failure). What the stage waits for may then be queued at a server whose last
        answer said it had none, which a worker kept busy by such tasks would never ask again (a slot
        taken over at an older version waits for backward tasks of the batch it lacks while the
        frontal servers hand out tasks of later batches): every server is asked again, this task's
        server last, until a task is done."""
        await self.member.hand_back(link, meta["task"], meta.get("epoch", 0))
        self.more.clear()
        self.unready = link.device

    def order(self) -> list[str]:
        """The stage's servers to ask for a task: backward servers first, rotating the start; the
        server whose last task could not be worked on goes last."""
        st = self.stage()
        order = [d for d in list(st.backward) + list(st.frontal) if d in self.links]
        if not order:
            return order
        self._turn = (self._turn + 1) % len(order)
        order = order[self._turn :] + order[: self._turn]
        return sorted(order, key=lambda d: d == self.unready)

    async def take(self, device: str, wait: float = 0.0):
        """(link, meta, tensors) of a task leased from `device`, or None; waits up to `wait` seconds
        there for one (a long poll) when asked to."""
        link, member = self.links[device], self.member
        request, done = member.handing_in(device, {"wait": wait} if wait else {})
        try:
            meta, tensors = await self.call(link, "take", request, timeout=10.0 + wait)
        except RemoteError as e:
            member.hand_ins.release(device, done)
            if e.refusal is Refusal.NOT_REGISTERED:
                await member.quiet(link.call, "register", member.registration())
            if wait:
                await asyncio.sleep(self.poll)  # the answer came at once: no tight loop of refused waits
            return None
        except BaseException as e:
            member.hand_ins.release(device, done)
            if not isinstance(e, Exception):
                raise  # (cancelled: a stop)
            logger.info("%s: take from %s failed: %r", self.device_id, device, e)
            leased = e.meta.get("task") if isinstance(e, StreamCut) and isinstance(e.meta, dict) else None
            if isinstance(leased, str):  # the answer was cut after naming the task: the server leased it
                # to us; hand it back now rather than leave it until a heartbeat reclaims it (>= 5 s)
                await member.hand_back(link, leased, e.meta.get("epoch", self.epoch()))
            elif isinstance(e, (ConnectionError, asyncio.TimeoutError)):
                # no answer at all: the server may have leased a task whose answer was lost. This was the
                # only take in flight there, so say so with what we hold: it re-queues the rest at once
                # (else a heartbeat does once the lease is 5 s old, the time an answer may be on its way)
                await member.quiet(link.call, "register", member.registration(device, take_lost=True), timeout=10.0)
            if wait:
                await asyncio.sleep(self.poll)
            return None
        member.hand_ins.release(device, done)
        member.hand_ins.arrived(device, done)
        self.more[device] = meta.get("more") is not False
        if not meta.get("task"):
            return None
        member.held_tickets[meta["task"]] = meta.get("lease")
        return link, meta, tensors

    def harvest(self) -> None:
        """Move the tasks that waiting takes brought into `ready`."""
        for device, fut in list(self.waiting.items()):
            if fut.done():
                del self.waiting[device]
                got = None if fut.cancelled() or fut.exception() is not None else fut.result()
                if got is not None:
                    self.ready.append(got)

    def pop_ready(self):
        """The best task that already arrived, in the pools' own order (lower batch, then lower
        micro-batch, then backward first): tasks that servers leased into this worker's waiting takes
        while it was busy wait for it, and the one the oldest batch waits for goes first."""

        def order(j):
            meta = self.ready[j][1]
            return priority(meta.get("batch", 0), meta.get("micro", 0), meta.get("kind"))

        i = min(range(len(self.ready)), key=order)
        return self.ready.pop(i)

    async def take_one(self):
        """A task that already arrived, else one from the first server that has one (backward servers
        first, rotating the start; a server with a waiting take is not asked twice, nor one whose last
        answer said it had no more tasks queued); None if none has."""
        self.harvest()
        if self.ready:
            return self.pop_ready()
        for device in self.order():
            if device in self.waiting or not self.more.get(device, True):
                continue
            got = await self.take(device)
            if got is not None:
                return got
        return None

    async def wait_for_task(self, stop: asyncio.Event, wait: float = TAKE_WAIT, until: float | None = None):
        """Wait up to `wait` seconds for a task at every server of the stage at once (one long-polled
        take per server): an idle worker costs each server one open call per `wait` seconds rather
        than a poll every `poll` seconds, and gets a task the moment one is cut. The first task to
        arrive is returned; one that another server hands out meanwhile waits in `ready`. With
        `until`, this returns None after that many seconds, the takes still waiting (a held gradient
        sum falls due then)."""
        for device in self.order():
            if device not in self.waiting:
                self.waiting[device] = asyncio.ensure_future(self.take(device, wait))
        if not self.waiting:
            await asyncio.sleep(self.poll)
            return None
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([*self.waiting.values(), stopped], timeout=until, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        self.harvest()
        return self.pop_ready() if self.ready else None
