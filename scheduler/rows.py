"""How a frontal server cuts a micro-batch's rows among its clients by their weights: here, below the
servers, so that the step model (scheduler/stepsim.py) plays the very rule the servers run
(parameter_server/frontal.py imports it through parameter_server.layout)."""
from __future__ import annotations


def split_by_weights(lo: int, hi: int, weights: list[float]) -> list[tuple[int, int, int]]:
    """Rows [lo, hi) cut into len(weights) contiguous pieces proportional to the weights (largest
    remainder rounding), as (weight index, lo, hi); empty pieces are dropped, so fewer pieces come
    back when rows are scarcer than weights."""
    n = hi - lo
    if n <= 0:
        return []
    w = [max(float(x), 0.0) for x in weights] or [1.0]
    total = sum(w)
    if total <= 0:
        w, total = [1.0] * len(w), float(len(w))
    exact = [n * x / total for x in w]
    counts = [int(e) for e in exact]
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    pieces, at = [], lo
    for i, c in enumerate(counts):
        if c > 0:
            pieces.append((i, at, at + c))
            at += c
    return pieces
