"""Restart: replay of the request log through the same handlers, on top of the shard checkpoint
already loaded, then re-sending what this server owes others (receivers drop what they have).
Must not write the log (the handlers skip it while replaying). A part of a server, built with what it
reads of it (parameter_server/parts.py); `replaying` is its own, read by the other parts."""

from __future__ import annotations

from typing import Callable

from parameter_server.updates import RETAIN
from taskpool import Task, TaskKind


class Recovery:
    """A server's replay of its request log, given what it reads of it: its `place`, the run's
    `micro_batches`; its `surface` (the handlers a request is replayed through), `frontal` and
    `backward` (the data path's roles); as they are now: `dp()`, `version()`; and `maybe_step()`."""

    def __init__(
        self,
        *,
        place,
        micro_batches: int,
        surface,
        frontal,
        backward,
        dp: Callable[[], object],
        version: Callable[[], int],
        maybe_step: Callable[[], None],
    ) -> None:
        self.place, self.micro_batches, self.surface, self.frontal, self.backward = (
            place,
            micro_batches,
            surface,
            frontal,
            backward,
        )
        self.dp, self.version, self.maybe_step = dp, version, maybe_step
        self.replaying = False  # while the log is replayed: handlers check nothing again and log nothing

    async def recover(self, entries: list) -> int:
        """Rebuild buffers, ledger, pools and credits from the request log (on top of the shard
        checkpoint already loaded), then re-send what this server owes others (receivers drop what
        they already have). Returns the number of records replayed."""
        self.replaying = True
        batches, cut = set(), set()
        p = self.place
        try:
            for record, tensors in entries:
                dp = self.dp()  # (a replayed layout epoch makes the data path anew)
                if "task" in record:
                    tid, t, m, a, b, preferred = record["task"]
                    batches.add(t)
                    cut.add((t, m))
                    if (
                        tid not in dp.issued
                        and t >= dp.forgotten_before
                        and not (p.stage == 0 and t < self.version() - (RETAIN - 1))
                    ):
                        if p.stage == 0 and p.role == "frontal" and (t, m) not in dp.buffers:
                            self.frontal.build_inputs(t)
                        dp.pool.add(
                            Task(
                                task_id=tid,
                                kind=TaskKind.FORWARD,
                                batch=t,
                                micro_batch=m,
                                stage=p.stage,
                                rows=(a, b),
                                preferred_client=preferred,
                            )
                        )
                        dp.issued.add(tid)
                    continue
                await self.surface.handle(record["method"], record["meta"], tensors, record["sender"])
        finally:
            self.replaying = False
        dp = self.dp()
        if p.stage == 0 and p.role == "frontal":
            dp.next_batch = max([self.version()] + [t + 1 for t in batches])
            for t in batches:  # micro-batches whose tasks were not cut before the crash
                for m in range(self.micro_batches):
                    if (t, m) not in cut and t >= self.version() - (RETAIN - 1):
                        self.frontal.make_forward_tasks(t, m)
        # inputs whose tasks were cut before the crash must not be cut again (differently)
        dp.waiting_inputs = [key for key in dp.waiting_inputs if key not in cut]
        self.frontal.release_waiting()
        self.maybe_step()  # (a step held during the replay for the run's gradient norm asks for it now)
        if p.role == "backward" and not p.last:
            for (t, m), buf in list(dp.buffers.items()):
                if buf.complete:
                    self.backward.send_outputs(t, m)
        if p.role == "frontal" and p.stage > 0:
            for (t, m), buf in list(dp.grad_buffers.items()):
                for a, b in buf.covered:
                    self.frontal.relay_input_grads(t, m, a, b, buf.slice(a, b)[0])
        return len(entries)
