"""The ids of a pool's closed tasks (done or abandoned), kept so that an id cannot be added again and a
later result for it is answered DUPLICATE, by batch, until the owner forgets the batches it will never
see a result of again (a run lasts days: kept for ever, the ids would grow by every task)."""

from __future__ import annotations


class ClosedIds:
    __slots__ = ("done", "abandoned", "by_batch")

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.abandoned: set[str] = set()
        self.by_batch: dict[int, list[str]] = {}  # batch -> ids done or abandoned, to forget

    def __contains__(self, task_id: str) -> bool:
        return task_id in self.done or task_id in self.abandoned

    def add_done(self, task_id: str, batch: int) -> None:
        self.done.add(task_id)
        self.by_batch.setdefault(batch, []).append(task_id)

    def add_abandoned(self, task_id: str, batch: int) -> None:
        self.abandoned.add(task_id)
        self.by_batch.setdefault(batch, []).append(task_id)

    def undo_done(self, task_id: str, batch: int) -> bool:
        """Forget that `task_id` (of `batch`) is done, to queue it again; False when it is not done."""
        if task_id not in self.done:
            return False
        self.done.discard(task_id)
        ids = self.by_batch.get(batch)
        if ids is not None and task_id in ids:
            ids.remove(task_id)
        return True

    def forget(self, before_batch: int) -> list[str]:
        """Forget the ids of the batches < `before_batch`; returns them."""
        gone: list[str] = []
        for batch in [b for b in self.by_batch if b < before_batch]:
            ids = self.by_batch.pop(batch)
            for task_id in ids:
                self.done.discard(task_id)
                self.abandoned.discard(task_id)
            gone += ids
        return gone

    def state(self, task_id: str) -> str:
        """What a task id not in the pool is, in words."""
        if task_id in self.done:
            return "already done"
        if task_id in self.abandoned:
            return "abandoned"
        return "unknown"
