"""`peer swarm`'s flags, and what they resolve to: the model config, the layout and the servers of
each role (a UsageError naming any flag that is wrong), and `--lose-server`'s schedule."""

from __future__ import annotations

import argparse
import json
import os

from core.model.config import PRESETS
from core.protocol.records import DEFAULT_ANNOUNCE_PERIOD
from peer.errors import UsageError
from peer.reference import DEFAULTS as TRAIN_DEFAULTS


def add_arguments(p) -> None:
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--servers-per-stage", type=int, default=2, help="frontal + backward servers per stage (>= 2)")
    p.add_argument("--volunteers", type=int, default=4)
    p.add_argument("--volunteer-stage", default="spread", help="'spread' (round robin), 'auto' or a stage index")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=TRAIN_DEFAULTS["model"], help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--data", default=None)
    p.add_argument("--batch-size", type=int, default=TRAIN_DEFAULTS["batch_size"])
    p.add_argument("--micro-batches", type=int, default=TRAIN_DEFAULTS["micro_batches"])
    p.add_argument("--lr", type=float, default=TRAIN_DEFAULTS["lr"], help="peak learning rate")
    from core.protocol import recipe as recipe_flags

    recipe_flags.add_arguments(p)
    recipe_flags.add_run_arguments(p)
    p.add_argument("--churn", type=float, default=0.0, help="fraction of volunteers SIGKILLed (and replaced) each step")
    p.add_argument("--no-requeue", action="store_true", help="drop a departed volunteer's work (SWARM-like baseline)")
    p.add_argument(
        "--servers-compute",
        choices=["yes", "no"],
        default="no",
        help="'yes': the servers run a local worker too (on one machine they then take most tasks: a "
        "batch goes to a free server's worker first); by default the volunteers compute, as in a "
        "deployment whose committed hosts keep the parameters",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the volunteers compute (the servers step their shards on the CPU)",
    )
    p.add_argument(
        "--volunteer-slowdown",
        type=float,
        default=None,
        help="stretch the volunteers' compute by this factor (emulates slower devices)",
    )
    p.add_argument(
        "--no-param-deltas",
        action="store_true",
        help="volunteers pull every parameter version whole (peer join --no-param-deltas)",
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="CLUSTER.json",
        help="with --plan: the cluster the plan was made for; also the link profile",
    )
    p.add_argument(
        "--plan",
        default=None,
        metavar="PLAN.json",
        help="lay the swarm out as this plan says: each process takes a device's identity",
    )
    p.add_argument("--link-profile", default=None, metavar="CLUSTER.json")
    p.add_argument("--link-scale", type=float, default=1.0)
    p.add_argument("--run-id", default="swarm")
    p.add_argument(
        "--fork-processes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Linux: fork each server and volunteer from one process that imported torch and hivemind "
        "once, which starts them seconds sooner (the default; elsewhere, or with "
        "--no-fork-processes, each is a new interpreter)",
    )
    p.add_argument(
        "--announce-period",
        type=float,
        default=DEFAULT_ANNOUNCE_PERIOD,
        help="seconds between the peers' DHT announcements (as `peer serve`)",
    )
    p.add_argument("--task-timeout", type=float, default=30.0)
    p.add_argument("--client-timeout", type=float, default=4.0)
    p.add_argument(
        "--failover-after",
        type=float,
        default=10.0,
        help="seconds a server may be silent in the DHT before the others fail it over (0: never)",
    )
    p.add_argument(
        "--lose-server",
        action="append",
        default=[],
        metavar="DEVICE@STEP",
        help="lose server DEVICE for good right after it applies step STEP: it SIGKILLs itself, its DHT "
        "process and p2p daemon (peer serve --die-at-version), and the others fail it over (repeatable)",
    )
    p.add_argument(
        "--compress",
        default="none",
        choices=["none", "fp16", "bf16", "8bit"],
        help="activations, their gradients and gradient pushes on the wire (default none: exact)",
    )
    p.add_argument(
        "--verify-rate",
        type=float,
        default=None,
        metavar="P",
        help="servers re-run each volunteer contribution with probability P after its probation (default 0.1)",
    )
    p.add_argument(
        "--ban-reach",
        type=int,
        default=None,
        metavar="N",
        help="servers keep N versions on disk beyond memory's for a ban's rollback (default 64; 0: memory only)",
    )
    p.add_argument(
        "--probation",
        type=int,
        default=None,
        metavar="N",
        help="servers re-run all of a new volunteer's first N contributions (default 4)",
    )
    p.add_argument(
        "--cheater",
        action="append",
        default=[],
        metavar="KIND[@AFTER][/EVERY]",
        help="TEST TOOL: add a volunteer started with `peer join --cheat KIND[@AFTER][/EVERY]` (repeatable)",
    )
    p.add_argument(
        "--task-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the fewest tokens a forward task carries (peer serve's default when not given)",
    )
    p.add_argument(
        "--client-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the fewest tokens of a batch a client computes at a frontal server (peer serve's default "
        "when not given; 1: every client a share of every micro-batch)",
    )
    p.add_argument(
        "--no-local-first",
        action="store_true",
        help="peer serve --no-local-first on every server: a batch's clients chosen by the rows each "
        "is owed only, volunteers and servers' workers alike",
    )
    p.add_argument("--summary-json", default=None)
    p.add_argument("--checkpoint-out", default=None, help="write model.safetensors here")
    p.add_argument("--work-dir", default=None, help="logs and server checkpoints (default: a temporary folder)")
    p.add_argument("--hold", action="store_true", help="keep the swarm up after the last step until Ctrl-C")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--supervise-servers",
        action="store_true",
        help="start every server with `peer serve --supervise` (a crashed server is forked again from "
        "its checkpoint by a supervisor that keeps torch and hivemind imported)",
    )
    from peer.hf import init as hf_init

    hf_init.add_arguments(p.add_argument_group("starting from a Transformers model"))


def validate(args):
    from core.layout import RunLayout
    from core.model.config import check_micro_batches
    from peer.hf import init as hf_init

    cfg, args.hf_model = hf_init.resolve_model(args)
    try:
        check_micro_batches(args.batch_size, args.micro_batches)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.servers_per_stage < 2:
        raise UsageError("--servers-per-stage must be >= 2 (one frontal and one backward server)")
    if args.volunteers < 0 or args.steps < 1:
        raise UsageError("--volunteers must be >= 0 and --steps >= 1")
    from core.protocol import recipe as recipe_flags

    try:
        args.recipe = recipe_flags.from_args(args, args.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for flag in ("task_tokens", "client_batch_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    from core.protocol.runid import split_run_id

    try:
        if split_run_id(args.run_id)[1] is not None:
            raise ValueError("a local swarm makes its own run key: give the name alone")
    except ValueError as e:
        raise UsageError(f"--run-id: {e}") from None
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device (the volunteers would fail at their start)")
    if args.ban_reach is not None and args.ban_reach < 0:
        raise UsageError(f"--ban-reach must be >= 0 versions, got {args.ban_reach}")
    if args.volunteer_slowdown is not None and args.volunteer_slowdown < 1:
        raise UsageError("--volunteer-slowdown must be >= 1")
    if not 0 <= args.churn <= 1:
        raise UsageError(f"--churn is a fraction in [0, 1], got {args.churn}")
    frontal = (args.servers_per_stage + 1) // 2
    backward = args.servers_per_stage // 2
    if bool(args.plan) != bool(args.cluster):
        raise UsageError("--plan and --cluster go together")
    try:
        if args.plan:
            with open(args.plan) as f:
                layout = RunLayout.from_dict(json.load(f), cfg.layers)
            args.link_profile = args.link_profile or args.cluster
            args.stages = layout.num_stages
            args.volunteers = sum(len(st.clients) for st in layout.stages)
        else:
            layout = RunLayout.even(args.stages, cfg.layers, frontal, backward)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--plan {args.plan}: {e}") from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    frontal = max(len(st.frontal) for st in layout.stages)
    backward = max(len(st.backward) for st in layout.stages)
    n = layout.num_stages
    if args.servers_compute == "no" and args.volunteers < n:
        raise UsageError(
            f"--volunteers {args.volunteers} for {n} stages with servers that do not compute: a stage "
            f"without a volunteer has no one to run its tasks (give --volunteers {n} or more, or "
            "--servers-compute yes)"
        )
    if args.servers_compute == "no" and n > 1 and args.volunteer_stage not in ("spread", "auto"):
        raise UsageError(
            f"--volunteer-stage {args.volunteer_stage} puts every volunteer on one stage, and the servers "
            "do not compute: the other stages would have no one to run their tasks (give 'spread', "
            "'auto', or --servers-compute yes)"
        )
    if args.link_profile:
        from scheduler import PlanInputError, load_cluster

        try:
            cluster = load_cluster(args.link_profile)
        except (OSError, PlanInputError) as e:
            raise UsageError(f"{args.link_profile}: {e}") from None
        known = set(cluster.reliable_ids)
        missing = [d for st in layout.stages for d in st.servers if d not in known]
        if args.plan and missing:
            raise UsageError(f"the plan's servers {missing} are not reliable devices of {args.link_profile}")
    if max(frontal, backward) > args.batch_size // args.micro_batches:
        raise UsageError("more servers of one role than rows in a micro-batch")
    if args.volunteer_stage not in ("spread", "auto"):
        try:
            if not 0 <= int(args.volunteer_stage) < args.stages:
                raise ValueError
        except ValueError:
            raise UsageError(f"--volunteer-stage must be spread, auto or 0..{args.stages - 1}") from None
    if args.data is not None or args.hf_model is not None:
        # checked here, before any process starts (with a tokenizer, this fills the token cache the
        # batch-building server then reads)
        hf_init.load_training_corpus(args.data, cfg, args.hf_model, progress=not args.no_progress)
    if args.failover_after < 0:
        raise UsageError(f"--failover-after must be >= 0 seconds, got {args.failover_after}")
    args.losses = parse_lose_server(args.lose_server, layout, args.steps)
    if args.losses and args.failover_after <= 0:
        raise UsageError("--lose-server needs --failover-after > 0: without failover the run would stop")
    if args.losses and getattr(args, "supervise_servers", False):
        raise UsageError("--lose-server with --supervise-servers: a supervisor would fork the lost server again")
    if args.summary_json and os.path.dirname(os.path.abspath(args.summary_json)):
        os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
    return cfg, layout, frontal, backward


def parse_lose_server(values: list[str], layout, steps: int) -> list[tuple[int, str]]:
    """--lose-server DEVICE@STEP values -> sorted (step, device); UsageError naming what is wrong."""
    out = []
    for v in values:
        device, _, at = v.partition("@")
        try:
            step = int(at)
        except ValueError:
            raise UsageError(f"--lose-server {v!r}: expected DEVICE@STEP") from None
        try:
            stage, role, _ = layout.locate(device)
        except ValueError:
            raise UsageError(f"--lose-server {v!r}: {device!r} is not a server of the layout") from None
        if not 1 <= step < steps:
            raise UsageError(f"--lose-server {v!r}: STEP must be in 1..{steps - 1}")
        st = layout.stages[stage]
        if len(st.frontal if role == "frontal" else st.backward) < 2:
            raise UsageError(f"--lose-server {v!r}: stage {stage} has no other {role} server to fail over to")
        out.append((step, device))
    if len({d for _, d in out}) != len(out):
        raise UsageError("--lose-server names a server twice")
    return sorted(out)
