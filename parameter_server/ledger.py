"""What a server holds of the data path: the rows of a micro-batch received piece by piece
(RowBuffer) and the backward server's ledger of which client computed which rows (LedgerEntry).
Plain containers: they check overlaps, not senders."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.protocol.wire import PayloadError


@dataclass
class RowBuffer:
    """Rows [lo, hi) of one micro-batch held by this server, filled piece by piece."""

    lo: int
    hi: int
    data: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    covered: list = field(default_factory=list)  # (a, b) pieces received

    def rows_covered(self) -> int:
        return sum(b - a for a, b in self.covered)

    @property
    def complete(self) -> bool:
        return self.rows_covered() == self.hi - self.lo

    def add(self, a: int, b: int, data: torch.Tensor, labels: torch.Tensor | None) -> bool:
        """Store rows [a, b); False if exactly these rows are already here (a duplicate)."""
        for x, y in self.covered:
            if x < b and a < y:
                if (x, y) == (a, b):
                    return False
                raise PayloadError(f"rows [{a}, {b}) overlap rows [{x}, {y}) already received")
        if self.data is None:
            self.data = torch.zeros((self.hi - self.lo,) + tuple(data.shape[1:]), dtype=data.dtype)
            if labels is not None:
                self.labels = torch.zeros((self.hi - self.lo,) + tuple(labels.shape[1:]), dtype=labels.dtype)
        self.data[a - self.lo : b - self.lo] = data
        if labels is not None and self.labels is not None:
            self.labels[a - self.lo : b - self.lo] = labels
        self.covered.append((a, b))
        return True

    def has(self, a: int, b: int) -> bool:
        need = b - a
        got = sum(max(0, min(b, y) - max(a, x)) for x, y in self.covered)
        return got == need

    def slice(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        d = self.data[a - self.lo : b - self.lo].clone()
        lab = None if self.labels is None else self.labels[a - self.lo : b - self.lo].clone()
        return d, lab


@dataclass
class LedgerEntry:
    client: str
    rows: tuple[int, int]
    frontal: str  # the FS holding this piece's inputs
    forward_task: str
    backward_task: str | None = None
