"""`peer serve`'s flags, and what they resolve to: the model config, the layout, this server's
device id and the run config every server of the run must share (a UsageError naming any flag that
is wrong); `--volunteers-allow`'s file read."""

from __future__ import annotations

import json
import os

from core.layout import DEFAULT_CLIENT_BATCH_TOKENS, DEFAULT_TASK_TOKENS
from core.model.config import PRESETS
from core.protocol.records import DEFAULT_ANNOUNCE_PERIOD, JOINING_PERIOD, STALE_PERIODS
from peer.errors import UsageError, check_new_file_folder
from peer.reference import DEFAULTS as TRAIN_DEFAULTS
from peer.runtime import (
    add_common_arguments,
)


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
    train.add_argument("--lr", type=float, default=TRAIN_DEFAULTS["lr"], help="peak learning rate")
    from core.protocol import recipe as recipe_flags

    recipe_flags.add_arguments(train)
    recipe_flags.add_run_arguments(train)
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
        "--log-dir",
        default=None,
        metavar="DIR",
        help="write a row a step (loss on the last stage, lr, gradient norm, tokens/s, volunteers, tasks, "
        "bans) to DIR/train.csv and TensorBoard event files (docs/training.md)",
    )
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
        "--die-at-version",
        type=int,
        default=None,
        metavar="N",
        help="fault injection for tests (`peer swarm --lose-server`): SIGKILL this server, its DHT process "
        "and p2p daemon once it has applied step N, as a host lost for good",
    )
    net.add_argument(
        "--hold",
        action="store_true",
        help="at the run's last step, keep serving the final state until stopped (by default the server "
        "writes its checkpoint, says the run finished and exits 0)",
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
        "in fp32 plus a micro-batch's activations twice plus 16 MiB, for the run's servers' replicas; a "
        "volunteer's requests: the stage's parameters in fp32 or the activations twice, plus 4 MiB)",
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
    checks.add_argument(
        "--ban-reach",
        type=int,
        default=None,
        metavar="N",
        help="keep each shard's versions on disk up to N versions beyond those in memory (every 8th and "
        "the one before it), so that a ban rolls a liar caught late back that far (default 64: see "
        "docs/trust.md, 'A ban's reach'); 0 keeps memory's only",
    )
    checks.add_argument(
        "--ban-reach-gb",
        type=float,
        default=None,
        metavar="GB",
        help="at most GB of disk for them (default 20; fewer versions where each costs more)",
    )
    add_common_arguments(p)


def resolve(args):
    """Validate the arguments into (model config, layout, device id, run config); UsageError on any problem."""
    from peer.errors import check_identity_path
    from peer.runtime import check_maddrs

    check_identity_path(args.identity_path)
    check_maddrs("--host-maddrs", args.host_maddrs)
    check_maddrs("--announce-maddrs", args.announce_maddrs, need_port=True)
    from core.layout import RunLayout
    from core.model.config import check_micro_batches
    from core.protocol.records import RunConfig
    from peer.hf import init as hf_init

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
    from core.protocol import recipe as recipe_flags

    try:
        recipe = recipe_flags.from_args(args, args.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
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
    from core.protocol.trust import SigningKey

    args.allowed = read_allow_list(args.volunteers_allow) if args.volunteers_allow else None
    from parameter_server.verify import DEFAULT_PROBATION, DEFAULT_VERIFY_RATE

    args.verify_rate = DEFAULT_VERIFY_RATE if args.verify_rate is None else args.verify_rate
    if not 0.0 <= args.verify_rate <= 1.0:
        raise UsageError(f"--verify-rate must be a probability in [0, 1], got {args.verify_rate}")
    if args.die_at_version is not None and not 1 <= args.die_at_version < args.steps:
        raise UsageError(f"--die-at-version must be a step in 1..{args.steps - 1}, got {args.die_at_version}")
    args.probation = DEFAULT_PROBATION if args.probation is None else args.probation
    from parameter_server.old_versions import DEFAULT_BAN_REACH, DEFAULT_BAN_REACH_GB

    args.ban_reach = DEFAULT_BAN_REACH if args.ban_reach is None else args.ban_reach
    args.ban_reach_gb = DEFAULT_BAN_REACH_GB if args.ban_reach_gb is None else args.ban_reach_gb
    if args.ban_reach < 0:
        raise UsageError(f"--ban-reach must be >= 0 versions, got {args.ban_reach}")
    if not args.ban_reach_gb > 0:
        raise UsageError(f"--ban-reach-gb must be a positive number of GB, got {args.ban_reach_gb}")
    if args.probation < 0:
        raise UsageError(f"--probation must be >= 0 contributions, got {args.probation}")
    # a key file that is not there is made in memory now and written once the run admits this server
    # (peer.host.server ServerHost.keep_run_key): a server refused leaves no key file behind
    args.run_key_new = not os.path.exists(args.run_key)
    if args.run_key_new:
        check_new_file_folder("--run-key", args.run_key, "a new run key is written there")
    try:
        if args.run_key_new:
            args.run_key_obj = SigningKey.generate()
        else:
            args.run_key_obj = SigningKey.load(args.run_key)
    except (ValueError, OSError) as e:
        raise UsageError(f"--run-key: {e}") from None
    if args.run_fp is not None and args.run_fp != args.run_key_obj.fingerprint:
        raise UsageError(
            f"--run-key {args.run_key} has fingerprint {args.run_key_obj.fingerprint}, not the "
            f"{args.run_fp} that --run-id names"
        )
    args.run_fp = args.run_key_obj.fingerprint
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
        recipe=recipe.record(),
        precision=args.precision,
        eval_every=args.eval_every,
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
