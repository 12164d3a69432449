"""The frontal server's work: stage 0 builds each batch from (seed, t); a later stage receives its
inputs from the previous stage's backward servers. It cuts its rows of each micro-batch into forward
tasks by its clients' measured speed, serves inputs again for recomputation, and relays input
gradients to the previous stage. Must not step parameters. A part of a server, built with what it
reads of it (parameter_server/parts.py)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from core.layout import clients_per_batch, cut_rows, in_flight, local_first, note_cut, owners
from core.model.update_rule import version_for_batch
from core.protocol.fields import field as mfield
from core.protocol.fields import rows_field
from core.protocol.tasks import task_id as make_task_id
from core.protocol.wire import PayloadError
from parameter_server.ledger import RowBuffer
from taskpool import Task, TaskKind

logger = logging.getLogger("hivepipe.server")

BATCHES_CACHED = 4  # batches of data a frontal server keeps at hand: two in flight, and room for a re-run


class Frontal:
    """A frontal server's inputs, forward tasks and relay of input gradients, given what they read of
    its server: its `place` and `peer_id`; the run's `steps`, `micro_batches`, `seed` and
    `batch_size`, `rows` a micro-batch and `seq` tokens a row, the `corpus`; the cut's settings
    (`min_task_rows`, `min_client_rows`, `local_first`: scheduler/rows.py); the `clients` registered;
    its `registry`, `checks`, `arrivals`, `leases`, `directory`, `outbox` and `counters`; as they are
    now: `dp()` (the data path), `layout()`, `version()` and `replaying()`."""

    def __init__(
        self,
        *,
        place,
        peer_id: str,
        steps: int,
        micro_batches: int,
        seed: int,
        batch_size: int,
        rows: int,
        seq: int,
        corpus,
        min_task_rows: int,
        min_client_rows: int,
        local_first: bool,
        clients: dict,
        registry,
        checks,
        arrivals,
        leases,
        directory,
        outbox,
        counters: dict,
        dp: Callable[[], object],
        layout: Callable[[], object],
        version: Callable[[], int],
        replaying: Callable[[], bool],
    ) -> None:
        self.place, self.peer_id, self.steps, self.micro_batches = place, peer_id, steps, micro_batches
        self.seed, self.batch_size, self.rows, self.seq, self.corpus = seed, batch_size, rows, seq, corpus
        # the fewest rows a forward task carries: every task costs a few calls whatever its size, so a
        # micro-batch goes to fewer clients rather than into slivers
        self.min_task_rows = min_task_rows
        # the fewest rows of a batch a client computes here: each client that computes part of a batch
        # pulls and pushes the whole stage's parameters for it
        self.min_client_rows = min_client_rows
        # a new batch goes first to a free worker of a stage server (`_local_first`): it reads its
        # parameters there and pushes half of them
        self.local_first = local_first
        self.task_credit: dict[str, float] = {}  # client -> rows owed by its share of the compute
        self.clients, self.registry, self.checks, self.arrivals, self.leases = (
            clients,
            registry,
            checks,
            arrivals,
            leases,
        )
        self.directory, self.outbox, self.counters, self.dp, self.layout = directory, outbox, counters, dp, layout
        self.version, self.replaying = version, replaying
        self._batch_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def st(self):
        return self.layout().stages[self.place.stage]

    def maybe_start_batches(self) -> None:
        """Stage 0's FS builds batch t once the parameters it needs (version t-1) exist here, which
        bounds the micro-batches in flight to two batches."""
        if self.place.role != "frontal" or self.place.stage != 0 or self.replaying():
            return
        dp = self.dp()
        while (
            dp.next_batch < self.steps
            and self.version() >= version_for_batch(dp.next_batch)
            and dp.next_batch <= self.version() + 1
        ):
            t = dp.next_batch
            self.build_inputs(t)
            for m in range(self.micro_batches):
                self.make_forward_tasks(t, m)
            dp.next_batch += 1

    def _run_batch(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch t of the run's data (inputs, labels), as the reference reads it: a pure function of
        (corpus, seed, t). Kept for the batches in flight (a later stage asks for every micro-batch)."""
        from core.model.data import make_batch

        cache = self._batch_cache
        batch = cache.get(t)
        if batch is None:
            batch = cache[t] = make_batch(self.corpus, self.seed, t, self.batch_size, self.seq)
            while len(cache) > BATCHES_CACHED:  # the oldest other than t (a rollback asks for an older one)
                del cache[min(k for k in cache if k != t)]
        return batch

    def run_labels(self, t: int, m: int, a: int, b: int) -> torch.Tensor:
        """The labels of rows [a, b) of micro-batch m of batch t, from the run's data: what a loss is
        computed against never passes through a volunteer (a stage-0 volunteer handing on labels of
        its own could make the model learn anything, and every output check would pass)."""
        base = m * self.rows
        return self._run_batch(t)[1][base + a : base + b]

    def build_inputs(self, t: int) -> None:
        """Stage 0: batch t's rows of this server, inputs and labels, from the run's data."""
        inputs, labels = self._run_batch(t)
        dp = self.dp()
        lo, hi = dp.seg
        for m in range(self.micro_batches):
            base = m * self.rows
            buf = RowBuffer(lo, hi)
            buf.add(lo, hi, inputs[base + lo : base + hi], labels[base + lo : base + hi])
            dp.buffers[(t, m)] = buf

    def split_weights(self) -> list[tuple[str, float]]:
        """Each registered client's share of new forward tasks (paper 3.2.1, "Dynamic Client
        Participation"): its measured capacity once it has completed tasks here (rows a second while
        it held a lease: taskpool's `capacity`), else the compute power it registered, both relative
        to the clients' total so the two scales mix. Not its throughput (tasks completed a second):
        that follows the work a client was given, so a client handed fewer batches looked slower and
        was handed fewer still (in calm runs one volunteer of a stage computed 9 tasks to another's
        1,185). Clients that
        have not delivered a task on time here (taskpool/standing.py) share one seat: together they
        weigh at most what the median client that has does, so that identities made by the dozen,
        registering any compute they like, draw no more batches than one newcomer would."""
        clients = sorted(self.clients.items())
        measured = self.dp().pool.stats().get("clients", {})
        thr = {p: measured.get(p, {}).get("capacity", 0.0) for p, _ in clients}
        have = [p for p in thr if thr[p] > 0]
        if not have:
            return [(p, c.compute) for p, c in clients]
        # clients without a measurement yet get the median measured share of their registered compute
        scale = sorted(thr[p] / self.clients[p].compute for p in have)[len(have) // 2]
        weights = [(p, thr[p] if thr[p] > 0 else c.compute * scale) for p, c in clients]
        proven = sorted(w for p, w in weights if self.dp().pool.standing.proven(p))
        unproven = sum(w for p, w in weights if not self.dp().pool.standing.proven(p))
        seat = proven[len(proven) // 2] if proven else 0.0
        if not proven or unproven <= seat:
            return weights
        return [(p, w if self.dp().pool.standing.proven(p) else w * seat / unproven) for p, w in weights]

    def make_forward_tasks(self, t: int, m: int) -> None:
        """One micro-batch's rows of this stage cut into forward tasks, each preferred for the client
        it was cut for (scheduler/rows.py `cut_rows`: by the clients' split weights and, when rows
        are fewer than clients x min_task_rows, by the rows each is owed), among the batch's members
        when its rows here are fewer than clients x min_client_rows."""
        dp = self.dp()
        lo, hi = dp.seg
        members = dp.batch_members.setdefault(t, [])
        first = self._local_first(t) if not members else frozenset()
        pieces = cut_rows(
            lo,
            hi,
            self.split_weights(),
            self.task_credit,
            self.min_task_rows,
            members,
            clients_per_batch(self.micro_batches, hi - lo, self.min_client_rows),
            first,
        )
        if m == 0:
            logger.debug(
                "%s: batch %d goes to %s (servers' workers free: %s)",
                self.place.device_id,
                t,
                [p[-8:] for p in members],
                sorted(p[-8:] for p in first),
            )
        note_cut(dp.batch_cut, t, {client for client, _, _ in pieces})
        for client, a, b in pieces:
            self.leases.add_task(
                Task(
                    task_id=make_task_id(TaskKind.FORWARD, t, m, self.place.stage, (a, b)),
                    kind=TaskKind.FORWARD,
                    batch=t,
                    micro_batch=m,
                    stage=self.place.stage,
                    rows=(a, b),
                    preferred_client=client,
                )
            )

    def _local_first(self, t: int) -> set:
        """The clients batch t's members are chosen from first (scheduler/rows.py `local_first`): the
        workers of this stage's servers that are not members of an earlier batch this stage has not
        applied yet; none with `--no-local-first`. Speeds compared are the compute each client
        registered (its device's measure of itself), not the throughput measured here: that counts
        the work a client was given, so a volunteer given batches would look faster than the servers'
        workers it took them from, and keep them."""
        if not self.local_first:
            return set()
        servers, reverse = set(self.st.servers), self.directory.devices
        speeds = [(p, c.compute) for p, c in sorted(self.clients.items())]
        local = {p for p, _ in speeds if p == self.peer_id or reverse.get(p) in servers}
        return local_first(speeds, local, in_flight(self.dp().batch_members, self.version(), t))

    async def on_push_inputs(self, meta, tensors, sender):
        p = self.place
        if p.role != "frontal" or p.stage == 0:
            raise PayloadError("push_inputs goes to a frontal server of a stage > 0")
        self.checks.server_of(sender, p.stage - 1, "backward")
        t, m, a, b = self.checks.rows_payload(meta, tensors, "push_inputs", ("hidden",))
        dp = self.dp()
        buf = dp.buffers.setdefault((t, m), RowBuffer(*dp.seg))
        if not buf.add(a, b, tensors[0], self.run_labels(t, m, a, b) if p.last else None):
            self.counters["relay_duplicates"] += 1
            return {"result": "duplicate"}
        if buf.complete:
            dp.waiting_inputs.append((t, m))
            self.release_waiting()
        return {"result": "accepted"}

    def release_waiting(self) -> None:
        """Publish forward tasks of batch t only once this server holds parameters version t-1, so
        that no worker leases a task it cannot compute yet (and blocks on it while older, re-queued
        work waits: a deadlock)."""
        if self.replaying():
            return
        waiting = self.dp().waiting_inputs
        ready = [(t, m) for t, m in waiting if version_for_batch(t) <= self.version()]
        for key in ready:
            waiting.remove(key)
            self.make_forward_tasks(*key)

    async def on_get_inputs(self, meta, tensors, sender):
        self.registry.caller(sender)
        if self.place.role != "frontal":
            raise PayloadError("get_inputs goes to a frontal server")
        t, m = self.checks.batch_micro(meta)
        a, b = rows_field(meta, "rows", self.rows)
        buf = self.dp().buffers.get((t, m))
        if buf is None or not buf.has(a, b):
            raise PayloadError(f"rows [{a}, {b}) of batch {t} micro-batch {m} are not held here")
        x, _ = buf.slice(a, b)
        return {"ok": True}, [x]

    async def on_push_input_grads(self, meta, tensors, sender):
        """A client's input gradient for rows of this FS: kept, and relayed to stage k-1's BS until
        it is taken. Workers send it before their gradient shards, so once this stage has applied
        batch t, every input gradient of t is held here."""
        self.registry.caller(sender)
        p = self.place
        if p.role != "frontal" or p.stage == 0:
            raise PayloadError("push_input_grads goes to a frontal server of a stage > 0")
        task_id = mfield(meta, "task", str)
        t, m, a, b = self.checks.rows_payload(meta, tensors, "push_input_grads", ("input gradient",))
        self.checks.answers_lease(
            meta.get("lease"),
            task_id,
            sender,
            TaskKind.FORWARD if p.last else TaskKind.BACKWARD,
            t,
            m,
            (a, b),
            exact=True,
        )
        dp = self.dp()
        buf = dp.grad_buffers.setdefault((t, m), RowBuffer(*dp.seg))
        fresh = buf.add(a, b, tensors[0], None)
        if fresh:
            dp.gin_senders[(t, m, a, b)] = sender  # checked with its sender's gradient push (verify.py)
            # relayed now, and the previous stage may apply batch t with it before that push comes (a
            # liar banned first never sends it): a ban's rollback must reach batch t all the same
            self.arrivals.note_work(sender, t)
            self.relay_input_grads(t, m, a, b, tensors[0])
        else:
            self.counters["relay_duplicates"] += 1
        return {"result": "accepted" if fresh else "duplicate", "task": task_id}

    def relay_input_grads(self, t: int, m: int, a: int, b: int, grad: torch.Tensor) -> None:
        """An input gradient of rows [a, b) to the previous stage's backward servers that hold them."""
        if self.replaying():
            return
        prev = self.layout().stages[self.place.stage - 1]
        for j, x, y in owners(self.rows, len(prev.backward), a, b):
            self.outbox.spawn(
                self.outbox.deliver(
                    prev.backward[j],
                    "push_output_grads",
                    {"batch": t, "micro": m, "rows": [x, y]},
                    [grad[x - a : y - a]],
                )
            )
