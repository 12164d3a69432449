"""Where a server sits in the run, as the parts it is made of are told it (parameter_server/parts.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerPlace:
    """Where a server sits in the run: its device id, stage, role and index in that role (at its start:
    a failover keeps a server's stage and role), and whether its stage is the last."""

    device_id: str
    stage: int
    role: str
    index: int
    last: bool
