"""A stage worker's parameter gradients, summed per batch over its tasks, and their pushes (a part of
peer/volunteer/worker.py's StageWorker): a batch's sum goes to every server of the stage, one shard
each, when the flush rule says so (scheduler/flush.py); its tasks stay leased until every server has
credited it, and those not credited everywhere are handed back to be re-run."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from scheduler.flush import IDLE_HOLD_S, awaiting_after, batches_to_push, hold_ends, owed_after

logger = logging.getLogger("hivepipe.worker")


@dataclass
class Pending:
    """The parameter gradients of one batch summed over tasks whose sum is not pushed yet; the tasks
    stay leased (and are re-run by others if this client vanishes) until every server credits it."""

    batch: int
    epoch: int  # the layout epoch its tasks were taken in
    tasks: list = field(default_factory=list)  # (leasing server's link, task id, lease deadline, lease seconds)
    tickets: dict = field(default_factory=dict)  # task id -> its lease's ticket (core/protocol/leases.py)
    grads: dict | None = None
    loss_sum: float | None = None

    def add(self, link, meta: dict, grads: dict[str, torch.Tensor], loss: float | None) -> None:
        length = float(meta.get("deadline", 60.0))
        self.tasks.append((link, meta["task"], time.monotonic() + length, length))
        self.tickets[meta["task"]] = meta.get("lease")
        if self.grads is None:
            self.grads = grads
        else:
            for n, g in grads.items():
                self.grads[n].add_(g)
        if loss is not None:
            self.loss_sum = (self.loss_sum or 0.0) + loss


class GradientSums:
    """The sums not pushed yet (`pending`, batch -> Pending), those on their way (`pushing`), the
    batches an idle worker holds while it is owed tasks of them (`awaiting`, `owed_forward`)."""

    def __init__(
        self,
        *,
        device_id,
        last,
        max_pending,
        call,
        links,
        shards,
        own_server,
        stats,
        finish_later,
        hand_back,
        point,
        die_at,
    ):
        self.device_id, self.last, self.max_pending = device_id, last, max_pending
        self.call, self.links, self.shards, self.own_server = call, links, shards, own_server
        self.stats, self.die_at = stats, die_at
        # the worker's own: a task finished (handed in later), a task handed back, a kill point reached
        self.finish_later, self.hand_back, self.point = finish_later, hand_back, point
        self.pending: dict[int, Pending] = {}  # batch -> gradients summed over tasks not pushed yet
        self.awaiting: dict[int, float] = {}  # batch held while idle (owed tasks of it) -> since when
        self.owed_forward: set[int] = set()  # batches its frontal server said it cuts more tasks of for this worker
        self.pushing: list[Pending] = []  # sums on their way to the servers (their tasks still held)

    def add(self, link, meta: dict, grads: dict[str, torch.Tensor], loss: float | None) -> None:
        """A task's gradients into its batch's sum (the task stays leased until the sum is credited)."""
        self.pending.setdefault(meta["batch"], Pending(meta["batch"], meta["epoch"])).add(link, meta, grads, loss)

    async def push_alone(self, link, meta: dict, grads: dict[str, torch.Tensor], loss: float | None) -> None:
        """A task on its second attempt is pushed alone at once: a sum never overlaps another client's
        in part for long."""
        alone = Pending(meta["batch"], meta["epoch"])
        alone.add(link, meta, grads, loss)
        await self.push(alone)

    def holding(self, device: str) -> list[str]:
        """The task ids leased from server `device` that are in a sum, pushed or not."""
        sums = list(self.pending.values()) + list(self.pushing)
        return [tid for p in sums for link, tid, _, _ in p.tasks if link.device == device]

    def owed(self, batch: int, more: bool) -> None:
        """A forward task's answer said whether its server cuts more of `batch` for this worker."""
        self.owed_forward = owed_after(self.owed_forward, batch, more)

    def clear(self) -> None:
        """A new layout epoch: the old epoch's leases are gone, and their tasks run again in it."""
        self.pending.clear()

    async def flush_all(self) -> None:
        await self.flush(sorted(self.pending))

    def due(self, task: dict | None, kept) -> list[int]:
        """The pending batches to push now (scheduler/flush.py); an idle worker holds a batch it is owed
        tasks of for up to IDLE_HOLD_S: backward tasks of the forward passes it keeps (`kept`, keyed
        by batch first), or forward tasks of the micro-batches its frontal server has not cut yet (the
        batch's member, say its answers)."""
        now = time.monotonic()
        leases = {b: [(deadline, length) for _, _, deadline, length in p.tasks] for b, p in self.pending.items()}
        if task is None:
            owed = ({key[0] for key in kept} | self.owed_forward).intersection(self.pending)
            self.awaiting = awaiting_after(self.awaiting, owed, now)
        return batches_to_push(leases, task, now, self.max_pending, self.last, self.awaiting, IDLE_HOLD_S)

    def hold_left(self) -> float | None:
        """Seconds until the first batch an idle worker holds is due (None: it holds none)."""
        ends = hold_ends(self.awaiting, self.pending)
        return None if ends is None else max(0.0, ends - time.monotonic())

    async def flush(self, batches: list[int]) -> None:
        for b in batches:
            if b in self.pending:
                try:
                    await self.push(self.pending.pop(b))
                except Exception as e:  # its tasks stay leased here: they run out and are re-run by others
                    transport = isinstance(e, (ConnectionError, asyncio.TimeoutError))
                    logger.log(
                        logging.INFO if transport else logging.WARNING,
                        "%s: gradient push of batch %d failed: %r",
                        self.device_id,
                        b,
                        e,
                    )

    async def push(self, p: Pending) -> None:
        """Push one batch's summed gradient, sharded, to every server of the stage with the ids of the
        tasks it covers; then complete the tasks every server credited and hand back the rest (they
        are re-run and pushed alone). Each server credits the push all or nothing."""
        self.pushing.append(p)
        try:
            await self._push(p)
        finally:
            self.pushing.remove(p)

    async def _push(self, p: Pending) -> None:
        ids = [tid for _, tid, _, _ in p.tasks]
        base = {"tasks": ids, "leases": [p.tickets[tid] for tid in ids], "batch": p.batch}
        if p.loss_sum is not None:
            base["loss_sum"] = float(p.loss_sum)
        items = self.shards()

        def send(device: str, slot: int, names: list[str]):
            grads = [p.grads[n] for n in names]
            return self.call(
                self.links[device], "push_grads", dict(base, slot=slot), grads, timeout=60.0, epoch=p.epoch
            )

        if self.die_at == "mid_grad_push":  # one server gets its shard, the others never do
            await send(*items[0])
            self.point("mid_grad_push")
        server = self.own_server()
        if server is not None:  # its replica of each other slot may take the step from this push
            for device, slot, names in items:
                if device != self.device_id:
                    server.copies.note_own_push(slot, p.batch, [p.grads[n] for n in names])
        answers = await asyncio.gather(*(send(*item) for item in items), return_exceptions=True)
        self.stats["pushes"] += 1
        self.point("after_grad_push")
        credited = set(ids)
        for (device, _, _), answer in zip(items, answers):
            if isinstance(answer, BaseException):
                logger.info("%s: gradient push to %s failed: %r", self.device_id, device, answer)
                credited = set()
            elif answer[0].get("result") == "conflict":
                # some tasks were credited there from another client's copy: the rest are re-run alone
                credited &= set(answer[0].get("credited", []))
                self.stats["conflicts"] += 1
        # the tasks credited everywhere are handed in with the next take or heartbeat to the server
        # that leased each (they stay listed as held until then); a task not credited everywhere is
        # handed back on its own
        for link, tid, _, _ in p.tasks:
            if tid in credited:
                self.finish_later(link.device, tid, p.epoch)
        await asyncio.gather(
            *(self.hand_back(link, tid, p.epoch) for link, tid, _, _ in p.tasks if tid not in credited)
        )
        n = len(ids) - len(credited)
        if n:
            self.stats["dropped"] += n
            logger.info("%s: %d tasks of batch %d handed back to be re-run", self.device_id, n, p.batch)
