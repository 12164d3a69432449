"""The task id, formatted and parsed here and nowhere else.

A task id names what a task computes: its kind (F forward, B backward), batch, micro-batch, stage
and rows, as `F3.1.0.4-8`. Since a task's result is a pure function of (parameter version, rows),
the id is all a server needs to credit a contribution exactly once. This module must not know
about pools, leases or servers."""

from __future__ import annotations

import re
from dataclasses import dataclass

from core.protocol.wire import PayloadError
from taskpool.types import TaskKind

_PATTERN = re.compile(r"([FB])(\d+)\.(\d+)\.(\d+)\.(\d+)-(\d+)")
KINDS = {"F": TaskKind.FORWARD, "B": TaskKind.BACKWARD}


@dataclass(frozen=True)
class TaskId:
    kind: TaskKind
    batch: int
    micro: int
    stage: int
    rows: tuple[int, int]

    def __str__(self) -> str:
        letter = "F" if self.kind == TaskKind.FORWARD else "B"
        return f"{letter}{self.batch}.{self.micro}.{self.stage}.{self.rows[0]}-{self.rows[1]}"

    @classmethod
    def parse(cls, text) -> "TaskId":
        """'B3.1.0.4-8' -> TaskId('backward', 3, 1, 0, (4, 8)); PayloadError for anything else."""
        match = _PATTERN.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise PayloadError(f"malformed task id {text!r}: expected <F|B><batch>.<micro>.<stage>.<lo>-<hi>")
        kind, t, m, k, lo, hi = match.groups()
        return cls(KINDS[kind], int(t), int(m), int(k), (int(lo), int(hi)))


def task_id(kind: str, batch: int, micro: int, stage: int, rows: tuple[int, int]) -> str:
    return str(TaskId(kind, batch, micro, stage, (int(rows[0]), int(rows[1]))))


def batch_of(text) -> int | None:
    """The batch a task id names, or None when it is not a task id."""
    try:
        return TaskId.parse(text).batch
    except PayloadError:
        return None
