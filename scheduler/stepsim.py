"""A calibrated model of a step: the swarm's own protocol, played out as a discrete-event simulation
on a cluster's links.

`plan_cost` (docs/cost-model.md) is the planner's contract: one activation transfer each way
per client and stage, compute in proportion to FLOP/s, a pipeline of `d + K - 1` slots. It ranks
layouts; it does not say how long the swarm takes. This module does: it runs the protocol of
peer/volunteer/worker.py and parameter_server/ on simulated time, call by call, with three measured
costs besides the links (`Calibration`):

- every RPC costs `call_seconds` beyond its link time (packing, the two p2p daemons, the handler),
  and `byte_seconds` per payload byte (serialization and copies through the daemons);
- a task's compute is what was measured for that stage's slice (seconds per row of a forward pass,
  of a forward+loss+backward pass and of a backward pass from kept activations, on a reference
  device of `ref_flops` FLOP/s), scaled by `ref_flops / flops` of the device and by how much slower
  passes run in the swarm than alone (`compute_factor`); a micro-batch's rows are split by the
  compute each device measured and registered (`weights`);
- a worker builds the slice of each new parameter version (`slice_build`, a compute cost);
- a server's step of its shard takes `apply_seconds`.

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

Emulated links are what core/protocol/links.py makes them: every message sleeps `delay + bytes /
bandwidth` before it goes out, with no sharing of a link between messages. The model leaves out
the checked work's re-runs, heartbeats and DHT traffic, and any CPU contention between processes
(which `call_seconds` measured alone does not see): the fidelity benchmark
(scripts/bench_fidelity.py) says how far that takes it from measured runs.

Pure Python and numpy, no torch or network (the planner's floor): it may not import the servers or
the worker, so the rules it plays with them live below both and both call them: the frontal
server's cut of a micro-batch's rows with its credit (scheduler/rows.py) and the worker's flush
rule (scheduler/flush.py).
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from dataclasses import dataclass, field

from scheduler.files import Cluster, Plan
from scheduler.flush import IDLE_HOLD_S, awaiting_after, batches_to_push, hold_ends, owed_after
from scheduler.prefetch import version_to_fetch
from scheduler.rows import clients_per_batch, cut_rows, in_flight, local_first, note_cut, owed_more


@dataclass
class Calibration:
    call_seconds: float  # one RPC's own cost beyond its link time
    byte_seconds: float  # per payload byte of an RPC
    ref_flops: float  # the device the compute below was measured on
    forward_row: list  # per stage: seconds per row (sequence) of a forward pass, on ref_flops
    fb_row: list  # per stage: forward + loss + backward (the last stage's task; a recompute elsewhere)
    backward_row: list  # per stage: backward from kept activations
    slice_build: list = field(default_factory=list)  # per stage: seconds to build the slice of a new version
    apply_seconds: float = 0.0  # a server's step of its shard
    # how much longer a pass takes in the run than the above says, the run's processes sharing the
    # machine (the devices' own measurements of themselves against the calibration, their median)
    compute_factor: float = 1.0
    # device -> the compute it registered with its servers (rows/s of its own measurement), which is
    # what the frontal servers split a micro-batch's rows by; its declared FLOP/s where not listed
    weights: dict = field(default_factory=dict)


@dataclass
class Workload:
    steps: int
    micro_batches: int
    rows: int  # sequences per micro-batch
    min_task_rows: int  # the fewest rows a forward task carries (peer serve --task-tokens / seq_len)
    input_bytes: list  # per stage: bytes per row a forward task's take brings (inputs and labels)
    act_bytes: float  # bytes per row of hidden activations at a stage boundary (and of their gradient)
    label_bytes: float  # bytes per row of labels (they travel with the activations)
    param_bytes: list  # per stage: bytes of all its parameters (split over its servers' slots)
    preference_grace: float = 0.5  # seconds a task waits for its preferred worker
    min_client_rows: int = (
        1  # the fewest rows of a batch a worker computes (peer serve --client-batch-tokens / seq_len)
    )
    local_first: bool = True  # a new batch goes first to a free worker of a stage server (peer serve --no-local-first)


def steady_seconds_per_step(version_times: list, warmup: int) -> float:
    """The mean seconds per step from version `warmup` to the last (`version_times[v - 1]`: when the
    run reached version v): a run's start (joining, the first parameter pulls, the pipeline's fill)
    left out, the same way for a simulated and a measured run."""
    if not 1 <= warmup < len(version_times):
        raise ValueError(f"{len(version_times)} versions leave no steady state after version {warmup}")
    return (version_times[-1] - version_times[warmup - 1]) / (len(version_times) - warmup)


@dataclass
class StepTrace:
    version_times: list  # when every server had reached version v (v = 1..steps)
    calls: int = 0  # RPCs made
    tasks: int = 0  # tasks computed
    recomputed: int = 0  # backward tasks run by another worker than their forward pass
    compute_seconds: dict = field(default_factory=dict)  # worker -> seconds of its passes and slice builds
    volunteers: list = field(default_factory=list)  # the workers that are volunteers (not a server's own)

    def utilisation(self) -> float:
        """The volunteers' mean share of the run spent computing (to the last version), as `peer
        join` reports its own: the seconds its passes last over the time it is in the run."""
        end = self.version_times[-1] if self.version_times else 0.0
        if not self.volunteers or end <= 0:
            return 0.0
        return statistics.mean(self.compute_seconds.get(d, 0.0) / end for d in self.volunteers)

    def seconds_per_step(self, warmup: int = 2) -> float:
        """Steady state: `steady_seconds_per_step` of the simulated versions."""
        return steady_seconds_per_step(self.version_times, warmup)

    def median_step(self) -> float:
        t = self.version_times
        return statistics.median(b - a for a, b in zip(t, t[1:]))


@dataclass
class _Task:
    kind: str  # "forward" | "fb" | "backward"
    stage: int
    batch: int
    micro: int
    rows: int
    server: str
    preferred: str | None
    open_at: float
    seq: int
    forward_worker: str | None = None


@dataclass
class _Server:
    device: str
    stage: int
    role: str
    version: int = 0
    tasks: list = field(default_factory=list)
    credited: dict = field(default_factory=dict)  # batch -> rows credited (of every micro-batch)
    outputs: dict = field(default_factory=dict)  # (batch, micro) -> rows arrived (backward server)
    credit: dict = field(default_factory=dict)  # worker -> rows owed (frontal server)
    members: dict = field(default_factory=dict)  # batch -> the workers its forward tasks are cut for (frontal server)
    cut: dict = field(default_factory=dict)  # batch -> (micro-batches cut, the workers that got a piece of each)


@dataclass
class _Worker:
    device: str
    stage: int
    flops: float
    host: str | None  # the server whose process runs this worker, if any
    versions: set = field(default_factory=set)
    worked: set = field(default_factory=set)  # versions of its last tasks (scheduler/prefetch.py)
    fetching: set = field(default_factory=set)  # versions it fetches ahead of need
    built: set = field(default_factory=set)  # versions whose slice it has built
    pending: dict = field(default_factory=dict)  # batch -> [task]
    kept: set = field(default_factory=set)  # (batch, micro) whose forward pass it keeps
    awaiting: dict = field(default_factory=dict)  # batch held while idle (owed tasks of it) -> since when
    owed_forward: set = field(default_factory=set)  # batches its frontal server cuts more tasks of for it
    idle: bool = False


def device_flops(cluster: Cluster, device: str) -> float:
    """The FLOP/s a cluster file declares for a device, reliable or not."""
    if cluster.kind(device) == "reliable":
        return float(cluster.reliable_flops[cluster.index(device)])
    return float(cluster.unreliable_flops[cluster.index(device)])


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
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self._waiting: list = []  # (predicate, generator) of processes waiting on the swarm's state
        self.servers: dict[str, _Server] = {}
        self.workers: dict[str, _Worker] = {}
        self.stage_workers: list[list[str]] = []
        for k, st in enumerate(plan.stages):
            self.servers[st.frontal[0]] = _Server(st.frontal[0], k, "frontal")
            self.servers[st.backward[0]] = _Server(st.backward[0], k, "backward")
            names = []
            for d in ([st.frontal[0], st.backward[0]] if servers_compute else []) + list(st.clients):
                self.workers[d] = _Worker(d, k, self._flops(d), d if d in self.servers else None)
                names.append(d)
            if not names:
                raise ValueError(f"stage {k} has no worker (no clients and the servers do not compute)")
            self.stage_workers.append(names)
        self.trace = StepTrace([], volunteers=[d for st in plan.stages for d in st.clients])
        self.next_batch = 0
        self._ledger: dict = {}  # (backward server, batch, micro) -> [(worker, rows)] of its forward tasks
        self._grad_rows: dict = {}  # (backward server, batch, micro) -> rows of output gradient arrived

    # ---- costs ----
    def _flops(self, device: str) -> float:
        return device_flops(self.cluster, device)

    def one_way(self, src: str, dst: str, nbytes: float) -> float:
        if src == dst:
            return 0.0
        return self.cluster.delay(src, dst) + nbytes / self.cluster.bandwidth(src, dst)

    def rpc(self, caller: str, host: str | None, callee: str, req: float, resp: float) -> float:
        """A call from a worker (or server) `caller` to server `callee`; free in-process (own server)."""
        if host == callee or caller == callee:
            return 0.0
        self.trace.calls += 1
        return (
            self.one_way(caller, callee, req)
            + self.one_way(callee, caller, resp)
            + self.cal.call_seconds
            + (req + resp) * self.cal.byte_seconds
        )

    def compute(self, w: _Worker, kind: str, rows: int) -> float:
        per = {"forward": self.cal.forward_row, "fb": self.cal.fb_row, "backward": self.cal.backward_row}[kind][w.stage]
        return self._busy(w, rows * per * self.cal.ref_flops / w.flops * self.cal.compute_factor)

    def _busy(self, w: _Worker, seconds: float) -> float:
        """`seconds` of compute by `w`, counted in the trace; returned for the worker to wait."""
        self.trace.compute_seconds[w.device] = self.trace.compute_seconds.get(w.device, 0.0) + seconds
        return seconds

    def shard_bytes(self, stage: int) -> float:
        return self.work.param_bytes[stage] / 2  # two slots: the frontal's and the backward's

    # ---- the event loop ----
    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def _start(self, gen) -> None:
        self._step(gen, None)

    def _step(self, gen, _value) -> None:
        try:
            what = next(gen)
        except StopIteration:
            return
        if isinstance(what, (int, float)):
            self._at(self.now + max(float(what), 0.0), self._step, gen, None)
        else:  # a predicate on the state: resumed once it holds
            if what():
                self._at(self.now, self._step, gen, None)
            else:
                self._waiting.append((what, gen))

    def _changed(self) -> None:
        """The swarm's state changed: resume the processes whose condition now holds."""
        still = []
        for pred, gen in self._waiting:
            if pred():
                self._at(self.now, self._step, gen, None)
            else:
                still.append((pred, gen))
        self._waiting = still

    def run(self, limit: float = 1e6) -> StepTrace:
        fs0 = self.servers[self.plan.stages[0].frontal[0]]
        self._cut_batches(fs0)
        for d in self.workers:
            self._start(self._worker(self.workers[d]))
        while self._heap and len(self.trace.version_times) < self.work.steps:
            t, _, fn, args = heapq.heappop(self._heap)
            if t > limit:
                break
            self.now = t
            fn(*args)
        if len(self.trace.version_times) < self.work.steps:
            raise RuntimeError(
                f"the simulated run stalled at version {len(self.trace.version_times)} of {self.work.steps}"
            )
        return self.trace

    # ---- servers ----
    def _cut_batches(self, fs0: _Server) -> None:
        while (
            self.next_batch < self.work.steps
            and fs0.version >= max(self.next_batch - 1, 0)
            and self.next_batch <= fs0.version + 1
        ):
            t = self.next_batch
            for m in range(self.work.micro_batches):
                self._make_forward_tasks(fs0, t, m)
            self.next_batch += 1
        self._changed()

    def _credit_split(self, fs: _Server, t: int) -> list:
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

    def _make_forward_tasks(self, fs: _Server, t: int, m: int) -> None:
        kind = "fb" if fs.stage == self.K - 1 else "forward"
        pieces = self._credit_split(fs, t)
        note_cut(fs.cut, t, {d for d, _ in pieces})
        for d, rows in pieces:
            self._add(
                fs,
                _Task(kind, fs.stage, t, m, rows, fs.device, d, self.now + self.work.preference_grace, next(self._seq)),
            )

    def _add(self, server: _Server, task: _Task) -> None:
        server.tasks.append(task)
        self._at(task.open_at, self._changed)  # others may take it once its grace is over
        self._changed()

    def _arrival(self, caller: str, host: str | None, callee: str, req: float) -> float:
        """Seconds until a request from `caller` is at server `callee` (its handler acts then)."""
        if host == callee or caller == callee:
            return 0.0
        return self.one_way(caller, callee, req) + self.cal.call_seconds / 2 + req * self.cal.byte_seconds

    def _outputs_arrived(self, bs: _Server, task: _Task, worker: str) -> None:
        key = (task.batch, task.micro)
        self._ledger.setdefault((bs.device,) + key, []).append((worker, task.rows))
        bs.outputs[key] = bs.outputs.get(key, 0) + task.rows
        if bs.outputs[key] == self.work.rows:  # a whole micro-batch: relayed to the next stage's FS
            fs = self.servers[self.plan.stages[bs.stage + 1].frontal[0]]
            self.trace.calls += 1
            nbytes = self.work.rows * (self.work.act_bytes + self.work.label_bytes)
            self._at(
                self.now + self._arrival(bs.device, None, fs.device, nbytes),
                self._make_forward_tasks,
                fs,
                task.batch,
                task.micro,
            )

    def _input_grads_arrived(self, fs: _Server, task: _Task) -> None:
        """A stage's frontal server relays an input gradient to the previous stage's backward server,
        which offers the backward tasks of the micro-batch, once all its rows are in, to the
        workers that ran their forward passes."""
        bs = self.servers[self.plan.stages[fs.stage - 1].backward[0]]
        self.trace.calls += 1
        arrive = self._arrival(fs.device, None, bs.device, task.rows * self.work.act_bytes)
        self._at(self.now + arrive, self._grads_at_backward, bs, task)

    def _grads_at_backward(self, bs: _Server, task: _Task) -> None:
        key = (bs.device, task.batch, task.micro)
        self._grad_rows[key] = self._grad_rows.get(key, 0) + task.rows
        if self._grad_rows[key] < self.work.rows:
            return
        for worker, rows in self._ledger.pop(key, []):
            self._add(
                bs,
                _Task(
                    "backward",
                    bs.stage,
                    task.batch,
                    task.micro,
                    rows,
                    bs.device,
                    worker,
                    self.now + self.work.preference_grace,
                    next(self._seq),
                    forward_worker=worker,
                ),
            )

    def _credit(self, server: _Server, batch: int, rows: int) -> None:
        server.credited[batch] = server.credited.get(batch, 0) + rows
        self._maybe_apply(server)

    def _maybe_apply(self, server: _Server) -> None:
        t = server.version
        if server.credited.get(t, 0) >= self.work.micro_batches * self.work.rows:
            del server.credited[t]
            self._at(self.now + self.cal.apply_seconds, self._applied, server)

    def _applied(self, server: _Server) -> None:
        server.version += 1
        v = min(s.version for s in self.servers.values())
        while len(self.trace.version_times) < v:
            self.trace.version_times.append(self.now)
        if server.stage == 0 and server.role == "frontal":
            self._cut_batches(server)
        self._maybe_apply(server)
        self._changed()

    # ---- workers ----
    def _servers_of(self, stage: int) -> list:
        st = self.plan.stages[stage]
        return [self.servers[st.backward[0]], self.servers[st.frontal[0]]]

    def _best(self, w: _Worker) -> _Task | None:
        """The task `w` would get: lower batch, lower micro-batch, backward first; one preferred for
        another worker only after its grace."""
        best = None
        for s in self._servers_of(w.stage):
            for task in s.tasks:
                if task.preferred not in (None, w.device) and task.open_at > self.now:
                    continue
                key = (task.batch, task.micro, task.kind != "backward", task.seq)
                if best is None or key < best[0]:
                    best = (key, task)
        return None if best is None else best[1]

    def _lease(self, w: _Worker, task: _Task) -> None:
        server = self.servers[task.server]
        server.tasks.remove(task)
        if task.kind != "backward":  # the take's answer says whether the server cuts more of the batch for w
            w.owed_forward = owed_after(
                w.owed_forward, task.batch, owed_more(server.cut, task.batch, w.device, self.work.micro_batches)
            )

    def _take_bytes(self, task: _Task) -> float:
        if task.kind == "backward":
            return task.rows * self.work.act_bytes
        return task.rows * self.work.input_bytes[task.stage]

    def _worker(self, w: _Worker):
        while True:
            task, waited = self._best(w), False
            if task is None:  # idle: push what it holds, then wait at every server for a task
                for b in self._flush_due(w, None):
                    yield from self._push(w, b)
                if self._best(w) is None:
                    due = hold_ends(w.awaiting, w.pending)
                    if due is not None:  # a held sum falls due then
                        self._at(due, self._changed)
                        yield lambda: self._best(w) is not None or self.now >= due
                    else:
                        yield lambda: self._best(w) is not None
                    waited = True
                task = self._best(w)
                if task is None:
                    continue
            self._lease(w, task)
            nbytes = self._take_bytes(task)
            if not waited:
                yield self.rpc(w.device, w.host, task.server, 64, nbytes)
            elif w.host != task.server:  # the take was waiting there: only the answer travels
                self.trace.calls += 1
                yield (
                    self.one_way(task.server, w.device, nbytes) + self.cal.call_seconds + nbytes * self.cal.byte_seconds
                )
            for b in self._flush_due(w, task):
                yield from self._push(w, b)
            yield from self._ensure_version(w, max(task.batch - 1, 0))
            yield from self._process(w, task)
            self.trace.tasks += 1

    def _flush_due(self, w: _Worker, task: _Task | None) -> list[int]:
        """The worker's own flush rule (scheduler/flush.py), with the worker's cap of held leases
        (2 x micro-batches); the model has no lease deadlines, so no lease is ever about to run out."""
        held = {b: [(float("inf"), 1.0)] * len(tasks) for b, tasks in w.pending.items()}
        if task is None:
            w.awaiting = awaiting_after(
                w.awaiting, ({b for b, _ in w.kept} | w.owed_forward).intersection(w.pending), self.now
            )
        return batches_to_push(
            held,
            None if task is None else {"batch": task.batch, "kind": task.kind},
            self.now,
            2 * self.work.micro_batches,
            w.stage == self.K - 1,
            w.awaiting,
            IDLE_HOLD_S,
        )

    def _ensure_version(self, w: _Worker, v: int):
        if v not in w.versions:
            if v in w.fetching:  # fetched ahead: wait for it to arrive
                yield lambda: v in w.versions
            else:
                yield from self._pull(w, v)
        ahead, w.worked = version_to_fetch(w.worked, v, w.versions, w.fetching)
        if ahead is not None:
            w.fetching.add(ahead)
            self._start(self._fetch_ahead(w, ahead))
        if self.cal.slice_build and v not in w.built:  # the slice of a new version is built in its first pass
            w.built = {x for x in w.built if x >= v - 1} | {v}
            yield self._busy(w, self.cal.slice_build[w.stage] * self.cal.ref_flops / w.flops * self.cal.compute_factor)

    def _pull(self, w: _Worker, v: int):
        """Version v of every server of the stage, one call each, all at once, once they all have it."""
        servers = self._servers_of(w.stage)
        yield lambda: all(s.version >= v for s in servers)
        yield max(self.rpc(w.device, w.host, s.device, 64, self.shard_bytes(w.stage)) for s in servers)
        w.versions = {x for x in w.versions if x >= v - 1} | {v}

    def _fetch_ahead(self, w: _Worker, v: int):
        yield from self._pull(w, v)
        w.fetching.discard(v)
        self._changed()

    def _process(self, w: _Worker, task: _Task):
        st = self.plan.stages[w.stage]
        fs, bs = self.servers[st.frontal[0]], self.servers[st.backward[0]]
        if task.kind == "forward":
            yield self.compute(w, "forward", task.rows)
            w.kept.add((task.batch, task.micro))
            nbytes = task.rows * (self.work.act_bytes + self.work.label_bytes)
            self._at(
                self.now + self._arrival(w.device, w.host, bs.device, nbytes), self._outputs_arrived, bs, task, w.device
            )
            yield self.rpc(w.device, w.host, bs.device, nbytes, 64)
            return
        if task.kind == "fb":
            yield self.compute(w, "fb", task.rows)
        elif (task.batch, task.micro) in w.kept:
            w.kept.discard((task.batch, task.micro))
            yield self.compute(w, "backward", task.rows)
        else:  # another worker ran the forward pass: fetch the inputs and recompute it
            self.trace.recomputed += 1
            yield self.rpc(w.device, w.host, fs.device, 64, task.rows * self.work.input_bytes[w.stage])
            yield self.compute(w, "fb", task.rows)
        if w.stage > 0:  # the input gradient to the frontal server, which relays it back a stage
            nbytes = task.rows * self.work.act_bytes
            self._at(self.now + self._arrival(w.device, w.host, fs.device, nbytes), self._input_grads_arrived, fs, task)
            yield self.rpc(w.device, w.host, fs.device, nbytes, 64)
        w.pending.setdefault(task.batch, []).append(task)

    def _push(self, w: _Worker, b: int):
        """One shard of batch b's summed gradient to every server of the stage at once (each credits
        it as it arrives); the tasks' completion rides on the worker's next take or heartbeat."""
        tasks = w.pending.pop(b)
        rows = sum(t.rows for t in tasks)
        times = []
        for s in self._servers_of(w.stage):
            self._at(
                self.now + self._arrival(w.device, w.host, s.device, self.shard_bytes(w.stage)),
                self._credit,
                s,
                b,
                rows,
            )
            times.append(self.rpc(w.device, w.host, s.device, self.shard_bytes(w.stage), 64))
        yield max(times)


def simulate(cluster: Cluster, plan: Plan, work: Workload, cal: Calibration, servers_compute: bool = True) -> StepTrace:
    """The simulated run of `work.steps` steps of `plan` on `cluster` (delays and bandwidths as the
    links behave: a benchmark's link scale already applied)."""
    return StepSimulation(cluster, plan, work, cal, servers_compute).run()
