"""What a peer reads of its run from the DHT: the run's servers, their versions and epochs and when
each last said something new (`Directory`), and the log of a run that its servers say is stopped
(`HaltNotice`)."""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.dht import DHT

from core.protocol import record_store, records
from core.protocol.links import LinkEmulator
from core.protocol.records import RecordState
from peer.server_links import P2PLink

logger = logging.getLogger("hivepipe.node")


class HaltNotice:
    """The log of a stopped run (a role lost its last server), in the manner of LinkHealth: one
    ERROR line when it stops, with the reason; one a minute while it stays stopped; one when it
    goes on. `update` takes the current reason (None: running). A reader of other peers' records
    passes `clear_after`: a DHT read can miss every record that says so, so the run counts as going
    on only once no read said it was stopped for that many seconds, or at once when the read shows
    progress (the servers' highest parameter version, passed as `progress`) beyond any read made
    before or while it was stopped: the records that carry a version also carry the stop, and a
    version reached before the stop that a lagging read had not shown yet is no progress."""

    def __init__(self, who: str, clock=time.monotonic, period: float = 60.0, clear_after: float = 0.0, on_change=None):
        self.who, self.clock, self.period, self.clear_after = who, clock, period, clear_after
        # instead of its own log lines: on_change(reason) when the run stops (or the reason changes),
        # on_change(None, seconds stopped) when it goes on (a peer's state line says it: peer.host)
        self.on_change = on_change
        self.reason: str | None = None
        self.since = self._logged_at = self._said_at = 0.0
        self._progress = -1  # the highest progress read so far

    def update(self, reason: str | None, progress: int | None = None) -> None:
        now = self.clock()
        if reason is None:
            moved = progress is not None and progress > self._progress
            if progress is not None:
                self._progress = max(self._progress, progress)
            if self.reason is not None and (moved or now - self._said_at >= self.clear_after):
                self.went_on()
            return
        self._said_at = now
        if progress is not None:
            self._progress = max(self._progress, progress)
        if self.on_change is not None:
            if self.reason is None:
                self.since = now
            if reason != self.reason:
                self.reason = reason
                self.on_change(reason)
            return
        if self.reason is None:
            self.reason, self.since, self._logged_at = reason, now, now
            logger.error("%s: %s", self.who, reason)
        elif reason != self.reason or now - self._logged_at >= self.period:
            self.reason, self._logged_at = reason, now
            logger.error("%s: still stopped after %.0f s: %s", self.who, now - self.since, reason)

    def went_on(self) -> None:
        """The run went on (a read showed it, or it reached its last step, which it cannot while
        stopped: a peer that learns the end while it still counts the run stopped says it went on)."""
        if self.reason is None:
            return
        now = self.clock()
        if self.on_change is not None:
            self.on_change(None, now - self.since)
        else:
            logger.warning("%s: the run goes on again after %.0f s stopped", self.who, now - self.since)
        self.reason = None


class Directory:
    """device id -> peer id of the run's servers, refreshed from the stage records."""

    def __init__(self, dht: DHT, run_id: str, num_stages: int):
        self.dht = dht
        self.run_id = run_id
        self.num_stages = num_stages
        self.servers: dict[str, str] = {}
        # every server ever seen (device -> peer id): one read of a key may miss a record that another
        # DHT node holds, so membership checks and calls use this, and losses are confirmed by a call
        self.known: dict[str, str] = {}
        self.versions: dict[str, int] = {}  # server device -> announced parameter version
        self.epochs: dict[str, int] = {}  # server device -> the layout epoch of that announcement
        self.records: dict[str, dict] = {}  # peer id -> record (servers and clients)
        self.addresses: dict[str, list[str]] = {}  # server peer id -> the multiaddrs it last announced
        # server device -> (the time its newest record was written, when (time.monotonic) this
        # process saw that record's time advance): a record lives records.record_ttl, longer than
        # its writer may be silent, so liveness is how long since a server last said something new
        self._heard: dict[str, tuple[float, float]] = {}
        # servers that announced the run finished (they leave once every server reached the last
        # step): their silence afterwards is not a loss
        self.finished: set[str] = set()

    async def refresh(self) -> dict[str, str]:
        servers, recs, versions, epochs = {}, {}, {}, {}
        for k, found in enumerate(await record_store.read_stages(self.dht, self.run_id, self.num_stages)):
            for peer, rec, problem in found:
                if rec is None:
                    logger.debug("ignoring a malformed record under stage %d: %s", k, problem)
                    continue
                recs[peer] = rec
                if rec["kind"] == "server":
                    self.addresses[peer] = [m for m in rec["maddrs"] if isinstance(m, str)]
                    self._note(rec)
                    if rec["state"] == RecordState.FINISHED:
                        self.finished.add(rec["device"])
                if rec["kind"] == "server" and rec["state"] != RecordState.OFFLINE:
                    servers[rec["device"]] = peer
                    versions[rec["device"]] = rec["version"]
                    epochs[rec["device"]] = rec.get("epoch", 0)
        self.servers, self.records, self.versions, self.epochs = servers, recs, versions, epochs
        self.known.update(servers)
        return servers

    def _note(self, rec: dict) -> None:
        device, written = rec["device"], float(rec["time"])
        if rec["state"] == RecordState.OFFLINE:  # it said it left
            self._heard[device] = (written, float("-inf"))
            return
        last = self._heard.get(device)
        if last is None:  # first sight: as old as its own time says (a record outlives its writer)
            self._heard[device] = (written, time.monotonic() - max(0.0, time.time() - written))
        elif written > last[0]:  # something new: its writer was there a read ago
            self._heard[device] = (written, time.monotonic())

    def silent_for(self, device: str) -> float:
        """Seconds since server `device` last announced something new, as this directory's reads
        saw it (inf if never, or if it announced that it went offline)."""
        heard = self._heard.get(device)
        return float("inf") if heard is None else time.monotonic() - heard[1]

    def halted(self, period: float) -> str | None:
        """Why the run is stopped, as a live server of it announces (None while it runs): records
        fresher than records.stale_after(period) (a stopped server's record outlives it)."""
        return records.halted_reason(r for r in self.records.values() if records.is_fresh(r, period))

    def link(
        self,
        p2p,
        device: str,
        links: LinkEmulator | None = None,
        peer_id: str | None = None,
        backoff: bool = True,
        compress: str = "none",
    ) -> P2PLink:
        """A P2P link to server `device` (by default the peer id last seen for it) that dials the
        multiaddrs its record announces."""
        peer = peer_id or self.known[device]
        return P2PLink(
            p2p,
            peer,
            device,
            links,
            addresses=lambda: self.addresses.get(peer, []),
            backoff=backoff,
            compress=compress,
        )

    async def wait_for(self, devices, timeout: float = 120.0) -> None:
        """Until every device in `devices` has been seen in a record. Seen once is enough: one read
        of the stage keys can miss a record another DHT node holds, and with many servers a read that
        misses none may take a long while; and devices already seen cost no read at all (a restarted
        server read the run's servers before it served, and a second read of a busy DHT can take seconds)."""
        deadline = time.monotonic() + timeout
        missing = [d for d in devices if d not in self.known]
        while missing:
            await self.refresh()
            missing = [d for d in missing if d not in self.known]
            if missing and time.monotonic() > deadline:
                raise TimeoutError(f"servers not found in the DHT: {missing}")
            if missing:
                await asyncio.sleep(0.3)
