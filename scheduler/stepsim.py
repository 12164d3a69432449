"""A calibrated model of a step: the swarm's own protocol, played out as a discrete-event simulation
on a cluster's links.

`plan_cost` (docs/cost-model.md) is the planner's contract: one activation transfer each way
per client and stage, compute in proportion to FLOP/s, a pipeline of `d + K - 1` slots. It ranks
layouts; it does not say how long the swarm takes. This module does: it runs the protocol of
peer/volunteer/worker.py and parameter_server/ on simulated time, call by call, with measured costs
besides the links (`Calibration`; what each costs: scheduler/step_costs.py).

What it plays, as the swarm does it:
- stage 0's frontal server cuts batch t (one forward task per micro-batch and chosen worker) once
  its version is at least t - 1, at most two batches ahead; every forward task goes to the worker
  owed the most rows by its registered compute among the batch's members (scheduler/rows.py
  `cut_rows`, the server's own: a batch goes to as few workers as give each `min_client_rows`,
  a free server's worker first, `local_first`);
- a worker takes the best task it may (lower batch, lower micro-batch, backward first; a task
  preferred for another worker is open to it after `preference_grace`), paying a round trip, or
  only the answer's way when it was idle and waiting at the server (the long-polled take);
- before computing it holds the task's parameter version (t - 1) of every server of its stage,
  fetched from all of them at once once they all have it, or fetched ahead while it computed on
  the version before (the worker's own rule, scheduler/prefetch.py);
- a forward task pushes its outputs to the stage's backward server (its completion rides on the
  worker's next take or heartbeat: no call of its own); the backward
  server relays a whole micro-batch to the next stage's frontal server, which cuts its tasks; the
  last stage's forward+loss+backward task pushes its input gradient to its frontal server, which
  relays it to the previous stage's backward server, which offers the backward task to the worker
  that ran the forward pass (kept activations: a backward pass; another worker recomputes, after
  fetching the inputs);
- a worker sums a batch's gradients and pushes them (one shard to each server of its stage, in
  parallel; the tasks' completion rides on later calls) when it goes idle (holding for up to
  IDLE_HOLD_S a batch whose tasks it is owed) or before a task that needs them
  (scheduler/flush.py, the worker's own rule); a server steps batch t when every micro-batch of t is credited and
  its version is t;
- a server's own worker calls its own server in-process: no link, no call cost.

The model leaves out the checked work's re-runs, heartbeats and DHT traffic, and any CPU contention
between processes (which `call_seconds` measured alone does not see): the fidelity benchmark
(scripts/bench_fidelity.py) says how far that takes it from measured runs.

Pure Python and numpy, no torch or network (the planner's floor): it may not import the servers or
the worker, so the rules it plays with them live below both and both call them: the frontal
server's cut of a micro-batch's rows with its credit (scheduler/rows.py) and the worker's flush
rule (scheduler/flush.py).
"""

from __future__ import annotations

import itertools

from scheduler.events import Events
from scheduler.files import Cluster, Plan
from scheduler.flush import IDLE_HOLD_S, awaiting_after, batches_to_push, hold_ends, owed_after
from scheduler.prefetch import version_to_fetch
from scheduler.rows import clients_per_batch, cut_rows, in_flight, local_first, note_cut, owed_more
from scheduler.step_costs import Costs
from scheduler.step_io import Calibration, StepTrace, Workload
from scheduler.step_state import SimServer, SimTask, SimWorker


class StepSimulation:
    def __init__(self, cluster: Cluster, plan: Plan, work: Workload, cal: Calibration, servers_compute: bool = True):
        for k, st in enumerate(plan.stages):
            if len(st.frontal) != 1 or len(st.backward) != 1:
                raise ValueError(
                    f"stage {k}: the step simulation models one frontal and one backward server per "
                    f"stage, the plan has {len(st.frontal)} and {len(st.backward)}"
                )
        self.cluster, self.plan, self.work, self.cal = cluster, plan, work, cal
        self.K = len(plan.stages)
        self.events = Events()  # simulated time, the queue of what happens next, the waiting processes
        self._task_seq = itertools.count()  # tasks in the order they were made (ties between them)
        self.trace = StepTrace([], volunteers=[d for st in plan.stages for d in st.clients])
        self.costs = Costs(cluster, cal, work, self.trace)  # links, calls, passes (scheduler/step_costs.py)
        self.servers: dict[str, SimServer] = {}
        self.workers: dict[str, SimWorker] = {}
        self.stage_workers: list[list[str]] = []
        for k, st in enumerate(plan.stages):
            self.servers[st.frontal[0]] = SimServer(st.frontal[0], k, "frontal")
            self.servers[st.backward[0]] = SimServer(st.backward[0], k, "backward")
            names = []
            for d in ([st.frontal[0], st.backward[0]] if servers_compute else []) + list(st.clients):
                self.workers[d] = SimWorker(d, k, self.costs.flops(d), d if d in self.servers else None)
                names.append(d)
            if not names:
                raise ValueError(f"stage {k} has no worker (no clients and the servers do not compute)")
            self.stage_workers.append(names)
        self.next_batch = 0
        self._ledger: dict = {}  # (backward server, batch, micro) -> [(worker, rows)] of its forward tasks
        self._grad_rows: dict = {}  # (backward server, batch, micro) -> rows of output gradient arrived

    def run(self, limit: float = 1e6) -> StepTrace:
        fs0 = self.servers[self.plan.stages[0].frontal[0]]
        self._cut_batches(fs0)
        for d in self.workers:
            self.events.start(self._worker(self.workers[d]))
        self.events.run(lambda: len(self.trace.version_times) >= self.work.steps, limit)
        if len(self.trace.version_times) < self.work.steps:
            raise RuntimeError(
                f"the simulated run stalled at version {len(self.trace.version_times)} of {self.work.steps}"
            )
        return self.trace

    # ---- servers ----
    def _cut_batches(self, fs0: SimServer) -> None:
        while (
            self.next_batch < self.work.steps
            and fs0.version >= max(self.next_batch - 1, 0)
            and self.next_batch <= fs0.version + 1
        ):
            t = self.next_batch
            for m in range(self.work.micro_batches):
                self._make_forward_tasks(fs0, t, m)
            self.next_batch += 1
        self.events.changed()

    def _credit_split(self, fs: SimServer, t: int) -> list:
        """(worker, rows) of one micro-batch's forward tasks, cut as the frontal server cuts them
        (scheduler/rows.py `cut_rows`) by the weights the workers registered."""
        names = sorted(self.stage_workers[fs.stage])
        if all(d in self.cal.weights for d in names):
            weights = [float(self.cal.weights[d]) for d in names]
        else:
            weights = [self.workers[d].flops for d in names]
        per_batch = clients_per_batch(self.work.micro_batches, self.work.rows, self.work.min_client_rows)
        for store in (fs.members, fs.cut):
            for old in [b for b in store if b < t - 2]:
                del store[old]
        clients, members = list(zip(names, weights)), fs.members.setdefault(t, [])
        first = set()
        if self.work.local_first and not members:
            local = {d for d in names if self.workers[d].host is not None}
            first = local_first(clients, local, in_flight(fs.members, fs.version, t))
        return [
            (d, b - a)
            for d, a, b in cut_rows(
                0, self.work.rows, clients, fs.credit, self.work.min_task_rows, members, per_batch, first
            )
        ]

    def _make_forward_tasks(self, fs: SimServer, t: int, m: int) -> None:
        kind = "fb" if fs.stage == self.K - 1 else "forward"
        pieces = self._credit_split(fs, t)
        note_cut(fs.cut, t, {d for d, _ in pieces})
        for d, rows in pieces:
            self._add(
                fs,
                SimTask(
                    kind,
                    fs.stage,
                    t,
                    m,
                    rows,
                    fs.device,
                    d,
                    self.events.now + self.work.preference_grace,
                    next(self._task_seq),
                ),
            )

    def _add(self, server: SimServer, task: SimTask) -> None:
        server.tasks.append(task)
        self.events.at(task.open_at, self.events.changed)  # others may take it once its grace is over
        self.events.changed()

    def _outputs_arrived(self, bs: SimServer, task: SimTask, worker: str) -> None:
        key = (task.batch, task.micro)
        self._ledger.setdefault((bs.device,) + key, []).append((worker, task.rows))
        bs.outputs[key] = bs.outputs.get(key, 0) + task.rows
        if bs.outputs[key] == self.work.rows:  # a whole micro-batch: relayed to the next stage's FS
            fs = self.servers[self.plan.stages[bs.stage + 1].frontal[0]]
            self.trace.calls += 1
            nbytes = self.work.rows * (self.work.act_bytes + self.work.label_bytes)
            self.events.at(
                self.events.now + self.costs.arrival(bs.device, None, fs.device, nbytes),
                self._make_forward_tasks,
                fs,
                task.batch,
                task.micro,
            )

    def _input_grads_arrived(self, fs: SimServer, task: SimTask) -> None:
        """A stage's frontal server relays an input gradient to the previous stage's backward server,
        which offers the backward tasks of the micro-batch, once all its rows are in, to the
        workers that ran their forward passes."""
        bs = self.servers[self.plan.stages[fs.stage - 1].backward[0]]
        self.trace.calls += 1
        arrive = self.costs.arrival(fs.device, None, bs.device, task.rows * self.work.act_bytes)
        self.events.at(self.events.now + arrive, self._grads_at_backward, bs, task)

    def _grads_at_backward(self, bs: SimServer, task: SimTask) -> None:
        key = (bs.device, task.batch, task.micro)
        self._grad_rows[key] = self._grad_rows.get(key, 0) + task.rows
        if self._grad_rows[key] < self.work.rows:
            return
        for worker, rows in self._ledger.pop(key, []):
            self._add(
                bs,
                SimTask(
                    "backward",
                    bs.stage,
                    task.batch,
                    task.micro,
                    rows,
                    bs.device,
                    worker,
                    self.events.now + self.work.preference_grace,
                    next(self._task_seq),
                    forward_worker=worker,
                ),
            )

    def _credit(self, server: SimServer, batch: int, rows: int) -> None:
        server.credited[batch] = server.credited.get(batch, 0) + rows
        self._maybe_apply(server)

    def _maybe_apply(self, server: SimServer) -> None:
        t = server.version
        if server.credited.get(t, 0) >= self.work.micro_batches * self.work.rows:
            del server.credited[t]
            self.events.at(self.events.now + self.cal.apply_seconds, self._applied, server)

    def _applied(self, server: SimServer) -> None:
        server.version += 1
        v = min(s.version for s in self.servers.values())
        while len(self.trace.version_times) < v:
            self.trace.version_times.append(self.events.now)
        if server.stage == 0 and server.role == "frontal":
            self._cut_batches(server)
        self._maybe_apply(server)
        self.events.changed()

    # ---- workers ----
    def _servers_of(self, stage: int) -> list:
        st = self.plan.stages[stage]
        return [self.servers[st.backward[0]], self.servers[st.frontal[0]]]

    def _best(self, w: SimWorker) -> SimTask | None:
        """The task `w` would get: lower batch, lower micro-batch, backward first; one preferred for
        another worker only after its grace."""
        best = None
        for s in self._servers_of(w.stage):
            for task in s.tasks:
                if task.preferred not in (None, w.device) and task.open_at > self.events.now:
                    continue
                key = (task.batch, task.micro, task.kind != "backward", task.seq)
                if best is None or key < best[0]:
                    best = (key, task)
        return None if best is None else best[1]

    def _lease(self, w: SimWorker, task: SimTask) -> None:
        server = self.servers[task.server]
        server.tasks.remove(task)
        if task.kind != "backward":  # the take's answer says whether the server cuts more of the batch for w
            w.owed_forward = owed_after(
                w.owed_forward, task.batch, owed_more(server.cut, task.batch, w.device, self.work.micro_batches)
            )

    def _take_bytes(self, task: SimTask) -> float:
        if task.kind == "backward":
            return task.rows * self.work.act_bytes
        return task.rows * self.work.input_bytes[task.stage]

    def _worker(self, w: SimWorker):
        while True:
            task, waited = self._best(w), False
            if task is None:  # idle: push what it holds, then wait at every server for a task
                for b in self._flush_due(w, None):
                    yield from self._push(w, b)
                if self._best(w) is None:
                    due = hold_ends(w.awaiting, w.pending)
                    if due is not None:  # a held sum falls due then
                        self.events.at(due, self.events.changed)
                        yield lambda: self._best(w) is not None or self.events.now >= due
                    else:
                        yield lambda: self._best(w) is not None
                    waited = True
                task = self._best(w)
                if task is None:
                    continue
            self._lease(w, task)
            nbytes = self._take_bytes(task)
            if not waited:
                yield self.costs.rpc(w.device, w.host, task.server, 64, nbytes)
            elif w.host != task.server:  # the take was waiting there: only the answer travels
                self.trace.calls += 1
                yield (
                    self.costs.one_way(task.server, w.device, nbytes)
                    + self.cal.call_seconds
                    + nbytes * self.cal.byte_seconds
                )
            for b in self._flush_due(w, task):
                yield from self._push(w, b)
            yield from self._ensure_version(w, max(task.batch - 1, 0))
            yield from self._process(w, task)
            self.trace.tasks += 1

    def _flush_due(self, w: SimWorker, task: SimTask | None) -> list[int]:
        """The worker's own flush rule (scheduler/flush.py), with the worker's cap of held leases
        (2 x micro-batches); the model has no lease deadlines, so no lease is ever about to run out."""
        held = {b: [(float("inf"), 1.0)] * len(tasks) for b, tasks in w.pending.items()}
        if task is None:
            w.awaiting = awaiting_after(
                w.awaiting, ({b for b, _ in w.kept} | w.owed_forward).intersection(w.pending), self.events.now
            )
        return batches_to_push(
            held,
            None if task is None else {"batch": task.batch, "kind": task.kind},
            self.events.now,
            2 * self.work.micro_batches,
            w.stage == self.K - 1,
            w.awaiting,
            IDLE_HOLD_S,
        )

    def _ensure_version(self, w: SimWorker, v: int):
        if v not in w.versions:
            if v in w.fetching:  # fetched ahead: wait for it to arrive
                yield lambda: v in w.versions
            else:
                yield from self._pull(w, v)
        ahead, w.worked = version_to_fetch(w.worked, v, w.versions, w.fetching)
        if ahead is not None:
            w.fetching.add(ahead)
            self.events.start(self._fetch_ahead(w, ahead))
        if self.cal.slice_build and v not in w.built:  # the slice of a new version is built in its first pass
            w.built = {x for x in w.built if x >= v - 1} | {v}
            yield self.costs.busy(
                w, self.cal.slice_build[w.stage] * self.cal.ref_flops / w.flops * self.cal.compute_factor
            )

    def _pull(self, w: SimWorker, v: int):
        """Version v of every server of the stage, one call each, all at once, once they all have it."""
        servers = self._servers_of(w.stage)
        yield lambda: all(s.version >= v for s in servers)
        yield max(self.costs.rpc(w.device, w.host, s.device, 64, self.costs.shard_bytes(w.stage)) for s in servers)
        w.versions = {x for x in w.versions if x >= v - 1} | {v}

    def _fetch_ahead(self, w: SimWorker, v: int):
        yield from self._pull(w, v)
        w.fetching.discard(v)
        self.events.changed()

    def _process(self, w: SimWorker, task: SimTask):
        st = self.plan.stages[w.stage]
        fs, bs = self.servers[st.frontal[0]], self.servers[st.backward[0]]
        if task.kind == "forward":
            yield self.costs.compute(w, "forward", task.rows)
            w.kept.add((task.batch, task.micro))
            nbytes = task.rows * (self.work.act_bytes + self.work.label_bytes)
            self.events.at(
                self.events.now + self.costs.arrival(w.device, w.host, bs.device, nbytes),
                self._outputs_arrived,
                bs,
                task,
                w.device,
            )
            yield self.costs.rpc(w.device, w.host, bs.device, nbytes, 64)
            return
        if task.kind == "fb":
            yield self.costs.compute(w, "fb", task.rows)
        elif (task.batch, task.micro) in w.kept:
            w.kept.discard((task.batch, task.micro))
            yield self.costs.compute(w, "backward", task.rows)
        else:  # another worker ran the forward pass: fetch the inputs and recompute it
            self.trace.recomputed += 1
            yield self.costs.rpc(w.device, w.host, fs.device, 64, task.rows * self.work.input_bytes[w.stage])
            yield self.costs.compute(w, "fb", task.rows)
        if w.stage > 0:  # the input gradient to the frontal server, which relays it back a stage
            nbytes = task.rows * self.work.act_bytes
            self.events.at(
                self.events.now + self.costs.arrival(w.device, w.host, fs.device, nbytes),
                self._input_grads_arrived,
                fs,
                task,
            )
            yield self.costs.rpc(w.device, w.host, fs.device, nbytes, 64)
        w.pending.setdefault(task.batch, []).append(task)

    def _push(self, w: SimWorker, b: int):
        """One shard of batch b's summed gradient to every server of the stage at once (each credits
        it as it arrives); the tasks' completion rides on the worker's next take or heartbeat."""
        tasks = w.pending.pop(b)
        rows = sum(t.rows for t in tasks)
        times = []
        for s in self._servers_of(w.stage):
            self.events.at(
                self.events.now + self.costs.arrival(w.device, w.host, s.device, self.costs.shard_bytes(w.stage)),
                self._credit,
                s,
                b,
                rows,
            )
            times.append(self.costs.rpc(w.device, w.host, s.device, self.costs.shard_bytes(w.stage), 64))
        yield max(times)


def simulate(cluster: Cluster, plan: Plan, work: Workload, cal: Calibration, servers_compute: bool = True) -> StepTrace:
    """The simulated run of `work.steps` steps of `plan` on `cluster` (delays and bandwidths as the
    links behave: a benchmark's link scale already applied)."""
    return StepSimulation(cluster, plan, work, cal, servers_compute).run()
