"""The checks every handler shares: the sender is a registered client or a server of the named
stage and role, batch and micro-batch indices are in range and not applied yet, and a payload's
rows lie in this server's segment with tensors of the right shape, dtype and values. A check
raises PayloadError and changes nothing."""

from __future__ import annotations

import torch

from core.protocol.fields import check_tensor, rows_field
from core.protocol.fields import field as mfield
from core.protocol.refusals import Refusal
from core.protocol.tasks import TaskId
from core.protocol.wire import PayloadError
from parameter_server.updates import RETAIN


class Checks:
    """StageServer's payload and sender checks shared by the handlers (a part of parameter_server.service.StageServer)."""

    def _any_server_sender(self, sender: str) -> None:
        """A method only servers call (the method table's caller column): the sender's peer id, which
        libp2p authenticates, must be a server of the current layout as the run-key-signed records
        name them (the handler then checks its stage and role)."""
        if not self.directory.is_server(sender):
            raise PayloadError(f"{sender[-8:]} is not a server of this run: only its servers may call this")

    def _server_sender(self, sender: str, stage: int, *roles: str) -> str:
        if self.replaying:
            return "replay"
        dev = self.directory.device_of(sender)
        st = self.layout.stages[stage]
        allowed = (st.frontal if "frontal" in roles else ()) + (st.backward if "backward" in roles else ())
        if dev is None or dev not in allowed:
            raise PayloadError(f"sender {sender[-8:]} is not a {' or '.join(roles)} server of stage {stage}")
        return dev

    def _answers_lease(
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
        if self.replaying:
            return
        tid = TaskId.parse(task_id)
        if tid.kind != kind or tid.stage != self.stage or tid.batch != t or (m is not None and tid.micro != m):
            where = f"batch {t}" + ("" if m is None else f" micro-batch {m}")
            raise PayloadError(f"task {task_id} is not a {kind} task of {where} of stage {self.stage}")
        if rows is not None:
            (a, b), (lo, hi) = rows, tid.rows
            if not exact:  # the task's rows that this server holds
                lo, hi = max(lo, self.seg[0]), min(hi, self.seg[1])
            if (a, b) != (lo, hi):
                raise PayloadError(f"rows [{a}, {b}) are not the rows [{lo}, {hi}) of task {task_id} held here")
        self.lease_tickets.check(ticket, task_id, sender, self.epoch)

    def _batch_micro(self, meta: dict, check_applied: bool = True) -> tuple[int, int]:
        t = mfield(meta, "batch", int)
        m = mfield(meta, "micro", int)
        if not 0 <= t < self.run.steps:
            raise PayloadError(f"batch {t} outside the run's 0..{self.run.steps - 1}")
        if not 0 <= m < self.run.micro_batches:
            raise PayloadError(f"micro-batch {m} outside 0..{self.run.micro_batches - 1}")
        if check_applied:
            self._not_applied(t)
        return t, m

    def _not_applied(self, t: int) -> None:
        if t < self.version - (RETAIN - 1) and (self.reflow_from is None or t < self.reflow_from):
            raise PayloadError(f"batch {t} is already applied (version {self.version})", Refusal.ALREADY_APPLIED)

    def _activation_check(self, x: torch.Tensor, n: int, name: str, tokens: bool) -> None:
        if tokens:
            check_tensor(x, name, (n, self.seq), torch.int64)
            if n and (int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size):
                raise PayloadError(f"{name}: token ids outside [0, {self.cfg.vocab_size})")
        else:
            check_tensor(x, name, (n, self.seq, self.hidden), torch.float32)

    def _labels_check(self, y: torch.Tensor, n: int) -> None:
        self._activation_check(y, n, "labels", tokens=True)

    def _rows_payload(self, meta: dict, tensors: list, what: str, kinds: tuple[str, ...]) -> tuple[int, int, int, int]:
        """(batch, micro, lo, hi) of a payload for rows of this server's segment, its tensors checked
        against `kinds` ("hidden"/"labels"/a gradient's name) for those rows."""
        t, m = self._batch_micro(meta, check_applied=False)
        a, b = rows_field(meta, "rows", self.rows)
        lo, hi = self.seg
        if not (lo <= a and b <= hi):
            raise PayloadError(f"rows [{a}, {b}) outside this server's segment [{lo}, {hi})")
        if len(tensors) != len(kinds):
            raise PayloadError(f"{what} expects [{', '.join(kinds)}], got {len(tensors)} tensors")
        for x, kind in zip(tensors, kinds):
            if kind == "labels":
                self._labels_check(x, b - a)
            else:
                self._activation_check(x, b - a, kind, tokens=False)
        self._not_applied(t)  # after the checks: a malformed payload is named as such whatever its batch
        return t, m, a, b
