"""The task pool's face to clients: `take` (a lease with the rows or gradients it needs),
`complete` and `fail`, and the one place tasks enter the pool (forward tasks are logged, so that a
restart re-creates the very same cut). Must not build rows or step parameters. A part of a server,
built with what it reads of it (parameter_server/parts.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from core.layout import owed_more
from core.model.update_rule import version_for_batch
from core.protocol.fields import field as mfield
from core.protocol.fields import wait_field
from core.protocol.leases import MAX_COMPLETE
from core.protocol.tasks import batch_of
from core.protocol.wire import PayloadError
from taskpool import Completion, Task, TaskKind

logger = logging.getLogger("hivepipe.server")
SEEN_DEVICES = 4096  # workers counted by name in tasks_by_device; the rest under "(others)"

# the longest a `take` may wait for a task (its `wait` field): a waiting client costs the server one
# open call instead of a poll every few tens of milliseconds, and gets a new task the moment it is cut
MAX_TAKE_WAIT = 5.0
RECHECK = 0.05  # a waiting take looks again this often: preferences and leases run out with the clock
NOT_HELD = "not_held"  # a completion's result when its sender never held a lease of the task


class Leases:
    """A server's take, complete and fail, given what they read of it: `device_id`, `peer_id`, `stage`,
    `last` and `micro_batches`; its `clock`; the run's `lease_tickets`; its `registry` (the clients),
    `bans`, `directory`, `checks`, `contributions`, `counters` and `tasks_by_device`; as they are now:
    `epoch()`, `version()`, `dp()` (the data path: the pool, the ids of the tasks made here, the rows and
    gradients tasks carry), `log()` (the request log, or None) and `replaying()`."""

    def __init__(
        self,
        *,
        device_id: str,
        peer_id: str,
        stage: int,
        last: bool,
        micro_batches: int,
        clock: Callable[[], float],
        lease_tickets,
        registry,
        bans,
        directory,
        checks,
        contributions,
        counters: dict,
        tasks_by_device: dict,
        epoch: Callable[[], int],
        version: Callable[[], int],
        dp: Callable[[], object],
        log: Callable[[], object],
        replaying: Callable[[], bool],
    ) -> None:
        self.device_id, self.peer_id, self.stage, self.last, self.micro_batches = (
            device_id,
            peer_id,
            stage,
            last,
            micro_batches,
        )
        self.clock, self.lease_tickets, self.registry, self.bans, self.directory = (
            clock,
            lease_tickets,
            registry,
            bans,
            directory,
        )
        self.checks, self.contributions, self.counters, self.tasks_by_device = (
            checks,
            contributions,
            counters,
            tasks_by_device,
        )
        self.epoch, self.version, self.dp, self.log, self.replaying = epoch, version, dp, log, replaying
        self._tasks_added = asyncio.Event()

    def signal_tasks(self) -> None:
        """Wake every `take` waiting for a task."""
        self._tasks_added.set()
        self._tasks_added = asyncio.Event()

    async def _wait_for_task(self, sender: str, wait: float, epoch: int):
        """A lease for `sender`, waiting up to `wait` seconds for one: woken when a task is added and
        re-checked every RECHECK (a task preferred for another client, or a lease that runs out, opens
        with the clock). None when none came, or the run moved meanwhile (a new layout epoch, a ban),
        or the client has given this take up as lost."""
        deadline = time.monotonic() + wait
        # (None only while a restart replays its log: _client does not check the sender then, and
        # the loop's first test answers None)
        info = self.registry.clients.get(sender)
        lost = info.takes_lost if info is not None else 0
        while True:
            if self.epoch() != epoch or sender in self.bans.banned or sender not in self.registry.clients:
                return None  # its next call hears why (stale epoch, banned, not registered)
            if self.registry.clients[sender] is not info or info.takes_lost != lost:
                # the client said this take's answer never reached it (register with 'take_lost')
                # while it still waited here: a lease now would be answered into a closed stream
                # and wait for a heartbeat to be re-queued (a stall of a heartbeat period or more)
                self.counters["takes_dropped"] = self.counters.get("takes_dropped", 0) + 1
                logger.info(
                    "%s: a take by %s that it gave up as lost was still waiting: dropped", self.device_id, sender[-8:]
                )
                return None
            lease = self.dp().pool.take(sender)
            left = deadline - time.monotonic()
            if lease is not None or left <= 0:
                return lease
            try:
                await asyncio.wait_for(self._tasks_added.wait(), min(RECHECK, left))
            except asyncio.TimeoutError:
                pass

    async def on_take(self, meta, tensors, sender):
        self.registry.caller(sender)
        wait = wait_field(meta, MAX_TAKE_WAIT)
        self.complete_carried(carried_completes(meta), sender)
        epoch = self.epoch()
        while True:
            lease = await self._wait_for_task(sender, wait, epoch)
            if lease is None:
                if sender != self.peer_id:  # (what the network carried: a server's own worker calls in-process)
                    key = "takes_waited_out" if wait > 0 else "takes_found_nothing"
                    self.counters[key] = self.counters.get(key, 0) + 1
                if wait > 0:
                    self.checks.check_epoch(meta)  # a failover came while it waited: the client fetches the layout
                return {
                    "task": None,
                    "version": self.version(),
                    "epoch": self.epoch(),
                    "more": self.dp().pool.queued() > 0,
                }
            task = lease.task
            if task.batch < self.directory.run_min_version():  # applied by every server: nothing left to do
                self.dp().pool.abandon(task.task_id)
                continue
            break
        t, m, (a, b) = task.batch, task.micro_batch, task.rows
        # "more": tasks are queued here after this one (a hint: a worker done with its task asks a
        # server that had none only with a waiting take, when it has gone idle, not with a take that
        # answers "nothing" at once: those were 0.73 of the 3.9 calls a task cost)
        common = {
            "task": task.task_id,
            "kind": task.kind,
            "batch": t,
            "micro": m,
            "rows": [a, b],
            "stage": self.stage,
            "version": version_for_batch(t),
            "deadline": lease.deadline - self.clock(),
            "attempt": lease.attempt,
            "epoch": self.epoch(),
            "more": self.dp().pool.queued() > 0,
            "lease": self.lease_tickets.issue(task.task_id, lease.client, lease.attempt, self.epoch()),
        }
        if task.kind == TaskKind.FORWARD:
            x, y = self.dp().buffers[(t, m)].slice(a, b)
            if not self.last:  # only the last stage computes a loss: the labels stay here
                y = None
            # owed: more of batch t's micro-batches are still to be cut here, and this client got a piece
            # of every one cut so far (its worker holds its sum of the batch while idle, flush.py)
            owed = owed_more(self.dp().batch_cut, t, lease.client, self.micro_batches)
            return dict(common, frontal=self.device_id, owed=owed), [x] if y is None else [x, y]
        entry = task.payload_ref  # a LedgerEntry
        g, _ = self.dp().grad_buffers[(t, m)].slice(a, b)
        return dict(common, frontal=entry.frontal, forward_task=entry.forward_task), [g]

    def known_task(self, meta) -> str:
        """The task id `meta` names, made here (refused otherwise)."""
        task_id = mfield(meta, "task", str)
        if task_id not in self.dp().issued:
            raise PayloadError(f"unknown task id {task_id!r}")
        return task_id

    def add_task(self, task: Task) -> None:
        """Forward tasks depend on the clients registered when they were cut, so they are logged and,
        in a replay, re-created from the log; backward tasks follow from the ledger."""
        if task.kind == TaskKind.FORWARD:
            if self.replaying():
                return
            if self.log() is not None:
                self.log().append(
                    {
                        "task": [
                            task.task_id,
                            task.batch,
                            task.micro_batch,
                            task.rows[0],
                            task.rows[1],
                            task.preferred_client,
                        ],
                        "batch": task.batch,
                    }
                )
        self.dp().pool.add(task)
        self.dp().issued.add(task.task_id)
        self.signal_tasks()

    async def on_complete(self, meta, tensors, sender):
        """One task ("task": id) or several ("tasks": [ids], what a gradient push covered at this
        server: one call instead of one per task); every id is checked before any is completed."""
        c = self.registry.caller(sender)
        if "tasks" not in meta:
            task_ids = [self.known_task(meta)]
        else:
            task_ids = [self.known_task({"task": tid}) for tid in _task_ids(meta, "tasks")]
        results = self._complete(c, task_ids, sender)
        if "tasks" in meta:
            return {"results": results}
        return {"result": results[task_ids[0]]}

    def complete_carried(self, task_ids: list[str] | None, sender: str) -> None:
        """Complete the tasks a `take` or a heartbeat carries in its 'complete' field (a worker hands
        in what it finished with its next call to the server instead of a `complete` of its own: one
        call a task fewer). An id this server does not know changes nothing (a late one may name a
        task forgotten after every server applied its batch); the accepted ones are written to the
        request log as a `complete`, which a restart replays. The caller checked the field with the
        request's others (`carried_completes`) and its epoch: a refused call completes nothing."""
        if not task_ids:
            return
        c = self.registry.caller(sender)
        accepted = [
            t
            for t, r in self._complete(c, [t for t in task_ids if t in self.dp().issued], sender).items()
            if r == Completion.ACCEPTED.value
        ]
        log = self.log()
        if log is None or self.replaying():
            return
        by_batch: dict[int, list[str]] = {}  # one record a batch: the log is compacted by batch
        for t in accepted:
            by_batch.setdefault(batch_of(t) or 0, []).append(t)
        for batch, ids in sorted(by_batch.items()):
            log.append(
                {
                    "method": "complete",
                    "meta": {"tasks": ids, "batch": batch, "epoch": self.epoch()},
                    "sender": sender,
                    "batch": batch,
                }
            )

    def _complete(self, c, task_ids: list[str], sender: str) -> dict[str, str]:
        """Complete what `sender` may complete: an open task only if it held a lease of it (a
        client that never did could close a task nobody computed, and if the holder then died the
        task would never be re-queued and its batch never stepped); NOT_HELD for the others, which
        change nothing. A restart's replay of the log completes what was accepted before."""
        results, refused = {}, []
        for task_id in task_ids:
            if not self.replaying() and self.dp().pool.ever_held(task_id, sender) is False:
                results[task_id] = NOT_HELD
                refused.append(task_id)
                continue
            result = self.dp().pool.complete(task_id, sender)
            if result is Completion.ACCEPTED:
                c.tasks_done += 1
                who = (
                    c.device
                    if c.device in self.tasks_by_device or len(self.tasks_by_device) < SEEN_DEVICES
                    else "(others)"
                )
                self.tasks_by_device[who] = self.tasks_by_device.get(who, 0) + 1
                self.contributions.task_done(sender, None if self.replaying() else c.device)
            results[task_id] = result.value
        if refused:  # (one line a call: a list may name up to MAX_COMPLETE ids)
            self.counters["completes_not_held"] = self.counters.get("completes_not_held", 0) + len(refused)
            logger.info(
                "%s: %s completes %d task(s) it never held (%s): ignored",
                self.device_id,
                sender[-8:],
                len(refused),
                refused[0],
            )
        return results

    async def on_fail(self, meta, tensors, sender):
        self.registry.caller(sender)
        task_id = self.known_task(meta)
        self.dp().pool.fail(task_id, sender)
        return {"ok": True}


def carried_completes(meta: dict) -> list[str] | None:
    """The 'complete' field of a `take` or heartbeat (task ids the client finished), checked."""
    return None if meta.get("complete") is None else _task_ids(meta, "complete")


def _task_ids(meta: dict, name: str) -> list[str]:
    """Field `name` of a request: a list of 1 to MAX_COMPLETE task ids."""
    task_ids = mfield(meta, name, list)
    if not 1 <= len(task_ids) <= MAX_COMPLETE:
        raise PayloadError(f"field {name!r} must list 1 to {MAX_COMPLETE} task ids, got {len(task_ids)}")
    if not all(isinstance(t, str) and len(t) <= 64 for t in task_ids):
        raise PayloadError(f"field {name!r} must list task ids (strings of at most 64 characters)")
    return task_ids
