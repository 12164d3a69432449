"""The multiaddrs of a run's other servers, kept in a server's checkpoint folder, so that a restart
without --initial-peers (the first server's own command) joins the run's DHT through them instead of
starting a DHT of its own beside it."""

from __future__ import annotations

import logging
import os
from typing import Iterable

logger = logging.getLogger("hivepipe.serve")


class KnownPeers:
    """`DEVICE.peers` in `checkpoint_dir` (nothing is kept without a folder)."""

    def __init__(self, checkpoint_dir: str | None, device: str):
        self.path = os.path.join(checkpoint_dir, f"{device}.peers") if checkpoint_dir else None
        self.device = device
        self._written: list[str] = []

    def read(self) -> list[str]:
        """The multiaddrs kept (with a peer id each), [] when there are none or no folder."""
        if self.path is None:
            return []
        try:
            with open(self.path) as f:
                return [m for m in f.read().split() if "/p2p/" in m]
        except OSError:
            return []

    def remember(self, maddrs: Iterable[str]) -> None:
        """Keep `maddrs` (those with a peer id), replacing the file at once, when they changed."""
        kept = sorted(m for m in maddrs if "/p2p/" in m)
        if self.path is None or not kept or kept == self._written:
            return
        try:
            with open(self.path + ".tmp", "w") as f:
                f.write("\n".join(kept) + "\n")
            os.replace(self.path + ".tmp", self.path)
            self._written = kept
        except OSError as e:
            logger.info("%s: cannot keep the run's peers in %s: %s", self.device, self.path, e)
