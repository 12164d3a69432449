"""The parts a StageServer is composed of, each built here (and in compose_data.py) with what it
reads of its server, as the server is at each call (a failover changes its layout, epoch, hosted
slots and replicas; a layout epoch makes its DataPath anew), rather than sharing the server's
attributes: the directory of the run's servers (directory.py), the checks every handler shares
(checks.py), the client registry (clients.py), what volunteers sent (arrivals.py), the outbox
(outbox.py), the gradient-norm round (clipping.py), the held-out evaluation (evaluate.py), the holds
and pins (pins.py), the bans (bans.py), take/complete/fail (leases.py), the versions sent as
differences (param_deltas.py), the status (status.py) and the replicas (replicas.py); then
compose_data.py's. A call's handler is `on_<method>` of the part PART_HANDLERS names, or of the
server."""

from __future__ import annotations

from parameter_server.arrivals import Arrivals
from parameter_server.backward import Backward
from parameter_server.bans import Bans
from parameter_server.checks import Checks
from parameter_server.clients import Clients
from parameter_server.clipping import Clipping
from parameter_server.compose_data import compose_data_parts
from parameter_server.directory import Directory
from parameter_server.evaluate import Evaluation
from parameter_server.failover import Failover
from parameter_server.frontal import Frontal
from parameter_server.leases import Leases
from parameter_server.outbox import Outbox
from parameter_server.param_deltas import ParamDeltas
from parameter_server.pins import Pins
from parameter_server.place import ServerPlace
from parameter_server.replicas import Replicas
from parameter_server.rescue import Rescue
from parameter_server.status import SEEN_VOLUNTEERS, Status
from parameter_server.updates import Updates

# method -> (the attribute of the part that answers it on a server, the part's class): the RPC surface
# finds a method's handler as on_<method> of the server or of the part named here
PART_HANDLERS: dict[str, tuple[str, type]] = {
    "grad_norm": ("clipping", Clipping),
    "eval_forward": ("evaluation", Evaluation),
    "pin": ("pins", Pins),
    "ban": ("bans", Bans),
    "report_cheat": ("bans", Bans),
    "requeue_missing": ("rescue", Rescue),
    "register": ("registry", Clients),
    "take": ("leases", Leases),
    "complete": ("leases", Leases),
    "fail": ("leases", Leases),
    "push_replica": ("copies", Replicas),
    "push_inputs": ("frontal", Frontal),
    "get_inputs": ("frontal", Frontal),
    "push_input_grads": ("frontal", Frontal),
    "get_params": ("updates", Updates),
    "push_grads": ("updates", Updates),
    "push_outputs": ("backward", Backward),
    "push_output_grads": ("backward", Backward),
    "get_layout": ("epochs", Failover),
    "adopt_epoch": ("epochs", Failover),
    "ping": ("report", Status),
    "status": ("report", Status),
}


def compose_parts(
    server,
    run,
    cfg,
    *,
    verify_rate: float,
    probation: int,
    client_timeout: float,
    volunteers_allow: frozenset[str] | None,
    max_request_bytes: int,
    min_task_rows: int,
    min_client_rows: int,
    local_first: bool,
) -> None:
    """Give `server` (a StageServer being built, its checks' secret drawn) its `directory`, `checks`,
    `registry` (its clients), `arrivals`, `outbox`, `clipping`, `evaluation`, `pins`, `bans`, `leases`,
    `deltas`, `report` (its status) and `copies` (its replicas), then compose_data.py's; the server that
    starts each evaluation gets the evaluation's step callback."""

    place = ServerPlace(server.device_id, server.stage, server.role, server.index, server.last)

    def connector(device: str):
        return server.connector(device) if server.connector else None

    def layout():
        return server.layout

    def epoch() -> int:
        return server.epoch

    def replaying() -> bool:
        return server.recovery.replaying

    server.directory = Directory(
        device_id=server.device_id,
        peer_id=server.peer_id,
        layout=layout,
        epoch=epoch,
        version=lambda: server.version,
        replaying=replaying,
    )
    server.checks = Checks(
        stage=server.stage,
        rows=server.rows,
        steps=run.steps,
        micro_batches=run.micro_batches,
        seq=cfg.seq_len,
        hidden=cfg.hidden,
        vocab=cfg.vocab_size,
        lease_tickets=server.lease_tickets,
        directory=server.directory,
        layout=layout,
        epoch=epoch,
        version=lambda: server.version,
        segment=lambda: server.seg,
        reflow_from=lambda: server.reflow_from,
        replaying=replaying,
    )
    server.registry = Clients(
        device_id=server.device_id,
        peer_id=server.peer_id,
        stage=server.stage,
        rows=server.rows,
        micro_batches=run.micro_batches,
        clock=lambda: server.clock(),  # (a test may set the server's clock after it is built)
        client_timeout=client_timeout,
        volunteers_allow=volunteers_allow,  # peer ids a closed run admits (None: open to anyone)
        requeue=server.requeue,
        lease_tickets=server.lease_tickets,
        directory=server.directory,
        counters=server.counters,
        pool=lambda: server.pool,
        version=lambda: server.version,
        epoch=epoch,
        replaying=replaying,
        run_over=lambda: server.run_over,
        complete_carried=lambda ids, sender: server.leases.complete_carried(ids, sender),
        seen=SEEN_VOLUNTEERS,
        clients=server.clients,
    )
    banned: dict[str, str] = {}  # peer id -> why: made by `bans`, read by `arrivals`
    server.arrivals = Arrivals(
        verify_rate=verify_rate,
        probation=probation,
        rng=server.verify_rng,
        drift=server.drift,
        counts=server.verify_counts,
        banned=banned,
        clients=server.clients,
        is_server=server.directory.is_server,
        replaying=replaying,
        kept_from=lambda: server.version - server.shard.reach(),
    )
    server.outbox = Outbox(server.device_id, layout=layout, epoch=epoch, connector=connector)
    server.clipping = Clipping(
        run.training_recipe().clip_grad_norm,
        device_id=server.device_id,
        stage=server.stage,
        steps=run.steps,
        layout=layout,
        epoch=epoch,
        replaying=replaying,
        hosted=lambda: server.hosted,
        replicas=lambda: server.replicas,
        outbox=server.outbox,
        call=server.server_call,
        on_news=server.maybe_step,
    )
    server.evaluation = Evaluation(
        run.eval_every,
        place=place,
        run=run,
        cfg=cfg,
        corpus=server.corpus,
        seq=server.seq,
        epoch=epoch,
        layout=layout,
        version=lambda: server.version,
        step_event=lambda: server.updates.step_event,
        replaying=replaying,
        recompute=server.recompute,
        device=server.verify_device,
        connector=connector,
        outbox=server.outbox,
    )
    server.pins = Pins(
        device_id=server.device_id,
        peer_id=server.peer_id,
        clock=lambda: server.clock(),  # (a test may set the server's clock after it is built)
        layout=layout,
        shards=lambda: [*server.hosted.values(), *server.replicas.values()],
        checks_pending=lambda: server.checks_pending,
        unsettled=server.arrivals.unsettled_first,
        counts=server.verify_counts,
        call=server.server_call,
        outbox=server.outbox,
        steps=run.steps,
    )
    server.bans = Bans(
        device_id=server.device_id,
        banned=banned,
        clients=server.clients,
        pool=lambda: server.pool,
        counts=server.verify_counts,
        arrivals=server.arrivals,
        pins=server.pins,
        outbox=server.outbox,
        call=server.server_call,
        layout=layout,
        epoch=epoch,
        epoch_record=lambda: server.epoch_record,
        shards=lambda: list(server.hosted.values()),
        replaying=replaying,
        is_server=server.directory.is_server,
        steps=run.steps,
        send_epoch=lambda record, devices: server.epochs.send_epoch(record, devices),
        adopt=lambda record: server.epochs.adopt(record),
    )
    server.leases = Leases(
        device_id=server.device_id,
        peer_id=server.peer_id,
        stage=server.stage,
        last=server.last,
        micro_batches=run.micro_batches,
        clock=lambda: server.clock(),
        lease_tickets=server.lease_tickets,
        registry=server.registry,
        bans=server.bans,
        directory=server.directory,
        checks=server.checks,
        contributions=server.contributions,
        counters=server.counters,
        tasks_by_device=server.tasks_by_device,
        epoch=epoch,
        version=lambda: server.version,
        dp=lambda: server.dp,
        log=lambda: server.log,
        replaying=replaying,
    )
    server.deltas = ParamDeltas(lambda shard, version, snap: server.updates.params_on_wire(shard, version, snap))
    server.report = Status(
        place=place,
        links=server.links,
        clients=server.clients,
        shard=server.shard,
        stage_layers=lambda: server.st.layers,
        pool=lambda: server.pool,
        hosted=lambda: server.hosted,
        replicas=lambda: server.replicas,
        version=lambda: server.version,
        epoch=epoch,
        halted=lambda: server.halted,
        evaluation=server.evaluation,
        clipping=server.clipping,
        deltas=server.deltas,
        arrivals=server.arrivals,
        bans=server.bans,
        counters=server.counters,
        check_counts=server.verify_counts,
        tasks_by_device=server.tasks_by_device,
    )
    server.copies = Replicas(
        device_id=server.device_id,
        stage=server.stage,
        compress=server.compress,
        slots=len(server.slot_names),
        new_shard=server.new_shard,
        replicas=server.replicas,
        outbox=server.outbox,
        directory=server.directory,
        checks=server.checks,
        counters=server.counters,
        stage_servers=lambda: server.st,
        hosted=lambda: server.hosted,
        epoch=epoch,
        replaying=replaying,
        connector=lambda: server.connector,
        maybe_step=lambda: server.maybe_step(),
    )
    compose_data_parts(
        server,
        run,
        cfg,
        place,
        layout=layout,
        epoch=epoch,
        replaying=replaying,
        max_request_bytes=max_request_bytes,
        min_task_rows=min_task_rows,
        min_client_rows=min_client_rows,
        local_first=local_first,
    )
    if server.evaluation.starts:
        server.updates.on_step.append(server.evaluation.maybe_evaluate)
