"""Stable seeds: the same on every process, machine and Python run (no `hash()`, which is salted)."""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A 63-bit seed for torch.Generator.manual_seed from the parts' string forms.

    Parts are joined with a separator that cannot be confused with their contents' boundaries for
    the ints and names used here, e.g. stable_seed("init", 0, "layers.3.attn.wq.weight")."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)
