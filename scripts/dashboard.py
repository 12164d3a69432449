#!/usr/bin/env python3
"""Status dashboard of a hivepipe run, read from its DHT records only (docs/dashboard.md).

    python scripts/dashboard.py --initial-peers MADDR [--run-id R] [--json | --serve PORT] [--refresh S] [-v]

A live terminal view by default; --json prints one snapshot and exits (code 2 when the run is not
found within --timeout seconds); --serve PORT serves a self-updating page on 127.0.0.1, the snapshot
at /api/state and Prometheus metrics at /metrics (PORT 0 picks a free port; the address is printed).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer.dashboard import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
