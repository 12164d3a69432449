"""The parts a reliable server serves its stage with (a part of peer/host/server.py's ServerHost), built
in order: its emulated links, its view of the run's servers (Directory) and its links to them, the
stage server (from its checkpoint folder and request log when it has them), its worker's measured
compute, its P2P handlers, then the announcer, the failure detector, the maintenance loop and what it
reports. Each part is given what it depends on; the host keeps them (`StageParts`)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from peer.host.announcer import Announcer
from peer.host.failures import PROBE_S, FailureDetector
from peer.host.maintenance import Maintenance
from peer.host.report import RunReport
from peer.runtime import link_emulator

logger = logging.getLogger("hivepipe.serve")


@dataclass
class StageParts:
    links: object  # its emulated links (core.protocol.links.LinkEmulator)
    slowdown: float  # its compute stretched by the link profile (or --slowdown)
    directory: object  # the run's servers as their records say (peer.directory.Directory)
    connector: object  # device -> a link to that server (a LocalLink to itself), or None
    server: object  # parameter_server.service.StageServer
    compute: float  # rows/s of its own worker (0 with --no-compute)
    announcer: Announcer
    halt: object  # peer.directory.HaltNotice
    report: RunReport
    detector: FailureDetector
    maintenance: Maintenance
    writer: object | None  # its checkpoint writer (--checkpoint-dir)
    trainlog: object | None  # its training log (--log-dir)


async def build_parts(host) -> StageParts:
    """The parts of `host` (a ServerHost that has entered its run: its node, peer id and multiaddrs),
    whose own hooks they call: `_die_at` and `_on_step` at each step, `_halt_changed` when the run
    stops or goes on, `_look` and `_remember_peers` after each announcement round."""
    from core.protocol.leases import LeaseTickets
    from core.protocol.wire import MAX_MESSAGE_BYTES, bound_messages
    from parameter_server.service import StageServer
    from peer.directory import Directory, HaltNotice
    from peer.hf.init import initial_state
    from peer.server_links import LocalLink

    args, run_cfg, device = host.options, host.run_cfg, host.device
    t0 = time.perf_counter()
    links = link_emulator(args, device)
    slowdown = args.slowdown or links.compute_slowdown()
    directory = Directory(host.dht, run_cfg.run_id, host.layout.num_stages)
    link_cache: dict[tuple[str, str], object] = {}
    server = None

    def connector(dev: str):
        peer = directory.known.get(dev)
        if peer is None:
            return None
        if peer == host.peer_id:
            return LocalLink(server, host.peer_id)
        key = (dev, peer)
        if key not in link_cache:
            link_cache[key] = directory.link(host.p2p, dev, links, peer_id=peer, compress=run_cfg.compress)
        return link_cache[key]

    st = host.layout.stages[host.stage]
    server = StageServer(
        run=run_cfg,
        layout=host.layout,
        cfg=host.cfg,
        device_id=device,
        peer_id=host.peer_id,
        stage_params=initial_state(host.cfg, *st.layers, run_cfg.seed, args.hf_model),
        corpus=host.corpus,
        links=links,
        task_timeout=args.task_timeout,
        client_timeout=args.client_timeout,
        connector=connector,
        requeue=not args.no_requeue,
        max_request_bytes=args.max_request_bytes,
        volunteers_allow=args.allowed,
        verify_rate=args.verify_rate,
        probation=args.probation,
        verify_device=args.device,
        task_tokens=args.task_tokens,
        client_batch_tokens=args.client_batch_tokens,
        local_first=not args.no_local_first,
        lease_tickets=LeaseTickets.of_run_key(args.run_key_obj),
    )
    logger.info("%s: its stage server built in %.1f s", device, time.perf_counter() - t0)
    keep_old_versions(server, args, device)
    writer = await resume(server, args, host.cfg, device) if args.checkpoint_dir else None
    server.updates.on_step.append(server.report.note_step)
    if args.die_at_version is not None:
        server.updates.on_step.append(host._die_at)
    trainlog = None
    if args.log_dir:
        from peer.host.trainlog import TrainingLog

        trainlog = TrainingLog(args.log_dir, server)
        server.updates.on_step.append(trainlog.on_step)
        server.evaluation.on_eval.append(trainlog.on_eval)
    # who the run's servers are, before this server answers anyone: a restarted server refused the
    # others' replicas and inputs ("not a server of this run") until its first announcement round
    try:
        server.directory.update(await directory.refresh(), directory.versions, directory.epochs)
    except Exception as e:
        logger.debug("%s: reading the run's servers before serving failed: %r", device, e)
    bound_messages(min(MAX_MESSAGE_BYTES, server.surface.max_request_bytes))  # no message read past the bound
    compute = 0.0
    if not args.no_compute:
        # measured before the first record: a record that said "online" with no compute while the
        # worker started made the stage look empty to a volunteer choosing one (`--stage auto`)
        from peer.volunteer.device import measured_compute

        compute = await asyncio.to_thread(
            measured_compute, run_cfg, host.layout, host.cfg, host.stage, args.device, slowdown
        )
    await server.add_p2p_handlers(host.p2p)
    announcer = Announcer(
        host.dht,
        server,
        directory,
        run_cfg,
        host.maddrs,
        host.peer_id,
        device,
        compute=lambda: host.worker.compute if host.worker is not None else compute,
    )
    halt = HaltNotice(device, on_change=host._halt_changed)

    async def answers(d: str) -> bool:
        """Whether server `d` answers a ping within PROBE_S, dial and retries included: a host that
        froze or lost its network (its connections hang rather than close) must not hold the
        watcher for a timeout per retry."""
        link = directory.link(host.p2p, d, links, backoff=False)
        try:
            await asyncio.wait_for(link.call("ping", {}, timeout=PROBE_S), PROBE_S)
            return True
        except Exception:
            return False

    detector = FailureDetector(
        server, directory, device, run_cfg.announce_period, args.failover_after, answers=answers, halt=halt
    )
    # the run's last version is announced at once, not up to a period later: `peer swarm` and the
    # dashboard see the run end by it
    server.updates.on_step.append(host._on_step)
    announcer.says = host.state.line
    announcer.on_refresh.append(host._look)
    announcer.on_refresh.append(host._remember_peers)
    return StageParts(
        links=links,
        slowdown=slowdown,
        directory=directory,
        connector=connector,
        server=server,
        compute=compute,
        announcer=announcer,
        halt=halt,
        report=RunReport(server, directory, run_cfg, host.cfg, device, host.peer_id),
        detector=detector,
        maintenance=Maintenance(server, host.p2p, device),
        writer=writer,
        trainlog=trainlog,
    )


async def resume(server, args, cfg, device: str):
    """`server` from its checkpoint folder and request log (replayed), its checkpoint writer and request
    log hooked to its steps, adopted slots and replicas; returns the writer."""
    from parameter_server.checkpoint import CheckpointWriter, load_checkpoint
    from parameter_server.requestlog import RequestLog
    from parameter_server.service import RETAIN
    from peer.hf.init import write_model_json

    os.makedirs(args.checkpoint_dir, exist_ok=True)
    write_model_json(args.checkpoint_dir, cfg, args.hf_model)  # what `peer export --checkpoint-dirs` reads
    t0 = time.perf_counter()
    resumed = load_checkpoint(server, args.checkpoint_dir)
    request_log, logged = RequestLog.resume(os.path.join(args.checkpoint_dir, f"{device}.requests.log"))
    replayed = await server.recovery.recover(logged)
    del logged
    if resumed or replayed:
        logger.warning(
            "%s resumed from %s at version %d, replayed %d logged requests in %.1f s",
            device,
            args.checkpoint_dir,
            server.version,
            replayed,
            time.perf_counter() - t0,
        )
    server.log = request_log
    writer = CheckpointWriter(server, args.checkpoint_dir)

    def persist(version: int) -> None:  # the log forgets old batches once the checkpoint is on disk
        writer.after_step(lambda: request_log.compact(version - (RETAIN - 1)))

    server.updates.on_step.append(persist)
    server.epochs.on_adopt.append(lambda record: writer.now())
    server.copies.on_replica.append(writer.replica)
    return writer


def keep_old_versions(server, args, device: str) -> None:
    """The versions memory lets go, kept on disk within a ban's reach (parameter_server/old_versions.py):
    beside the checkpoint (a folder of their own), or in a temporary folder removed at the end."""
    from parameter_server.old_versions import STRIDE, OldVersions, disk_bytes, reach_depth

    shard_bytes = sum(p.numel() * p.element_size() for p in server.shard.params.values())
    depth = reach_depth(args.ban_reach, args.ban_reach_gb, shard_bytes)
    if depth < 1:
        return
    folder = os.path.join(args.checkpoint_dir, f"{device}.old-versions") if args.checkpoint_dir else None
    server.use_old_versions(OldVersions(folder, depth))
    logger.info(
        "%s: a ban reaches %d versions back on disk beyond memory's (every %dth with the one before it: "
        "%.1f MB at most, in %s)",
        device,
        depth,
        STRIDE,
        disk_bytes(depth, shard_bytes) / 2**20,
        server.old_versions.directory,
    )
