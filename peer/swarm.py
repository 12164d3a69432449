"""`peer swarm`: a whole swarm on this machine, as separate processes on 127.0.0.1: a bootstrap DHT
(this process), the reliable servers, the volunteers, optional churn (SIGKILL and replacement). At
the end it writes the summary JSON and the full model assembled from the servers' shards."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time

from core.protocol.records import JOINING_PERIOD
from peer.swarm_flags import add_arguments, validate  # noqa: F401  (the command's flags: peer/cli.py reads them here)

logger = logging.getLogger("hivepipe.swarm")


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
