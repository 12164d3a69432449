"""The run's servers as a server knows them: each server's peer id from the run's signed records (a
server once seen stays known: a read of the DHT can miss a record), the versions they announced in
this layout epoch, and whether a peer is one of them. A part of a server, built with what it reads
of it (parameter_server/parts.py)."""

from __future__ import annotations

from typing import Callable


class Directory:
    """A server's directory of the run's servers, given `device_id` and `peer_id` (its own), and, as
    they are now, `layout()`, `epoch()`, `version()` (the version every shard hosted here has reached)
    and `replaying()` (a request-log replay trusts what it replays)."""

    def __init__(
        self,
        *,
        device_id: str,
        peer_id: str,
        layout: Callable[[], object],
        epoch: Callable[[], int],
        version: Callable[[], int],
        replaying: Callable[[], bool],
    ) -> None:
        self.device_id, self.peer_id, self.layout, self.epoch, self.version = device_id, peer_id, layout, epoch, version
        self.replaying = replaying
        self.peers: dict[str, str] = {}  # device -> peer id
        self.devices: dict[str, str] = {}  # peer id -> device
        self.run_versions: dict[str, int] = {}  # device -> the version it announced in this layout epoch

    def update(
        self,
        device_to_peer: dict[str, str],
        versions: dict[str, int] | None = None,
        epochs: dict[str, int] | None = None,
    ) -> None:
        """Merge what one read of the DHT found. Versions are taken only from announcements of this
        server's layout epoch: a server that takes over a lagging shard slot announces a lower version
        than before."""
        self.peers = self.peers | dict(device_to_peer)
        self.devices = {p: d for d, p in self.peers.items()}
        if versions is not None:
            epochs = epochs or {}
            self.run_versions.update({d: v for d, v in versions.items() if epochs.get(d, 0) == self.epoch()})

    def new_epoch(self) -> None:
        """A layout epoch began: readings of the old one no longer say what is applied."""
        self.run_versions = {}

    def peer_of(self, device: str) -> str | None:
        """The peer id the run's records gave server `device`, if any has been read."""
        return self.peers.get(device)

    def device_of(self, peer: str) -> str | None:
        """The server whose peer id `peer` is, if any has been read."""
        return self.devices.get(peer)

    def is_server(self, peer: str) -> bool:
        """The peer is this server or a server of the run's layout (whose workers compute too)."""
        if peer == self.peer_id or self.replaying():
            return True
        dev = self.devices.get(peer)
        return dev is not None and any(dev in st.servers for st in self.layout().stages)

    def run_min_version(self) -> int:
        """The lowest version any server of the run has announced: a batch below it is applied by
        every shard, so no task of it is needed by anyone (after a failover, a stage re-runs the
        forward and backward of batches it has applied itself for the stages that have not)."""
        known = [self.run_versions.get(d, 0) for st in self.layout().stages for d in st.servers if d != self.device_id]
        return min([self.version()] + known)
