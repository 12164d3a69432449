"""The backward server's work: it receives forward outputs, keeps the ledger of (client, rows),
sends each complete micro-batch to the next stage's frontal servers (evenly segmented), and turns
output gradients into backward tasks that prefer the client of the forward pass. Must not step
parameters. A part of a server, built with what it reads of it (parameter_server/parts.py)."""

from __future__ import annotations

from typing import Callable

from core.layout import owners
from core.protocol.fields import field as mfield
from core.protocol.tasks import task_id as make_task_id
from core.protocol.wire import PayloadError
from parameter_server.ledger import LedgerEntry, RowBuffer
from taskpool import Task, TaskKind


class Backward:
    """A backward server's outputs, ledger and backward tasks, given what they read of its server: its
    `place`, `rows` a micro-batch; its `registry`, `checks`, `arrivals`, `leases` (tasks enter the
    pool there), `outbox` and `counters`; as they are now: `dp()` (the data path), `layout()`,
    `replaying()`; and `check_outputs(sender, t, m, a, b, outputs)`, which checks a forward task's
    outputs later (verify.py)."""

    def __init__(
        self,
        *,
        place,
        rows: int,
        registry,
        checks,
        arrivals,
        leases,
        outbox,
        counters: dict,
        dp: Callable[[], object],
        layout: Callable[[], object],
        replaying: Callable[[], bool],
        check_outputs: Callable[..., None],
    ) -> None:
        self.place, self.rows, self.registry, self.checks, self.arrivals = place, rows, registry, checks, arrivals
        self.leases, self.outbox, self.counters, self.dp, self.layout = leases, outbox, counters, dp, layout
        self.replaying, self.check_outputs = replaying, check_outputs

    async def on_push_outputs(self, meta, tensors, sender):
        self.registry.caller(sender)
        p = self.place
        if p.role != "backward" or p.last:
            raise PayloadError("push_outputs goes to a backward server of a stage that is not the last")
        task_id = mfield(meta, "task", str)
        frontal = mfield(meta, "frontal", str)
        if frontal not in self.layout().stages[p.stage].frontal:
            raise PayloadError(f"{frontal!r} is not a frontal server of stage {p.stage}")
        # the outputs only: the labels a loss is computed against come from the run's data at the
        # frontal servers (frontal.py `_run_labels`), never through a volunteer
        t, m, a, b = self.checks.rows_payload(meta, tensors, "push_outputs", ("hidden",))
        self.checks.answers_lease(meta.get("lease"), task_id, sender, TaskKind.FORWARD, t, m, (a, b))
        dp = self.dp()
        buf = dp.buffers.setdefault((t, m), RowBuffer(*dp.seg))
        if not buf.add(a, b, tensors[0], None):
            self.counters["output_duplicates"] += 1
            return {"result": "duplicate"}
        dp.ledger.setdefault((t, m), []).append(LedgerEntry(sender, (a, b), frontal, task_id))
        if self.arrivals.note_contribution(sender, t):
            self.check_outputs(sender, t, m, a, b, tensors[0])
        self._make_backward_tasks(t, m)  # (the gradients can come first after a failover)
        if buf.complete:
            self.send_outputs(t, m)
        return {"result": "accepted"}

    def send_outputs(self, t: int, m: int) -> None:
        """A complete micro-batch of outputs to the next stage's FS, evenly segmented."""
        if self.replaying():
            return
        buf = self.dp().buffers[(t, m)]
        nxt = self.layout().stages[self.place.stage + 1]
        for j, x, y in owners(self.rows, len(nxt.frontal), buf.lo, buf.hi):
            d, _ = buf.slice(x, y)
            self.outbox.spawn(
                self.outbox.deliver(nxt.frontal[j], "push_inputs", {"batch": t, "micro": m, "rows": [x, y]}, [d])
            )

    async def on_push_output_grads(self, meta, tensors, sender):
        p = self.place
        if p.role != "backward" or p.last:
            raise PayloadError("push_output_grads goes to a backward server of a stage that is not the last")
        self.checks.server_of(sender, p.stage + 1, "frontal")
        t, m, a, b = self.checks.rows_payload(meta, tensors, "push_output_grads", ("output gradient",))
        dp = self.dp()
        buf = dp.grad_buffers.setdefault((t, m), RowBuffer(*dp.seg))
        if not buf.add(a, b, tensors[0], None):
            self.counters["relay_duplicates"] += 1
            return {"result": "duplicate"}
        self._make_backward_tasks(t, m)
        return {"result": "accepted"}

    def _make_backward_tasks(self, t: int, m: int) -> None:
        """A backward task for every ledger piece of (t, m) whose output gradient is here."""
        dp = self.dp()
        buf = dp.grad_buffers.get((t, m))
        for entry in dp.ledger.get((t, m), []) if buf is not None else []:
            if entry.backward_task is None and buf.has(*entry.rows):
                x, y = entry.rows
                entry.backward_task = make_task_id(TaskKind.BACKWARD, t, m, self.place.stage, (x, y))
                self.leases.add_task(
                    Task(
                        task_id=entry.backward_task,
                        kind=TaskKind.BACKWARD,
                        batch=t,
                        micro_batch=m,
                        stage=self.place.stage,
                        rows=(x, y),
                        preferred_client=entry.client,
                        payload_ref=entry,
                    )
                )
