"""The corpus folder's manifest, without torch: `peer data prepare` (peer/data_cmd.py) writes it in a
process that never imports torch (its memory stays that of numpy and the block in flight), and
core.model.data reads it."""

from __future__ import annotations

import hashlib
import json

MANIFEST = "manifest.json"  # of a corpus folder that `peer data prepare` wrote
FORMAT = "hivepipe-tokens-1"


def manifest_fingerprint(manifest: dict) -> str:
    """sha256 of a corpus manifest without its fingerprint, as canonical JSON: the corpus's identity."""
    body = {k: v for k, v in manifest.items() if k != "fingerprint"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
