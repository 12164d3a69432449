"""`peer serve --reliable`: one parameter server (frontal or backward) of one stage."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import time

from parameter_server.layout import DEFAULT_CLIENT_BATCH_TOKENS, DEFAULT_TASK_TOKENS
from peer.errors import NetworkError, UsageError
from peer.model.config import PRESETS
from peer.protocol.records import DEFAULT_ANNOUNCE_PERIOD, JOINING_PERIOD, STALE_PERIODS
from peer.reference import DEFAULTS as TRAIN_DEFAULTS
from peer.runtime import (
    add_common_arguments,
    check_common,
    freeze_startup_objects,
    link_emulator,
    run_until_signalled,
    trim_heap,
)

logger = logging.getLogger("hivepipe.serve")
# seconds between two reads of the node's connections (departed clients): every pass of the 0.2 s
# maintenance loop (parameter_server.clients.DISCONNECT_GRACE)
CONNECTION_READ_PERIOD = 0.2
HEAP_TRIM_PERIOD = 60.0  # seconds between two returns of the C heap's free pages (peer.runtime.trim_heap)
PROBE_S = 5.0  # seconds a liveness probe of a server that seems lost may take, dial and retries included


def add_arguments(p) -> None:
    p.add_argument("--reliable", action="store_true", required=True, help="this host is a committed server")
    where = p.add_argument_group("which server (either --stage/--role or --plan/--device-id)")
    where.add_argument("--stage", type=int, default=None)
    where.add_argument("--role", choices=["frontal", "backward"], default=None)
    where.add_argument("--index", type=int, default=0, help="index among the stage's servers of that role")
    where.add_argument("--stages", type=int, default=2, help="number of stages (without --plan)")
    where.add_argument("--frontal-per-stage", type=int, default=1)
    where.add_argument("--backward-per-stage", type=int, default=1)
    where.add_argument("--plan", default=None, metavar="PLAN.json", help="a plan from `peer plan`")
    where.add_argument("--device-id", default=None, help="this host's id in --plan")
    train = p.add_argument_group("training (every server of a run must agree)")
    train.add_argument("--model", default=TRAIN_DEFAULTS["model"], help=f"model preset: {', '.join(PRESETS)}")
    train.add_argument("--data", default=None, help="text file or folder (default: the Python standard library)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--steps", type=int, default=50)
    train.add_argument("--batch-size", type=int, default=TRAIN_DEFAULTS["batch_size"])
    train.add_argument("--micro-batches", type=int, default=TRAIN_DEFAULTS["micro_batches"])
    train.add_argument("--lr", type=float, default=TRAIN_DEFAULTS["lr"])
    train.add_argument(
        "--compress",
        default="none",
        choices=["none", "fp16", "bf16", "8bit"],
        help="activations, their gradients and gradient pushes on the wire: none (exact, the default), "
        "fp16, bf16 or 8bit (hivemind's codecs; lossy: the run no longer equals the reference)",
    )
    from peer.hf import init as hf_init

    hf_init.add_arguments(train)
    net = p.add_argument_group("network and process")
    net.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="where to listen (default: every interface, a free port; pin the port, e.g. "
        "/ip4/0.0.0.0/tcp/31337, to open it in a firewall)",
    )
    net.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="the addresses others should dial, e.g. the public address in front of port forwarding "
        "(default: what it listens on); must give a port",
    )
    net.add_argument(
        "--no-reachability-check",
        action="store_true",
        help="skip asking a peer of the run to dial this server back at start",
    )
    net.add_argument("--identity-path", default=None, help="a persistent libp2p key (same peer id after restarts)")
    net.add_argument(
        "--run-key",
        required=True,
        metavar="PATH",
        help="the run's key, shared by its servers: it signs the run's config and server records "
        "(created here if missing: copy it to the run's other servers; or make it with `peer keygen`)",
    )
    net.add_argument("--checkpoint-dir", default=None, help="save the shard here after every step; resume from it")
    net.add_argument(
        "--supervise",
        action="store_true",
        help="run the server in a child process and fork it again, from its checkpoint and under the "
        "same identity, when it crashes (killed by a signal or an error exit): torch and hivemind "
        "stay imported, so a restart takes seconds (needs --checkpoint-dir; the identity defaults "
        "to CHECKPOINT_DIR/DEVICE.identity.key; at most 5 restarts in 10 minutes)",
    )
    net.add_argument(
        "--announce-period",
        type=float,
        default=DEFAULT_ANNOUNCE_PERIOD,
        help=f"seconds between DHT announcements (every {JOINING_PERIOD:g} s until the run is online); a "
        f"server silent for {STALE_PERIODS} periods counts as gone, and is failed over --failover-after "
        "seconds later",
    )
    net.add_argument("--task-timeout", type=float, default=60.0, help="seconds before an unanswered task is re-queued")
    net.add_argument("--client-timeout", type=float, default=5.0, help="seconds of silence before a client is dropped")
    net.add_argument(
        "--failover-after",
        type=float,
        default=30.0,
        help="seconds a server may be missing from the DHT before the others fail it over (0: never)",
    )
    net.add_argument(
        "--volunteers-allow",
        default=None,
        metavar="FILE",
        help="a closed run: admit only the volunteers whose peer ids this file lists (one per line, '#' "
        "comments; a volunteer keeps its peer id with `peer join --identity-path`); default: open",
    )
    net.add_argument(
        "--task-tokens",
        type=int,
        default=DEFAULT_TASK_TOKENS,
        metavar="N",
        help="the fewest tokens a forward task carries: a micro-batch with more clients than such "
        "tasks goes to the clients owed the most rows (default %(default)s)",
    )
    net.add_argument(
        "--client-batch-tokens",
        type=int,
        default=DEFAULT_CLIENT_BATCH_TOKENS,
        metavar="N",
        help="the fewest tokens of a batch a client computes here: a batch goes to as few clients as "
        "give each N (each pulls and pushes the stage's parameters for it), the next batch to the "
        "next ones; 1 spreads every micro-batch over every client (default %(default)s)",
    )
    net.add_argument(
        "--no-local-first",
        action="store_true",
        help="choose a batch's clients by the rows each is owed only; by default a free worker of a "
        "stage server goes first (its parameters are local: it moves a quarter of the bytes)",
    )
    net.add_argument("--no-compute", action="store_true", help="do not run a local worker beside the services")
    net.add_argument(
        "--no-requeue", action="store_true", help="drop a departed client's work (SWARM-like; benchmarks only)"
    )
    net.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        metavar="N",
        help="refuse a request larger than N bytes while it arrives (default: 3x the stage's parameters "
        "in fp32 plus a micro-batch's activations twice plus 16 MiB)",
    )
    checks = p.add_argument_group("checked work (parameter_server/verify.py)")
    checks.add_argument(
        "--verify-rate",
        type=float,
        default=None,
        metavar="P",
        help="after its probation, re-run each volunteer contribution here with probability P "
        "(default 0.1: see README, 'Checked work'); 0 checks probation only",
    )
    checks.add_argument(
        "--probation",
        type=int,
        default=None,
        metavar="N",
        help="re-run every one of a new volunteer's first N contributions here (default 4)",
    )
    add_common_arguments(p)


def resolve(args):
    """Validate the arguments into (model config, layout, device id, run config); UsageError on any problem."""
    from peer.runtime import check_maddrs

    check_maddrs("--host-maddrs", args.host_maddrs)
    check_maddrs("--announce-maddrs", args.announce_maddrs, need_port=True)
    from parameter_server.layout import RunLayout
    from peer.hf import init as hf_init
    from peer.model.config import check_micro_batches
    from peer.protocol.records import RunConfig

    cfg, args.hf_model = hf_init.resolve_model(args)
    try:
        check_micro_batches(args.batch_size, args.micro_batches)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.task_tokens < 1:
        raise UsageError(f"--task-tokens must be >= 1, got {args.task_tokens}")
    if args.client_batch_tokens < 1:
        raise UsageError(f"--client-batch-tokens must be >= 1, got {args.client_batch_tokens}")
    if args.lr <= 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if args.failover_after < 0:
        raise UsageError(f"--failover-after must be >= 0 seconds, got {args.failover_after}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1 << 16:
        raise UsageError(f"--max-request-bytes must be at least 65536, got {args.max_request_bytes}")
    if args.plan:
        if not args.device_id:
            raise UsageError("--plan needs --device-id")
        try:
            with open(args.plan) as f:
                layout = RunLayout.from_dict(json.load(f), cfg.layers)
        except (OSError, json.JSONDecodeError, ValueError) as e:
            raise UsageError(f"--plan {args.plan}: {e}") from None
        device = args.device_id
    else:
        if args.stage is None or args.role is None:
            raise UsageError("give --stage and --role (or --plan and --device-id)")
        try:
            layout = RunLayout.even(args.stages, cfg.layers, args.frontal_per_stage, args.backward_per_stage)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not 0 <= args.stage < args.stages:
            raise UsageError(f"--stage {args.stage} outside 0..{args.stages - 1}")
        st = layout.stages[args.stage]
        names = st.frontal if args.role == "frontal" else st.backward
        if not 0 <= args.index < len(names):
            raise UsageError(f"--index {args.index} outside 0..{len(names) - 1} for role {args.role}")
        device = names[args.index]
    try:
        layout.locate(device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from peer.protocol.trust import SigningKey

    args.allowed = read_allow_list(args.volunteers_allow) if args.volunteers_allow else None
    from parameter_server.verify import DEFAULT_PROBATION, DEFAULT_VERIFY_RATE

    args.verify_rate = DEFAULT_VERIFY_RATE if args.verify_rate is None else args.verify_rate
    if not 0.0 <= args.verify_rate <= 1.0:
        raise UsageError(f"--verify-rate must be a probability in [0, 1], got {args.verify_rate}")
    args.probation = DEFAULT_PROBATION if args.probation is None else args.probation
    if args.probation < 0:
        raise UsageError(f"--probation must be >= 0 contributions, got {args.probation}")
    try:
        args.run_key_obj, created = SigningKey.load_or_create(args.run_key)
    except (ValueError, OSError) as e:
        raise UsageError(f"--run-key: {e}") from None
    if args.run_fp is not None and args.run_fp != args.run_key_obj.fingerprint:
        raise UsageError(
            f"--run-key {args.run_key} has fingerprint {args.run_key_obj.fingerprint}, not the "
            f"{args.run_fp} that --run-id names"
        )
    args.run_fp = args.run_key_obj.fingerprint
    if created:
        logger.warning(
            "made a new run key %s (fingerprint %s): copy it to this run's other servers", args.run_key, args.run_fp
        )
    rows = args.batch_size // args.micro_batches
    for st in layout.stages:
        if max(len(st.frontal), len(st.backward)) > rows:
            raise UsageError(f"stage {st.index} has more servers of one role than the {rows} rows of a micro-batch")
    run = RunConfig(
        run_id=args.run_id,
        model=cfg.name if args.hf_model else args.model,
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        lr=args.lr,
        layout=layout.to_dict(),
        announce_period=args.announce_period,
        arch=cfg.to_dict() if args.hf_model else None,
        compress=args.compress,
    )
    return cfg, layout, device, run


def read_allow_list(path: str) -> frozenset[str]:
    """The peer ids of --volunteers-allow FILE; UsageError naming the file and line of anything else."""
    import multihash  # comes with hivemind
    from hivemind.p2p import PeerID

    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--volunteers-allow {path}: {getattr(e, 'strerror', None) or e}") from None
    allowed = set()
    for i, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            multihash.decode(PeerID.from_base58(text).to_bytes())  # a peer id is a multihash of a public key
        except Exception:
            raise UsageError(f"--volunteers-allow {path}, line {i}: {text[:60]!r} is not a peer id") from None
        allowed.add(text)
    return frozenset(allowed)


def run(args) -> int:
    check_common(args)
    if args.supervise:
        if not args.checkpoint_dir:
            raise UsageError("--supervise restarts a crashed server from its checkpoint: give --checkpoint-dir")
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread behind the corpus's progress bar: the supervisor forks
    cfg, layout, device, run_cfg = resolve(args)
    stage, role, _ = layout.locate(device)
    corpus = None
    # the run's data, read where a batch begins (stage 0's frontal servers: inputs) and where a loss is
    # computed (the last stage's: labels), so that what a loss is computed against never passes
    # through a volunteer
    if role == "frontal" and stage in (0, layout.num_stages - 1):
        from peer.hf.init import load_training_corpus

        corpus = load_training_corpus(args.data, cfg, args.hf_model, progress=args.parent_pid is None)
    from peer.node import watch_parent

    if not args.supervise:
        watch_parent(args.parent_pid)
        return run_until_signalled(lambda stop: serve_main(args, cfg, layout, device, run_cfg, corpus, stop))
    from peer.supervisor import supervise

    if args.identity_path is None:  # a restarted server must come back under the same peer id
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        args.identity_path = os.path.join(args.checkpoint_dir, f"{device}.identity.key")
    preload_server_modules()
    # the host's DHT node (with its p2p daemon) is the supervisor's: it outlives a crashed server
    # process, so a restart starts no node (seconds under load), keeps the peers' connections and
    # the addresses they know, and takes its stream handlers over (peer.node.HeldNode)
    import torch.multiprocessing

    from peer.node import HeldNode, dht_leaves_with, stop_dht

    # hivemind shares its futures' state through torch shared memory, by default (strategy
    # "file_system") through a manager process with one connection per process: a forked child
    # would share the supervisor's (a child SIGKILLed mid-message broke it for every later one), or
    # start its own (0.2 s idle, more under load, and its segments left behind at each SIGKILL).
    # The supervisor and its server processes share by file descriptor: no manager at all.
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    dht = start_server_dht(args, run_cfg, device)
    dht_leaves_with(dht, os.getpid())
    held = HeldNode.of(dht, os.path.join(tempfile.gettempdir(), f"hivepipe-{os.getpid()}-{device[:40]}.sock"))

    def child(supervisor_pid: int, run: int) -> int:
        watch_parent(supervisor_pid)
        args.restarted = run > 0  # the node was checked reachable by the first server process
        try:
            return run_until_signalled(
                lambda stop: serve_main(args, cfg, layout, device, run_cfg, corpus, stop, held=held)
            )
        except (UsageError, NetworkError) as e:
            print(f"peer serve: error: {e}", file=sys.stderr, flush=True)
            return 2

    try:
        return supervise(
            child,
            name=device,
            parent_pid=args.parent_pid,
            needs=lambda: None if dht.is_alive() else "its DHT process is gone",
        )
    finally:
        stop_dht(dht)
        try:
            os.unlink(held.socket_path)
        except OSError:
            pass


def start_server_dht(args, run_cfg, device: str):
    from peer.node import NetworkStartError, start_dht

    t0 = time.perf_counter()
    try:
        dht = start_dht(
            args.initial_peers,
            run_id=run_cfg.run_id,
            run_fp=args.run_fp,
            run_key=args.run_key_obj,
            identity_path=args.identity_path,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            timeout=args.timeout or 60.0,
        )
    except NetworkStartError as e:
        raise NetworkError(str(e)) from None
    logger.info("%s: DHT node and p2p daemon up in %.1f s", device, time.perf_counter() - t0)
    return dht


def preload_server_modules() -> None:
    """Import what serve_main imports, before the supervisor (or the swarm's zygote) forks: a
    restarted child pays for none of it (no thread, no event loop and no CUDA context is started by
    these imports)."""
    import torch

    import parameter_server.checkpoint  # noqa: F401
    import parameter_server.requestlog  # noqa: F401
    import parameter_server.service  # noqa: F401
    import peer.hf.init  # noqa: F401
    import peer.node  # noqa: F401
    import peer.protocol.records  # noqa: F401
    import peer.reachability  # noqa: F401
    import peer.volunteer.worker  # noqa: F401

    # the first optimizer imports torch._dynamo (1.6 s here idle, 7.8 s under a soak's load)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    # what was imported outlives every child forked from here: frozen now, each child's own
    # freeze_startup_objects walks only what that child built (it walked all of it again in each,
    # 326,000 objects, 0.25-0.28 CPU-s a child here), and the children leave those pages unwritten
    freeze_startup_objects()


async def serve_main(args, cfg, layout, device, run_cfg, corpus, stop: asyncio.Event, held=None) -> int:
    """Serve `device` until `stop`: on `held` (a peer.node.HeldNode: a supervisor's), or on a DHT
    node of its own."""
    import torch

    from parameter_server.checkpoint import CheckpointWriter, load_checkpoint
    from parameter_server.layout import halt_reason
    from parameter_server.service import StageServer
    from peer.hf.init import initial_state, write_model_json
    from peer.node import Directory, HaltNotice, LocalLink, announced_maddrs, stop_dht
    from peer.protocol import records
    from peer.protocol.leases import LeaseTickets
    from peer.protocol.wire import MAX_MESSAGE_BYTES, bound_messages
    from peer.reachability import DialBackService
    from peer.volunteer.worker import StageWorker

    torch.set_num_threads(1)
    stage, role, _ = layout.locate(device)
    st = layout.stages[stage]
    owns_dht = held is None  # else the supervisor's, which outlives this process
    if owns_dht:
        dht = start_server_dht(args, run_cfg, device)
        p2p = await dht.replicate_p2p()
        maddrs = announced_maddrs(dht)
    else:
        t0 = time.perf_counter()
        dht, maddrs = held.dht, held.maddrs
        p2p = await held.replicate()
        logger.info("%s: attached to its supervisor's DHT node in %.1f s", device, time.perf_counter() - t0)
    peer_id = str(dht.peer_id)
    # the first line on stdout: what a volunteer (or another server) passes to --initial-peers
    print("initial_peers=" + " ".join(maddrs), flush=True)
    # the second: what a volunteer passes to --run-id, so that it believes only this run's servers
    print(f"run={run_cfg.run_id}@{args.run_fp}", flush=True)
    await DialBackService().add_p2p_handlers(p2p)
    if not args.no_reachability_check and not getattr(args, "restarted", False):
        try:
            await check_own_reachability(dht, p2p, args, run_cfg.run_id, layout.num_stages, maddrs, device)
        except NetworkError:
            if owns_dht:
                stop_dht(dht)
            raise
    t0 = time.perf_counter()
    current = await records.read_config_value(dht)
    logger.info("%s: read the run's config record in %.1f s", device, time.perf_counter() - t0)
    if isinstance(current, dict) and isinstance(current.get("layout"), dict) and current.get("epoch", 0) > 0:
        from parameter_server.layout import RunLayout

        if not any(device in s.servers for s in RunLayout.from_dict(current["layout"], cfg.layers).stages):
            if owns_dht:
                stop_dht(dht)
            raise UsageError(
                f"{device} was failed over (the run is at layout epoch {current['epoch']} without it); "
                "start it under a new device id as a volunteer, or start a new run"
            )
    t0 = time.perf_counter()
    links = link_emulator(args, device)
    slowdown = args.slowdown or links.compute_slowdown()
    link_cache: dict[tuple[str, str], object] = {}
    directory = Directory(dht, run_cfg.run_id, layout.num_stages)

    def connector(dev: str):
        peer = directory.known.get(dev)
        if peer is None:
            return None
        if peer == peer_id:
            return LocalLink(server, peer_id)
        key = (dev, peer)
        if key not in link_cache:
            link_cache[key] = directory.link(p2p, dev, StageServer, links, peer_id=peer, compress=run_cfg.compress)
        return link_cache[key]

    server = StageServer(
        run=run_cfg,
        layout=layout,
        cfg=cfg,
        device_id=device,
        peer_id=peer_id,
        stage_params=initial_state(cfg, *st.layers, run_cfg.seed, args.hf_model),
        corpus=corpus,
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
    writer = None
    if args.checkpoint_dir:
        from parameter_server.requestlog import RequestLog
        from parameter_server.service import RETAIN

        os.makedirs(args.checkpoint_dir, exist_ok=True)
        write_model_json(args.checkpoint_dir, cfg, args.hf_model)  # what `peer export --checkpoint-dirs` reads
        t0 = time.perf_counter()
        resumed = load_checkpoint(server, args.checkpoint_dir)
        request_log, logged = RequestLog.resume(os.path.join(args.checkpoint_dir, f"{device}.requests.log"))
        replayed = await server.recover(logged)
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

        server.on_step.append(persist)
        server.on_adopt.append(lambda record: writer.now())
        server.on_replica.append(writer.replica)
    server.on_step.append(server.note_step)
    worker = None
    # who the run's servers are, before this server answers anyone: a restarted server refused the
    # others' replicas and inputs ("not a server of this run") until its first announcement round
    try:
        server.set_directory(await directory.refresh(), directory.versions, directory.epochs)
    except Exception as e:
        logger.debug("%s: reading the run's servers before serving failed: %r", device, e)
    # no single message is read past the request bound either (wire.py bound_messages)
    bound_messages(min(MAX_MESSAGE_BYTES, server.max_request_bytes))
    await server.add_p2p_handlers(p2p)
    period = run_cfg.announce_period

    def record(state: str) -> dict:
        servers = set(directory.servers.values()) | {peer_id}
        compute = float(worker.compute) if worker is not None else 0.0
        return records.record_to_dict(server.announcement(state, maddrs, compute, servers))

    fenced: list[str] = []  # why this server left the run (failed over while it was away)

    config_sent = {"body": None, "at": float("-inf")}

    async def announce(state: str) -> None:
        # the run config carries the current layout epoch, for volunteers that join after a failover
        # (not from a server the run has failed over: its layout is of an older epoch). It is the
        # same for every server and changes only at a failover: stored when it changes and a third
        # of its life after the last store, not every period (each store is a DHT traversal)
        ttl = records.record_ttl(period)
        if not fenced:
            config = run_cfg.to_dict() | {"layout": server.layout.to_dict(), "epoch": server.epoch}
            if config != config_sent["body"] or time.monotonic() - config_sent["at"] >= ttl / 3:
                if await records.publish(dht, config, ttl=ttl):
                    config_sent.update(body=config, at=time.monotonic())
        await records.publish(dht, record(state), ttl=ttl, stage=stage)

    async def failed_over_meanwhile() -> str | None:
        """Why this server is out of the run, if a later layout epoch leaves it out: the startup
        check above reads the config record once, and the others may fail this server over while it
        resumes (a restart slower than --failover-after)."""
        from parameter_server.layout import RunLayout

        if max(directory.epochs.values(), default=0) <= server.epoch:
            return None
        config = await records.read_config_value(dht)
        if not (
            isinstance(config, dict)
            and isinstance(config.get("epoch"), int)
            and config["epoch"] > server.epoch
            and isinstance(config.get("layout"), dict)
        ):
            return None
        later = RunLayout.from_dict(config["layout"], cfg.layers)
        if any(device in s.servers for s in later.stages):
            return None
        return (
            f"{device} was failed over while it was away (the run is at layout epoch {config['epoch']} without "
            "it); it leaves the run: start it under a new device id as a volunteer, or start a new run"
        )

    missing_since: dict[str, float] = {}
    halt = HaltNotice(device)
    online = asyncio.Event()  # every server of the layout was seen

    async def answers(d: str) -> bool:
        """Whether server `d` answers a ping within PROBE_S, dial and retries included: a host that
        froze or lost its network (its connections hang rather than close) must not hold the
        watcher for a timeout per retry."""
        try:
            await asyncio.wait_for(
                directory.link(p2p, d, StageServer, links, backoff=False).call("ping", {}, timeout=PROBE_S), PROBE_S
            )
            return True
        except Exception:
            return False

    async def watch_for_lost() -> None:
        """Once the run is online: a server of the current layout silent in the DHT (no new record
        for records.stale_after(period)) for --failover-after seconds more (30 s when failover is
        off) is lost. The first remaining server of the run fails it over (the others adopt the new
        layout epoch it sends them); a role's last server cannot be, so every server announces
        that the run is stopped until it comes back."""
        now = time.monotonic()
        current = [d for s in server.layout.stages for d in s.servers]
        for d in current:
            if d == device or directory.silent_for(d) <= records.stale_after(period):
                missing_since.pop(d, None)
            else:
                missing_since.setdefault(d, now)
        after = args.failover_after or 30.0
        lost = sorted(d for d, t0 in missing_since.items() if d in current and now - t0 >= after)
        # silent in the DHT is not enough (a busy DHT node's read can miss records for seconds): it
        # must not answer a direct call either
        # all at once: a DHT read under load can miss several live servers' records, and each probe
        # of a frozen one costs PROBE_S (probed one after the other, a failover took 47 s, not 3)
        for d, up in zip(list(lost), await asyncio.gather(*(answers(d) for d in lost))):
            if up:
                lost.remove(d)
                missing_since.pop(d, None)
        alive = [d for d in current if d not in lost]
        if args.failover_after > 0:
            stranded = server.layout.stranded(lost)
        else:
            stranded = [server.layout.locate(d)[:2] + ((d,),) for d in lost]
        server.halted = halt_reason(stranded, failover=args.failover_after > 0)
        halt.update(server.halted)
        lost = [d for d in lost if not any(d in devs for _, _, devs in stranded)]
        if lost and alive and alive[0] == device:
            try:
                record = await server.fail_over(lost)
                logger.warning(
                    "%s: failed over %s: layout epoch %d from batch %d",
                    device,
                    lost,
                    record["epoch"],
                    record["from_batch"],
                )
            except Exception as e:
                logger.error("%s: cannot fail over %s: %s", device, lost, e)
                for d in lost:  # try again after another --failover-after
                    missing_since[d] = now

    async def announcer():
        state = "joining"
        while not stop.is_set():
            try:
                why = await failed_over_meanwhile()
                if why is not None:
                    logger.error("%s", why)
                    fenced.append(why)
                    stop.set()
                    break
                await announce(state)
                servers = await directory.refresh()
                server.set_directory(servers, directory.versions, directory.epochs)
                # the servers of the current layout epoch (a server restarted after a failover does
                # not wait for the lost one)
                if state == "joining" and all(d in directory.known for s in server.layout.stages for d in s.servers):
                    state = "online"
                    online.set()
                    server.replicate_hosted()  # a server lost before the first step can be failed over
                    await announce(state)  # at once, not a period later: readers date the start by it
            except Exception as e:
                logger.debug("announce failed: %r", e)
            try:  # until it has seen every server, quickly: the run starts once all have
                await asyncio.wait_for(stop.wait(), period if online.is_set() else min(period, JOINING_PERIOD))
            except asyncio.TimeoutError:
                pass

    async def watcher():
        """Losses, once the run is online; apart from the announcer, whose records must not wait
        for the calls of a liveness check or a failover."""
        await online.wait()
        while not stop.is_set():
            try:
                await watch_for_lost()
            except Exception as e:
                logger.info("%s: checking for lost servers failed: %r", device, e)
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass

    async def maintenance():
        next_read = 0.0
        next_trim = time.monotonic() + HEAP_TRIM_PERIOD
        while not stop.is_set():
            if time.monotonic() >= next_trim:
                next_trim = time.monotonic() + HEAP_TRIM_PERIOD
                trim_heap()
            try:
                server.maintenance()
                server.maybe_start_batches()
            except Exception:
                logger.exception("%s: maintenance failed", device)
            if time.monotonic() >= next_read:  # a client whose connection closed has left (SIGKILL closes it)
                next_read = time.monotonic() + CONNECTION_READ_PERIOD
                try:
                    peers = await asyncio.wait_for(p2p.list_peers(), 5.0)
                    server.drop_disconnected_clients({str(info.peer_id) for info in peers})
                except Exception as e:
                    logger.debug("%s: reading the node's connections failed: %r", device, e)
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    def report_crash(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: background task failed", device, exc_info=task.exception())

    async def catch_up_epoch(target: int) -> None:
        """Restarted while the run is at a later layout epoch than the log says (a crash between
        taking a slot over and logging the epoch): take the epoch record from another server of
        it and adopt it (the replicas it needs are on disk)."""
        while not stop.is_set() and server.epoch < target:
            await directory.refresh()
            for d in [d for s_ in server.layout.stages for d in s_.servers if d != device]:
                link = connector(d)
                if link is None:
                    continue
                try:
                    record, _ = await link.call("get_layout", {}, timeout=10.0)
                    if record.get("epoch", 0) > server.epoch:
                        server.adopt(record)
                        logger.warning("%s: caught up with layout epoch %d from %s", device, server.epoch, d)
                        return
                except Exception as e:
                    logger.debug("%s: get_layout from %s: %r", device, d, e)
            await asyncio.sleep(1.0)

    async def announce_now() -> None:
        try:
            await announce("online")
        except Exception as e:
            logger.debug("announce failed: %r", e)

    # the run's last version is announced at once, not up to a period later: `peer swarm` and the
    # dashboard see the run end by it
    server.on_step.append(lambda version: announce_now() if version == run_cfg.steps and online.is_set() else None)
    tasks = [asyncio.ensure_future(announcer()), asyncio.ensure_future(watcher()), asyncio.ensure_future(maintenance())]
    run_epoch = current.get("epoch", 0) if isinstance(current, dict) else 0
    if isinstance(run_epoch, int) and run_epoch > server.epoch:
        try:
            await asyncio.wait_for(catch_up_epoch(run_epoch), 120)
        except asyncio.TimeoutError:
            logger.warning(
                "%s: the run is at layout epoch %d, this server at %d: no server of the run gave its "
                "record within 120 s; going on (its coordinator sends it again)",
                device,
                run_epoch,
                server.epoch,
            )
    if not args.no_compute:
        # after a replayed failover the server is already in a later layout epoch: its worker starts there.
        # A server fenced meanwhile (failed over while it was away) stops waiting at once: it never
        # announces itself, so waiting for every server of its old layout would take the full 120 s
        waiting = asyncio.ensure_future(directory.wait_for(server.st.servers, timeout=120))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        else:
            waiting.result()
    if not args.no_compute and not stop.is_set():
        server.set_directory(directory.servers)
        worker_links = {d: connector(d) for d in server.st.servers}
        worker = StageWorker(
            run=run_cfg,
            layout=server.layout,
            cfg=cfg,
            stage=stage,
            device_id=device,
            links=worker_links,
            compute=1.0,
            torch_device=args.device,
            slowdown=slowdown,
            activation_memory=int(args.activation_memory * 2**20),
        )
        worker.epoch = server.epoch
        worker.compute = worker.measure_compute()
        tasks.append(asyncio.ensure_future(worker.run_loop(stop)))
    for t in tasks:
        t.add_done_callback(report_crash)
    freeze_startup_objects()
    stretched = f", compute stretched x{slowdown:g} by the link profile" if slowdown > 1 and not args.no_compute else ""
    print(
        f"serving {device} (stage {stage} {role}, layers {st.layers[0]}-{st.layers[1]}{stretched}) as {peer_id}",
        flush=True,
    )
    await stop.wait()
    try:
        await asyncio.wait_for(announce("offline"), 5)
    except Exception:
        pass
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if writer is not None:
        writer.close()  # the last step's checkpoint is on disk before the process ends
    if owns_dht:
        stop_dht(dht)
    return 2 if fenced else 0


async def check_own_reachability(dht, p2p, args, run_id: str, num_stages: int, maddrs: list[str], device: str) -> None:
    """Ask a server of the run (for a new run: an initial peer) to dial us back at `maddrs`.
    NetworkError when nobody can; a first server on private addresses only gets one warning."""
    from peer.node import is_public
    from peer.protocol import records
    from peer.reachability import check_reachable, split_peer

    peer_id = str(dht.peer_id)
    private = [m for m in maddrs if not is_public(m)]
    if not args.initial_peers:
        if len(private) == len(maddrs):
            logger.warning(
                "%s announces only private or loopback addresses (%s): hosts outside this network "
                "cannot reach it; pass --announce-maddrs with a public address if they should",
                device,
                " ".join(maddrs),
            )
        return
    servers = []
    for k in range(num_stages):
        for peer, rec, _ in await records.read_stage(dht, run_id, k):
            if rec is not None and rec["kind"] == "server" and peer != peer_id and rec["state"] != "offline":
                servers.append((peer, [m for m in rec["maddrs"] if isinstance(m, str)]))
    initial = [(split_peer(m)[1], [m]) for m in args.initial_peers if split_peer(m)[1] not in (None, peer_id)]
    t0 = time.perf_counter()
    ok, detail = await check_reachable(p2p, maddrs, servers or initial, timeout=30.0)
    advice = (
        "open its TCP port to the internet (firewall, port forwarding), or pass --announce-maddrs with "
        "the public address that forwards to it"
    )
    if ok:
        logger.info(
            "%s: reachable at %s (checked by %s in %.1f s)",
            device,
            " ".join(maddrs),
            detail[-8:],
            time.perf_counter() - t0,
        )
    elif ok is False or servers:
        raise NetworkError(f"no peer of the run could dial this server back at {' '.join(maddrs)} ({detail}): {advice}")
    else:
        logger.warning(
            "%s: could not check that others can dial %s: no initial peer offers the check (%s)",
            device,
            " ".join(maddrs),
            detail,
        )
