"""Reading the run from the DHT: a client-mode node (it dials out only and stores nothing) that
fetches the run's keys, and the Watcher that polls it on its own thread so that readers (HTTP
handlers) never touch the DHT; `merge_reads` makes one view of several reads. Must not compute or
render the snapshot's contents."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from core.protocol.record_store import open_config, open_stage, validator_rejections
from core.protocol.records import clients_key, config_key, stage_key
from core.protocol.trust import key_name
from core.protocol.values import finite_number
from peer.dashboard.entries import History
from peer.dashboard.snapshot import MAX_PROBED_STAGES, build_snapshot, stage_count

logger = logging.getLogger("hivepipe.dashboard")

# seconds one read of a key may take: a read that searches every node (latest=True) past a busy or
# vanished one answers later, and a snapshot waits for no such read longer than this (the key counts
# as not found this time; the next read tries again)
READ_TIMEOUT_S = 10.0


class DhtReader:
    """A client-mode DHT node (it stores nothing) reading the run's keys."""

    def __init__(self, initial_peers: list[str], run_id: str, run_fp: str | None = None, timeout: float | None = None):
        """`timeout`: seconds to keep trying initial peers that do not answer yet (a server that is
        restarting, or slow to answer under load), one try without it."""
        from peer.node import start_dht

        self.run_id = run_id
        self.dht = start_dht(initial_peers, run_id=run_id, run_fp=run_fp, client_mode=True, timeout=timeout)
        self.trust = self.dht.hivepipe_trust
        # records of the last fetch that did not verify, as the snapshot's "malformed" entries: those this
        # reader dropped and those the DHT node's validator dropped before they reached it
        self.rejected: list[dict] = []
        # every server seen in a record that verified: peer id -> the addresses it announced. When a
        # read finds nothing the reader connects to them and reads again: no one server's absence
        # (the initial peer stopped, restarting) hides the run from a reader that has seen it
        self.known: dict[str, list[str]] = {}
        # when the last fetch read each record, {(stage, peer id): time}: its age is judged then
        self.seen_at: dict[tuple[int, str], float] = {}
        self.read_times: dict[str, float] = {}  # DHT key -> when its last read ended

    def _get(self, key: str) -> Any:
        return self._get_many([key])[0]

    def _get_many(self, keys: list[str]) -> list[Any]:
        """The values of `keys`, read at once (a snapshot waits for the slowest read, not their sum;
        none longer than READ_TIMEOUT_S: a key not read by then counts as not found this time)."""
        import concurrent.futures

        futures = [self.dht.get(key, latest=True, return_future=True) for key in keys]
        for key, future in zip(keys, futures):  # (each read's own end: the others may take longer)
            future.add_done_callback(lambda _, key=key: self.read_times.__setitem__(key, time.time()))
        deadline = time.monotonic() + READ_TIMEOUT_S
        values = []
        for key, future in zip(keys, futures):
            try:
                found = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except (TimeoutError, concurrent.futures.TimeoutError):
                future.cancel()
                logger.info("reading %s took over %g s: not found this time", key, READ_TIMEOUT_S)
                found = None
            values.append(None if found is None else found.value)
        return values

    def _stage_keys(self, k: int) -> list[str]:
        """Stage k's keys: its servers' records, and its volunteers' (which only a dashboard reads)."""
        return [stage_key(self.run_id, k), clients_key(self.run_id, k)]

    def _stage(self, k: int) -> dict | None:
        """{peer id: record} of the records of stage k (servers and volunteers) that verify (None:
        no value at all)."""
        return self._open_stage(k, *self._get_many(self._stage_keys(k)))

    def _open_stage(self, k: int, servers: Any, volunteers: Any = None) -> dict | None:
        """The records that verify of stage k's servers' value and volunteers' value (None: no
        value at all)."""
        if servers is None and volunteers is None:
            return None
        out = {}
        for kind, raw in (("stage", servers), ("clients", volunteers)):
            if raw is not None:
                out.update(self._open_key(k, kind, raw))
        return out

    def _open_key(self, k: int, kind: str, raw: Any) -> dict:
        key = key_name(self.run_id, kind, k)
        read_at = self.read_times.get(key, time.time())
        out = {}
        for peer, rec, problem in open_stage(self.trust, k, raw, kind):
            if rec is None:
                self.rejected.append({"stage": k, "peer": peer, "short": peer[-8:], "reason": f"dropped: {problem}"})
            else:
                out[peer] = rec
                self.seen_at[(k, peer)] = read_at
        return out

    def fetch(self) -> tuple[Any, list[Any]]:
        """(config, [stage maps]) of the records that verify: as many stages as the config's layout
        names, or, without a usable config, the stage keys up to the first empty one. What did not
        verify is in `rejected` after the call. When no server of a run seen before is found (a config
        this node still holds does not count: it outlives the servers' records), the servers it has
        seen are reached at their announced addresses and the run read once more."""
        import functools

        from peer.node import reach_peers

        config, stages = self._fetch()
        servers = [r for found in stages for r in (found or {}).values() if r.get("kind") == "server"]
        if not servers and self.known:
            reached = self.dht.run_coroutine(functools.partial(reach_peers, peers=sorted(self.known.items())))
            logger.info(
                "nothing of the run found: %d of the %d servers seen before reached again", reached, len(self.known)
            )
            if reached:
                config, stages = self._fetch()
        for found in stages:
            for peer, rec in (found or {}).items():
                if rec.get("kind") == "server" and rec.get("maddrs"):
                    self.known[peer] = [m for m in rec["maddrs"] if isinstance(m, str)]
        return config, stages

    def _fetch(self) -> tuple[Any, list[Any]]:
        from core.protocol.trust import AmbiguousRunKey

        self.rejected, self.seen_at = [], {}
        try:
            config, dropped = open_config(self.trust, self._get(config_key(self.run_id)))
        except AmbiguousRunKey as e:
            config, dropped = None, [("-", str(e))]
        self.rejected += [
            {"stage": None, "peer": fp, "short": fp[-8:], "reason": f"config dropped: {why}"} for fp, why in dropped
        ]
        n = stage_count(config)
        if n is not None:
            raw = self._get_many([key for k in range(n) for key in self._stage_keys(k)])
            stages = [self._open_stage(k, raw[2 * k], raw[2 * k + 1]) for k in range(n)]
        else:
            stages = []
            for k in range(MAX_PROBED_STAGES):
                value = self._stage(k)
                if value is None:
                    break
                stages.append(value)
        self.rejected += [
            {
                "stage": None,
                "peer": r["subkey"],
                "short": r["subkey"][-8:],
                "reason": f"dropped by this node's validator at {r['key']}: {r['reason']}",
            }
            for r in self.dht.run_coroutine(validator_rejections)
        ]
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
            snap = (
                dict(last)
                if last is not None
                else build_snapshot(self.run_id, None, [], time.time(), stale_periods=self.stale_periods)
            )
            snap["errors"] = [problem] + [m for m in snap["errors"] if not m.startswith("reading the DHT failed")]
        else:
            snap = build_snapshot(
                self.run_id,
                config,
                stages,
                time.time(),
                history=self.history,
                stale_periods=self.stale_periods,
                rejected=self.reader.rejected,
                seen_at=self.reader.seen_at,
            )
        with self.lock:
            self.snapshot = snap
        return snap

    def _loop(self) -> None:
        while not self.stop.wait(self.refresh):
            self.poll()

    def current(self) -> dict:
        with self.lock:
            return self.snapshot


def merge_reads(reads: list[tuple[Any, list[Any], dict]]) -> tuple[Any, list[Any], dict]:
    """One view of several (config, stages, seen_at) reads of the run, in the order they were made: a
    single DHT read can miss a record (one announced late under load lapses for a moment; a node
    nearest the key may not hold it yet), so a one-shot snapshot reads over an announce period or two
    and keeps, per peer, the latest record any read found (by its `time`), with the time of the last
    read that found it (`seen_at`, {(stage, peer): time}: that record was still the peer's newest
    then). The config is the last read's that has one."""
    config = next((c for c, _, _ in reversed(reads) if c is not None), None)
    width = max((len(st) for _, st, _ in reads), default=0)
    stages: list[Any] = []
    seen_at: dict[tuple[int, str], float] = {}
    for k in range(width):
        merged: dict | None = None
        for _, st, read_at in reads:
            value = st[k] if k < len(st) else None
            if not isinstance(value, dict):
                continue
            merged = {} if merged is None else merged
            for peer, rec in value.items():
                old = merged.get(peer)
                if old is None or _record_time(rec) >= _record_time(old):
                    merged[peer] = rec
                    if (k, peer) in read_at:
                        seen_at[(k, peer)] = read_at[(k, peer)]
        stages.append(merged)
    return config, stages, seen_at


def _record_time(rec: Any) -> float:
    t = rec.get("time") if isinstance(rec, dict) else None
    return float(t) if finite_number(t) else float("-inf")
