"""The delayed parameter update (DESIGN.md, step 6), as two pure functions that the servers, the
volunteers and the reference all read: which parameter version a batch computes on, and when a
batch's update may be applied. Nothing else in the project writes this rule down."""

from __future__ import annotations


def version_for_batch(t: int) -> int:
    """Batch t is computed on version max(t - 1, 0): the parameters updated through batch t - 2."""
    return max(t - 1, 0)


def update_applies(t: int, version: int) -> bool:
    """Batch t's update is applied to version t (producing t + 1), while batch t + 1 computes on
    version t: one update in flight, never more."""
    return version == t
