"""Replicas: every shard's state copied to the stage's next server (in shard order) after each step,
so that a server lost for good can be taken over from its replica (parameter_server/failover.py);
a slot steps at most REPLICA_LAG versions ahead of what its replica holds; the replica's own steps
from the gradient pushes it is sent (checked against the digest of what its host applied). A part of a
server, built with what it reads of it (parameter_server/parts.py)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Awaitable, Callable

from core.protocol import param_delta
from core.protocol.fields import field as mfield
from core.protocol.wire import PayloadError

logger = logging.getLogger("hivepipe.server")

# how many versions a slot may step ahead of the copy its replica has taken (Failover.replica_behind):
# at 1 a step waited for the copy of the version just made (its replica's durable write included),
# which cost a tiny-model swarm 14-21% of its tokens/s; at 2 the copy has a whole step to arrive, and
# a takeover still re-runs at most two batches, within what every shard keeps (3 + 2 x stages)
REPLICA_LAG = 2


class Replicas:
    """A server's replicas of its stage's shards, given what they read of it: `device_id`, `stage`,
    `compress` (the run's wire codec), `slots` (how many shard slots the stage has), `new_shard(slot)`;
    `replicas` (slot -> the copy kept here: written here, taken over by a failover); its `outbox`,
    `directory`, `checks` and `counters`; as they are now: `stage_servers()`, `hosted()`, `epoch()`,
    `replaying()` and `connector()` (device -> a link to that server, or None where there are no
    links); and `maybe_step()`, called when a copy a step waited for is taken. `on_replica` are called
    (and awaited) when a newer copy arrives, before it is acknowledged."""

    def __init__(
        self,
        *,
        device_id: str,
        stage: int,
        compress: str,
        slots: int,
        new_shard: Callable[[int], object],
        replicas: dict,
        outbox,
        directory,
        checks,
        counters: dict,
        stage_servers: Callable[[], object],
        hosted: Callable[[], dict],
        epoch: Callable[[], int],
        replaying: Callable[[], bool],
        connector: Callable[[], Callable[[str], object] | None],
        maybe_step: Callable[[], None],
    ) -> None:
        self.device_id, self.stage, self.compress, self.slots, self.new_shard = (
            device_id,
            stage,
            compress,
            slots,
            new_shard,
        )
        self.replicas, self.outbox, self.directory, self.checks, self.counters = (
            replicas,
            outbox,
            directory,
            checks,
            counters,
        )
        self.stage_servers, self.hosted, self.epoch, self.replaying = stage_servers, hosted, epoch, replaying
        self.connector, self.maybe_step = connector, maybe_step
        self.on_replica: list[Callable[[int], Awaitable[None] | None]] = []
        self.locks: dict[int, asyncio.Lock] = {}
        # slot -> (server, round, version): the newest version of the slot sent to its replica at that
        # server in that round of copies (a round begins with every layout epoch)
        self.sent: dict[int, tuple[str, int, int]] = {}
        self.round = 0
        # slot -> (server, version): the newest version of the slot that its replica there has taken
        self.acked: dict[int, tuple[str, int]] = {}
        self.catching_up: set[int] = set()  # slots whose replica a held step sends
        # (slot, batch) -> the gradient sum this server's own worker pushed to the slot's host
        self.own_pushes: dict[tuple[int, int], list | None] = {}
        self.event = asyncio.Event()  # set (and replaced) whenever a replica here takes a version

    def new_epoch(self) -> None:
        """A layout epoch began: the ring of replicas changed, or a rollback undid what they took;
        what was sent to the old ring counts for nothing."""
        self.acked = {}
        self.round += 1

    async def send(self, slot: int) -> None:
        """After a step of `slot`, copy its new state to the next server of the stage (in shard
        order), which can take the slot over if this server is lost for good. Every kept version not
        sent yet goes, oldest first: a takeover re-runs from the lowest version of any shard, and
        each re-run batch is computed on the version before it, which the replica must therefore
        hold (when steps came faster than the copies, the sender used to skip to the newest version,
        and a takeover then asked every worker for a version its host never had: the run re-queued
        the same tasks forever)."""
        if len(self.stage_servers().servers) < 2 or self.replaying():
            return
        lock = self.locks.setdefault(slot, asyncio.Lock())
        async with lock:
            # read under the lock: a copy of an earlier round (an epoch whose ring had another next
            # server) may have held it until now
            buddy, round_ = self.buddy(), self.round
            shard = self.hosted().get(slot)
            if shard is None:
                return
            # in a steady run one version a step, sent as the step that made it (the summed gradient:
            # a third of the state's bytes) to a replica that mirrors the version before; the whole
            # state when the replica does not (its first copy, a gap, a restart, a rollback)
            sent = self._sent_to(slot, buddy)
            for version in [v for v in sorted(shard.snapshots) if v > sent and v in shard.moments]:
                if version not in shard.snapshots:  # forgotten meanwhile (the shard stepped on)
                    continue
                # each copy carries the layout epoch it was made in: one that reaches the replica after
                # it adopted a ban's rollback is refused (a version of the undone lineage, whose batch
                # totals held the banned work's norms)
                step = shard.export_step(version) if version - 1 == self._sent_to(slot, buddy) else None
                taken = step is not None and await self._replica_step(
                    buddy, slot, dict(step[0], epoch=self.epoch()), step[1], self._buddy_made(shard, version, buddy)
                )
                if not taken:
                    if version not in shard.snapshots or version not in shard.moments:
                        continue  # rolled back while the step was on its way
                    meta, tensors = shard.export(version)
                    taken = await self.outbox.deliver(
                        buddy, "push_replica", dict(meta, slot=slot), tensors, attempts=60
                    )
                if self.round != round_:
                    # a layout epoch began while this copy was on its way: what it sent counts for
                    # nothing there, and the new round's copies (replicate_hosted) start afresh; saying
                    # it was sent would have them skip the versions the new next server needs
                    return
                self.sent[slot] = (buddy, round_, version)
                if taken:
                    self._replica_taken(slot, buddy, version)

    def _sent_to(self, slot: int, buddy: str) -> int:
        """The newest version of `slot` sent to `buddy` in this round of copies (-1: none)."""
        to, round_, version = self.sent.get(slot, (None, -1, -1))
        return version if (to, round_) == (buddy, self.round) else -1

    def _replica_taken(self, slot: int, buddy: str, version: int) -> None:
        """`buddy` holds `version` of `slot` now: a step this slot held for it (`replica_behind`) goes on."""
        acked_by, acked = self.acked.get(slot, (None, -1))
        self.acked[slot] = (buddy, version if acked_by != buddy else max(acked, version))
        self.maybe_step()

    def behind(self, slot: int, version: int) -> bool:
        """True while stepping `slot` from `version` would put it more than REPLICA_LAG versions ahead
        of the copy its replica (the stage's next server) has taken: the step waits for the copy. So a
        failover always finds the lost slot's replica within REPLICA_LAG versions of where its host
        was, inside what every other shard still keeps; unbounded, a loaded server's copies fell
        versions behind, and a takeover from version 0 then re-ran batches the other shards no longer
        kept the versions of (the run never finished). A stage of one server, a replay of the request
        log, or a server without links to the others (no one to copy to) holds nothing."""
        if self.replaying() or self.connector() is None or len(self.stage_servers().servers) < 2:
            return False
        buddy = self.buddy()
        acked_by, acked = self.acked.get(slot, (None, -1))
        if acked_by == buddy and acked >= version - (REPLICA_LAG - 1):
            return False
        if slot not in self.catching_up:  # (one catch-up at a time: this is asked at every credit)
            self.catching_up.add(slot)
            self.outbox.spawn(self._catch_up_replica(slot, buddy, acked if acked_by == buddy else -1))
        return True

    async def _catch_up_replica(self, slot: int, buddy: str, acked: int) -> None:
        """Send `slot`'s replica whatever `buddy` has not taken (everything after `acked`): a step
        holds for it. The copies sent after each step do it too; this one starts the first copy (and
        one after a copy was given up on), which no step would start."""
        try:
            self.sent[slot] = (buddy, self.round, min(self._sent_to(slot, buddy), acked))
            await self.send(slot)
        finally:
            self.catching_up.discard(slot)

    def buddy(self) -> str:
        """The server that keeps the replicas of the slots hosted here: the stage's next in shard order."""
        servers = list(self.stage_servers().servers)
        return servers[(servers.index(self.device_id) + 1) % len(servers)]

    def _buddy_made(self, shard, version: int, buddy: str) -> bool:
        """Whether `version`'s summed gradient is one push from `buddy`'s own worker, which `buddy`
        therefore holds already (exact runs only: a compressed push arrives other than it was sent)."""
        peer = self.directory.peer_of(buddy)
        return self.compress == "none" and peer is not None and shard.pushed_by(version) == (peer,)

    async def _replica_step(self, buddy: str, slot: int, meta: dict, tensors: list, by_reference: bool = False) -> bool:
        """Send one step of `slot` to its replica at `buddy` (the link repeats it after a lost answer;
        the replica takes it once): False when it was not taken (the replica does not mirror the
        version before, or the call failed), and the caller sends the whole state, with retries.
        `by_reference`: the step's summed gradient is the one push `buddy`'s own worker made, so only
        its digest goes first (`on_push_replica` takes the step from that push when the digests agree:
        0.92 MB a step and server saved in the default swarm); the tensors follow if asked for."""
        connector = self.connector()
        link = connector(buddy) if connector else None
        if link is None:
            return False
        try:
            if by_reference:
                digest = param_delta.digest(meta["names"], tensors)
                answer, _ = await link.call("push_replica", dict(meta, slot=slot, grad_digest=digest), [], timeout=30.0)
                if answer.get("result") in ("accepted", "duplicate"):
                    self.counters["replica_steps_by_reference"] += 1
                    return True
            answer, _ = await link.call("push_replica", dict(meta, slot=slot), tensors, timeout=30.0)
        except Exception as e:
            logger.debug(
                "%s: replica step %d of slot %d to %s not taken: %r", self.device_id, meta["version"], slot, buddy, e
            )
            return False
        return answer.get("result") in ("accepted", "duplicate")  # (a duplicate: a repeat after a lost answer)

    def replicate_hosted(self) -> None:
        """Send every slot hosted here to the stage's next server now, whatever was sent before:
        when the run comes online (a server lost before the first step must have a copy somewhere)
        and when a layout epoch changes the ring of replicas (a second loss must find one)."""
        self.round += 1
        for slot in sorted(self.hosted()):
            self.outbox.spawn(self.send(slot))

    async def on_push_replica(self, meta, tensors, sender):
        self.checks.server_of(sender, self.stage, "frontal", "backward")
        slot = mfield(meta, "slot", int)
        if not 0 <= slot < self.slots or slot in self.hosted():
            raise PayloadError(f"shard slot {slot} is not another server's slot of stage {self.stage}")
        replica = self.replicas.get(slot)
        if meta.get("form") == "step":  # the step that made the next version (a third of the bytes)
            if replica is None:
                raise PayloadError(f"no replica of slot {slot} here to take a step: send the whole state")
            if "grad_digest" in meta and not tensors:  # by reference: the sum this server's worker pushed
                tensors = self._own_push(slot, meta)
                if tensors is None:
                    return {"result": "need_tensors", "version": replica.version}
            newer = replica.absorb_step(meta, tensors)
        else:
            replica = replica or self.new_shard(slot)
            newer = replica.absorb(meta, tensors)
        self.replicas[slot] = replica
        self.counters["replicas_received"] += int(newer)
        if newer:
            self.event.set()
            self.event = asyncio.Event()
            for cb in self.on_replica:  # made durable before it is acknowledged
                r = cb(slot)
                if inspect.isawaitable(r):
                    await r
        return {"result": "accepted" if newer else "duplicate", "version": replica.version}

    def note_own_push(self, slot: int, batch: int, tensors: list) -> None:
        """This server's own worker pushed `tensors` (slot `slot`'s gradient sum of `batch`) to the
        slot's host: kept for a replica step by reference (`_own_push`) while the batch may still be
        stepped; a second push of the same batch makes the host's sum another one, so neither is kept."""
        key = (slot, batch)
        self.own_pushes[key] = None if key in self.own_pushes else list(tensors)
        for old in [k for k in self.own_pushes if k[1] < batch - 2]:
            del self.own_pushes[old]

    def _own_push(self, slot: int, meta: dict) -> list | None:
        """The gradient sum this server's worker pushed for the step `meta` makes of `slot`'s replica,
        when its digest is the one the host sent (`grad_digest`); None when it pushed none, pushed the
        batch twice, or other bits."""
        version, names = meta.get("version"), meta.get("names")
        if not isinstance(version, int) or not isinstance(names, list) or not isinstance(meta["grad_digest"], str):
            raise PayloadError(
                "a replica step by reference needs an int 'version', a 'names' list and a 'grad_digest' string"
            )
        pushed = self.own_pushes.get((slot, version - 1))
        if pushed is None or len(pushed) != len(names) or param_delta.digest(names, pushed) != meta["grad_digest"]:
            return None
        return pushed

    async def replica_at(self, slot: int, version: int, timeout: float) -> tuple[str, dict] | None:
        """(digest, parameters) of version `version` of the replica of `slot` kept here, waiting up to
        `timeout` seconds for the replica step that makes it (sent by the slot's host right after its
        own step); None when no replica of the slot is kept here or it does not hold the version in
        time. For this server's own worker (StageWorker._from_own_replica), which reads a version
        from here instead of pulling it when the host says its digest is the same."""
        deadline = time.monotonic() + timeout
        while True:
            replica = self.replicas.get(slot)
            if replica is None:
                return None
            if version in replica.snapshots:
                return replica.digest(version), replica.snapshots[version]
            left = deadline - time.monotonic()
            if replica.version > version or left <= 0:
                return None
            try:
                await asyncio.wait_for(self.event.wait(), left)
            except asyncio.TimeoutError:
                return None
