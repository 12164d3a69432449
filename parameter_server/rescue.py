"""Work handed in as done whose results never arrived is run again.

A task is done at the server that leased it when its holder says so (`complete`, or the `complete`
field of its next take or heartbeat); the results it owes go elsewhere: a forward task's outputs to
the stage's backward servers, a backward task's gradient push (a forward task's, on the last stage)
to every server of the stage. An honest worker says done only once they were accepted. A client that
says done without them (or whose results a server lost) left a batch that could never be applied:
the task was closed, never re-queued, and the run hung (at versions 0 and 2 in the attacks of the
third trust pass).

So a server whose next batch has waited RESCUE_FACTOR x the median step (at least RESCUE_MIN
seconds) asks, every RESCUE_PERIOD while it waits, the servers that leased the work it lacks to
reopen their done tasks of those rows (`requeue_missing`, a server-only method): the gradient rows
its shard slots have not been credited for that batch, and, on a backward server of a stage before
the last, the output rows of its segment not received. The leasing server queues again each done
task of that kind, batch and micro-batch whose rows meet the missing ones; a task still queued or
leased is left alone (its lease runs out as any other). Must not step parameters itself. A part of a
server, built with what it reads of it (parameter_server/parts.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from core.layout import owners
from core.protocol.fields import field as mfield
from core.protocol.tasks import TaskId
from core.protocol.wire import PayloadError, RemoteError
from taskpool import Task, TaskKind

logger = logging.getLogger("hivepipe.server")

RESCUE_FACTOR, RESCUE_MIN = 3.0, 10.0  # a batch waits this long before its missing work is asked for
RESCUE_PERIOD = 5.0  # and then asked for again this often while it waits
MAX_PIECES = 4096  # (micro-batch, rows) pieces one request may name


def gaps(covered: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that no interval of `covered` covers, in order."""
    out, at = [], lo
    for a, b in sorted(covered):
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


class Rescue:
    """A server's re-queueing of done work whose results never came, given what it reads of its
    server: its `place` (device id, stage, role, last), `rows` a micro-batch and `micro_batches` a
    batch, `steps` (the run's last version); as they are now: `stage_servers()` (its stage in the
    layout), `shards()` (slot -> shard hosted here), `dp()` (the data path: the rows received, this
    server's rows of each micro-batch, the pool, the ids of the tasks made here, the ledger),
    `version()`, `epoch()`, `replaying()`, `steps_held()` (a ban's hold); `step_times` (version -> when reached: the median step); `outbox`; `call`
    to another server; `server_sender(sender, stage, *roles)` (refuses any other caller); `signal_tasks()`
    (wakes the takes waiting); `counters`."""

    def __init__(
        self,
        *,
        place,
        rows: int,
        micro_batches: int,
        steps: int,
        stage_servers: Callable[[], object],
        shards: Callable[[], dict],
        dp: Callable[[], object],
        version: Callable[[], int],
        epoch: Callable[[], int],
        replaying: Callable[[], bool],
        steps_held: Callable[[], bool],
        step_times: dict,
        outbox,
        call: Callable[[str, str, dict], Awaitable[tuple[dict, list]]],
        server_sender: Callable[..., str],
        signal_tasks: Callable[[], None],
        counters: dict,
    ) -> None:
        self.place, self.rows, self.micro_batches, self.steps = place, rows, micro_batches, steps
        self.stage_servers, self.shards, self.dp, self.version, self.epoch = stage_servers, shards, dp, version, epoch
        self.replaying, self.steps_held = replaying, steps_held
        self.step_times, self.outbox, self.call, self.server_sender = step_times, outbox, call, server_sender
        self.signal_tasks, self.counters = signal_tasks, counters
        self.rescued_at = float("-inf")
        self.rescuing = False  # an ask is on its way (one at a time: a lost server answers in 30 s)
        self.waiting_since: tuple[int, float] | None = None  # (version, since when) the next batch waits

    def missing_work(self) -> dict[str, tuple[str, int, list[tuple[int, int, int]]]]:
        """Device -> (task kind, batch, [(micro, lo, hi)]): the work this server lacks for its next
        batch, by the server that leased it."""
        asks: dict[str, tuple[str, int, list]] = {}

        def ask(role: str, kind: str, t: int, m: int, lo: int, hi: int) -> None:
            st = self.stage_servers()
            servers = st.frontal if role == "frontal" else st.backward
            for j, x, y in owners(self.rows, len(servers), lo, hi):
                asks.setdefault(servers[j], (kind, t, []))[2].append((m, x, y))

        for shard in self.shards().values():
            t = shard.version
            if t >= self.steps:
                continue
            bc = shard.batches.get(t)
            for m in range(shard.micro_batches):
                covered = [] if bc is None else bc.intervals.get(m, [])
                for lo, hi in gaps(covered, 0, shard.rows_per_micro):
                    if self.place.last:
                        ask("frontal", TaskKind.FORWARD, t, m, lo, hi)
                    else:
                        ask("backward", TaskKind.BACKWARD, t, m, lo, hi)
        p = self.place
        if p.role == "backward" and not p.last and self.version() < self.steps:
            t = self.version()
            for m in range(self.micro_batches):
                buf = self.dp().buffers.get((t, m))
                for lo, hi in gaps([] if buf is None else buf.covered, *self.dp().seg):
                    ask("frontal", TaskKind.FORWARD, t, m, lo, hi)
        return asks

    def rescue_due(self, now: float) -> bool:
        """Whether the next batch has waited long enough for its missing work to be asked for again."""
        version = self.version()
        if version >= self.steps or self.replaying() or self.steps_held():
            return False
        if self.waiting_since is None or self.waiting_since[0] != version:
            self.waiting_since = (version, now)
        times = sorted(self.step_times.values())
        step_gaps = sorted(b - a for a, b in zip(times, times[1:]))
        median = step_gaps[len(step_gaps) // 2] if step_gaps else 0.0
        if now - self.waiting_since[1] < max(RESCUE_MIN, RESCUE_FACTOR * median):
            return False
        return now - self.rescued_at >= RESCUE_PERIOD

    def maybe_rescue(self) -> None:
        """Periodic (maintenance): ask for the missing work of a batch that has waited too long."""
        now = time.monotonic()
        if not self.rescuing and self.rescue_due(now):
            self.rescued_at, self.rescuing = now, True
            self.outbox.spawn(self._rescue())

    async def _rescue(self) -> int:
        """Ask each leasing server to reopen the done tasks owing what this one lacks; how many were."""
        try:
            return await self._ask_for_missing()
        finally:
            self.rescuing = False

    async def _ask_for_missing(self) -> int:
        epoch, reopened = self.epoch(), 0
        for device, (kind, t, pieces) in sorted(self.missing_work().items()):
            meta = {"kind": kind, "batch": t, "pieces": [list(p) for p in pieces[:MAX_PIECES]], "epoch": epoch}
            try:
                answer, _ = await self.call(device, "requeue_missing", meta)
            except (RemoteError, ConnectionError, asyncio.TimeoutError) as e:
                logger.debug("%s: asking %s for missing work failed: %r", self.place.device_id, device, e)
                continue
            got = answer.get("reopened") or []
            if got:
                reopened += len(got)
                logger.info(
                    "%s: %s had %d task(s) of batch %d done whose results never came: queued again (%s)",
                    self.place.device_id,
                    device,
                    len(got),
                    t,
                    " ".join(got[:8]),
                )
        return reopened

    async def on_requeue_missing(self, meta, tensors, sender):
        """A server of this stage lacks the results of rows of batch `batch`: the done tasks of `kind`
        leased here that owe them are queued again."""
        kind = mfield(meta, "kind", str)
        role = self.place.role
        want = {"frontal": TaskKind.FORWARD, "backward": TaskKind.BACKWARD}[role]
        if kind != want:
            raise PayloadError(f"a {role} server leases {want} tasks, not {kind} tasks")
        self.server_sender(sender, self.place.stage, "frontal", "backward")
        t = mfield(meta, "batch", int)
        pieces = mfield(meta, "pieces", list)
        if len(pieces) > MAX_PIECES or not all(
            isinstance(p, list) and len(p) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
            for p in pieces
        ):
            raise PayloadError(f"field 'pieces' must list at most {MAX_PIECES} [micro, lo, hi] triples")
        reopened = []
        pool = self.dp().pool
        for task_id in sorted(self.dp().issued):
            tid = TaskId.parse(task_id)
            if tid.kind != kind or tid.batch != t or not pool.is_done(task_id):
                continue
            lo, hi = tid.rows
            if not any(m == tid.micro and x < hi and lo < y for m, x, y in pieces):
                continue
            task = Task(
                task_id=task_id,
                kind=kind,
                batch=t,
                micro_batch=tid.micro,
                stage=self.place.stage,
                rows=(lo, hi),
                payload_ref=self.ledger_entry(t, tid.micro, task_id) if kind == TaskKind.BACKWARD else None,
            )
            if pool.reopen(task):
                reopened.append(task_id)
        if reopened:
            self.counters["tasks_reopened"] = self.counters.get("tasks_reopened", 0) + len(reopened)
            self.signal_tasks()
        return {"reopened": reopened}

    def ledger_entry(self, t: int, m: int, task_id: str):
        return next((e for e in self.dp().ledger.get((t, m), []) if e.backward_task == task_id), None)
