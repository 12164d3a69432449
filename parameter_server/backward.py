"""The backward server's work: it receives forward outputs, keeps the ledger of (client, rows),
sends each complete micro-batch to the next stage's frontal servers (evenly segmented), and turns
output gradients into backward tasks that prefer the client of the forward pass. Must not step
parameters."""

from __future__ import annotations

from core.layout import owners
from core.protocol.fields import field as mfield
from core.protocol.tasks import task_id as make_task_id
from core.protocol.wire import PayloadError
from parameter_server.ledger import LedgerEntry, RowBuffer
from taskpool import Task, TaskKind


class Backward:
    """StageServer's the backward server's outputs, ledger and backward tasks (a part of parameter_server.service.StageServer)."""

    async def on_push_outputs(self, meta, tensors, sender):
        self.registry.caller(sender)
        if self.role != "backward" or self.last:
            raise PayloadError("push_outputs goes to a backward server of a stage that is not the last")
        task_id = mfield(meta, "task", str)
        frontal = mfield(meta, "frontal", str)
        if frontal not in self.st.frontal:
            raise PayloadError(f"{frontal!r} is not a frontal server of stage {self.stage}")
        # the outputs only: the labels a loss is computed against come from the run's data at the
        # frontal servers (frontal.py `_run_labels`), never through a volunteer
        t, m, a, b = self.checks.rows_payload(meta, tensors, "push_outputs", ("hidden",))
        self.checks.answers_lease(meta.get("lease"), task_id, sender, TaskKind.FORWARD, t, m, (a, b))
        buf = self.buffers.setdefault((t, m), RowBuffer(*self.seg))
        if not buf.add(a, b, tensors[0], None):
            self.counters["output_duplicates"] += 1
            return {"result": "duplicate"}
        self.ledger.setdefault((t, m), []).append(LedgerEntry(sender, (a, b), frontal, task_id))
        if self.arrivals.note_contribution(sender, t):
            self.check_later(t, self._check_outputs, sender, t, m, a, b, tensors[0])
        self._make_backward_tasks(t, m)  # (the gradients can come first after a failover)
        if buf.complete:
            self._send_outputs(t, m)
        return {"result": "accepted"}

    def _send_outputs(self, t: int, m: int) -> None:
        """A complete micro-batch of outputs to the next stage's FS, evenly segmented."""
        if self.replaying:
            return
        buf = self.buffers[(t, m)]
        nxt = self.layout.stages[self.stage + 1]
        for j, x, y in owners(self.rows, len(nxt.frontal), buf.lo, buf.hi):
            d, _ = buf.slice(x, y)
            self.outbox.spawn(
                self.outbox.deliver(nxt.frontal[j], "push_inputs", {"batch": t, "micro": m, "rows": [x, y]}, [d])
            )

    async def on_push_output_grads(self, meta, tensors, sender):
        if self.role != "backward" or self.last:
            raise PayloadError("push_output_grads goes to a backward server of a stage that is not the last")
        self.checks.server_of(sender, self.stage + 1, "frontal")
        t, m, a, b = self.checks.rows_payload(meta, tensors, "push_output_grads", ("output gradient",))
        buf = self.grad_buffers.setdefault((t, m), RowBuffer(*self.seg))
        if not buf.add(a, b, tensors[0], None):
            self.counters["relay_duplicates"] += 1
            return {"result": "duplicate"}
        self._make_backward_tasks(t, m)
        return {"result": "accepted"}

    def _make_backward_tasks(self, t: int, m: int) -> None:
        """A backward task for every ledger piece of (t, m) whose output gradient is here."""
        buf = self.grad_buffers.get((t, m))
        for entry in self.ledger.get((t, m), []) if buf is not None else []:
            if entry.backward_task is None and buf.has(*entry.rows):
                x, y = entry.rows
                entry.backward_task = make_task_id(TaskKind.BACKWARD, t, m, self.stage, (x, y))
                self.leases.add_task(
                    Task(
                        task_id=entry.backward_task,
                        kind=TaskKind.BACKWARD,
                        batch=t,
                        micro_batch=m,
                        stage=self.stage,
                        rows=(x, y),
                        preferred_client=entry.client,
                        payload_ref=entry,
                    )
                )
