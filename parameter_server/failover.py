"""Failover: the layout epochs (a record checked, adopted, or coordinated by the first remaining
server when a server is lost for good), and `get_layout` for workers that meet a newer epoch; a lost
server's slots are taken over from their replicas (parameter_server/replicas.py). Must not touch the
data path except to reset it when an epoch begins. A part of a server, built with what it reads of it
(parameter_server/parts.py); it owns the server's `Placement`, which only an epoch changes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from core.layout import RunLayout
from core.model.update_rule import version_for_batch
from core.protocol.fields import field as mfield
from core.protocol.retry import Attempts
from core.protocol.wire import PayloadError
from parameter_server.updates import snapshots_kept

logger = logging.getLogger("hivepipe.server")


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:  # adopted outside a server's loop (an in-process test): nobody to send to
        return False


@dataclass
class Placement:
    """Where a server stands in the run's current layout epoch: the layout, its epoch (0: the first
    layout) and record (None before the first failover), the server's stage in it and its index in
    its role, and since the last epoch the first batch run again (None: none)."""

    layout: RunLayout
    epoch: int
    record: dict | None
    st: object
    index: int
    reflow_from: int | None = None


class Failover:
    """A server's layout epochs, given what they read and change of it: `device_id`, `peer_id`,
    `stage`, `role`, `steps` and `layers` (the run's); the `placement` it changes; `hosted` and
    `replicas` (slot -> shard: a takeover moves a replica into `hosted`); its `clipping`,
    `evaluation`, `bans`, `pins`, `directory`, `copies` (replicas) and `report` (status) parts; as they
    are now: `old_versions()` (a ban's reach on disk, or None), `connector()`, `replaying()` and
    `log()`; and the server's `reset_datapath()`, `forget_checks()` (the re-runs' cached versions),
    `wake_waiters()` and `start_batches()`. `on_adopt` are called with a record that took over slots or
    rolled back, before it is logged; `on_epoch` with every record adopted."""

    def __init__(
        self,
        *,
        device_id: str,
        peer_id: str,
        stage: int,
        role: str,
        steps: int,
        layers: int,
        placement: Placement,
        hosted: dict,
        replicas: dict,
        clipping,
        evaluation,
        bans,
        pins,
        directory,
        copies,
        report,
        old_versions: Callable[[], object],
        connector: Callable[[], Callable[[str], object] | None],
        replaying: Callable[[], bool],
        log: Callable[[], object],
        reset_datapath: Callable[[], None],
        forget_checks: Callable[[], None],
        wake_waiters: Callable[[], None],
        start_batches: Callable[[], None],
    ) -> None:
        self.device_id, self.peer_id, self.stage, self.role, self.steps, self.layers = (
            device_id,
            peer_id,
            stage,
            role,
            steps,
            layers,
        )
        self.placement, self.hosted, self.replicas = placement, hosted, replicas
        self.clipping, self.evaluation, self.bans, self.pins = clipping, evaluation, bans, pins
        self.directory, self.copies, self.report, self.old_versions = directory, copies, report, old_versions
        self.connector, self.replaying, self.log = connector, replaying, log
        self.reset_datapath, self.forget_checks = reset_datapath, forget_checks
        self.wake_waiters, self.start_batches = wake_waiters, start_batches
        self.on_epoch: list[Callable[[dict], None]] = []
        self.on_adopt: list[Callable[[dict], None]] = []  # slots taken over (before the epoch is logged)

    @property
    def layout(self) -> RunLayout:
        return self.placement.layout

    @property
    def epoch(self) -> int:
        return self.placement.epoch

    async def on_get_layout(self, meta, tensors, sender):
        """The current layout epoch: {"epoch", "layout", "from_batch"} (epoch 0 is the first layout)."""
        return self.placement.record or {"epoch": 0, "layout": self.layout.to_dict(), "from_batch": 0}

    async def on_adopt_epoch(self, meta, tensors, sender):
        """A failover's new layout epoch, from the server that coordinates it (any server of the run)."""
        if not self.directory.is_server(sender):
            raise PayloadError(f"sender {sender[-8:]} is not a server of this run")
        self.adopt(meta)
        return {"ok": True, "epoch": self.epoch}

    def check_epoch_record(self, record: dict) -> tuple[int, RunLayout, int]:
        epoch = mfield(record, "epoch", int)
        from_batch = mfield(record, "from_batch", int)
        try:
            layout = RunLayout.from_dict(mfield(record, "layout", dict), self.layers)
        except ValueError as e:
            raise PayloadError(f"epoch layout: {e}") from None
        if layout.num_stages != self.layout.num_stages or any(
            a.layers != b.layers or len(a.hosts) != len(b.hosts) for a, b in zip(layout.stages, self.layout.stages)
        ):
            raise PayloadError("an epoch layout must keep the stages, their layers and their shard slots")
        if not 0 <= from_batch < self.steps:
            raise PayloadError(f"from_batch {from_batch} outside 0..{self.steps - 1}")
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
                if shard.version > rollback_to and shard.rollback_epoch < epoch and not shard.keeps(rollback_to):
                    raise PayloadError(f"slot {slot} no longer keeps version {rollback_to} to roll back to")
        for i in take_over:
            shard = self.hosted[i] = self.replicas.pop(i)
            if self.old_versions() is not None:  # (a ban's reach on disk, from now on)
                shard.old = self.old_versions().slot(i)
            logger.warning("%s: took over shard slot %d at version %d", self.device_id, i, shard.version)
        rolled = False
        if rollback_to is not None:
            self.clipping.forget_sums_from(rollback_to, epoch)
            self.evaluation.forget_evals_from(rollback_to)
            for slot, shard in self.hosted.items():
                if shard.rollback(rollback_to, epoch):
                    rolled = True
                    logger.warning("%s: slot %d rolled back to version %d", self.device_id, slot, rollback_to)
            for slot, replica in list(self.replicas.items()):
                try:
                    replica.rollback(rollback_to, epoch)
                except PayloadError:  # it never held that version: its owner sends the rolled-back state
                    del self.replicas[slot]
            self.forget_checks()
        for peer in record.get("banned", []):
            self.bans.ban_here(peer, f"banned by layout epoch {epoch}")
        self.pins.release()  # the epoch a ban waited for
        for shard in self.hosted.values():
            shard.batches = {}
        p = self.placement
        p.layout, p.epoch, p.record, p.st, p.index, p.reflow_from = layout, epoch, dict(record), st, index, from_batch
        self.directory.new_epoch()  # readings of the old epoch no longer say what is applied
        self.copies.new_epoch()  # (the ring of replicas changed, or a rollback undid what they took)
        self.reset_datapath()
        if not self.replaying() and _in_event_loop():
            # the stage's ring of replicas changed: every slot hosted here goes to its new next server
            # now, not at its next step, so that a second loss in the stage finds a copy
            self.copies.replicate_hosted()
        log = self.log()
        if log is not None and not self.replaying():
            if rolled:  # what was logged of the undone batches must not be replayed after a restart
                log.drop_batches(rollback_to, self.steps)
            log.append({"method": "adopt_epoch", "meta": dict(record), "sender": self.peer_id, "batch": self.steps}, [])
        if (take_over or rolled) and not self.replaying():
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
        self.start_batches()
        return True

    async def fail_over(self, lost: list[str]) -> dict:
        """Coordinate the permanent loss of the servers `lost` (this server is the first remaining one
        of the run): pick for each lost slot the remaining server of its stage with the newest replica,
        find the lowest version of any shard, and send the new layout epoch to every remaining server
        (this one too). Returns the record; PayloadError if the loss cannot be absorbed."""
        alive = [d for st in self.layout.stages for d in st.servers if d not in lost]
        statuses = {}
        for d in alive:
            link = None if d == self.device_id else self.connector()(d)
            if link is None and d != self.device_id:
                raise PayloadError(f"{d} is not in the DHT right now")
            statuses[d] = self.report.status() if link is None else (await link.call("status", {}, timeout=10.0))[0]
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
            "from_batch": min(from_batch, self.steps - 1),
            "lost": sorted(lost),
            "banned": self.bans.ordered(),
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
                    await self.connector()(d).call("adopt_epoch", record, timeout=10.0)
                    break
                except Exception as e:
                    attempt.failed(e)
