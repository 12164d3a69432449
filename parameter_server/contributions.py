"""What each volunteer gave this server over the run: tasks completed here and checks of its work
passed here, by peer id (with the device id it registered under), kept after it left, for the run's
summary (`DEVICE.run-summary.json`, `peer summary`). Bounded: past SEEN peers, the others are
counted together under OTHERS. Counts start with the server process (a restart replays its request log: the tasks come back, the checks start again)."""

from __future__ import annotations

SEEN = 4096  # peers counted by name
OTHERS = "(others)"


class Contributions:
    def __init__(self, seen: int = SEEN):
        self.seen = seen
        self.peers: dict[str, dict] = {}  # peer id -> {"device", "tasks", "checks_passed"}

    def _entry(self, peer: str, device: str | None) -> dict:
        if peer not in self.peers and len(self.peers) >= self.seen:
            peer, device = OTHERS, None
        entry = self.peers.setdefault(peer, {"device": device, "tasks": 0, "checks_passed": 0})
        if device is not None and entry["device"] is None:
            entry["device"] = device
        return entry

    def task_done(self, peer: str, device: str | None) -> None:
        self._entry(peer, device)["tasks"] += 1

    def check_passed(self, peer: str) -> None:
        self._entry(peer, None)["checks_passed"] += 1

    def table(self, banned: dict[str, str], servers: set[str] = frozenset()) -> dict[str, dict]:
        """peer id -> {"device", "tasks", "checks_passed", "banned": why or None}: the volunteers (not
        `servers`, whose own workers compute too) that completed a task here or were banned here."""
        out = {}
        for peer in sorted(set(self.peers) | set(banned)):
            if peer in servers:
                continue
            entry = self.peers.get(peer, {"device": None, "tasks": 0, "checks_passed": 0})
            out[peer] = dict(entry, banned=banned.get(peer))
        return out
