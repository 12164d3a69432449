"""Restart: replay of the request log through the same handlers, on top of the shard checkpoint
already loaded, then re-sending what this server owes others (receivers drop what they have).
Must not write the log (the handlers skip it while replaying)."""

from __future__ import annotations

from parameter_server.updates import RETAIN
from taskpool import Task, TaskKind


class Recovery:
    """StageServer's replay of the request log (a part of parameter_server.service.StageServer)."""

    async def recover(self, entries: list) -> int:
        """Rebuild buffers, ledger, pools and credits from the request log (on top of the shard
        checkpoint already loaded), then re-send what this server owes others (receivers drop what
        they already have). Returns the number of records replayed."""
        self.replaying = True
        batches, cut = set(), set()
        try:
            for record, tensors in entries:
                if "task" in record:
                    tid, t, m, a, b, preferred = record["task"]
                    batches.add(t)
                    cut.add((t, m))
                    if (
                        tid not in self.issued
                        and t >= self.forgotten_before
                        and not (self.stage == 0 and t < self.version - (RETAIN - 1))
                    ):
                        if self.stage == 0 and self.role == "frontal" and (t, m) not in self.buffers:
                            self.frontal.build_inputs(t)
                        self.pool.add(
                            Task(
                                task_id=tid,
                                kind=TaskKind.FORWARD,
                                batch=t,
                                micro_batch=m,
                                stage=self.stage,
                                rows=(a, b),
                                preferred_client=preferred,
                            )
                        )
                        self.issued.add(tid)
                    continue
                await self.surface.handle(record["method"], record["meta"], tensors, record["sender"])
        finally:
            self.replaying = False
        if self.stage == 0 and self.role == "frontal":
            self.dp.next_batch = max([self.version] + [t + 1 for t in batches])
            for t in batches:  # micro-batches whose tasks were not cut before the crash
                for m in range(self.run.micro_batches):
                    if (t, m) not in cut and t >= self.version - (RETAIN - 1):
                        self.frontal.make_forward_tasks(t, m)
        # inputs whose tasks were cut before the crash must not be cut again (differently)
        self.dp.waiting_inputs = [key for key in self.dp.waiting_inputs if key not in cut]
        self.frontal.release_waiting()
        self.maybe_step()  # (a step held during the replay for the run's gradient norm asks for it now)
        if self.role == "backward" and not self.last:
            for (t, m), buf in list(self.buffers.items()):
                if buf.complete:
                    self.backward.send_outputs(t, m)
        if self.role == "frontal" and self.stage > 0:
            for (t, m), buf in list(self.grad_buffers.items()):
                for a, b in buf.covered:
                    self.frontal.relay_input_grads(t, m, a, b, buf.slice(a, b)[0])
        return len(entries)
