"""A stage worker's passes (a part of peer/volunteer/worker.py's StageWorker): a task computed on the
parameters of its version and handed in, in the order that makes any kill point safe (see the
worker's module docstring): a forward task's outputs to the next stage's backward servers, the last
stage's forward-backward and a backward task's input gradient to the frontal server, parameter
gradients into the batch's sum."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import torch

from core.layout import owners
from core.model.task_math import backward_kept, backward_rows, forward_keeping, forward_rows
from core.protocol.wire import RemoteError
from taskpool.types import TaskKind


class Passes:
    """`versions` (peer/volunteer/versions.py), `kept` (kept.py), `sums` (sums.py), `device`
    (device.py), `member` (membership.py) and `call`/`links` are the worker's own; `stage()` its stage
    in the layout now, `epoch()` its layout epoch now; `point(name)` a kill point (faults.py)."""

    def __init__(
        self,
        *,
        device_id: str,
        last: bool,
        rows: int,
        total_tokens: int,
        torch_device: torch.device,
        versions,
        kept,
        sums,
        device,
        member,
        call,
        links: dict,
        stage: Callable,
        epoch: Callable[[], int],
        stats: dict,
        cheat,
        point: Callable[[str], None],
    ):
        self.device_id, self.last, self.rows, self.total_tokens = device_id, last, rows, total_tokens
        self.torch_device = torch_device
        self.versions, self.kept, self.sums, self.device, self.member = versions, kept, sums, device, member
        self.call, self.links, self.stage, self.epoch = call, links, stage, epoch
        self.stats, self.cheat, self.point = stats, cheat, point

    def _lying(self, batch: int | None = None) -> bool:
        done = self.stats["forward"] + self.stats["backward"]
        return self.cheat is not None and self.cheat.lies_now(done, self.device_id, batch)

    async def process(self, link, meta: dict, tensors: list) -> None:
        """Compute task `meta` (its inputs `tensors`), leased through `link`, and hand its results in."""
        t = meta["batch"]
        pulling = time.monotonic()
        # whether the worker's first task had to fetch its parameters inside its lease (Worker.warm_up)
        self.stats.setdefault("first_task_fetched", meta["version"] not in self.versions.held)
        await self.versions.ensure(meta["version"])
        self.stats["param_seconds"] += time.monotonic() - pulling
        self.versions.prefetch_next(meta["version"])
        self.kept.drop_inputs_before(t - 1)
        if meta["kind"] == TaskKind.FORWARD:  # whether its server will cut more of the batch for this worker
            self.sums.owed(t, bool(meta.get("owed")))
        if meta["kind"] == TaskKind.FORWARD and not self.last:
            await self._forward(link, meta, tensors)
        elif meta["kind"] == TaskKind.FORWARD:
            await self._forward_backward(link, meta, tensors)
        else:
            await self._backward(link, meta, tensors)

    async def _forward(self, link, meta, tensors) -> None:
        """A forward task of a stage before the last: its rows go, cut by the next backward servers'
        segments, to those servers; each piece's pass is kept (within the memory budget) for the
        backward task of the same rows, which that server offers this worker first."""
        t, m, (a, b) = meta["batch"], meta["micro"], meta["rows"]
        x = tensors[0]  # (no labels: only the last stage computes a loss, against the run's own)
        version = meta["version"]
        self.point("before_forward")
        nxt = self.stage().backward
        pieces = owners(self.rows, len(nxt), a, b)

        def fwd():
            self.point("during_forward")
            model = self.versions.model(version)
            if self.kept.activation_memory <= 0:
                return [(forward_rows(model, x[p - a : q - a], self.torch_device), None) for _, p, q in pieces]
            return [forward_keeping(model, x[p - a : q - a], self.torch_device) for _, p, q in pieces]

        outs = await self.device.run(fwd)
        self.kept.drop_passes_before(t - 1)
        for (_, p, q), (_, kept) in zip(pieces, outs):
            if kept is not None:
                self.kept.keep((t, m, p, q, version, meta["epoch"]), kept)  # (an epoch's own, as the inputs)
        if self._lying(t):
            outs = [(self.cheat.tensor(out), kept) for out, kept in outs]
        self.kept.add_inputs(t, m, meta["epoch"], a, b, x)
        if self.cheat is not None and self.cheat.kind == "unsent" and self._lying(t):
            self.member.finish_later(link.device, meta["task"], meta["epoch"])  # done, it says; nothing was sent
            self.stats["forward"] += 1
            return
        await asyncio.gather(
            *(
                self.call(
                    self.links[nxt[j]],
                    "push_outputs",
                    {
                        "task": meta["task"],
                        "batch": t,
                        "micro": m,
                        "rows": [p, q],
                        "frontal": meta["frontal"],
                        "lease": meta.get("lease"),
                    },
                    [out],
                    timeout=60.0,
                    epoch=meta["epoch"],
                )
                for (j, p, q), (out, _) in zip(pieces, outs)
            )
        )
        self.point("after_outputs")
        self.member.finish_later(link.device, meta["task"], meta["epoch"])
        self.stats["forward"] += 1

    def _backward_pass(self, version: int, x: torch.Tensor, out_grad=None, labels=None):
        """Recompute the slice on x and backpropagate; returns (input grad or None, loss_sum or None)."""
        self.point("during_backward")
        return backward_rows(
            self.versions.model(version), x, self.torch_device, self.total_tokens, out_grad=out_grad, labels=labels
        )

    async def _forward_backward(self, link, meta, tensors) -> None:
        """The last stage: forward, loss and backward in one task."""
        x, y = tensors
        gin, loss, grads = await self.device.run(lambda: self._backward_pass(meta["version"], x, labels=y))
        await self._finish(link, link, meta, gin, grads, loss)
        self.stats["forward"] += 1

    async def _finish(self, link, frontal, meta, gin, grads, loss) -> None:
        """Hand a computed task in, in the order that makes any kill point safe: the input gradient
        to the frontal server (which relays it); then the parameter gradient into the batch's sum,
        the task staying leased until the sum is credited by every server. A task on its second
        attempt (its first client vanished or was late) is pushed alone at once, so that a sum never
        overlaps another client's in part for long."""
        if self._lying(meta["batch"]):
            gin, grads, loss = self.cheat.corrupt(gin, grads, loss)
        if gin is not None:
            await self.call(
                frontal,
                "push_input_grads",
                {
                    "task": meta["task"],
                    "batch": meta["batch"],
                    "micro": meta["micro"],
                    "rows": meta["rows"],
                    "lease": meta.get("lease"),
                },
                [gin],
                epoch=meta["epoch"],
            )
            self.point("after_input_grads")
            if self.cheat is not None and self.cheat.kind == "relay" and self._lying(meta["batch"]):
                await self.member.hand_back(link, meta["task"], meta["epoch"])  # (no push would check the lie)
                return
        if meta["epoch"] != self.epoch():  # a failover voided it: it is run again in the new epoch
            raise RemoteError(
                f"task {meta['task']} belongs to layout epoch {meta['epoch']}, the run is at {self.epoch()}"
            )
        if meta.get("attempt", 1) > 1:
            await self.sums.push_alone(link, meta, grads, loss)
        else:
            self.sums.add(link, meta, grads, loss)

    async def _backward(self, link, meta, tensors) -> None:
        t, m, (a, b) = meta["batch"], meta["micro"], meta["rows"]
        (g,) = tensors
        frontal = self.links[meta["frontal"]]
        kept = self.kept.take((t, m, a, b, meta["version"], meta["epoch"]))
        if kept is not None:  # this worker ran the forward pass of these very rows: no recompute

            def bwd():
                self.point("during_backward")
                return backward_kept(self.versions.model(meta["version"]), kept, g, self.torch_device)

            gin, _, grads = await self.device.run(bwd)
            self.stats["recompute_avoided"] += 1
            await self._finish(link, frontal, meta, gin, grads, None)
            self.stats["backward"] += 1
            return
        self.stats["recomputed"] += 1
        x = self.kept.rows(t, m, a, b, meta["epoch"])
        if x is None:
            _, (x,) = await self.call(
                frontal, "get_inputs", {"batch": t, "micro": m, "rows": [a, b]}, epoch=meta["epoch"]
            )
        gin, _, grads = await self.device.run(lambda: self._backward_pass(meta["version"], x, out_grad=g))
        await self._finish(link, frontal, meta, gin, grads, None)
        self.stats["backward"] += 1
