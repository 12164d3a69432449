"""A run's name and the fingerprint of its run key, as `--run-id NAME[@FINGERPRINT]` gives them: parsed
without the cryptography and hivemind that core.protocol.trust needs, so that a command checks its
arguments (and says its first line) before those are imported."""

from __future__ import annotations

FINGERPRINT_LEN = 16


def split_run_id(text: str) -> tuple[str, str | None]:
    """`NAME` or `NAME@FINGERPRINT` -> (name, fingerprint or None); ValueError naming the problem."""
    name, _, fp = text.partition("@")
    if not name or not all(c.isascii() and (c.isalnum() or c in "-._") for c in name):
        raise ValueError(f"run id {name!r}: use letters, digits, '-', '_' and '.' only")
    if "@" in text:
        fp = fp.lower()
        if len(fp) != FINGERPRINT_LEN or any(c not in "0123456789abcdef" for c in fp):
            raise ValueError(
                f"run fingerprint {fp!r}: expected {FINGERPRINT_LEN} hex digits (as `peer serve` "
                "or `peer keygen` print it)"
            )
        return name, fp
    return name, None
