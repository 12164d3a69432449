"""A stage worker's standing with its stage's servers (a part of peer/volunteer/worker.py's
StageWorker): its registration and heartbeats, each saying which of a server's tasks it holds (with
their lease tickets) and handing in the tasks it finished there; a task handed back; a refusal that
will not change (banned, not allowed), kept and said once; and the run's end, when a server answers
that it is over."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from core.protocol.refusals import Refusal
from core.protocol.retry import Attempts
from core.protocol.wire import RemoteError
from peer.volunteer.handins import HandIns

logger = logging.getLogger("hivepipe.worker")


class Membership:
    """`links` (device -> link to each server of the stage), `servers()` the stage's servers now (a
    failover changes them), `epoch()` the worker's layout epoch now, `holding(device)` the task ids
    leased from `device` that the worker works on or keeps, `call` the worker's request (StageWorker.call)."""

    def __init__(
        self,
        *,
        device_id: str,
        stage: int,
        compute: Callable[[], float],
        links: dict,
        servers: Callable[[], list[str]],
        epoch: Callable[[], int],
        holding: Callable[[str], list[str]],
        call,
        heartbeat: float,
    ):
        # the rows/s it registers, read at each registration: its worker measures it after it is built
        self.device_id, self.stage, self.compute, self.links = device_id, stage, compute, links
        self.servers, self.epoch, self.holding, self.call, self.heartbeat = servers, epoch, holding, call, heartbeat
        # the tasks finished (credited by every server, or a forward pass's outputs delivered) and
        # handed in with the next take or heartbeat to the server that leased each (peer/volunteer/handins.py)
        self.hand_ins = HandIns()
        # task id -> the ticket of its lease, while this worker holds it: a `register` that lists what it
        # holds proves each lease with its ticket (a server that restarted adopts only proven leases)
        self.held_tickets: dict[str, str | None] = {}
        # why the run refuses this worker for good (its work failed a check; it is not on a closed run's
        # list): such a refusal will not change, so the worker stops rather than ask again
        self.banned: str | None = None  # the words of a refusal for good (banned, not allowed), once heard
        self.refusal: Refusal | None = None  # and its code
        # a server of the stage answered that the run is over (every server of the run applied its
        # last step): nothing more will come, and the worker stops (`over`, and `halt` set)
        self.over = False
        self.halt: asyncio.Event | None = None
        # device -> the parameter version its last `register` answer said it is at (Worker.warm_up)
        self.versions_told: dict[str, int] = {}

    def clear(self) -> None:
        """A new layout epoch: the old epoch's leases are gone, and their tasks run again in it."""
        self.hand_ins.clear()
        self.held_tickets.clear()
        self.versions_told.clear()

    def _stage(self) -> list[str]:
        return [d for d in self.servers() if d in self.links]

    async def register(self, first: bool = False) -> None:
        """Register (and heartbeat) with every server of the stage, saying which of its tasks this
        worker holds: a lease it does not know of (an answer lost on the way) is re-queued at once.
        `first`: this worker just started, so any lease under its peer id is a predecessor's (a
        supervised server forked again) and goes back at once, however young."""
        extra = {"first": True} if first else {}
        self.forget_tickets()
        await asyncio.gather(*(self.beat_once(d, **extra) for d in self._stage()))

    def stage_version(self) -> int | None:
        """The newest parameter version every server of the stage has said it holds (their `register`
        answers), or None before all of them answered."""
        told = [self.versions_told.get(d) for d in self._stage()]
        return None if not told or None in told else min(told)

    def forget_tickets(self) -> None:
        """Forget the tickets of tasks no longer held anywhere (done, handed back, or an old epoch's)."""
        held = {t for d in self._stage() for t in self.holding(d)}
        for task in [t for t in self.held_tickets if t not in held]:
            del self.held_tickets[task]

    async def beat_once(self, device: str, **extra) -> None:
        """One `register` at `device`, carrying the tasks finished there (quiet: a failure is logged at
        debug, and the finished tasks go with the next call)."""
        meta, done = self.handing_in(device, self.registration(device, **extra))
        try:
            answer = await self.quiet(self.links[device].call, "register", meta, timeout=10.0)
        finally:
            self.hand_ins.release(device, done)
        if answer is not None:
            self.hand_ins.arrived(device, done)
            if isinstance(answer, tuple) and isinstance(answer[0], dict) and isinstance(answer[0].get("version"), int):
                self.versions_told[device] = answer[0]["version"]
            if isinstance(answer, tuple) and isinstance(answer[0], dict) and answer[0].get("over") is True:
                self.over = True
                if self.halt is not None:
                    self.halt.set()

    def registration(self, device: str | None = None, **extra) -> dict:
        """A `register` request; with `device`, listing what this worker holds at that server."""
        meta = {"device": self.device_id, "compute": float(self.compute()), "stage": self.stage, **extra}
        if device is not None:
            meta["holding"] = self.holding(device)
            meta["leases"] = [self.held_tickets.get(t) for t in meta["holding"]]
        return meta

    def finish_later(self, device: str, task_id: str, epoch: int) -> None:
        """A task leased from `device` in layout epoch `epoch` is done: say so with the next take or
        heartbeat there (nothing to say of an older epoch's task: its lease is gone)."""
        if epoch == self.epoch():
            self.hand_ins.add(device, task_id)

    def handing_in(self, device: str, meta: dict) -> tuple[dict, list[str]]:
        """`meta` carrying the tasks finished at `device` (and the epoch they belong to) that no call
        in flight carries, and their ids (in flight until hand_ins.release)."""
        done = self.hand_ins.take(device)
        return (dict(meta, complete=done, epoch=self.epoch()) if done else meta), done

    async def hand_in_finished(self) -> None:
        """A heartbeat to every server that has finished tasks of this worker not handed in yet (a
        clean stop)."""
        await asyncio.gather(*(self.beat_once(d) for d in self.hand_ins.devices() if d in self.links))

    async def hand_back(self, link, task: str, epoch: int) -> None:
        """Give task `task` back to the server of `link` (`fail`: it is re-queued at once), quietly."""
        await self.quiet(self.call, link, "fail", {"task": task}, epoch=epoch)

    async def quiet(self, call, *args, **kwargs):
        """`call(*args, **kwargs)`, its failure logged at debug and answered None. The call is made
        here, not handed in made: a gather of these cancelled before its tasks start would leave a
        handed-in coroutine never awaited ("coroutine 'StageWorker.call' was never awaited")."""
        try:
            return await call(*args, **kwargs)
        except Exception as e:
            if not self.refused_for_good(e):
                logger.debug("%s: %r", self.device_id, e)
            return None

    def refused_for_good(self, e: Exception) -> bool:
        """Whether `e` is a refusal that will not change (Refusal.final); the first one is kept as
        `banned` (its words) and `refusal` (its code) and said once."""
        if not isinstance(e, RemoteError) or not e.refusal.final:
            return False
        if self.banned is None:
            self.banned, self.refusal = str(e), e.refusal
            logger.error("%s: %s", self.device_id, e)
        return True

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        """A heartbeat to each server of the stage on its own beat: a server slow to answer (its
        loop busy, or restarting) must not delay the others', which would count the delay as
        silence (sent and awaited together, one slow answer delays every beat).
        The stage's servers are looked up every beat (a failover changes them)."""
        beats: dict[str, asyncio.Future] = {}
        try:
            async for _ in Attempts(pause=self.heartbeat, stop=stop):
                devices = set(self._stage())
                for d in [d for d, b in beats.items() if d not in devices or b.done()]:
                    beats.pop(d).cancel()
                for d in sorted(devices - beats.keys()):
                    beats[d] = asyncio.ensure_future(self.beats_to(d, stop))
        finally:
            for b in beats.values():
                b.cancel()
            await asyncio.gather(*beats.values(), return_exceptions=True)

    async def beats_to(self, device: str, stop: asyncio.Event) -> None:
        """A heartbeat to `device` every `heartbeat` seconds until `stop`, or until it leaves the stage."""
        async for _ in Attempts(pause=self.heartbeat, stop=stop):
            if self.links.get(device) is None or device not in self.servers():
                return
            self.forget_tickets()
            await self.beat_once(device)
