"""Bans: a volunteer caught by a check is refused here at once and reported to the run's coordinator
(its first server), which bans it on every server and starts a layout epoch that rolls every shard
back to the first batch it contributed to, within the kept versions, and runs again from there. A
part of a server, built with what it reads of it (parameter_server/parts.py); the epoch's machinery
is failover's."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from core.model.update_rule import version_for_batch
from core.protocol.fields import field as mfield
from core.protocol.retry import Attempts
from core.protocol.wire import PayloadError
from parameter_server.old_versions import STRIDE

logger = logging.getLogger("hivepipe.server")

BAN_PATIENCE = 30.0  # how long the coordinator tries to reach each server with a ban
REPORT_TRIES = 30  # how often a server that caught a cheater tries to tell the run's coordinator (0.5 s apart)


def rollback_target(first: int, kept_from: int, versions: list[int], memory_from: int | None = None) -> int:
    """The version a ban rolls every shard back to, for a liar whose first work was batch `first`, when
    the oldest version every server still keeps is `kept_from` (`memory_from` in memory; below it, on
    disk, only old_versions.STRIDE's grid) and the servers' slots are at `versions`. The first batch
    re-run, t, computes on version_for_batch(t) (t - 1, the delayed update), which must still be kept:
    past the window's start the oldest version kept is where a re-run starts from, not where it rolls
    back to; below memory, the grid's version at or before t (or, past the reach, after it). And a
    server that has not reached the liar's first batch applied none of its work: the run goes back no
    further than the slowest server's version (an epoch's `rollback_to` is at most its `from_batch`)."""
    target = first if version_for_batch(first) >= kept_from else max(first, kept_from + 1)
    if memory_from is not None and version_for_batch(target) < memory_from:
        below = target // STRIDE * STRIDE
        target = below if version_for_batch(below) >= kept_from else -(-target // STRIDE) * STRIDE
    return min(target, min(versions))


class Bans:
    """A server's bans and their rollback epochs, given what it reads of its server: `device_id`;
    `banned` (peer id -> why: the bans made, written here);
    `clients` (a banned one is dropped) and `pool()` (its leases re-queued) as they are now; `counts`
    (the check counters: `caught`); `arrivals` (what each volunteer sent: the first batch a rollback
    must reach); `pins` (a ban holds the steps until its epoch); `outbox`; `call` to another server;
    `layout()`, `epoch()`, `epoch_record()` and the `shards()` hosted here as they are now;
    `replaying()`; `is_server(peer)`; `steps` (the run's last version); and failover's `send_epoch` and
    `adopt`, which make and take the ban's layout epoch."""

    def __init__(
        self,
        *,
        device_id: str,
        banned: dict[str, str],
        clients: dict,
        pool: Callable[[], object],
        counts: dict,
        arrivals,
        pins,
        outbox,
        call: Callable[[str, str, dict], Awaitable[tuple[dict, list]]],
        layout: Callable[[], object],
        epoch: Callable[[], int],
        epoch_record: Callable[[], dict | None],
        shards: Callable[[], list],
        replaying: Callable[[], bool],
        is_server: Callable[[str], bool],
        steps: int,
        send_epoch: Callable[[dict, list], Awaitable[None]],
        adopt: Callable[[dict], bool],
    ) -> None:
        self.device_id, self.clients, self.pool, self.counts, self.arrivals = device_id, clients, pool, counts, arrivals
        self.pins, self.outbox, self.call, self.layout, self.epoch = pins, outbox, call, layout, epoch
        self.epoch_record, self.shards, self.replaying, self.is_server, self.steps = (
            epoch_record,
            shards,
            replaying,
            is_server,
            steps,
        )
        self.send_epoch, self.adopt = send_epoch, adopt
        self.banned = banned  # peer id -> why (kept across layout epochs; arrivals.py refuses them)
        # bans heard of (made here, or ordered by a coordinator) whose rollback epoch has not come yet:
        # the ban log a new coordinator orders itself, should the one that banned die before its epoch
        self.pending: dict[str, str] = {}
        self._ordering = False
        self.lock = asyncio.Lock()

    def ordered(self) -> list[str]:
        """The bans the layout epochs so far have ordered, each with its rollback: what a new epoch
        lists as banned. Not every ban made here: a peer this server caught waits for its own turn
        (ban_and_roll_back), and listed as done before it, its rollback would never come."""
        return list((self.epoch_record() or {}).get("banned", []))

    # bans --------------------------------------------------------------------------------------
    def ban_here(self, peer: str, why: str) -> None:
        if peer in self.banned:
            return
        self.banned[peer] = why
        self.clients.pop(peer, None)
        n = len(self.pool().client_left(peer))
        logger.warning("%s: volunteer %s banned (%s); %d of its leases re-queued", self.device_id, peer[-8:], why, n)

    def caught(self, peer: str, why: str) -> None:
        """A check here found `peer` lying: refused here at once, reported to the run's coordinator."""
        if peer in self.banned:
            return
        self.counts["caught"] += 1
        self.ban_here(peer, why)
        self.pending.setdefault(peer, why)
        self.pins.hold_for_ban()  # no step until the ban's rollback (on_ban)
        self.outbox.spawn(self._report(peer, why))

    def order_pending(self) -> None:
        """Periodic (maintenance): the run's coordinator orders, one at a time, the bans it heard of
        whose rollback epoch never came: a coordinator that died (or froze and was failed over) after
        every server heard its ban and before its epoch left the liar's work applied (0.27 from the
        reference in the third trust pass); the next coordinator holds the same ban log."""
        for peer in [p for p in self.pending if p in self.ordered()]:
            del self.pending[peer]
        if not self.pending or self._ordering or self.lock.locked() or self.replaying():
            return
        if self.coordinator() != self.device_id:
            return
        peer, why = next(iter(self.pending.items()))
        self._ordering = True

        async def order():
            try:
                await self.ban_and_roll_back(peer, why)
            except Exception as e:  # (a server not reachable yet: tried again at the next maintenance)
                logger.info("%s: ordering the ban of %s failed: %r", self.device_id, peer[-8:], e)
            finally:
                self._ordering = False

        self.outbox.spawn(order())

    def coordinator(self) -> str:
        """The server that orders bans (and their rollbacks) into layout epochs: the run's first."""
        return next(d for st in self.layout().stages for d in st.servers)

    async def _report(self, peer: str, why: str) -> None:
        async for attempt in Attempts(
            f"{self.device_id}: reporting {peer[-8:]}", tries=REPORT_TRIES, pause=0.5, log=logger
        ):
            try:
                coordinator = self.coordinator()
                if coordinator == self.device_id:
                    await self.ban_and_roll_back(peer, why)
                else:
                    await self.call(coordinator, "report_cheat", {"peer": peer, "why": why})
                return
            except Exception as e:
                attempt.failed(e)
        logger.warning(
            "%s: %s was caught cheating but could not be reported in %d tries", self.device_id, peer[-8:], REPORT_TRIES
        )

    async def _server_call_patiently(self, device: str, method: str, meta: dict) -> tuple[dict, list]:
        """server_call, tried again for up to BAN_PATIENCE seconds while `device` cannot be reached
        (a ban early in a run met a coordinator whose directory did not list a server of another stage
        yet: the ban's epoch was never made, and the liar's work stayed applied)."""
        async for attempt in Attempts(f"{self.device_id}: {method} to {device}", within=BAN_PATIENCE, log=logger):
            try:
                return await self.call(device, method, meta)
            except (ConnectionError, asyncio.TimeoutError) as e:
                if attempt.last:
                    raise
                attempt.failed(e)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _ban_reported(self, peer: str, why: str) -> None:
        try:
            await self.ban_and_roll_back(peer, why)
        except Exception as e:  # said, not lost in a task nobody awaits; the servers step again after pins.HOLD_SECONDS
            logger.error("%s: the ban of %s could not be ordered: %r", self.device_id, peer[-8:], e)

    async def on_report_cheat(self, meta, tensors, sender):
        peer, why = mfield(meta, "peer", str), mfield(meta, "why", str)
        if self.coordinator() != self.device_id:
            raise PayloadError(f"{self.device_id} does not coordinate this run's bans ({self.coordinator()} does)")
        if self.is_server(peer):
            raise PayloadError(f"{peer[-8:]} is a server of this run: servers are trusted, not banned")
        self.outbox.spawn(self._ban_reported(peer, why))
        return {"ok": True}

    async def on_ban(self, meta, tensors, sender):
        """Ban `peer` here; answer the first batch it ever contributed to here (one already out of the
        kept window too: the coordinator then says which of its work stays applied), the oldest version
        kept and the versions of the slots hosted here."""
        peer, why = mfield(meta, "peer", str), mfield(meta, "why", str)
        self.ban_here(peer, why)
        if peer not in self.ordered():
            self.pending.setdefault(peer, why)
        self.pins.hold_for_ban()  # (bounded, should the coordinator die)
        batches = self.arrivals.contributed.get(peer)
        first = min(batches) if batches else -1
        return {
            "first_batch": min(first, self.arrivals.first_contributed.get(peer, first)) if batches else -1,
            "versions": [sh.version for sh in self.shards()],
            "kept_from": max(sh.kept_from() for sh in self.shards()),
            "memory_from": max(sh.memory_from() for sh in self.shards()),
        }

    async def ban_and_roll_back(self, peer: str, why: str) -> dict | None:
        """(The coordinator) ban `peer` on every server and start a layout epoch that drops every
        unapplied contribution and rolls every shard back to the first batch it contributed to (as far
        as the kept versions allow), then runs again from there. Returns the epoch record (None if the
        peer was banned by an earlier epoch)."""
        async with self.lock:
            if peer in self.ordered():
                return None
            answers = []
            for st in self.layout().stages:
                for d in st.servers:
                    answers.append(await self._server_call_patiently(d, "ban", {"peer": peer, "why": why}))
            firsts = [a["first_batch"] for a, _ in answers if a["first_batch"] >= 0]
            versions = [v for a, _ in answers for v in a["versions"]]
            kept_from = max(a["kept_from"] for a, _ in answers)
            memory_from = max(a.get("memory_from", kept_from) for a, _ in answers)
            record = {
                "epoch": self.epoch() + 1,
                "layout": self.layout().to_dict(),
                "banned": sorted(set(self.ordered()) | {peer}),
                "lost": list((self.epoch_record() or {}).get("lost", [])),
            }
            first = min(firsts) if firsts else None
            if first is not None and first < max(versions):
                target = rollback_target(first, kept_from, versions, memory_from)
                if target > first:
                    logger.error(
                        "%s: %s's work of batches %d..%d stays applied: versions before %d are no longer kept",
                        self.device_id,
                        peer[-8:],
                        first,
                        target - 1,
                        target,
                    )
                record["rollback_to"] = target
            low = min(versions + ([record["rollback_to"]] if "rollback_to" in record else []))
            record["from_batch"] = min(low, self.steps - 1)
            await self.send_epoch(record, [d for st in self.layout().stages for d in st.servers])
            self.adopt(record)
            logger.warning(
                "%s: volunteer %s banned from the run; epoch %d %s",
                self.device_id,
                peer[-8:],
                record["epoch"],
                f"rolled back to version {record['rollback_to']} from {max(versions)}"
                if "rollback_to" in record
                else "(nothing of it was applied)",
            )
            return record
