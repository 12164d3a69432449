"""The parts of a StageServer that carry its data path and answer its calls, built after the others
(parameter_server/parts.py calls this): the two roles' data path (frontal.py, backward.py), the
versions, credits and steps (updates.py), the layout epochs (failover.py), the calls in (rpc.py), the
request log's replay (recovery.py) and the re-queueing of work whose results never came (rescue.py).
Each is given what it reads of the server, as in parts.py."""

from __future__ import annotations

from typing import Callable

from parameter_server.backward import Backward
from parameter_server.budget import RequestBudget, client_request_bytes
from parameter_server.failover import Failover
from parameter_server.frontal import Frontal
from parameter_server.recovery import Recovery
from parameter_server.rescue import Rescue
from parameter_server.rpc import RpcSurface
from parameter_server.updates import Updates


def compose_data_parts(
    server,
    run,
    cfg,
    place,
    *,
    layout: Callable[[], object],
    epoch: Callable[[], int],
    replaying: Callable[[], bool],
    max_request_bytes: int,
    min_task_rows: int,
    min_client_rows: int,
    local_first: bool,
) -> None:
    """Give `server` (its other parts built: parts.py) its `frontal`, `updates`, `backward`, `epochs`,
    `surface`, `recovery` and `rescue`."""
    client_bytes = min(max_request_bytes, client_request_bytes(server.stage_params, server.rows, cfg))
    server.frontal = Frontal(
        place=place,
        peer_id=server.peer_id,
        steps=run.steps,
        micro_batches=run.micro_batches,
        seed=run.seed,
        batch_size=run.batch_size,
        rows=server.rows,
        seq=cfg.seq_len,
        corpus=server.corpus,
        min_task_rows=min_task_rows,
        min_client_rows=min_client_rows,
        local_first=local_first,
        clients=server.clients,
        registry=server.registry,
        checks=server.checks,
        arrivals=server.arrivals,
        leases=server.leases,
        directory=server.directory,
        outbox=server.outbox,
        counters=server.counters,
        dp=lambda: server.dp,
        layout=layout,
        version=lambda: server.version,
        replaying=replaying,
    )
    server.updates = Updates(
        place=place,
        peer_id=server.peer_id,
        slot=server.slot,
        micro_batches=run.micro_batches,
        precision=run.precision,
        rows=server.rows,
        hosted=server.hosted,
        registry=server.registry,
        checks=server.checks,
        directory=server.directory,
        arrivals=server.arrivals,
        pins=server.pins,
        clipping=server.clipping,
        copies=server.copies,
        frontal=server.frontal,
        outbox=server.outbox,
        deltas=lambda: server.deltas,
        dp=lambda: server.dp,
        stage_servers=lambda: server.st,
        epoch=epoch,
        version=lambda: server.version,
        replaying=replaying,
        check_push=lambda sender, t, *work: server.check_later(t, server.check_push, sender, t, *work),
        back_input_grads=lambda sender, t, pieces: server.back_input_grads(sender, t, pieces),
    )
    server.backward = Backward(
        place=place,
        rows=server.rows,
        registry=server.registry,
        checks=server.checks,
        arrivals=server.arrivals,
        leases=server.leases,
        outbox=server.outbox,
        counters=server.counters,
        dp=lambda: server.dp,
        layout=layout,
        replaying=replaying,
        check_outputs=lambda sender, t, *work: server.check_later(t, server.check_outputs, sender, t, *work),
    )
    server.epochs = Failover(
        device_id=server.device_id,
        peer_id=server.peer_id,
        stage=server.stage,
        role=server.role,
        steps=run.steps,
        layers=cfg.layers,
        placement=server.placement,
        hosted=server.hosted,
        replicas=server.replicas,
        clipping=server.clipping,
        evaluation=server.evaluation,
        bans=server.bans,
        pins=server.pins,
        directory=server.directory,
        copies=server.copies,
        report=server.report,
        old_versions=lambda: server.old_versions,
        connector=lambda: server.connector,
        replaying=replaying,
        log=lambda: server.log,
        reset_datapath=server.reset_datapath,
        forget_checks=server.forget_checks,
        wake_waiters=server.updates.wake_waiters,
        start_batches=server.frontal.maybe_start_batches,
    )
    server.surface = RpcSurface(
        device_id=server.device_id,
        compress=server.compress,
        links=server.links,
        # a peer that is not one of the run's servers sends no replica: its requests are bounded by the
        # largest a volunteer sends, and so is its share of the budget of unanswered requests' bytes,
        # per volunteer and in all (budget.py)
        request_budget=RequestBudget.for_requests(client_bytes, max_request_bytes),
        max_request_bytes=max_request_bytes,
        max_client_request_bytes=client_bytes,
        counters=server.counters,
        directory=server.directory,
        checks=server.checks,
        arrivals=server.arrivals,
        handler_of=server.handler_of,
        device_of=server.device_of,
        log=lambda: server.log,
        replaying=replaying,
    )
    server.recovery = Recovery(
        place=place,
        micro_batches=run.micro_batches,
        surface=server.surface,
        frontal=server.frontal,
        backward=server.backward,
        dp=lambda: server.dp,
        version=lambda: server.version,
        maybe_step=lambda: server.maybe_step(),
    )
    server.rescue = Rescue(
        place=place,
        rows=server.rows,
        micro_batches=run.micro_batches,
        steps=run.steps,
        stage_servers=lambda: server.st,
        shards=lambda: server.hosted,
        dp=lambda: server.dp,
        version=lambda: server.version,
        epoch=epoch,
        replaying=replaying,
        steps_held=server.pins.steps_held,
        step_times=server.report.step_times,
        outbox=server.outbox,
        call=server.server_call,
        server_sender=server.checks.server_of,
        signal_tasks=server.leases.signal_tasks,
        counters=server.counters,
    )
