"""Reading the run from the DHT: a client-mode node (it dials out only and stores nothing) that
fetches the run's keys, and the Watcher that polls it on its own thread so that readers (HTTP
handlers) never touch the DHT. Must not compute or render the snapshot's contents."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from peer.dashboard.snapshot import MAX_PROBED_STAGES, History, build_snapshot, stage_count
from peer.protocol.records import config_key, stage_key, subkey_values

logger = logging.getLogger("hivepipe.dashboard")


class DhtReader:
    """A client-mode DHT node (it stores nothing) reading the run's keys."""

    def __init__(self, initial_peers: list[str], run_id: str):
        from peer.node import start_dht

        self.run_id = run_id
        self.dht = start_dht(initial_peers, client_mode=True)

    def _get(self, key: str) -> Any:
        found = self.dht.get(key, latest=True)
        if found is None:
            return None
        value = found.value
        if isinstance(value, dict):  # a key with subkeys: peer id -> ValueWithExpiration
            return subkey_values(value)
        return value

    def fetch(self) -> tuple[Any, list[Any]]:
        """(config value, [stage values]): as many stages as the config's layout names, or, without a
        usable config, the stage keys up to the first empty one."""
        config = self._get(config_key(self.run_id))
        n = stage_count(config)
        if n is not None:
            return config, [self._get(stage_key(self.run_id, k)) for k in range(n)]
        stages = []
        for k in range(MAX_PROBED_STAGES):
            value = self._get(stage_key(self.run_id, k))
            if value is None:
                break
            stages.append(value)
        return config, stages

    def shutdown(self) -> None:
        from peer.node import stop_dht

        stop_dht(self.dht)


class Watcher:
    """Reads the DHT every `refresh` seconds on its own thread and keeps the latest snapshot (with a
    History), so that readers (HTTP handlers) never touch the DHT."""

    def __init__(self, reader: DhtReader, run_id: str, refresh: float, stale_periods: float):
        self.reader, self.run_id, self.refresh, self.stale_periods = reader, run_id, refresh, stale_periods
        self.history = History()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.snapshot = self.poll()
        self.thread = threading.Thread(target=self._loop, name="dashboard-poller", daemon=True)

    def poll(self) -> dict:
        """Read the DHT once; the new snapshot (kept as the current one)."""
        try:
            config, stages = self.reader.fetch()
        except Exception as e:  # the DHT node failing is shown, not raised: the last snapshot stays, flagged
            logger.debug("reading the DHT failed", exc_info=True)
            problem = f"reading the DHT failed: {e!r}"
            with self.lock:
                last = getattr(self, "snapshot", None)
            snap = dict(last) if last is not None else \
                build_snapshot(self.run_id, None, [], time.time(), stale_periods=self.stale_periods)
            snap["errors"] = [problem] + [m for m in snap["errors"] if not m.startswith("reading the DHT failed")]
        else:
            snap = build_snapshot(self.run_id, config, stages, time.time(), history=self.history,
                                  stale_periods=self.stale_periods)
        with self.lock:
            self.snapshot = snap
        return snap

    def _loop(self) -> None:
        while not self.stop.wait(self.refresh):
            self.poll()

    def current(self) -> dict:
        with self.lock:
            return self.snapshot
