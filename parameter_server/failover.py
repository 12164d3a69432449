"""Failover, all of it: replicas of every shard copied to the stage's next server after each step,
the layout epochs (a record checked, adopted, or coordinated by the first remaining server when a
server is lost for good), and `get_layout` for workers that meet a newer epoch. Must not touch the
data path except to reset it when an epoch begins."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time

from core.layout import RunLayout
from core.model.update_rule import version_for_batch
from core.protocol.fields import field as mfield
from core.protocol.retry import Attempts
from core.protocol.wire import PayloadError
from parameter_server.shard import tensors_digest
from parameter_server.updates import snapshots_kept

logger = logging.getLogger("hivepipe.server")

# how many versions a slot may step ahead of the copy its replica has taken (Failover.replica_behind):
# at 1 a step waited for the copy of the version just made (its replica's durable write included),
# which cost a tiny-model swarm 14-21% of its tokens/s; at 2 the copy has a whole step to arrive, and
# a takeover still re-runs at most two batches, within what every shard keeps (3 + 2 x stages)
REPLICA_LAG = 2


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:  # adopted outside a server's loop (an in-process test): nobody to send to
        return False


class Failover:
    """StageServer's replicas and layout epochs (a part of parameter_server.service.StageServer)."""

    async def _send_replica(self, slot: int) -> None:
        """After a step of `slot`, copy its new state to the next server of the stage (in shard
        order), which can take the slot over if this server is lost for good. Every kept version not
        sent yet goes, oldest first: a takeover re-runs from the lowest version of any shard, and
        each re-run batch is computed on the version before it, which the replica must therefore
        hold (when steps came faster than the copies, the sender used to skip to the newest version,
        and a takeover then asked every worker for a version its host never had: the run re-queued
        the same tasks forever)."""
        if len(self.st.servers) < 2 or self.replaying:
            return
        buddy = self.replica_buddy()
        lock = self.replica_locks.setdefault(slot, asyncio.Lock())
        async with lock:
            shard = self.hosted.get(slot)
            if shard is None:
                return
            # in a steady run one version a step, sent as the step that made it (the summed gradient:
            # a third of the state's bytes) to a replica that mirrors the version before; the whole
            # state when the replica does not (its first copy, a gap, a restart, a rollback)
            sent = getattr(lock, "sent", -1)
            for version in [v for v in sorted(shard.snapshots) if v > sent and v in shard.moments]:
                if version not in shard.snapshots:  # forgotten meanwhile (the shard stepped on)
                    continue
                # each copy carries the layout epoch it was made in: one that reaches the replica after
                # it adopted a ban's rollback is refused (a version of the undone lineage, whose batch
                # totals held the banned work's norms)
                step = shard.export_step(version) if version - 1 == getattr(lock, "sent", -1) else None
                taken = step is not None and await self._replica_step(
                    buddy, slot, dict(step[0], epoch=self.epoch), step[1], self._buddy_made(shard, version, buddy)
                )
                if not taken:
                    if version not in shard.snapshots or version not in shard.moments:
                        continue  # rolled back while the step was on its way
                    meta, tensors = shard.export(version)
                    taken = await self._deliver(buddy, "push_replica", dict(meta, slot=slot), tensors, attempts=60)
                lock.sent = version
                if taken and buddy in self.st.servers:  # (a buddy failed over meanwhile took nothing)
                    self._replica_taken(slot, buddy, version)

    def _replica_taken(self, slot: int, buddy: str, version: int) -> None:
        """`buddy` holds `version` of `slot` now: a step this slot held for it (`replica_behind`) goes on."""
        acked_by, acked = self.replica_acked.get(slot, (None, -1))
        self.replica_acked[slot] = (buddy, version if acked_by != buddy else max(acked, version))
        self._maybe_step()

    def replica_behind(self, slot: int, version: int) -> bool:
        """True while stepping `slot` from `version` would put it more than REPLICA_LAG versions ahead
        of the copy its replica (the stage's next server) has taken: the step waits for the copy. So a
        failover always finds the lost slot's replica within REPLICA_LAG versions of where its host
        was, inside what every other shard still keeps; unbounded, a loaded server's copies fell
        versions behind, and a takeover from version 0 then re-ran batches the other shards no longer
        kept the versions of (the run never finished). A stage of one server, a replay of the request
        log, or a server without links to the others (no one to copy to) holds nothing."""
        if self.replaying or self.connector is None or len(self.st.servers) < 2:
            return False
        buddy = self.replica_buddy()
        acked_by, acked = self.replica_acked.get(slot, (None, -1))
        if acked_by == buddy and acked >= version - (REPLICA_LAG - 1):
            return False
        if slot not in self.replica_catching_up:  # (one catch-up at a time: this is asked at every credit)
            self.replica_catching_up.add(slot)
            self._spawn(self._catch_up_replica(slot, buddy, acked if acked_by == buddy else -1))
        return True

    async def _catch_up_replica(self, slot: int, buddy: str, acked: int) -> None:
        """Send `slot`'s replica whatever `buddy` has not taken (everything after `acked`): a step
        holds for it. The copies sent after each step do it too; this one starts the first copy (and
        one after a copy was given up on), which no step would start."""
        try:
            lock = self.replica_locks.setdefault(slot, asyncio.Lock())
            lock.sent = min(getattr(lock, "sent", -1), acked)
            await self._send_replica(slot)
        finally:
            self.replica_catching_up.discard(slot)

    def replica_buddy(self) -> str:
        """The server that keeps the replicas of the slots hosted here: the stage's next in shard order."""
        servers = list(self.st.servers)
        return servers[(servers.index(self.device_id) + 1) % len(servers)]

    def _buddy_made(self, shard, version: int, buddy: str) -> bool:
        """Whether `version`'s summed gradient is one push from `buddy`'s own worker, which `buddy`
        therefore holds already (exact runs only: a compressed push arrives other than it was sent)."""
        peer = self.peer_of(buddy)
        return self.compress == "none" and peer is not None and shard.pushed_by(version) == (peer,)

    async def _replica_step(self, buddy: str, slot: int, meta: dict, tensors: list, by_reference: bool = False) -> bool:
        """Send one step of `slot` to its replica at `buddy` (the link repeats it after a lost answer;
        the replica takes it once): False when it was not taken (the replica does not mirror the
        version before, or the call failed), and the caller sends the whole state, with retries.
        `by_reference`: the step's summed gradient is the one push `buddy`'s own worker made, so only
        its digest goes first (`on_push_replica` takes the step from that push when the digests agree:
        0.92 MB a step and server saved in the default swarm); the tensors follow if asked for."""
        link = self.connector(buddy) if self.connector else None
        if link is None:
            return False
        try:
            if by_reference:
                digest = tensors_digest(meta["names"], dict(zip(meta["names"], tensors)))
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
        for lock in self.replica_locks.values():
            lock.sent = -1
        for slot in sorted(self.hosted):
            self._spawn(self._send_replica(slot))

    async def on_push_replica(self, meta, tensors, sender):
        self._server_sender(sender, self.stage, "frontal", "backward")
        slot = mfield(meta, "slot", int)
        if not 0 <= slot < len(self.slot_names) or slot in self.hosted:
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
            replica = replica or self._new_shard(slot)
            newer = replica.absorb(meta, tensors)
        self.replicas[slot] = replica
        self.counters["replicas_received"] += int(newer)
        if newer:
            self.replica_event.set()
            self.replica_event = asyncio.Event()
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
        if (
            pushed is None
            or len(pushed) != len(names)
            or tensors_digest(names, dict(zip(names, pushed))) != meta["grad_digest"]
        ):
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
                await asyncio.wait_for(self.replica_event.wait(), left)
            except asyncio.TimeoutError:
                return None

    def ordered_bans(self) -> list[str]:
        """The bans the layout epochs so far have ordered, each with its rollback: what a new epoch
        lists as banned. Not every ban made here: a peer this server caught waits for its own turn
        (bans.py, ban_and_roll_back), and listed as done before it, its rollback would never come."""
        return list((self.epoch_record or {}).get("banned", []))

    async def on_get_layout(self, meta, tensors, sender):
        """The current layout epoch: {"epoch", "layout", "from_batch"} (epoch 0 is the first layout)."""
        return self.epoch_record or {"epoch": 0, "layout": self.layout.to_dict(), "from_batch": 0}

    async def on_adopt_epoch(self, meta, tensors, sender):
        """A failover's new layout epoch, from the server that coordinates it (any server of the run)."""
        if sender != self.peer_id and not self.replaying:
            dev = self.directory_reverse().get(sender)
            if dev is None or not any(dev in st.servers for st in self.layout.stages):
                raise PayloadError(f"sender {sender[-8:]} is not a server of this run")
        self.adopt(meta)
        return {"ok": True, "epoch": self.epoch}

    def check_epoch_record(self, record: dict) -> tuple[int, RunLayout, int]:
        epoch = mfield(record, "epoch", int)
        from_batch = mfield(record, "from_batch", int)
        try:
            layout = RunLayout.from_dict(mfield(record, "layout", dict), self.cfg.layers)
        except ValueError as e:
            raise PayloadError(f"epoch layout: {e}") from None
        if layout.num_stages != self.layout.num_stages or any(
            a.layers != b.layers or len(a.hosts) != len(b.hosts) for a, b in zip(layout.stages, self.layout.stages)
        ):
            raise PayloadError("an epoch layout must keep the stages, their layers and their shard slots")
        if not 0 <= from_batch < self.run.steps:
            raise PayloadError(f"from_batch {from_batch} outside 0..{self.run.steps - 1}")
        banned = mfield(record, "banned", list, optional=True) or []
        if not all(isinstance(p, str) and 0 < len(p) <= 128 for p in banned):
            raise PayloadError("field 'banned' must list peer ids")
        rollback_to = mfield(record, "rollback_to", int, optional=True)
        if rollback_to is not None and not 0 <= rollback_to <= from_batch:
            raise PayloadError(f"rollback_to {rollback_to} outside 0..from_batch {from_batch}")
        return epoch, layout, from_batch

    def adopt(self, record: dict) -> bool:
        """Switch to a later layout epoch: take over the slots it hosts here (from their replicas),
        re-segment the rows among the remaining servers, drop every credit, pool, row and ledger of
        unapplied batches, and run again from batch `from_batch` (the lowest version of any shard of
        the run): every shard either has applied a batch, and ignores its pushes, or credits it whole
        in the new epoch. Messages of the old epoch are refused from now on. False if not newer."""
        epoch, layout, from_batch = self.check_epoch_record(record)
        if epoch <= self.epoch:
            return False
        try:
            stage, role, index = layout.locate(self.device_id)
        except ValueError:
            raise PayloadError(f"{self.device_id} is not a server of epoch {epoch}'s layout") from None
        st = layout.stages[stage]
        take_over = [i for i in st.slots_of(self.device_id) if i not in self.hosted]
        missing = [i for i in take_over if i not in self.replicas]
        if stage != self.stage or role != self.role or missing:
            raise PayloadError(
                f"epoch {epoch} moves {self.device_id} or gives it slots {missing} it holds no replica of"
            )
        for i in take_over:  # all checked before anything changes
            if self.replicas[i].version < from_batch:
                raise PayloadError(
                    f"the replica of slot {i} is at version {self.replicas[i].version}, below from_batch {from_batch}"
                )
        rollback_to = record.get("rollback_to")
        if rollback_to is not None:  # a caught cheater's applied work is undone (parameter_server/bans.py)
            for slot, shard in self.hosted.items():
                if shard.version > rollback_to and shard.rollback_epoch < epoch and rollback_to not in shard.moments:
                    raise PayloadError(f"slot {slot} no longer keeps version {rollback_to} to roll back to")
        for i in take_over:
            shard = self.hosted[i] = self.replicas.pop(i)
            logger.warning("%s: took over shard slot %d at version %d", self.device_id, i, shard.version)
        rolled = False
        if rollback_to is not None:
            self.forget_sums_from(rollback_to, epoch)
            self.forget_evals_from(rollback_to)
            for slot, shard in self.hosted.items():
                if shard.rollback(rollback_to, epoch):
                    rolled = True
                    logger.warning("%s: slot %d rolled back to version %d", self.device_id, slot, rollback_to)
            for slot, replica in list(self.replicas.items()):
                try:
                    replica.rollback(rollback_to, epoch)
                except PayloadError:  # it never held that version: its owner sends the rolled-back state
                    del self.replicas[slot]
            self._verify_params = {}
        for peer in record.get("banned", []):
            self._ban_here(peer, f"banned by layout epoch {epoch}")
        self.hold_steps_until = None  # the epoch a ban waited for (pins.py)
        for shard in self.hosted.values():
            shard.batches = {}
        self.epoch, self.epoch_record, self.layout = epoch, dict(record), layout
        self.st, self.index, self.reflow_from = st, index, from_batch
        self.run_versions = {}  # readings of the old epoch no longer say what is applied
        self.replica_acked = {}  # (the ring of replicas changed, or a rollback undid what they took)
        self._reset_datapath()
        if not self.replaying and _in_event_loop():
            # the stage's ring of replicas changed: every slot hosted here goes to its new next server
            # now, not at its next step, so that a second loss in the stage finds a copy
            self.replicate_hosted()
        if self.log is not None and not self.replaying:
            if rolled:  # what was logged of the undone batches must not be replayed after a restart
                self.log.drop_batches(rollback_to, self.run.steps)
            self.log.append(
                {"method": "adopt_epoch", "meta": dict(record), "sender": self.peer_id, "batch": self.run.steps}, []
            )
        if (take_over or rolled) and not self.replaying:
            for cb in self.on_adopt:  # adopted slots and rollbacks reach the checkpoint before they are served
                cb(dict(record))
        for cb in self.on_epoch:
            cb(dict(record))
        if _in_event_loop():
            self.wake_waiters()  # (a `get_params` of this epoch may be waiting for it)
        logger.warning(
            "%s: layout epoch %d from batch %d (stage %d: frontal %s, backward %s, slots %s)",
            self.device_id,
            epoch,
            from_batch,
            stage,
            list(st.frontal),
            list(st.backward),
            list(st.hosts),
        )
        self.maybe_start_batches()
        return True

    async def fail_over(self, lost: list[str]) -> dict:
        """Coordinate the permanent loss of the servers `lost` (this server is the first remaining one
        of the run): pick for each lost slot the remaining server of its stage with the newest replica,
        find the lowest version of any shard, and send the new layout epoch to every remaining server
        (this one too). Returns the record; PayloadError if the loss cannot be absorbed."""
        alive = [d for st in self.layout.stages for d in st.servers if d not in lost]
        statuses = {}
        for d in alive:
            link = None if d == self.device_id else self.connector(d)
            if link is None and d != self.device_id:
                raise PayloadError(f"{d} is not in the DHT right now")
            statuses[d] = self.status() if link is None else (await link.call("status", {}, timeout=10.0))[0]
        versions = [v for d in alive for v in statuses[d]["hosted"].values()]
        moves = {}
        for dev in lost:
            stage = self.layout.locate(dev)[0]
            st = self.layout.stages[stage]
            for slot in st.slots_of(dev):
                holders = [(statuses[d]["replicas"].get(str(slot), -1), d) for d in st.servers if d in statuses]
                best, host = max(holders)
                if best < 0:
                    raise PayloadError(f"no remaining server of stage {stage} holds a replica of {dev}'s shard")
                moves[dev] = host
                versions.append(best)
        if not moves:
            raise PayloadError(f"{lost} host no shard slots")
        from_batch = min(versions)
        if max(versions) - from_batch >= snapshots_kept(self.layout.num_stages) - 1:
            raise PayloadError(
                f"shards are at versions {min(versions)}..{max(versions)}: too far apart to run again from the lowest"
            )
        # the re-run computes batch from_batch on version_for_batch(from_batch) of every shard: a
        # replica older than what a shard still keeps would take over a slot that never steps again
        kept = {(d, s): v for d in alive for s, v in statuses[d].get("kept_from", {}).items()}
        gone = {k: v for k, v in kept.items() if v > version_for_batch(from_batch)}
        if gone:
            (d, s), v = max(gone.items(), key=lambda kv: kv[1])
            raise PayloadError(
                f"a re-run from batch {from_batch} needs version {version_for_batch(from_batch)}, and slot {s} "
                f"of {d} keeps versions from {v} on: the lost slots' replicas are too old"
            )
        try:
            layout = self.layout.without(moves)
        except ValueError as e:
            raise PayloadError(str(e)) from None
        record = {
            "epoch": self.epoch + 1,
            "layout": layout.to_dict(),
            "from_batch": min(from_batch, self.run.steps - 1),
            "lost": sorted(lost),
            "banned": self.ordered_bans(),
        }
        await self.send_epoch(record, alive)
        self.adopt(record)
        return record

    async def send_epoch(self, record: dict, devices) -> None:
        """Send a layout epoch's record to every server of `devices` but this one (each tried 20 times)."""
        for d in devices:
            if d == self.device_id:
                continue
            async for attempt in Attempts(f"{self.device_id}: adopt_epoch to {d}", tries=20, pause=0.2, log=logger):
                try:
                    await self.connector(d).call("adopt_epoch", record, timeout=10.0)
                    break
                except Exception as e:
                    attempt.failed(e)
