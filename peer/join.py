"""`peer join`: a volunteer. It finds the run in the DHT, picks a stage (`auto`: measured links and
the planner's rule), registers its compute power with the stage's servers, downloads the stage's
parameters, and pulls tasks until stopped or killed."""

from __future__ import annotations

import asyncio
import logging
import time

from peer.errors import UsageError
from peer.runtime import add_common_arguments, check_common, freeze_startup_objects, link_emulator, run_until_signalled

logger = logging.getLogger("hivepipe.join")


def add_arguments(p) -> None:
    p.add_argument(
        "--stage",
        default="auto",
        help="'auto' (the stage whose predicted step time improves most with this volunteer, by the "
        "planner's cost model; re-checked every --rebalance-period) or a stage index",
    )
    p.add_argument("--device-id", default=None, help="this volunteer's id (in --link-profile); default: a fresh one")
    p.add_argument("--probe-bytes", type=int, default=1 << 20, help="payload of the bandwidth probe")
    p.add_argument("--compute", type=float, default=None, help="override the measured compute power (rows/s)")
    p.add_argument(
        "--rebalance-period",
        type=float,
        default=60.0,
        help="with --stage auto: seconds between checks whether another stage needs this volunteer "
        "more (0: never move)",
    )
    p.add_argument(
        "--identity-path",
        default=None,
        metavar="PATH",
        help="keep this volunteer's libp2p key here (made if missing): the same peer id on every start, "
        "for runs that admit only listed volunteers (`peer serve --volunteers-allow`)",
    )
    p.add_argument(
        "--die-at",
        default=None,
        metavar="POINT",
        help="fault injection for tests: SIGKILL this volunteer at the first POINT of the protocol "
        "(before_forward, during_forward, after_outputs, during_backward, after_input_grads, "
        "mid_grad_push, after_grad_push, pulling_params)",
    )
    p.add_argument(
        "--cheat",
        default=None,
        metavar="KIND[@AFTER]",
        help="TEST TOOL, never for real runs: after AFTER honest tasks (default 0) hand in wrong results "
        "(scale: x1e4, signflip, noise: +0.1 x RMS, zeros) to exercise the servers' checks; the "
        "servers ban such a volunteer",
    )
    add_common_arguments(p)


def run(args) -> int:
    check_common(args)
    if args.stage != "auto":
        try:
            stage = int(args.stage)
        except ValueError:
            raise UsageError(f"--stage must be 'auto' or a stage index, got {args.stage!r}") from None
        if stage < 0:
            raise UsageError(f"--stage must be >= 0, got {stage}")
    from peer.volunteer.worker import KILL_POINTS

    if args.die_at is not None and args.die_at not in KILL_POINTS:
        raise UsageError(f"--die-at {args.die_at!r}: choose from {', '.join(KILL_POINTS)}")
    if args.cheat is not None:
        from peer.volunteer.cheat import Cheat

        try:
            args.cheat = Cheat.parse(args.cheat)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.compute is not None and args.compute <= 0:
        raise UsageError("--compute must be positive")
    if args.rebalance_period < 0:
        raise UsageError(f"--rebalance-period must be >= 0 seconds, got {args.rebalance_period}")
    if args.probe_bytes < 4:
        raise UsageError(f"--probe-bytes must be >= 4, got {args.probe_bytes}")
    if not args.initial_peers:
        raise UsageError("--initial-peers is required: the initial_peers= line printed by `peer serve` or `peer swarm`")
    from peer.node import watch_parent

    watch_parent(args.parent_pid)
    return run_until_signalled(lambda stop: join_main(args, stop))


async def wait_until(stop: asyncio.Event, what: str, check, poll: float = 0.5, log_every: float = 60.0):
    """Poll `check()` (a coroutine returning a value, or None to keep waiting) until it gives a value
    or `stop` is set (then None). Says what it waits for once at the start and once a minute; a
    network failure inside `check` is waiting too, never an exit."""
    from peer.protocol.trust import AmbiguousRunKey

    t0 = last = time.monotonic()
    logger.info("waiting for %s", what)
    while not stop.is_set():
        try:
            value = await check()
        except UsageError:
            raise
        except AmbiguousRunKey as e:  # nothing to wait for: the user must say which run
            raise UsageError(str(e)) from None
        except Exception as e:
            logger.debug("while waiting for %s: %r", what, e)
            value = None
        if value is not None:
            return value
        now = time.monotonic()
        if now - last >= log_every:
            logger.warning("still waiting for %s (%.0f s)", what, now - t0)
            last = now
        try:
            await asyncio.wait_for(stop.wait(), poll)
        except asyncio.TimeoutError:
            pass
    return None


async def join_main(args, stop: asyncio.Event) -> int:
    import random
    import secrets

    import torch

    from parameter_server.layout import RunLayout
    from parameter_server.service import StageServer
    from parameter_server.verify import BANNED
    from peer.errors import NetworkError
    from peer.model.config import run_model
    from peer.node import Directory, HaltNotice, NetworkStartError, start_dht, stop_dht
    from peer.protocol import records
    from peer.volunteer.stage_choice import StagePicker
    from peer.volunteer.worker import StageWorker

    torch.set_num_threads(1)
    try:  # a volunteer dials out only (client mode): it works behind NAT without opening a port
        dht = start_dht(
            args.initial_peers,
            run_id=args.run_id,
            run_fp=args.run_fp,
            client_mode=True,
            identity_path=args.identity_path,
            timeout=args.timeout or 120.0,
        )
    except NetworkStartError as e:
        raise NetworkError(str(e)) from None
    p2p = await dht.replicate_p2p()
    peer_id = str(dht.peer_id)
    device = args.device_id or f"v-{secrets.token_hex(3)}"
    rng = random.Random(peer_id)
    try:
        run = await wait_until(
            stop,
            f"run {args.run_id!r} to appear in the DHT (its config record)",
            lambda: records.read_config(dht, args.run_id),
        )
        if run is None:
            return 0
        try:
            cfg = run_model(run.model, run.arch)
        except ValueError as e:
            raise UsageError(f"run {run.run_id!r} names a model this peer cannot build: {e}") from None
        layout = RunLayout.from_dict(run.layout, cfg.layers)
        if args.stage != "auto" and int(args.stage) >= layout.num_stages:
            raise UsageError(f"--stage {args.stage}: the run has {layout.num_stages} stages")
        directory = Directory(dht, run.run_id, layout.num_stages)
        epoch = 0  # the layout epoch of `layout` (the run config carries it after a failover)

        async def all_servers():
            """The run's current layout once all its servers are in the DHT: a failover while we wait
            changes the layout (the config record carries the current epoch's), and a lost server
            never comes back."""
            nonlocal layout, epoch
            value = await records.read_config_value(dht)
            if isinstance(value, dict) and isinstance(value.get("layout"), dict):
                layout = RunLayout.from_dict(value["layout"], cfg.layers)
                # that layout's epoch: a first request of an older one is refused ("stale epoch")
                epoch = value["epoch"] if isinstance(value.get("epoch"), int) and value["epoch"] >= 0 else 0
            await directory.refresh()
            return True if all(d in directory.servers for s in layout.stages for d in s.servers) else None

        if (
            await wait_until(
                stop,
                f"the servers of run {run.run_id} in the DHT "
                f"({' '.join(d for s in layout.stages for d in s.servers)} at the start)",
                all_servers,
            )
            is None
        ):
            return 0
        links_emulator = link_emulator(args, device)
        slowdown = args.slowdown or links_emulator.compute_slowdown()
        picker = None
        if args.stage == "auto":
            probe = StageWorker(
                run=run,
                layout=layout,
                cfg=cfg,
                stage=0,
                device_id=device,
                links={},
                compute=1.0,
                torch_device=args.device,
                slowdown=slowdown,
            )
            picker = StagePicker(
                run,
                layout,
                cfg,
                directory,
                p2p,
                links_emulator,
                peer_id,
                args.probe_bytes,
                args.compute or probe.measure_compute(),
            )
            del probe

            async def measured():
                await picker.measure()
                return True

            if await wait_until(stop, "link measurements to every server", measured, poll=2.0) is None:
                return 0
            decision = await wait_until(stop, "the stage records to choose a stage", lambda: picker.decide(None))
            if decision is None:
                return 0
            stage = decision.stage
        else:
            stage = int(args.stage)
        halt = HaltNotice(device, clear_after=6 * run.announce_period)

        async def look_at_halt():
            try:
                await asyncio.wait_for(directory.refresh(), 10.0)
                halt.update(directory.halted(run.announce_period), max(directory.versions.values(), default=0))
            except Exception as e:
                logger.debug("reading the stage records failed: %r", e)

        async def watch_halt():
            """Say so when the run stops (a server announces that a role lost its last server), a
            minute while it stays stopped, and when it goes on; the directory (and the servers'
            addresses, which a restarted server may have changed) stays fresh meanwhile."""
            while not stop.is_set():
                await look_at_halt()
                try:
                    await asyncio.wait_for(stop.wait(), 2 * run.announce_period)
                except asyncio.TimeoutError:
                    pass

        watcher = asyncio.ensure_future(watch_halt())
        verb = "joined run"
        done = {"forward": 0, "backward": 0, "recompute_avoided": 0}
        banned = None
        stages_worked: list[int] = []
        while not stop.is_set():
            st = layout.stages[stage]
            links = {d: directory.link(p2p, d, StageServer, links_emulator, compress=run.compress) for d in st.servers}
            worker = StageWorker(
                run=run,
                layout=layout,
                cfg=cfg,
                stage=stage,
                device_id=device,
                links=links,
                compute=1.0,
                torch_device=args.device,
                slowdown=slowdown,
                die_at=args.die_at,
                cheat=args.cheat,
                activation_memory=int(args.activation_memory * 2**20),
                epoch=epoch,
            )
            worker.compute = args.compute or worker.measure_compute()
            stretched = f" (compute stretched x{slowdown:g} by the link profile)" if slowdown > 1 else ""
            print(
                f"{verb} {run.run_id} as {device} ({peer_id}) on stage {stage}, compute {worker.compute:.3g} rows/s"
                f"{stretched}",
                flush=True,
            )
            leave = asyncio.Event()  # set when the run stops us or another stage needs us more
            moving: list[int] = []

            async def relay_stop():
                await stop.wait()
                leave.set()

            async def announce(stage=stage, worker=worker):
                while not leave.is_set():
                    elapsed = max(time.time() - worker.stats["started"], 1e-6)
                    tasks = worker.stats["forward"] + worker.stats["backward"]
                    rec = records.record_to_dict(
                        records.ClientRecord(
                            device=device,
                            stage=stage,
                            state="online",
                            compute=float(worker.compute),
                            tasks_done=tasks,
                            throughput=tasks / elapsed,
                            time=time.time(),
                        )
                    )
                    try:
                        await records.publish(dht, rec, ttl=records.record_ttl(run.announce_period), stage=stage)
                    except Exception as e:
                        logger.debug("announce failed: %r", e)
                    try:
                        await asyncio.wait_for(leave.wait(), run.announce_period)
                    except asyncio.TimeoutError:
                        pass

            async def offline(stage=stage, worker=worker):
                """Say at once that we left this stage, rather than let the record expire."""
                try:
                    await records.publish(
                        dht,
                        records.record_to_dict(
                            records.ClientRecord(
                                device=device,
                                stage=stage,
                                state="offline",
                                compute=float(worker.compute),
                                time=time.time(),
                            )
                        ),
                        ttl=records.record_ttl(run.announce_period),
                        stage=stage,
                    )
                except Exception as e:
                    logger.debug("offline announce failed: %r", e)

            async def pause(seconds: float) -> bool:
                """Sleep; True if we are leaving meanwhile."""
                try:
                    await asyncio.wait_for(leave.wait(), seconds)
                    return True
                except asyncio.TimeoutError:
                    return False

            async def rebalance(stage=stage):
                period = args.rebalance_period
                # the first look comes soon: volunteers that joined together saw the same records
                wait = min(period, 3 * run.announce_period + rng.uniform(0.0, 2.0))
                while not await pause(wait):
                    try:
                        decision = await picker.decide(stage)
                        # while some stage has no compute at all, look again within seconds
                        wait = period if decision.stay[0] == 0 else min(period, 5.0)
                        if not decision.moves:
                            continue
                        # a random pause, then the same question on fresh records: two volunteers
                        # that saw the same evidence do not both move
                        if await pause(rng.uniform(0.0, min(period / 2, 10.0))):
                            return
                        again = await picker.decide(stage)
                    except Exception as e:
                        logger.info("stage re-check failed: %r", e)
                        continue
                    if again.moves:
                        logger.warning(
                            "%s: moving from stage %d to stage %d: %s", device, stage, again.stage, again.reason
                        )
                        moving.append(again.stage)
                        await offline()
                        leave.set()
                        return

            helpers = [asyncio.ensure_future(relay_stop()), asyncio.ensure_future(announce())]
            if picker is not None and args.rebalance_period > 0:
                helpers.append(asyncio.ensure_future(rebalance()))
            freeze_startup_objects()
            await worker.run_loop(leave)  # returns once what it holds is finished and its gradients pushed
            for h in helpers:
                h.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if worker.current is not None:  # a clean stop hands its task back at once
                dev, task = worker.current
                try:
                    await links[dev].call("fail", {"task": task}, timeout=5)
                except Exception:
                    pass
            await offline()
            worker.executor.shutdown(wait=False)
            for kind in done:
                done[kind] += worker.stats[kind]
            stages_worked.append(stage)
            if worker.banned is not None:
                banned = worker.banned
                break
            if not moving:
                break
            layout, epoch = worker.layout, worker.epoch  # as its last failover left them
            stage, verb = moving[0], "moved in run"
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        if banned is not None:  # a refusal that will not change: said once, exit 3
            what = "banned from run" if BANNED in banned else "refused by run"
            print(
                f"{what} {run.run_id} as {device} ({peer_id}) after {done['forward']} forward and "
                f"{done['backward']} backward tasks: {banned}",
                flush=True,
            )
            return 3
        if halt.reason is not None:  # the run may have gone on and ended between two looks
            await look_at_halt()
        print(
            f"left run {run.run_id} as {device}: {done['forward']} forward and {done['backward']} backward tasks "
            f"done on stage(s) {' -> '.join(map(str, stages_worked)) or 'none'}",
            flush=True,
        )
        print(
            f"{device}: {done['recompute_avoided']} backward tasks ran on their kept forward pass (no recompute)",
            flush=True,
        )
        return 0
    finally:
        stop_dht(dht)
