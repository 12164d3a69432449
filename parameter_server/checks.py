"""The checks every handler shares: the sender is a registered client or a server of the named
stage and role, batch and micro-batch indices are in range and not applied yet, and a payload's
rows lie in this server's segment with tensors of the right shape, dtype and values. A check
raises PayloadError and changes nothing. A part of a server, built with what it reads of it
(parameter_server/parts.py)."""

from __future__ import annotations

from typing import Callable

import torch

from core.protocol.fields import check_tensor, rows_field
from core.protocol.fields import field as mfield
from core.protocol.refusals import Refusal
from core.protocol.tasks import TaskId
from core.protocol.wire import PayloadError
from parameter_server.updates import RETAIN


class Checks:
    """A server's payload and sender checks shared by its handlers, given what they read of it: its
    `stage`, `rows` a micro-batch, `steps` and `micro_batches` (the run's), the model's `seq`, `hidden`
    and `vocab`, the run's `lease_tickets`, its `directory`; as they are now: `layout()`, `epoch()`,
    `version()`, `segment()` (its rows of each micro-batch), `reflow_from()` (since a failover, the first
    batch run again) and `replaying()` (a request-log replay re-applies what was checked before)."""

    def __init__(
        self,
        *,
        stage: int,
        rows: int,
        steps: int,
        micro_batches: int,
        seq: int,
        hidden: int,
        vocab: int,
        lease_tickets,
        directory,
        layout: Callable[[], object],
        epoch: Callable[[], int],
        version: Callable[[], int],
        segment: Callable[[], tuple[int, int]],
        reflow_from: Callable[[], int | None],
        replaying: Callable[[], bool],
    ) -> None:
        self.stage, self.rows, self.steps, self.micro_batches = stage, rows, steps, micro_batches
        self.seq, self.hidden, self.vocab, self.lease_tickets, self.directory = (
            seq,
            hidden,
            vocab,
            lease_tickets,
            directory,
        )
        self.layout, self.epoch, self.version, self.segment = layout, epoch, version, segment
        self.reflow_from, self.replaying = reflow_from, replaying

    def only_servers(self, sender: str) -> None:
        """A method only servers call (the method table's caller column): the sender's peer id, which
        libp2p authenticates, must be a server of the current layout as the run-key-signed records
        name them (the handler then checks its stage and role)."""
        if not self.directory.is_server(sender):
            raise PayloadError(f"{sender[-8:]} is not a server of this run: only its servers may call this")

    def server_of(self, sender: str, stage: int, *roles: str) -> str:
        if self.replaying():
            return "replay"
        dev = self.directory.device_of(sender)
        st = self.layout().stages[stage]
        allowed = (st.frontal if "frontal" in roles else ()) + (st.backward if "backward" in roles else ())
        if dev is None or dev not in allowed:
            raise PayloadError(f"sender {sender[-8:]} is not a {' or '.join(roles)} server of stage {stage}")
        return dev

    def answers_lease(
        self,
        ticket,
        task_id: str,
        sender: str,
        kind: str,
        t: int,
        m: int | None = None,
        rows: tuple[int, int] | None = None,
        exact: bool = False,
    ) -> None:
        """A result for task `task_id` is accepted only from a holder of its lease (the `ticket` it got
        with `take`, core/protocol/leases.py), and only for what the task covers: a `kind` task of this
        stage, batch `t` (and micro-batch `m`), whose rows are `rows` where they meet this server's
        segment (with `exact`: are `rows`), never a part of them: a part pushed and the task handed back
        would make every whole re-run overlap it, and be refused. A restart's replay of its request log
        re-applies what was accepted before."""
        if self.replaying():
            return
        tid = TaskId.parse(task_id)
        if tid.kind != kind or tid.stage != self.stage or tid.batch != t or (m is not None and tid.micro != m):
            where = f"batch {t}" + ("" if m is None else f" micro-batch {m}")
            raise PayloadError(f"task {task_id} is not a {kind} task of {where} of stage {self.stage}")
        if rows is not None:
            (a, b), (lo, hi) = rows, tid.rows
            if not exact:  # the task's rows that this server holds
                seg = self.segment()
                lo, hi = max(lo, seg[0]), min(hi, seg[1])
            if (a, b) != (lo, hi):
                raise PayloadError(f"rows [{a}, {b}) are not the rows [{lo}, {hi}) of task {task_id} held here")
        self.lease_tickets.check(ticket, task_id, sender, self.epoch())

    def batch_micro(self, meta: dict, check_applied: bool = True) -> tuple[int, int]:
        t = mfield(meta, "batch", int)
        m = mfield(meta, "micro", int)
        if not 0 <= t < self.steps:
            raise PayloadError(f"batch {t} outside the run's 0..{self.steps - 1}")
        if not 0 <= m < self.micro_batches:
            raise PayloadError(f"micro-batch {m} outside 0..{self.micro_batches - 1}")
        if check_applied:
            self.not_applied(t)
        return t, m

    def not_applied(self, t: int) -> None:
        version, reflow_from = self.version(), self.reflow_from()
        if t < version - (RETAIN - 1) and (reflow_from is None or t < reflow_from):
            raise PayloadError(f"batch {t} is already applied (version {version})", Refusal.ALREADY_APPLIED)

    def activation(self, x: torch.Tensor, n: int, name: str, tokens: bool) -> None:
        if tokens:
            check_tensor(x, name, (n, self.seq), torch.int64)
            if n and (int(x.min()) < 0 or int(x.max()) >= self.vocab):
                raise PayloadError(f"{name}: token ids outside [0, {self.vocab})")
        else:
            check_tensor(x, name, (n, self.seq, self.hidden), torch.float32)

    def labels(self, y: torch.Tensor, n: int) -> None:
        self.activation(y, n, "labels", tokens=True)

    def rows_payload(self, meta: dict, tensors: list, what: str, kinds: tuple[str, ...]) -> tuple[int, int, int, int]:
        """(batch, micro, lo, hi) of a payload for rows of this server's segment, its tensors checked
        against `kinds` ("hidden"/"labels"/a gradient's name) for those rows."""
        t, m = self.batch_micro(meta, check_applied=False)
        a, b = rows_field(meta, "rows", self.rows)
        lo, hi = self.segment()
        if not (lo <= a and b <= hi):
            raise PayloadError(f"rows [{a}, {b}) outside this server's segment [{lo}, {hi})")
        if len(tensors) != len(kinds):
            raise PayloadError(f"{what} expects [{', '.join(kinds)}], got {len(tensors)} tensors")
        for x, kind in zip(tensors, kinds):
            if kind == "labels":
                self.labels(x, b - a)
            else:
                self.activation(x, b - a, kind, tokens=False)
        self.not_applied(t)  # after the checks: a malformed payload is named as such whatever its batch
        return t, m, a, b

    def check_epoch(self, meta: dict, later_ok: bool = False) -> None:
        """PayloadError unless `meta`'s layout epoch (0 when absent) is this server's; `later_ok`: a
        later one passes (the caller waits for this server to adopt it)."""
        epoch = mfield(meta, "epoch", int, optional=True) or 0
        current = self.epoch()
        if epoch < current:
            raise PayloadError(
                f"stale epoch {epoch}: the run is at layout epoch {current} since a failover; "
                "fetch the layout again (get_layout)",
                Refusal.STALE_EPOCH,
            )
        if epoch > current and not later_ok:
            raise PayloadError(
                f"epoch {epoch} is not adopted here yet (this server is at epoch {current})", Refusal.FUTURE_EPOCH
            )
