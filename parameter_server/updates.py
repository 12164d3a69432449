"""Parameters and gradients: serving parameter versions, crediting gradient pushes exactly once
(all or nothing per push, a task at most once), and the step under the delayed update
(core/model/update_rule.py), followed by a copy of the new shard to the stage's next server.
Must not touch the data path's rows. A part of a server, built with what it reads of it
(parameter_server/parts.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

import torch

from core.model.precision import wire_dtype
from core.protocol.fields import field as mfield
from core.protocol.fields import wait_field
from core.protocol.param_delta import ENCODING
from core.protocol.params import MAX_PARAMS_WAIT
from core.protocol.tasks import TaskId
from core.protocol.wire import PayloadError
from taskpool import TaskKind

if TYPE_CHECKING:
    from parameter_server.shard import ShardState

logger = logging.getLogger("hivepipe.server")

# Servers of a stage step on their own. A task of batch t+1 needs version t on every server of its
# stage, so one server leads another by at most two versions: each keeps three parameter versions
# and the rows of three batches, which is what a re-run of a task needs from the leader.
RETAIN = 3


def snapshots_kept(num_stages: int) -> int:
    """Parameter versions a shard keeps. A failover re-runs every batch from the lowest version of any
    shard of the run, and stages' versions can differ by two per stage boundary, so a shard keeps
    that many more versions than a task needs in steady operation."""
    return RETAIN + 2 * num_stages


class Updates:
    """A server's parameter versions, gradient credits and steps, given what they read of it: its
    `place`, `peer_id` and own `slot`; the run's `micro_batches` and `precision`, `rows` a micro-batch;
    `hosted` (slot -> shard); its `registry`, `checks`, `directory`, `arrivals`, `pins`, `clipping`,
    `copies` (replicas), `frontal`, `outbox` and `deltas`; as they are now: `dp()`, `stage_servers()`,
    `epoch()`, `version()` and `replaying()`; and the checks' `check_push(sender, t, ids, slot,
    grads, loss)` (a push drawn for a re-run) and `back_input_grads(sender, t, pieces)`. `on_step` are
    called with each new version, `on_credit` with each (slot, batch) credited."""

    def __init__(
        self,
        *,
        place,
        peer_id: str,
        slot: int,
        micro_batches: int,
        precision: str,
        rows: int,
        hosted: dict,
        registry,
        checks,
        directory,
        arrivals,
        pins,
        clipping,
        copies,
        frontal,
        outbox,
        deltas: Callable[[], object],
        dp: Callable[[], object],
        stage_servers: Callable[[], object],
        epoch: Callable[[], int],
        version: Callable[[], int],
        replaying: Callable[[], bool],
        check_push: Callable[..., None],
        back_input_grads: Callable[[str, int, list], None],
    ) -> None:
        self.place, self.peer_id, self.slot, self.micro_batches, self.precision, self.rows = (
            place,
            peer_id,
            slot,
            micro_batches,
            precision,
            rows,
        )
        self.hosted, self.registry, self.checks, self.directory, self.arrivals = (
            hosted,
            registry,
            checks,
            directory,
            arrivals,
        )
        self.pins, self.clipping, self.copies, self.frontal, self.outbox = pins, clipping, copies, frontal, outbox
        self.deltas, self.dp, self.stage_servers, self.epoch, self.version = deltas, dp, stage_servers, epoch, version
        self.replaying, self.check_push, self.back_input_grads = replaying, check_push, back_input_grads
        self.step_event = asyncio.Event()  # set (and replaced) at each step and adopted epoch (wake_waiters)
        self.on_step: list[Callable[[int], Awaitable[None] | None]] = []
        self.on_credit: list[Callable[[int, int], None]] = []  # (slot, batch): a gradient push was credited
        self.missing_versions: set[tuple[int, int]] = set()  # (asked, current) refused and logged (on_get_params)
        self._wire_params: dict = {}  # (shard, version, token) -> its tensors in bf16 (params_on_wire)

    async def on_get_params(self, meta, tensors, sender):
        version = mfield(meta, "version", int)
        wait = wait_field(meta, MAX_PARAMS_WAIT)
        # A reader of a layout epoch (a volunteer's task, a server's check; the field is optional for
        # readers outside the run's epochs) is answered from that epoch's lineage: a ban's rollback
        # re-makes the versions after its batch, and a server that has not adopted it yet still holds
        # the undone ones. A later epoch is waited for like a version; an earlier one is refused.
        epoch = mfield(meta, "epoch", int, optional=True)
        if epoch is not None:
            self.checks.check_epoch(meta, later_ok=True)
        shard = self._hosted(meta)
        # a version not reached yet is waited for up to `wait` seconds (woken by each step and each
        # adopted epoch), so that a client asks once where it polled every few tens of milliseconds
        deadline = time.monotonic() + wait
        while (version > shard.version or (epoch or 0) > self.epoch()) and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self.step_event.wait(), left)
            except asyncio.TimeoutError:
                break
            shard = self._hosted(meta)  # a failover may have moved the slot meanwhile
        if epoch is not None:
            self.checks.check_epoch(meta, later_ok=True)
        if version > shard.version or (epoch or 0) > self.epoch():
            return {"retry": True, "version": shard.version}
        snap = shard.params_at(version)
        if snap is None:
            if version >= shard.version - 1 and (version, shard.version) not in self.missing_versions:
                # a task of the current batches needs it: the run cannot go on until another
                # layout epoch; say so once, loudly (workers re-queue such a task again and again)
                self.missing_versions.add((version, shard.version))
                logger.error(
                    "%s: version %d of a hosted slot is asked for and not held (held: %s): tasks "
                    "computed on it cannot run",
                    self.place.device_id,
                    version,
                    sorted(shard.snapshots),
                )
            raise PayloadError(f"version {version} is no longer held (current {shard.version})")
        if mfield(meta, "digest_only", bool, optional=True):  # (a worker that holds a replica of the slot)
            return {"names": shard.names, "version": version, "digest": shard.digest(version)}, []
        wire = self.params_on_wire(shard, version, snap)
        base = mfield(meta, "base", int, optional=True)  # a version the worker holds (param_deltas.py)
        if base is not None:
            if not 0 <= base < version:
                raise PayloadError(f"field 'base': {base} is not a version older than {version}")
            blob = await self.deltas().against(shard, base, mfield(meta, "base_digest", str), version, wire)
            if blob is not None:
                answer = {"names": shard.names, "version": version, "encoding": ENCODING, "base": base}
                return answer, [torch.frombuffer(bytearray(blob), dtype=torch.uint8)]
        return {"names": shard.names, "version": version}, wire

    def params_on_wire(self, shard: ShardState, version: int, snap: dict) -> list:
        """The tensors of `version` as a volunteer is sent them: fp32, or at --precision bf16 rounded to
        bfloat16 (half the bytes: the rounding a task computes on anyway), made once per version."""
        dtype = wire_dtype(self.precision)
        if dtype == torch.float32:
            return [snap[n] for n in shard.names]
        key = (id(shard), version, shard.tokens.get(version))
        cache = self._wire_params
        if key not in cache:
            for old in list(cache)[: max(0, len(cache) - 2 * len(self.hosted) - 1)]:
                del cache[old]
            cache[key] = [snap[n].to(dtype) for n in shard.names]
        return cache[key]

    def wake_waiters(self) -> None:
        """Wake the requests that wait for a version or a layout epoch (a step, an adopted epoch)."""
        self.step_event.set()
        self.step_event = asyncio.Event()

    def _hosted(self, meta: dict) -> ShardState:
        slot = mfield(meta, "slot", int, optional=True)
        slot = self.slot if slot is None else slot
        if slot not in self.hosted:
            raise PayloadError(f"shard slot {slot} is not hosted here (this server hosts {sorted(self.hosted)})")
        return self.hosted[slot]

    async def on_push_grads(self, meta, tensors, sender):
        """A client's gradient shard accumulated over the tasks `tasks` (ids) of batch `batch`."""
        if sender != self.peer_id:
            self.registry.caller(sender)
        t = mfield(meta, "batch", int)
        ids = mfield(meta, "tasks", list)
        if len(ids) > self.micro_batches * self.rows:
            raise PayloadError(
                f"{len(ids)} tasks in one push: a batch has at most {self.micro_batches * self.rows} rows"
            )
        if len(set(map(str, ids))) != len(ids):
            raise PayloadError("field 'tasks' names a task twice")
        pieces = []
        for task_id in ids:
            tid = TaskId.parse(task_id)
            kind, batch, micro, stage, rows = tid.kind, tid.batch, tid.micro, tid.stage, tid.rows
            if stage != self.place.stage or batch != t:
                raise PayloadError(f"task {task_id} is not of batch {t} of stage {self.place.stage}")
            if kind != (TaskKind.FORWARD if self.place.last else TaskKind.BACKWARD):
                raise PayloadError(
                    f"task {task_id}: only {'forward' if self.place.last else 'backward'} tasks carry "
                    f"gradients on stage {self.place.stage}"
                )
            pieces.append((task_id, micro, rows))
        loss = mfield(meta, "loss_sum", float, optional=True)
        if self.place.last and loss is None:
            raise PayloadError("the last stage's gradient pushes must carry 'loss_sum'")
        tickets = mfield(meta, "leases", list, optional=True) or []
        kind = TaskKind.FORWARD if self.place.last else TaskKind.BACKWARD

        def leased() -> None:  # after the payload's checks: a malformed push is named as such
            if len(tickets) != len(ids) and not self.replaying():
                raise PayloadError(
                    f"field 'leases' must hold one lease ticket per task: {len(ids)} tasks, {len(tickets)} tickets"
                )
            for (task_id, _, _), ticket in zip(pieces, tickets):
                self.checks.answers_lease(ticket, task_id, sender, kind, t)

        slot = mfield(meta, "slot", int, optional=True)
        shard = self._hosted(meta)
        result, already = shard.credit(
            batch=t, pieces=pieces, grads=tensors, loss_sum=loss, sender=sender, authorize=leased
        )
        if result == "credited":
            self.back_input_grads(sender, t, pieces)
            rows = sum(hi - lo for _, _, (lo, hi) in pieces)
            unusual = not self.directory.is_server(sender) and (
                self.arrivals.unusual_norm(self.slot if slot is None else slot, tensors, rows)
                | self.arrivals.unusual_direction(self.slot if slot is None else slot, shard, tensors, sender)
            )
            for cb in self.on_credit:
                cb(self.slot if slot is None else slot, t)
            if self.arrivals.note_contribution(sender, t, shared_by=len(self.stage_servers().hosts)) or (
                unusual and not self.replaying()
            ):
                self.check_push(sender, t, [p[0] for p in pieces], self.slot if slot is None else slot, tensors, loss)
            self.maybe_step()
        return {"result": result, "credited": already}

    def maybe_step(self) -> None:
        if self.pins.steps_held():
            return
        if any(shard.ready_to_step() for shard in self.hosted.values()):
            self.pins.update_pins()  # before a step forgets a version a ban may still need
        stepped = False
        self.clipping.announce_sums()  # (before any other hold: the other stages wait on these sums)
        for slot, shard in sorted(self.hosted.items()):
            while (
                shard.ready_to_step()
                and not self.pins.checks_hold(shard.version)
                and not self.copies.behind(slot, shard.version)
                and not self.clipping.clip_hold(slot, shard)
            ):
                before = self.version()
                scale, total = self.clipping.clip_step(slot, shard)
                v = shard.step(scale, total)
                stepped = True
                if total is None:
                    logger.info("%s: applied batch %d -> version %d (slot %d)", self.place.device_id, v - 1, v, slot)
                else:
                    logger.info(
                        "%s: applied batch %d -> version %d (slot %d), gradient norm %.4g%s",
                        self.place.device_id,
                        v - 1,
                        v,
                        slot,
                        total**0.5,
                        f", clipped x{scale:.4g}" if scale < 1.0 else "",
                    )
                self.outbox.spawn(self.copies.send(slot))
                if self.version() == before:
                    continue
                self.forget_before(self.version() - (RETAIN - 1))
                for cb in self.on_step:
                    r = cb(self.version())
                    if asyncio.iscoroutine(r):
                        self.outbox.spawn(r)
        if stepped:
            self.wake_waiters()
            self.frontal.maybe_start_batches()
            self.frontal.release_waiting()

    def forget_before(self, batch: int) -> None:
        """Let go of batches < batch, applied by every server of the stage (DataPath.forget_before),
        and of what is remembered of volunteers gone for good (Arrivals.forget_departed)."""
        self.dp().forget_before(batch)
        self.arrivals.forget_departed()
