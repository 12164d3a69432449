"""What a stage worker keeps of its forward tasks (a part of peer/volunteer/worker.py's StageWorker):
the passes themselves, for the backward task of the same rows (which the backward server offers the
worker of the forward pass first: no recompute), oldest dropped first beyond a memory budget; and
the input rows each forward task received, so that a backward task of rows it computed needs no
`get_inputs`. Both are keyed by layout epoch too: a task of an older epoch that ends after a rollback
stores its own, which the re-made batch's tasks must not read."""

from __future__ import annotations

import torch

from core.model.task_math import KeptForward


class KeptForwards:
    def __init__(self, activation_memory: int):
        self.activation_memory = activation_memory  # bytes of kept passes at most (0: keep none)
        # (batch, micro-batch, rows lo, rows hi, version, layout epoch) -> the kept pass
        self.passes: dict[tuple, KeptForward] = {}
        # (batch, micro-batch, layout epoch) -> the input rows forward tasks received: (lo, hi, rows)
        self.inputs: dict[tuple[int, int, int], list[tuple[int, int, torch.Tensor]]] = {}

    def clear(self) -> None:
        """A new layout epoch: a rollback re-makes versions after its batch, and their inputs."""
        self.passes.clear()
        self.inputs.clear()

    def keep(self, key: tuple, kept: KeptForward) -> None:
        if kept.nbytes > self.activation_memory:
            return
        self.passes[key] = kept
        total = sum(k.nbytes for k in self.passes.values())
        while total > self.activation_memory:
            oldest = next(iter(self.passes))
            total -= self.passes.pop(oldest).nbytes

    def take(self, key: tuple) -> KeptForward | None:
        """The pass kept under `key`, no longer kept, or None."""
        return self.passes.pop(key, None)

    def drop_passes_before(self, batch: int) -> None:
        for key in [k for k in self.passes if k[0] < batch]:
            del self.passes[key]

    def add_inputs(self, t: int, m: int, epoch: int, a: int, b: int, x: torch.Tensor) -> None:
        self.inputs.setdefault((t, m, epoch), []).append((a, b, x))

    def rows(self, t: int, m: int, a: int, b: int, epoch: int) -> torch.Tensor | None:
        """Input rows [a, b) of micro-batch m of batch t (layout epoch `epoch`), if a forward task here
        received them; else None."""
        for x0, y0, x in self.inputs.get((t, m, epoch), []):
            if x0 <= a and b <= y0:
                return x[a - x0 : b - x0]
        return None

    def drop_inputs_before(self, batch: int) -> None:
        for key in [k for k in self.inputs if k[0] < batch]:
            del self.inputs[key]
