"""Checks of single values read from records, run configs and RPC metadata (torch-free: the run
config's recipe uses it at `peer --help`)."""

from __future__ import annotations

import math


def finite_number(x) -> bool:
    """An int or float (not a bool) that is neither NaN nor infinite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
