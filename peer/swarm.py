"""`peer swarm`: a whole swarm on this machine, as separate processes on 127.0.0.1: a bootstrap DHT
(this process), the reliable servers, the volunteers, optional churn (SIGKILL and replacement). At
the end it writes the summary JSON and the full model assembled from the servers' shards."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time

from core.model.config import PRESETS
from core.protocol.records import DEFAULT_ANNOUNCE_PERIOD, JOINING_PERIOD
from peer.errors import UsageError
from peer.reference import DEFAULTS as TRAIN_DEFAULTS

logger = logging.getLogger("hivepipe.swarm")


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


def run(args) -> int:
    cfg, layout, frontal, backward = validate(args)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="hivepipe-swarm-")
    os.makedirs(work_dir, exist_ok=True)
    from peer.runtime import run_until_signalled

    return run_until_signalled(lambda stop: swarm_main(args, cfg, layout, frontal, backward, work_dir, stop))


def summary_line(summary: dict) -> str:
    """The summary in one plain line: steps, loss first -> last, tokens/s, micro-batches applied of
    expected, and who computed the tasks: the volunteers' share and the servers' own workers'."""
    return (
        f"{summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, "
        f"{summary['tokens_per_second']:,.0f} tokens/s, micro-batches {summary['microbatches_applied']}/"
        f"{summary['microbatches_expected']}, tasks computed: {who_computed(summary)}"
    )


def who_computed(summary: dict) -> str:
    """'volunteers 97% (v0 60, v1 58), servers 3% (s0f0 4)': each group's share of the tasks and
    each worker's count (a server's own worker under its server's name)."""
    by_worker = summary.get("tasks_by_worker", {})
    total = sum(by_worker.values())
    if not total:
        return "none"
    servers = set(summary.get("servers", ()))
    parts = []
    for group, names in (
        ("volunteers", [w for w in by_worker if w not in servers]),
        ("servers", [w for w in by_worker if w in servers]),
    ):
        n = sum(by_worker[w] for w in names)
        if n:
            each = ", ".join(f"{w} {by_worker[w]}" for w in sorted(names))
            parts.append(f"{group} {100 * n / total:.0f}% ({each})")
    return ", ".join(parts)


async def wait_for_failovers(monitor, lost: list[str], timeout: float, stop: asyncio.Event) -> None:
    """Wait until no server the launcher lost for good is in the run's current layout (the servers
    fail a lost server over after --failover-after seconds, also once the last step is done), so
    that the final statuses and parameters come from the servers that hold the slots."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        await monitor.refresh()
        waiting = sorted(set(lost) & set(monitor.all_devices()))
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the servers {waiting}, lost for good, were not failed over within {timeout:.0f} s")
        await asyncio.sleep(0.3)


async def swarm_main(args, cfg, layout, frontal, backward, work_dir, stop: asyncio.Event) -> int:
    from tqdm import tqdm

    from peer.addresses import visible_maddrs
    from peer.directory import HaltNotice
    from peer.launcher.churn import Churn
    from peer.launcher.monitor import Monitor
    from peer.launcher.processes import Swarm
    from peer.node import close_replica, start_dht, stop_dht
    from peer.reachability import DialBackService

    t_launch = time.time()
    run_fp = Swarm.run_key(work_dir).fingerprint
    dht = start_dht([], run_id=args.run_id, run_fp=run_fp)  # every process of a local swarm listens on loopback only
    maddrs = visible_maddrs(dht)
    print(f"initial_peers={maddrs[0]}", flush=True)
    print(f"run={args.run_id}@{run_fp}", flush=True)  # what another machine's `peer join --run-id` takes
    swarm = Swarm(args, layout, frontal, backward, maddrs, work_dir)
    churn = Churn(swarm, args.churn, random.Random(args.seed))
    p2p = None
    try:
        p2p = await dht.replicate_p2p()
        await DialBackService().add_p2p_handlers(p2p)  # the first server's reachability check asks us
        swarm.start_servers()
        swarm.start_volunteers()
        monitor = Monitor(dht, p2p, args.run_id, layout, args.batch_size * cfg.seq_len, args.eval_every)
        bar = tqdm(total=args.steps, desc="swarm", unit="step", disable=args.no_progress, file=sys.stderr)
        t_start = None
        step_times: list[float] = []
        last_version, last_change = 0, time.time()
        ended_at = None  # when the last version was reached (losses may still be due then)

        halt = HaltNotice("swarm", clear_after=6 * args.announce_period)
        while not stop.is_set():
            # a server of --lose-server SIGKILLs itself right after its step (peer serve --die-at-version:
            # at that step exactly, however seldom this loop reads the records); the run waits for the
            # others to fail it over
            for name, step in swarm.collect_losses():
                logger.warning("server %s lost for good after step %d (--lose-server)", name, step)
            swarm.check_alive()
            await monitor.refresh()
            halt.update(monitor.halted(), monitor.min_version())
            version = monitor.min_version()
            if t_start is None and monitor.all_online():
                t_start = monitor.online_at()
                last_change = t_start
                if version < args.steps:  # the first step's kills: its length is not known yet
                    churn.steps_began(1, within=args.announce_period)
            if version > last_version:
                now, last_seen = time.time(), last_version
                step_times.append((now - last_change) / (version - last_version))
                last_version, last_change = version, now
                bar.update(version - bar.n)
                loss, held_out = monitor.loss(version - 1), monitor.eval_loss()
                if loss is not None:
                    elapsed = max(now - (t_start or now), 1e-6)
                    shown = {"loss": f"{loss:.3f}"}
                    if held_out is not None:  # --eval-every: the last held-out loss, of its version
                        shown["val"] = f"{held_out[1]:.3f}@{held_out[0]}"
                    bar.set_postfix(shown, tok_s=f"{version * args.batch_size * cfg.seq_len / elapsed:.0f}")
                if version < args.steps:
                    passed = version - last_seen
                    churn.step_ended()
                    # the steps that passed unseen (the DHT records change once per announce period)
                    # and the next one: each its share, within the step expected next
                    churn.steps_began(passed, within=sum(step_times[-3:]) / len(step_times[-3:]))
                else:
                    churn.stop()
            if version >= args.steps:
                if not [x for x in args.losses if x[1] in swarm.servers]:
                    break
                ended_at = ended_at or time.time()
                if time.time() - ended_at > args.failover_after + 120.0:
                    raise RuntimeError(
                        f"the losses {args.losses} could not all happen: the failover of {swarm.lost} did not come"
                    )
            # the servers' records change once per announce period (every JOINING_PERIOD until the run
            # is online): reading the DHT more often only loads every DHT node of the run (at 0.2 s it
            # was a fifth of the DHT processes' work)
            period = args.announce_period if t_start else min(args.announce_period, JOINING_PERIOD)
            await asyncio.sleep(max(0.2, period / 2))
        bar.close()
        if stop.is_set() and last_version < args.steps:
            print("interrupted: stopping the swarm", file=sys.stderr)
            return 130
        # from the servers' own clocks at both ends (the records that showed them are up to an
        # announce period old)
        wall = min(time.time(), monitor.reached.completed().get(args.steps, time.time())) - (t_start or t_launch)
        await wait_for_failovers(monitor, swarm.lost, args.failover_after + 120.0, stop)
        statuses, state = await monitor.final(args.steps)
        summary = monitor.summary(args, cfg, statuses, swarm.killed, wall)
        summary["startup_seconds"] = (t_start or t_launch) - t_launch
        summary["training_started_at"] = t_start or t_launch  # (unix time: what a benchmark lines up with)
        # when the run reached each version, seconds from the start of training (the servers' clocks;
        # an exact run's parameters at version v are the reference's after v steps: its loss curve)
        summary["version_seconds"] = {
            str(v): round(t - (t_start or t_launch), 3) for v, t in monitor.reached.completed().items()
        }
        if args.checkpoint_out:
            from peer.hf.init import model_record
            from peer.reference import save_checkpoint

            save_checkpoint(args.checkpoint_out, state, cfg, model_record(cfg, args.hf_model)["tokenizer"])
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=2)
        print(summary_line(summary), flush=True)  # (the figures themselves: --summary-json)
        if args.hold:
            print("holding the swarm up; Ctrl-C to stop", file=sys.stderr, flush=True)
            await stop.wait()
        return 0
    finally:
        churn.stop()
        try:
            swarm.close()
        finally:
            await close_replica(p2p)
            stop_dht(dht)
            if not args.work_dir:  # (a folder of our own: logs, keys and the servers' checkpoints)
                shutil.rmtree(work_dir, ignore_errors=True)
