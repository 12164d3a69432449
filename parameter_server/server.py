"""A reliable parameter server of one stage: frontal (FS) or backward (BS), following "One training
step" of DESIGN.md and section 3.2 of the design paper.

- FS: holds the stage's inputs (stage 0 builds batch t from (seed, t); stage k>0 receives them from
  the BS of stage k-1), splits its rows into forward tasks by its clients' compute power, serves the
  inputs again for recomputation, and relays input gradients to the BS of stage k-1.
- BS: receives the forward outputs, keeps the ledger (client, rows), sends each complete micro-batch
  to the FS of stage k+1 (evenly segmented), turns output gradients into backward tasks that prefer
  the client of the forward pass.
- Both: own a shard of the stage's master parameters and AdamW state (ShardState), credit gradient
  pushes exactly once, step under the delayed update, serve parameter versions.

Every handler checks its payload (shape, dtype, finite values, known ids, registered sender) and
answers anything else with an error that says what is wrong, changing nothing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse

from parameter_server.layout import EPOCHED, RunLayout, owners, segment, split_by_weights
from parameter_server.shard import ShardState, assign_shards, parse_task_id, version_for_batch
from peer.node import TRAFFIC
from peer.protocol.links import LinkEmulator
from peer.protocol.wire import PayloadError, RemoteError, check_tensor, field as mfield, pack, rows_field, unpack
from taskpool import Completion, Task, TaskPool, TaskPoolError

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

# requests that change a server's state: written to its request log, replayed after a restart
# (an adopted layout epoch is logged too, by `adopt`, and never compacted away)
LOGGED = frozenset({"push_grads", "push_inputs", "push_outputs", "push_output_grads", "push_input_grads", "complete"})


def _batch_of(meta: dict) -> int:
    if isinstance(meta.get("batch"), int):
        return meta["batch"]
    task = meta.get("task")  # task ids are "F<batch>.<micro>.<stage>.<lo>-<hi>" (or "B...")
    try:
        return int(str(task)[1:].split(".")[0])
    except ValueError:
        return 0


RPC_NAMES = ("register", "take", "complete", "fail", "get_params", "push_grads", "push_inputs", "get_inputs",
             "push_input_grads", "push_outputs", "push_output_grads", "ping", "status", "push_replica",
             "adopt_epoch", "get_layout")




@dataclass
class ClientInfo:
    device: str
    compute: float
    last_seen: float
    tasks_done: int = 0


@dataclass
class RowBuffer:
    """Rows [lo, hi) of one micro-batch held by this server, filled piece by piece."""
    lo: int
    hi: int
    data: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    covered: list = field(default_factory=list)  # (a, b) pieces received

    def rows_covered(self) -> int:
        return sum(b - a for a, b in self.covered)

    @property
    def complete(self) -> bool:
        return self.rows_covered() == self.hi - self.lo

    def add(self, a: int, b: int, data: torch.Tensor, labels: torch.Tensor | None) -> bool:
        """Store rows [a, b); False if exactly these rows are already here (a duplicate)."""
        for x, y in self.covered:
            if x < b and a < y:
                if (x, y) == (a, b):
                    return False
                raise PayloadError(f"rows [{a}, {b}) overlap rows [{x}, {y}) already received")
        if self.data is None:
            self.data = torch.zeros((self.hi - self.lo,) + tuple(data.shape[1:]), dtype=data.dtype)
            if labels is not None:
                self.labels = torch.zeros((self.hi - self.lo,) + tuple(labels.shape[1:]), dtype=labels.dtype)
        self.data[a - self.lo : b - self.lo] = data
        if labels is not None and self.labels is not None:
            self.labels[a - self.lo : b - self.lo] = labels
        self.covered.append((a, b))
        return True

    def has(self, a: int, b: int) -> bool:
        need = b - a
        got = sum(max(0, min(b, y) - max(a, x)) for x, y in self.covered)
        return got == need

    def slice(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        d = self.data[a - self.lo : b - self.lo].clone()
        lab = None if self.labels is None else self.labels[a - self.lo : b - self.lo].clone()
        return d, lab


@dataclass
class LedgerEntry:
    client: str
    rows: tuple[int, int]
    frontal: str  # the FS holding this piece's inputs
    forward_task: str
    backward_task: str | None = None


class StageServer(ServicerBase):
    def __init__(self, *, run, layout: RunLayout, cfg, device_id: str, peer_id: str, stage_params: dict,
                 corpus=None, links: LinkEmulator | None = None, clock: Callable[[], float] = time.monotonic,
                 task_timeout: float = 60.0, client_timeout: float = 5.0, preference_grace: float = 0.5,
                 connector: Callable[[str], object] | None = None, requeue: bool = True):
        self.run = run
        self.layout = layout
        self.cfg = cfg
        self.device_id = device_id
        self.peer_id = peer_id
        self.stage, self.role, self.index = layout.locate(device_id)
        self.st = layout.stages[self.stage]
        self.last = self.stage == layout.num_stages - 1
        self.corpus = corpus
        self.links = links or LinkEmulator()
        self.clock = clock
        self.client_timeout = client_timeout
        self.connector = connector
        self.requeue = requeue
        self.rows = run.batch_size // run.micro_batches  # rows per micro-batch
        self.seq = cfg.seq_len
        self.hidden = cfg.hidden
        self.task_timeout, self.preference_grace = task_timeout, preference_grace
        # the stage's parameters are cut into one shard slot per server of the first layout; this
        # server hosts its own slot, and after a failover the slots of lost servers it held replicas of
        self.stage_params = stage_params
        self.slot_names = assign_shards({n: t.numel() for n, t in stage_params.items()}, len(self.st.hosts))
        self.slot = self.st.hosts.index(device_id)
        self.shard = self._new_shard(self.slot)
        self.hosted: dict[int, ShardState] = {self.slot: self.shard}
        self.replicas: dict[int, ShardState] = {}  # slots of other servers of the stage copied here after each step
        self.replica_locks: dict[int, asyncio.Lock] = {}
        self.run_versions: dict[str, int] = {}  # versions every server of the run announced
        self.epoch = 0  # the layout epoch: 0 is the first layout, each failover starts the next
        self.epoch_record: dict | None = None
        self.reflow_from: int | None = None  # since the last failover: the first batch run again
        self.clients: dict[str, ClientInfo] = {}
        self._reset_datapath()
        self.counters = {"payload_errors": 0, "relay_duplicates": 0, "output_duplicates": 0, "replicas_received": 0}
        self.background: set[asyncio.Task] = set()
        self.log = None  # RequestLog when the server has a checkpoint dir
        self.replaying = False
        self.step_event = asyncio.Event()
        self.on_step: list[Callable[[int], Awaitable[None] | None]] = []
        self.on_epoch: list[Callable[[dict], None]] = []

    def _new_shard(self, slot: int) -> ShardState:
        names = self.slot_names[slot]
        return ShardState({n: self.stage_params[n] for n in names}, lr=self.run.lr, rows_per_micro=self.rows,
                          micro_batches=self.run.micro_batches, steps=self.run.steps,
                          keep_versions=snapshots_kept(self.layout.num_stages))

    def _reset_datapath(self) -> None:
        """Fresh pools, rows and ledgers (at start, and when a failover starts a layout epoch)."""
        # my segment of each micro-batch's rows, among this stage's servers of my role
        self.seg = segment(self.rows, len(self.st.frontal if self.role == "frontal" else self.st.backward), self.index)
        # a client keeps the leases of the tasks whose gradients it is still accumulating (at most the
        # tasks of two batches, see StageWorker) and works on one more
        self.pool = TaskPool(clock=self.clock, default_timeout=self.task_timeout,
                             max_leases_per_client=2 * self.run.micro_batches + 1,
                             preference_grace=self.preference_grace)
        for peer, c in self.clients.items():
            self.pool.set_client_speed(peer, c.compute)
        self.issued: set[str] = set()  # every task id this server created
        self.waiting_inputs: list[tuple[int, int]] = []  # FS k>0: complete inputs waiting for their version
        self.buffers: dict[tuple[int, int], RowBuffer] = {}  # FS: inputs; BS: outputs
        self.grad_buffers: dict[tuple[int, int], RowBuffer] = {}  # BS: output grads; FS: relayed input grads
        self.ledger: dict[tuple[int, int], list[LedgerEntry]] = {}
        self.next_batch = self.reflow_from or 0  # stage-0 FS: the next batch to build

    @property
    def version(self) -> int:
        """The parameters version every shard hosted here has reached."""
        return min(sh.version for sh in self.hosted.values())

    # ------------------------------------------------------------------------------------------
    # transport glue: every rpc_* is a stream handler wrapping `handle`
    async def _serve(self, method: str, requests: AsyncIterator[ExpertRequest], context: P2PContext):
        async def counted():
            async for message in requests:
                TRAFFIC[f"{method}.request"] += message.ByteSize()
                yield message

        try:
            meta, tensors = await unpack(counted())
        except PayloadError as e:
            rmeta, rtensors = {"error": str(e)}, []
        else:
            rmeta, rtensors = await self.handle(method, meta, tensors, str(context.remote_id))
        out = pack(rmeta, rtensors, ExpertResponse)
        nbytes = sum(m.ByteSize() for m in out)
        TRAFFIC[f"{method}.response"] += nbytes
        await self.links.send(self._device_of(str(context.remote_id)), nbytes)
        for message in out:
            yield message

    async def handle(self, method: str, meta: dict, tensors: list, sender: str) -> tuple[dict, list]:
        """Run one request; any PayloadError/TaskPoolError becomes an error answer that changes nothing."""
        handler = getattr(self, f"on_{method}")
        try:
            if method in EPOCHED:
                self._check_epoch(meta)
            result = await handler(dict(meta), tensors, sender)
        except (PayloadError, TaskPoolError) as e:
            self.counters["payload_errors"] += 1
            logger.info("%s rejected %s from %s: %s", self.device_id, method, sender[-8:], e)
            return {"error": str(e)}, []
        except Exception as e:  # a bug: answer, log, keep serving
            logger.exception("%s failed on %s", self.device_id, method)
            return {"error": f"internal error: {type(e).__name__}: {e}"}, []
        result = result if isinstance(result, tuple) else (result, [])
        if self.log is not None and not self.replaying and method in LOGGED and result[0].get("result") != "duplicate":
            self.log.append({"method": method, "meta": meta, "sender": sender, "batch": _batch_of(meta)}, tensors)
        return result

    def _check_epoch(self, meta: dict) -> None:
        epoch = mfield(meta, "epoch", int, optional=True) or 0
        if epoch < self.epoch:
            raise PayloadError(f"stale epoch {epoch}: the run is at layout epoch {self.epoch} since a failover; "
                               "fetch the layout again (get_layout)")
        if epoch > self.epoch:
            raise PayloadError(f"epoch {epoch} is not adopted here yet (this server is at epoch {self.epoch})")

    def _device_of(self, peer: str) -> str | None:
        c = self.clients.get(peer)
        if c is not None:
            return c.device
        return self.directory_reverse().get(peer)

    def directory_reverse(self) -> dict:
        return getattr(self, "_directory_reverse", {})

    def set_directory(self, device_to_peer: dict[str, str], versions: dict[str, int] | None = None,
                      epochs: dict[str, int] | None = None) -> None:
        """Merge what one read of the DHT found: a server once seen stays known (a read can miss a
        record). Versions are taken only from announcements of this server's layout epoch: a
        server that takes over a lagging shard slot announces a lower version than before."""
        self._directory = getattr(self, "_directory", {}) | dict(device_to_peer)
        self._directory_reverse = {p: d for d, p in self._directory.items()}
        if versions is not None:
            epochs = epochs or {}
            self.run_versions.update({d: v for d, v in versions.items() if epochs.get(d, 0) == self.epoch})

    def run_min_version(self) -> int:
        """The lowest version any server of the run has announced: a batch below it is applied by
        every shard, so no task of it is needed by anyone (after a failover, a stage re-runs the
        forward and backward of batches it has applied itself for the stages that have not)."""
        known = [self.run_versions.get(d, 0) for st in self.layout.stages for d in st.servers if d != self.device_id]
        return min([self.version] + known)

    # ------------------------------------------------------------------------------------------
    # checks shared by handlers
    def _client(self, sender: str) -> ClientInfo:
        if self.replaying:  # the request was checked when it first arrived
            return ClientInfo("replay", 1.0, self.clock())
        c = self.clients.get(sender)
        if c is None:
            raise PayloadError(f"sender {sender[-8:]} is not registered for stage {self.stage}")
        c.last_seen = self.clock()
        return c

    def _server_sender(self, sender: str, stage: int, *roles: str) -> str:
        if self.replaying:
            return "replay"
        dev = self.directory_reverse().get(sender)
        st = self.layout.stages[stage]
        allowed = (st.frontal if "frontal" in roles else ()) + (st.backward if "backward" in roles else ())
        if dev is None or dev not in allowed:
            raise PayloadError(f"sender {sender[-8:]} is not a {' or '.join(roles)} server of stage {stage}")
        return dev

    def _batch_micro(self, meta: dict, check_applied: bool = True) -> tuple[int, int]:
        t = mfield(meta, "batch", int)
        m = mfield(meta, "micro", int)
        if not 0 <= t < self.run.steps:
            raise PayloadError(f"batch {t} outside the run's 0..{self.run.steps - 1}")
        if not 0 <= m < self.run.micro_batches:
            raise PayloadError(f"micro-batch {m} outside 0..{self.run.micro_batches - 1}")
        if check_applied:
            self._not_applied(t)
        return t, m

    def _not_applied(self, t: int) -> None:
        if t < self.version - (RETAIN - 1) and (self.reflow_from is None or t < self.reflow_from):
            raise PayloadError(f"batch {t} is already applied (version {self.version})")

    def _activation_check(self, x: torch.Tensor, n: int, name: str, tokens: bool) -> None:
        if tokens:
            check_tensor(x, name, (n, self.seq), torch.int64)
            if n and (int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size):
                raise PayloadError(f"{name}: token ids outside [0, {self.cfg.vocab_size})")
        else:
            check_tensor(x, name, (n, self.seq, self.hidden), torch.float32)

    def _labels_check(self, y: torch.Tensor, n: int) -> None:
        self._activation_check(y, n, "labels", tokens=True)

    def _rows_payload(self, meta: dict, tensors: list, what: str, kinds: tuple[str, ...]) -> tuple[int, int, int, int]:
        """(batch, micro, lo, hi) of a payload for rows of this server's segment, its tensors checked
        against `kinds` ("hidden"/"labels"/a gradient's name) for those rows."""
        t, m = self._batch_micro(meta, check_applied=False)
        a, b = rows_field(meta, "rows", self.rows)
        lo, hi = self.seg
        if not (lo <= a and b <= hi):
            raise PayloadError(f"rows [{a}, {b}) outside this server's segment [{lo}, {hi})")
        if len(tensors) != len(kinds):
            raise PayloadError(f"{what} expects [{', '.join(kinds)}], got {len(tensors)} tensors")
        for x, kind in zip(tensors, kinds):
            if kind == "labels":
                self._labels_check(x, b - a)
            else:
                self._activation_check(x, b - a, kind, tokens=False)
        self._not_applied(t)  # after the checks: a malformed payload is named as such whatever its batch
        return t, m, a, b

    # ------------------------------------------------------------------------------------------
    # membership
    async def on_register(self, meta, tensors, sender):
        device = mfield(meta, "device", str)
        compute = mfield(meta, "compute", float)
        if compute <= 0:
            raise PayloadError("field 'compute' must be positive")
        stage = mfield(meta, "stage", int)
        if stage != self.stage:
            raise PayloadError(f"this server serves stage {self.stage}, not {stage}")
        new = sender not in self.clients
        info = self.clients.setdefault(sender, ClientInfo(device, compute, self.clock()))
        info.compute, info.device, info.last_seen = compute, device, self.clock()
        if new:
            logger.info("%s: client %s (%s) registered, compute %.3g", self.device_id, sender[-8:], device, compute)
            self.pool.set_client_speed(sender, compute)
        return {"ok": True, "version": self.version, "epoch": self.epoch}

    def drop_stale_clients(self) -> list[str]:
        now = self.clock()
        gone = [p for p, c in self.clients.items() if now - c.last_seen > self.client_timeout and p != self.peer_id]
        for p in gone:
            del self.clients[p]
            # with --no-requeue the departed client's leases are left to run out their full timeout
            # (as a SWARM trainer waits out a request to a dead peer); the work is then done again
            n = len(self.pool.client_left(p)) if self.requeue else len(self.pool.leases_of(p))
            logger.info("%s: client %s left; %d tasks %s", self.device_id, p[-8:], n,
                        "re-queued" if self.requeue else "left to time out")
        return gone

    # ------------------------------------------------------------------------------------------
    # tasks
    async def on_take(self, meta, tensors, sender):
        self._client(sender)
        while True:
            lease = self.pool.take(sender)
            if lease is None:
                return {"task": None, "version": self.version, "epoch": self.epoch}
            task = lease.task
            if task.batch < self.run_min_version():  # applied by every server: nothing left to do
                self.pool.abandon(task.task_id)
                continue
            break
        t, m, (a, b) = task.batch, task.micro_batch, task.rows
        common = {"task": task.task_id, "kind": task.kind, "batch": t, "micro": m, "rows": [a, b],
                  "stage": self.stage, "version": version_for_batch(t), "deadline": lease.deadline - self.clock(),
                  "attempt": lease.attempt, "epoch": self.epoch}
        if task.kind == "forward":
            x, y = self.buffers[(t, m)].slice(a, b)
            return dict(common, frontal=self.device_id), [x, y]
        entry: LedgerEntry = task.payload_ref
        g, _ = self.grad_buffers[(t, m)].slice(a, b)
        return dict(common, frontal=entry.frontal, forward_task=entry.forward_task), [g]

    def _known_task(self, meta) -> str:
        task_id = mfield(meta, "task", str)
        if task_id not in self.issued:
            raise PayloadError(f"unknown task id {task_id!r}")
        return task_id

    def _add_task(self, task: Task) -> None:
        """Forward tasks depend on the clients registered when they were cut, so they are logged and,
        in a replay, re-created from the log; backward tasks follow from the ledger."""
        if task.kind == "forward":
            if self.replaying:
                return
            if self.log is not None:
                self.log.append({"task": [task.task_id, task.batch, task.micro_batch, task.rows[0], task.rows[1],
                                          task.preferred_client], "batch": task.batch})
        self.pool.add(task)
        self.issued.add(task.task_id)

    async def on_complete(self, meta, tensors, sender):
        c = self._client(sender)
        task_id = self._known_task(meta)
        result = self.pool.complete(task_id, sender)
        if result is Completion.ACCEPTED:
            c.tasks_done += 1
        return {"result": result.value}

    async def on_fail(self, meta, tensors, sender):
        self._client(sender)
        task_id = self._known_task(meta)
        self.pool.fail(task_id, sender)
        return {"ok": True}

    # ------------------------------------------------------------------------------------------
    # parameters and gradients
    async def on_get_params(self, meta, tensors, sender):
        version = mfield(meta, "version", int)
        shard = self._hosted(meta)
        if version > shard.version:
            return {"retry": True, "version": shard.version}
        snap = shard.params_at(version)
        if snap is None:
            raise PayloadError(f"version {version} is no longer held (current {shard.version})")
        return {"names": shard.names, "version": version}, [snap[n] for n in shard.names]

    def _hosted(self, meta: dict) -> ShardState:
        slot = mfield(meta, "slot", int, optional=True)
        slot = self.slot if slot is None else slot
        if slot not in self.hosted:
            raise PayloadError(f"shard slot {slot} is not hosted here (this server hosts {sorted(self.hosted)})")
        return self.hosted[slot]

    async def on_push_grads(self, meta, tensors, sender):
        """A client's gradient shard accumulated over the tasks `tasks` (ids) of batch `batch`."""
        if sender != self.peer_id:
            self._client(sender)
        t = mfield(meta, "batch", int)
        ids = mfield(meta, "tasks", list)
        if len(ids) > self.run.micro_batches * self.rows:
            raise PayloadError(f"{len(ids)} tasks in one push: a batch has at most {self.run.micro_batches * self.rows}"
                               " rows")
        if len(set(map(str, ids))) != len(ids):
            raise PayloadError("field 'tasks' names a task twice")
        pieces = []
        for task_id in ids:
            kind, batch, micro, stage, rows = parse_task_id(task_id)
            if stage != self.stage or batch != t:
                raise PayloadError(f"task {task_id} is not of batch {t} of stage {self.stage}")
            if kind != ("forward" if self.last else "backward"):
                raise PayloadError(f"task {task_id}: only {'forward' if self.last else 'backward'} tasks carry "
                                   f"gradients on stage {self.stage}")
            pieces.append((task_id, micro, rows))
        loss = mfield(meta, "loss_sum", float, optional=True)
        if self.last and loss is None:
            raise PayloadError("the last stage's gradient pushes must carry 'loss_sum'")
        result, already = self._hosted(meta).credit(batch=t, pieces=pieces, grads=tensors, loss_sum=loss)
        if result == "credited":
            self._maybe_step()
        return {"result": result, "credited": already}

    def _maybe_step(self) -> None:
        stepped = False
        for slot, shard in sorted(self.hosted.items()):
            while shard.ready_to_step():
                before = self.version
                v = shard.step()
                stepped = True
                logger.info("%s: applied batch %d -> version %d (slot %d)", self.device_id, v - 1, v, slot)
                self._spawn(self._send_replica(slot))
                if self.version == before:
                    continue
                self._forget_before(self.version - (RETAIN - 1))
                for cb in self.on_step:
                    r = cb(self.version)
                    if asyncio.iscoroutine(r):
                        self._spawn(r)
        if stepped:
            self.step_event.set()
            self.step_event = asyncio.Event()
            self.maybe_start_batches()
            self.release_waiting()

    def _forget_before(self, batch: int) -> None:
        """Drop the rows and ledgers of batches < batch (applied by every server of the stage)."""
        for store in (self.buffers, self.grad_buffers, self.ledger):
            for key in [k for k in store if k[0] < batch]:
                del store[key]

    # ------------------------------------------------------------------------------------------
    # frontal server: inputs, tasks, relay of input gradients
    def maybe_start_batches(self) -> None:
        """Stage 0's FS builds batch t once the parameters it needs (version t-1) exist here, which
        bounds the micro-batches in flight to two batches."""
        if self.role != "frontal" or self.stage != 0 or self.replaying:
            return
        while self.next_batch < self.run.steps and self.version >= version_for_batch(self.next_batch) \
                and self.next_batch <= self.version + 1:
            t = self.next_batch
            self._build_inputs(t)
            for m in range(self.run.micro_batches):
                self._make_forward_tasks(t, m)
            self.next_batch += 1

    def _build_inputs(self, t: int) -> None:
        from peer.model.data import make_batch

        inputs, labels = make_batch(self.corpus, self.run.seed, t, self.run.batch_size, self.seq)
        lo, hi = self.seg
        for m in range(self.run.micro_batches):
            base = m * self.rows
            buf = RowBuffer(lo, hi)
            buf.add(lo, hi, inputs[base + lo : base + hi], labels[base + lo : base + hi])
            self.buffers[(t, m)] = buf

    def split_weights(self) -> list[tuple[str, float]]:
        """Each registered client's share of new forward tasks (paper 3.2.1, "Dynamic Client
        Participation"): its measured throughput once it has completed tasks here, else the compute
        power it registered, both relative to the clients' total so the two scales mix."""
        clients = sorted(self.clients.items())
        measured = self.pool.stats().get("clients", {})
        thr = {p: measured.get(p, {}).get("throughput", 0.0) for p, _ in clients}
        have = [p for p in thr if thr[p] > 0]
        if not have:
            return [(p, c.compute) for p, c in clients]
        # clients without a measurement yet get the median measured share of their registered compute
        scale = sorted(thr[p] / self.clients[p].compute for p in have)[len(have) // 2]
        return [(p, thr[p] if thr[p] > 0 else c.compute * scale) for p, c in clients]

    def _make_forward_tasks(self, t: int, m: int) -> None:
        lo, hi = self.seg
        clients = self.split_weights()
        weights = [w for _, w in clients] or [1.0]
        for i, a, b in split_by_weights(lo, hi, weights):
            preferred = clients[i][0] if clients else None
            self._add_task(Task(task_id=f"F{t}.{m}.{self.stage}.{a}-{b}", kind="forward", batch=t, micro_batch=m,
                               stage=self.stage, rows=(a, b), preferred_client=preferred))

    async def on_push_inputs(self, meta, tensors, sender):
        if self.role != "frontal" or self.stage == 0:
            raise PayloadError("push_inputs goes to a frontal server of a stage > 0")
        self._server_sender(sender, self.stage - 1, "backward")
        t, m, a, b = self._rows_payload(meta, tensors, "push_inputs", ("hidden", "labels"))
        buf = self.buffers.setdefault((t, m), RowBuffer(*self.seg))
        if not buf.add(a, b, tensors[0], tensors[1]):
            self.counters["relay_duplicates"] += 1
            return {"result": "duplicate"}
        if buf.complete:
            self.waiting_inputs.append((t, m))
            self.release_waiting()
        return {"result": "accepted"}

    def release_waiting(self) -> None:
        """Publish forward tasks of batch t only once this server holds parameters version t-1, so
        that no worker leases a task it cannot compute yet (and blocks on it while older, re-queued
        work waits: a deadlock)."""
        if self.replaying:
            return
        ready = [(t, m) for t, m in self.waiting_inputs if version_for_batch(t) <= self.version]
        for key in ready:
            self.waiting_inputs.remove(key)
            self._make_forward_tasks(*key)

    async def on_get_inputs(self, meta, tensors, sender):
        self._client(sender)
        if self.role != "frontal":
            raise PayloadError("get_inputs goes to a frontal server")
        t, m = self._batch_micro(meta)
        a, b = rows_field(meta, "rows", self.rows)
        buf = self.buffers.get((t, m))
        if buf is None or not buf.has(a, b):
            raise PayloadError(f"rows [{a}, {b}) of batch {t} micro-batch {m} are not held here")
        x, _ = buf.slice(a, b)
        return {"ok": True}, [x]

    async def on_push_input_grads(self, meta, tensors, sender):
        """A client's input gradient for rows of this FS: kept, and relayed to stage k-1's BS until
        it is taken. Workers send it before their gradient shards, so once this stage has applied
        batch t, every input gradient of t is held here."""
        self._client(sender)
        if self.role != "frontal" or self.stage == 0:
            raise PayloadError("push_input_grads goes to a frontal server of a stage > 0")
        task_id = mfield(meta, "task", str)
        t, m, a, b = self._rows_payload(meta, tensors, "push_input_grads", ("input gradient",))
        buf = self.grad_buffers.setdefault((t, m), RowBuffer(*self.seg))
        fresh = buf.add(a, b, tensors[0], None)
        if fresh:
            self._relay_input_grads(t, m, a, b, tensors[0])
        else:
            self.counters["relay_duplicates"] += 1
        return {"result": "accepted" if fresh else "duplicate", "task": task_id}

    # ------------------------------------------------------------------------------------------
    # backward server: outputs, ledger, backward tasks
    async def on_push_outputs(self, meta, tensors, sender):
        self._client(sender)
        if self.role != "backward" or self.last:
            raise PayloadError("push_outputs goes to a backward server of a stage that is not the last")
        task_id = mfield(meta, "task", str)
        frontal = mfield(meta, "frontal", str)
        if frontal not in self.st.frontal:
            raise PayloadError(f"{frontal!r} is not a frontal server of stage {self.stage}")
        t, m, a, b = self._rows_payload(meta, tensors, "push_outputs", ("hidden", "labels"))
        buf = self.buffers.setdefault((t, m), RowBuffer(*self.seg))
        if not buf.add(a, b, tensors[0], tensors[1]):
            self.counters["output_duplicates"] += 1
            return {"result": "duplicate"}
        self.ledger.setdefault((t, m), []).append(LedgerEntry(sender, (a, b), frontal, task_id))
        self._make_backward_tasks(t, m)  # (the gradients can come first after a failover)
        if buf.complete:
            self._send_outputs(t, m)
        return {"result": "accepted"}

    def _send_outputs(self, t: int, m: int) -> None:
        """A complete micro-batch of outputs to the next stage's FS, evenly segmented."""
        if self.replaying:
            return
        buf = self.buffers[(t, m)]
        nxt = self.layout.stages[self.stage + 1]
        for j, x, y in owners(self.rows, len(nxt.frontal), buf.lo, buf.hi):
            d, lab = buf.slice(x, y)
            self._spawn(self._deliver(nxt.frontal[j], "push_inputs", {"batch": t, "micro": m, "rows": [x, y]}, [d, lab]))

    def _relay_input_grads(self, t: int, m: int, a: int, b: int, grad: torch.Tensor) -> None:
        if self.replaying:
            return
        prev = self.layout.stages[self.stage - 1]
        for j, x, y in owners(self.rows, len(prev.backward), a, b):
            self._spawn(self._deliver(prev.backward[j], "push_output_grads",
                                      {"batch": t, "micro": m, "rows": [x, y]}, [grad[x - a : y - a]]))

    async def recover(self, entries: list) -> int:
        """Rebuild buffers, ledger, pools and credits from the request log (on top of the shard
        checkpoint already loaded), then re-send what this server owes others (receivers drop what
        they already have). Returns the number of records replayed."""
        self.replaying = True
        batches, cut = set(), set()
        try:
            for record, tensors in entries:
                if "task" in record:
                    tid, t, m, a, b, preferred = record["task"]
                    batches.add(t)
                    cut.add((t, m))
                    if tid not in self.issued and not (self.stage == 0 and t < self.version - (RETAIN - 1)):
                        if self.stage == 0 and self.role == "frontal" and (t, m) not in self.buffers:
                            self._build_inputs(t)
                        self.pool.add(Task(task_id=tid, kind="forward", batch=t, micro_batch=m, stage=self.stage,
                                           rows=(a, b), preferred_client=preferred))
                        self.issued.add(tid)
                    continue
                await self.handle(record["method"], record["meta"], tensors, record["sender"])
        finally:
            self.replaying = False
        if self.stage == 0 and self.role == "frontal":
            self.next_batch = max([self.version] + [t + 1 for t in batches])
            for t in batches:  # micro-batches whose tasks were not cut before the crash
                for m in range(self.run.micro_batches):
                    if (t, m) not in cut and t >= self.version - (RETAIN - 1):
                        self._make_forward_tasks(t, m)
        # inputs whose tasks were cut before the crash must not be cut again (differently)
        self.waiting_inputs = [key for key in self.waiting_inputs if key not in cut]
        self.release_waiting()
        if self.role == "backward" and not self.last:
            for (t, m), buf in list(self.buffers.items()):
                if buf.complete:
                    self._send_outputs(t, m)
        if self.role == "frontal" and self.stage > 0:
            for (t, m), buf in list(self.grad_buffers.items()):
                for a, b in buf.covered:
                    self._relay_input_grads(t, m, a, b, buf.slice(a, b)[0])
        return len(entries)

    async def on_push_output_grads(self, meta, tensors, sender):
        if self.role != "backward" or self.last:
            raise PayloadError("push_output_grads goes to a backward server of a stage that is not the last")
        self._server_sender(sender, self.stage + 1, "frontal")
        t, m, a, b = self._rows_payload(meta, tensors, "push_output_grads", ("output gradient",))
        buf = self.grad_buffers.setdefault((t, m), RowBuffer(*self.seg))
        if not buf.add(a, b, tensors[0], None):
            self.counters["relay_duplicates"] += 1
            return {"result": "duplicate"}
        self._make_backward_tasks(t, m)
        return {"result": "accepted"}

    def _make_backward_tasks(self, t: int, m: int) -> None:
        """A backward task for every ledger piece of (t, m) whose output gradient is here."""
        buf = self.grad_buffers.get((t, m))
        for entry in self.ledger.get((t, m), []) if buf is not None else []:
            if entry.backward_task is None and buf.has(*entry.rows):
                x, y = entry.rows
                entry.backward_task = f"B{t}.{m}.{self.stage}.{x}-{y}"
                self._add_task(Task(task_id=entry.backward_task, kind="backward", batch=t, micro_batch=m,
                                   stage=self.stage, rows=(x, y), preferred_client=entry.client, payload_ref=entry))

    # ------------------------------------------------------------------------------------------
    # probing and status
    async def on_ping(self, meta, tensors, sender):
        """Round-trip and throughput probe: a tiny answer, sent back over the prober's emulated link
        (a prober is not registered yet, so it names its device)."""
        device = mfield(meta, "device", str, optional=True)
        if device is not None and sender not in self.clients:
            await self.links.send(device, 64)
        return {"ok": True, "received": sum(t.numel() * t.element_size() for t in tensors), "stage": self.stage}

    async def on_status(self, meta, tensors, sender):
        return self.status(recent=None)

    def status(self, recent: int | None = 8) -> dict:
        """Counters for the DHT record and the launcher; `losses` maps batch -> summed token loss (the
        `recent` last batches, or all of them)."""
        pool = self.pool.stats()
        losses = sorted(self.shard.losses.items())
        return {
            "device": self.device_id, "stage": self.stage, "role": self.role, "version": self.version,
            "epoch": self.epoch, "hosted": {str(k): sh.version for k, sh in self.hosted.items()},
            "replicas": {str(k): sh.version for k, sh in self.replicas.items()},
            "losses": {str(k): v for k, v in (losses if recent is None else losses[-recent:])},
            "microbatches_applied": min(sh.microbatches_applied for sh in self.hosted.values()),
            "duplicates": self.shard.duplicates + pool.get("duplicates", 0) + self.counters["relay_duplicates"]
            + self.counters["output_duplicates"],
            "requeued": pool.get("requeued", 0), "pool": pool, "counters": dict(self.counters),
            "clients": {p: {"device": c.device, "compute": c.compute, "tasks_done": c.tasks_done}
                        for p, c in self.clients.items()},
            "traffic": dict(TRAFFIC),
        }

    # ------------------------------------------------------------------------------------------
    # deliveries to other servers, retried until they are taken
    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _deliver(self, device: str, method: str, meta: dict, tensors: list, attempts: int = 600):
        """A coroutine that delivers one message, retrying until it is taken. A message of the data
        path is stamped now with this server's layout epoch: after a failover it is refused, not
        retried, since the new epoch runs that work again."""
        if method in EPOCHED:
            meta = dict(meta, epoch=self.epoch)
        return self._deliver_loop(device, method, meta, tensors, attempts)

    async def _deliver_loop(self, device: str, method: str, meta: dict, tensors: list, attempts: int) -> None:
        delay = 0.05
        for _ in range(attempts):
            if not any(device in st.servers for st in self.layout.stages):
                return  # failed over: whatever it was owed is run again in the new epoch
            link = self.connector(device) if self.connector else None
            if link is not None:
                try:
                    await link.call(method, meta, tensors, timeout=30.0)
                    return
                except RemoteError as e:
                    if "already applied" in str(e) or "stale epoch" in str(e):
                        return
                    logger.debug("%s: %s to %s refused: %s", self.device_id, method, device, e)
                except Exception as e:
                    logger.debug("%s: %s to %s failed: %r", self.device_id, method, device, e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        logger.warning("%s: gave up delivering %s to %s", self.device_id, method, device)

    # ------------------------------------------------------------------------------------------
    # replicas and failover
    async def _send_replica(self, slot: int) -> None:
        """After a step of `slot`, copy its new state to the next server of the stage (in shard
        order), which can take the slot over if this server is lost for good. Sent in version order."""
        servers = list(self.st.servers)
        if len(servers) < 2 or self.replaying:
            return
        buddy = servers[(servers.index(self.device_id) + 1) % len(servers)]
        lock = self.replica_locks.setdefault(slot, asyncio.Lock())
        async with lock:
            meta, tensors = self.hosted[slot].export()
            if meta["version"] <= getattr(lock, "sent", -1):
                return
            await self._deliver(buddy, "push_replica", dict(meta, slot=slot), tensors, attempts=60)
            lock.sent = meta["version"]

    async def on_push_replica(self, meta, tensors, sender):
        self._server_sender(sender, self.stage, "frontal", "backward")
        slot = mfield(meta, "slot", int)
        if not 0 <= slot < len(self.slot_names) or slot in self.hosted:
            raise PayloadError(f"shard slot {slot} is not another server's slot of stage {self.stage}")
        replica = self.replicas.get(slot) or self._new_shard(slot)
        newer = replica.absorb(meta, tensors)
        self.replicas[slot] = replica
        self.counters["replicas_received"] += int(newer)
        return {"result": "accepted" if newer else "duplicate", "version": replica.version}

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
                a.layers != b.layers or len(a.hosts) != len(b.hosts) for a, b in zip(layout.stages, self.layout.stages)):
            raise PayloadError("an epoch layout must keep the stages, their layers and their shard slots")
        if not 0 <= from_batch < self.run.steps:
            raise PayloadError(f"from_batch {from_batch} outside 0..{self.run.steps - 1}")
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
            raise PayloadError(f"epoch {epoch} moves {self.device_id} or gives it slots {missing} it holds no "
                               "replica of")
        for i in take_over:  # all checked before anything changes
            if self.replicas[i].version < from_batch:
                raise PayloadError(f"the replica of slot {i} is at version {self.replicas[i].version}, below "
                                   f"from_batch {from_batch}")
        for i in take_over:
            shard = self.hosted[i] = self.replicas.pop(i)
            logger.warning("%s: took over shard slot %d at version %d", self.device_id, i, shard.version)
        for shard in self.hosted.values():
            shard.batches = {}
        self.epoch, self.epoch_record, self.layout = epoch, dict(record), layout
        self.st, self.index, self.reflow_from = st, index, from_batch
        self.run_versions = {}  # readings of the old epoch no longer say what is applied
        self._reset_datapath()
        if self.log is not None and not self.replaying:
            self.log.append({"method": "adopt_epoch", "meta": dict(record), "sender": self.peer_id,
                             "batch": self.run.steps}, [])
        for cb in self.on_epoch:
            cb(dict(record))
        logger.warning("%s: layout epoch %d from batch %d (stage %d: frontal %s, backward %s, slots %s)",
                       self.device_id, epoch, from_batch, stage, list(st.frontal), list(st.backward), list(st.hosts))
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
            raise PayloadError(f"shards are at versions {min(versions)}..{max(versions)}: too far apart to run "
                               "again from the lowest")
        try:
            layout = self.layout.without(moves)
        except ValueError as e:
            raise PayloadError(str(e)) from None
        record = {"epoch": self.epoch + 1, "layout": layout.to_dict(), "from_batch": min(from_batch, self.run.steps - 1),
                  "lost": sorted(lost)}
        for d in alive:
            if d == self.device_id:
                continue
            for _ in range(20):
                try:
                    await self.connector(d).call("adopt_epoch", record, timeout=10.0)
                    break
                except Exception as e:
                    logger.info("%s: adopt_epoch to %s: %r", self.device_id, d, e)
                    await asyncio.sleep(0.2)
        self.adopt(record)
        return record

    def maintenance(self) -> None:
        """Periodic: re-queue expired leases, forget silent clients."""
        self.pool.expire(self.clock())
        self.drop_stale_clients()


def _make_rpc(name: str):
    async def rpc(self, requests: AsyncIterator[ExpertRequest], context: P2PContext) -> AsyncIterator[ExpertResponse]:
        async for message in self._serve(name, requests, context):
            yield message

    rpc.__name__ = rpc.__qualname__ = f"rpc_{name}"
    return rpc


for _name in RPC_NAMES:
    setattr(StageServer, f"rpc_{_name}", _make_rpc(_name))
