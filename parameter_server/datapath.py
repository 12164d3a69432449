"""What a server holds of the batches in flight, made anew when a layout epoch begins (the server's
`reset_datapath`): its rows of each micro-batch, the task pool and the ids of the tasks it made, the
rows and gradients received, the backward server's ledger, the frontal server's input gradients and
its batches' members. The parts of the data path (frontal.py, backward.py, leases.py, verify.py,
recovery.py) read and change it; `forget_before` lets go of applied batches."""

from __future__ import annotations

from dataclasses import dataclass, field

from taskpool import TaskPool


@dataclass
class DataPath:
    seg: tuple[int, int]  # this server's rows of each micro-batch, among its role's servers of the stage
    pool: TaskPool
    next_batch: int = 0  # stage-0 FS: the next batch to build
    issued: set[str] = field(default_factory=set)  # every task id made here, of batches >= forgotten_before
    forgotten_before: int = 0  # the closed tasks of earlier batches are forgotten (forget_before)
    waiting_inputs: list[tuple[int, int]] = field(
        default_factory=list
    )  # FS k>0: complete inputs awaiting their version
    buffers: dict = field(default_factory=dict)  # (t, m) -> RowBuffer. FS: inputs; BS: outputs
    grad_buffers: dict = field(default_factory=dict)  # (t, m) -> RowBuffer. BS: output grads; FS: relayed input grads
    ledger: dict = field(default_factory=dict)  # BS: (t, m) -> [LedgerEntry]: who computed which rows
    gin_senders: dict = field(default_factory=dict)  # FS: (t, m, a, b) -> who handed in that input gradient
    gin_orphans: set = field(default_factory=set)  # FS: those of them re-run on their own (verify.py)
    batch_members: dict = field(default_factory=dict)  # FS: batch -> the clients its forward tasks are cut for
    # FS: batch -> (how many of its micro-batches were cut into tasks, the clients that got a piece of each)
    batch_cut: dict = field(default_factory=dict)

    def forget_before(self, batch: int) -> None:
        """Drop the rows and ledgers of batches < batch (applied by every server of the stage), their
        tasks still open (a re-queued copy of work done, which `take` would abandon when handed out,
        and which would else stay open to the run's end) and the ids of their closed tasks (a run of
        days would else keep every task id it ever cut)."""
        for store in (self.buffers, self.grad_buffers, self.ledger, self.gin_senders):
            for key in [k for k in store if k[0] < batch]:
                del store[key]
        self.gin_orphans.difference_update([k for k in self.gin_orphans if k[0] < batch])
        for store in (self.batch_members, self.batch_cut):
            for t in [t for t in store if t < batch]:
                del store[t]
        self.pool.abandon_before(batch)
        self.issued.difference_update(self.pool.forget_closed(batch))
        self.forgotten_before = max(self.forgotten_before, batch)
