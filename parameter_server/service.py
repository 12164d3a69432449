"""A reliable parameter server of one stage: frontal (FS) or backward (BS), following "One training
step" of docs/design.md and section 3.2 of the design paper. This file is its thin service: the
state its parts share (the shards hosted here and the replicas kept, the clients registered, the
data path of the current layout epoch, where it stands in that epoch) and the methods hivemind's
servicer finds (`rpc_*`, each handing its stream to the RPC surface). Each concern is a part built
with what it reads of the server and tested alone (parts.py and compose_data.py build them; a call's
handler is found through parts.PART_HANDLERS): the directory of the run's servers, the checks every
handler shares, the client registry, take/complete/fail, the two roles' data path, parameter
versions, credits and steps, replicas, layout epochs, what volunteers sent and the sample of it,
bans, holds and pins, the gradient-norm round, the held-out evaluation, the status, the request
log's replay and the re-queueing of work whose results never came. The re-runs of that sample
(verify.py) are still mixed in and read the server's attributes.

Every handler checks its payload (shape, dtype, finite values, known ids, registered sender) and
answers anything else with an error that says what is wrong, changing nothing.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Callable

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse

from core.layout import DEFAULT_CLIENT_BATCH_TOKENS, DEFAULT_TASK_TOKENS, RunLayout, assign_shards, segment
from core.protocol import methods
from core.protocol.leases import LeaseTickets
from core.protocol.links import LinkEmulator
from parameter_server.budget import default_max_request_bytes
from parameter_server.clients import ClientInfo
from parameter_server.contributions import Contributions
from parameter_server.datapath import DataPath
from parameter_server.failover import Placement
from parameter_server.ledger import LedgerEntry, RowBuffer  # noqa: F401 (types of the shared state)
from parameter_server.parts import PART_HANDLERS, compose_parts
from parameter_server.shard import ShardState
from parameter_server.updates import RETAIN, snapshots_kept
from parameter_server.verify import DEFAULT_PROBATION, DEFAULT_VERIFY_RATE, Verification
from taskpool import TaskPool

logger = logging.getLogger("hivepipe.server")

STALL_REPORT_FACTOR, STALL_REPORT_MIN = 2.0, 3.0  # report_stall: a step this much longer than the median
# what a client new to this server may hold (taskpool/standing.py): two leases to begin with (one to
# compute, one to hold while its sum waits), and until it has delivered a task on time, leases that
# last 2x the typical lease here (its own speed factor applied), never under 0.25 s: a stranger that takes
# tasks and never answers holds little, briefly
START_LEASES = 2
PROBATION_FACTOR, PROBATION_FLOOR = 2.0, 0.25

__all__ = ["RETAIN", "StageServer"]


class StageServer(
    Verification,
    ServicerBase,
):
    def __init__(
        self,
        *,
        run,
        layout: RunLayout,
        cfg,
        device_id: str,
        peer_id: str,
        stage_params: dict,
        corpus=None,
        links: LinkEmulator | None = None,
        clock: Callable[[], float] = time.monotonic,
        task_timeout: float = 60.0,
        client_timeout: float = 5.0,
        preference_grace: float = 0.5,
        connector: Callable[[str], object] | None = None,
        requeue: bool = True,
        max_request_bytes: int | None = None,
        volunteers_allow: frozenset[str] | None = None,
        verify_rate: float = DEFAULT_VERIFY_RATE,
        probation: int = DEFAULT_PROBATION,
        verify_device: str = "cpu",
        task_tokens: int = DEFAULT_TASK_TOKENS,
        client_batch_tokens: int = DEFAULT_CLIENT_BATCH_TOKENS,
        local_first: bool = True,
        lease_tickets: LeaseTickets,
    ):
        self.run = run
        # the tickets of this run's leases, which every server of the run can check (core/protocol/leases.py)
        self.lease_tickets = lease_tickets
        self.cfg = cfg
        self.device_id = device_id
        self.peer_id = peer_id
        self.stage, self.role, index = layout.locate(device_id)
        # where this server stands in the current layout epoch: changed only by an epoch (failover.py)
        self.placement = Placement(layout, 0, None, layout.stages[self.stage], index)
        self.last = self.stage == layout.num_stages - 1
        self.corpus = corpus
        self.links = links or LinkEmulator()
        self.clock = clock
        self.connector = connector
        self.requeue = requeue
        self.compress = getattr(run, "compress", "none")  # activations and gradients on the wire (wire.py)
        self.rows = run.batch_size // run.micro_batches  # rows per micro-batch
        self.seq = cfg.seq_len
        self.hidden = cfg.hidden
        self.task_timeout, self.preference_grace = task_timeout, preference_grace
        # the stage's parameters are cut into one shard slot per server of the first layout; this
        # server hosts its own slot, and after a failover the slots of lost servers it held replicas of
        self.stage_params = stage_params
        self.slot_names = assign_shards({n: t.numel() for n, t in stage_params.items()}, len(self.st.hosts))
        self.slot = self.st.hosts.index(device_id)
        self.shard = self.new_shard(self.slot)
        self.old_versions = None  # versions kept on disk for bans (use_old_versions; None: memory only)
        self.hosted: dict[int, ShardState] = {self.slot: self.shard}
        self.replicas: dict[int, ShardState] = {}  # slots of other servers of the stage copied here after each step
        self.halted: str | None = None  # why the run is stopped (a role lost its last server), announced
        self.clients: dict[str, ClientInfo] = {}
        # set by its host once every server of the run has applied the last step: the answers to
        # heartbeats say so, and a worker that hears it stops (peer.host.server)
        self.run_over = False
        # tasks completed here by each worker's device id, also of workers that have left since
        self.tasks_by_device: dict[str, int] = {}
        self.contributions = Contributions()  # by peer id: tasks done, checks passed (the run's summary)
        self.reset_datapath()
        self.counters = {
            "payload_errors": 0,
            "relay_duplicates": 0,
            "output_duplicates": 0,
            "replicas_received": 0,
            "replica_steps_by_reference": 0,
        }
        self.log = None  # RequestLog when the server has a checkpoint dir
        self._stall_reported: int | None = None  # the version whose stall report_stall logged
        self._init_verification(verify_rate, probation, verify_device)
        compose_parts(
            self,
            run,
            cfg,
            verify_rate=verify_rate,
            probation=probation,
            client_timeout=client_timeout,
            volunteers_allow=volunteers_allow,
            max_request_bytes=max_request_bytes or default_max_request_bytes(stage_params, self.rows, cfg),
            min_task_rows=max(1, -(-int(task_tokens) // cfg.seq_len)),
            min_client_rows=max(1, -(-int(client_batch_tokens) // cfg.seq_len)),
            local_first=bool(local_first),
        )

    def use_old_versions(self, old_versions) -> None:
        """Keep the versions memory lets go on disk, within a ban's reach (old_versions.py): the slots
        hosted here now, and those a failover gives it."""
        self.old_versions = old_versions
        for slot, shard in self.hosted.items():
            shard.old = old_versions.slot(slot)

    def new_shard(self, slot: int) -> ShardState:
        names = self.slot_names[slot]
        return ShardState(
            {n: self.stage_params[n] for n in names},
            recipe=self.run.training_recipe(),
            rows_per_micro=self.rows,
            micro_batches=self.run.micro_batches,
            steps=self.run.steps,
            keep_versions=snapshots_kept(self.layout.num_stages),
        )

    def reset_datapath(self) -> None:
        """Fresh pools, rows and ledgers (at start, and when a failover starts a layout epoch)."""
        # my segment of each micro-batch's rows, among this stage's servers of my role
        seg = segment(self.rows, len(self.st.frontal if self.role == "frontal" else self.st.backward), self.index)
        # a client keeps the leases of the tasks whose gradients it is still accumulating (at most the
        # tasks of two batches, see StageWorker) and works on one more
        # ... leases it earns by delivering (taskpool/standing.py): taking work without doing it costs the taker
        pool = TaskPool(
            clock=lambda: self.clock(),  # (the server's clock as it is now: a test may set another)
            default_timeout=self.task_timeout,
            max_leases_per_client=2 * self.run.micro_batches + 1,
            preference_grace=self.preference_grace,
            start_leases=START_LEASES,
            probation_factor=PROBATION_FACTOR,
            probation_floor=PROBATION_FLOOR,
            # a proven client with nothing to do backs up a lease an unproven one holds past the typical
            # time (the first result wins): a hoarder holds up no batch while others are idle
            backups=self.requeue,
        )
        for peer, c in self.clients.items():
            pool.set_client_speed(peer, c.compute)
            if self.directory.is_server(peer):
                pool.standing.trust(peer)
        self.dp = DataPath(seg=seg, pool=pool, next_batch=self.reflow_from or 0)

    # what it holds of the batches in flight (datapath.py), read and changed by the rooms mixed in here
    seg = property(lambda self: self.dp.seg)
    pool = property(lambda self: self.dp.pool)
    issued = property(lambda self: self.dp.issued)
    buffers = property(lambda self: self.dp.buffers)
    grad_buffers = property(lambda self: self.dp.grad_buffers)
    ledger = property(lambda self: self.dp.ledger)
    gin_senders = property(lambda self: self.dp.gin_senders)
    gin_orphans = property(lambda self: self.dp.gin_orphans)
    batch_members = property(lambda self: self.dp.batch_members)
    batch_cut = property(lambda self: self.dp.batch_cut)
    forgotten_before = property(lambda self: self.dp.forgotten_before)

    # a request-log replay is under way (recovery.py): the parts check nothing again and log nothing
    replaying = property(lambda self: self.recovery.replaying)

    # where this server stands in the current layout epoch (failover.py's Placement, read-only here)
    layout = property(lambda self: self.placement.layout)
    epoch = property(lambda self: self.placement.epoch)
    epoch_record = property(lambda self: self.placement.record)
    st = property(lambda self: self.placement.st)
    index = property(lambda self: self.placement.index)
    reflow_from = property(lambda self: self.placement.reflow_from)

    @property
    def version(self) -> int:
        """The parameters version every shard hosted here has reached."""
        return min(sh.version for sh in self.hosted.values())

    # the handlers of the parts composed here (the RPC surface finds a method's handler as on_<method>)
    async def rpc_session(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertRequest]:
        """Calls multiplexed over one stream (rpc.py: RpcSurface.rpc_session)."""
        async for message in self.surface.rpc_session(requests, context):
            yield message

    def maybe_step(self) -> None:
        """Step every hosted slot whose batch is whole and whose holds are over (updates.py)."""
        self.updates.maybe_step()

    def maybe_start_batches(self) -> None:
        """Stage 0's frontal server builds the batches whose parameters exist (frontal.py)."""
        self.frontal.maybe_start_batches()

    def handler_of(self, method: str):
        """The `on_<method>` of the part that answers `method` (parts.PART_HANDLERS), or of this server."""
        part = PART_HANDLERS.get(method)
        return getattr(getattr(self, part[0]) if part else self, f"on_{method}")

    def device_of(self, peer: str) -> str | None:
        """The device of a registered client, or of a server of the run."""
        c = self.clients.get(peer)
        return c.device if c is not None else self.directory.device_of(peer)

    def maintenance(self) -> None:
        """Periodic: re-queue expired leases, drop clients that keep letting theirs run out, forget
        silent clients."""
        expired = self.pool.expire(self.clock())
        if expired:  # a lease that ran out its deadline: its client kept it without an answer
            self.counters["leases_expired"] = self.counters.get("leases_expired", 0) + len(expired)
            logger.info(
                "%s: %d lease(s) ran out unanswered (their tasks queued again unless done or backed up): %s",
                self.device_id,
                len(expired),
                " ".join(str(t.task_id) for t in expired[:8]),
            )
            self.registry.drop_struck_clients()
        self.registry.drop_stale_clients()
        self.pins.update_pins()
        self.report_stall(time.time())
        self.rescue.maybe_rescue()
        self.bans.order_pending()
        if self.pins.held_or_waiting or any(shard.ready_to_step() for shard in self.hosted.values()):
            # a step held with every credit already here is looked at again each pass, not only when a
            # push comes: a ban's hold or a check's that ran out, a replica copy that was taken or
            # given up on (no push may be left to come: the next batch needs this step's version)
            self.maybe_step()

    def report_stall(self, now: float) -> str | None:
        """Once per version, when the next batch has not been applied for STALL_REPORT_FACTOR x the
        median of the last steps (at least STALL_REPORT_MIN s): log at INFO what it waits for (the
        micro-batches whose gradients are missing here, and this server's tasks of that batch not
        done yet, with their holders), so that a stall in a long run can be explained from -v logs."""
        if len(self.report.step_times) < 3 or self.version >= self.run.steps or self._stall_reported == self.version:
            return None
        times = sorted(self.report.step_times.values())
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        median = gaps[len(gaps) // 2]
        limit = max(STALL_REPORT_MIN, STALL_REPORT_FACTOR * median)
        waited = now - times[-1]
        if waited < limit:
            return None
        self._stall_reported = self.version
        missing = []
        for slot, shard in sorted(self.hosted.items()):
            bc = shard.batches.get(shard.version)
            done = {} if bc is None else bc.rows_done
            lacking = [
                f"{m}:{shard.rows_per_micro - done.get(m, 0)}"
                for m in range(shard.micro_batches)
                if done.get(m, 0) < shard.rows_per_micro
            ]
            missing.append(f"slot {slot} batch {shard.version} lacks rows of micro-batches {' '.join(lacking) or '-'}")
        held = (
            "; ".join(
                f"{tid} {'queued' if c is None else 'held by ' + c[-8:]} {age:.1f} s"
                for tid, c, age in self.pool.open_tasks(self.version)[:8]
            )
            or "none"
        )
        why = (
            " (steps held)" if self.pins.steps_held() else " (waiting for checks)" if self.pins.check_hold_since else ""
        )
        line = (
            f"no step for {waited:.1f} s (median {median:.2f} s){why}: {'; '.join(missing)}; "
            f"its open tasks here: {held}"
        )
        logger.info("%s: %s", self.device_id, line)
        return line


def _make_rpc(name: str):
    async def rpc(self, requests: AsyncIterator[ExpertRequest], context: P2PContext) -> AsyncIterator[ExpertResponse]:
        async for message in self.surface.serve(name, requests, context):
            yield message

    rpc.__name__ = rpc.__qualname__ = f"rpc_{name}"
    return rpc


# the methods hivemind's servicer finds on the class: each hands its stream to the server's surface
for _name in methods.NAMES:
    setattr(StageServer, f"rpc_{_name}", _make_rpc(_name))
