"""Checks of single values read from records, run configs and RPC metadata, and how a duration is
written for a person (torch-free: the run config's recipe uses it at `peer --help`)."""

from __future__ import annotations

import math


def finite_number(x) -> bool:
    """An int or float (not a bool) that is neither NaN nor infinite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def format_duration(seconds: float) -> str:
    """A duration as a person reads it: "45 s", "12 min", "3.4 h", "2.1 days"."""
    if not finite_number(seconds) or seconds < 0:
        raise ValueError(f"a duration must be a finite number >= 0, got {seconds!r}")
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
