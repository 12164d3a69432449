"""`peer join`: a volunteer. It finds the run in the DHT, picks a stage (`auto`: measured links and
the planner's rule), registers its compute power with the stage's servers, downloads the stage's
parameters, and pulls tasks until stopped or killed."""
from __future__ import annotations

import asyncio
import logging
import time

from peer.errors import UsageError
from peer.runtime import add_common_arguments, check_common, run_until_signalled

logger = logging.getLogger("hivepipe.join")


def add_arguments(p) -> None:
    p.add_argument("--stage", default="auto",
                   help="'auto' (the stage whose predicted step time improves most with this volunteer, by the "
                        "planner's cost model; re-checked every --rebalance-period) or a stage index")
    p.add_argument("--device-id", default=None, help="this volunteer's id (in --link-profile); default: a fresh one")
    p.add_argument("--probe-bytes", type=int, default=1 << 20, help="payload of the bandwidth probe")
    p.add_argument("--compute", type=float, default=None, help="override the measured compute power (rows/s)")
    p.add_argument("--rebalance-period", type=float, default=60.0,
                   help="with --stage auto: seconds between checks whether another stage needs this volunteer "
                        "more (0: never move)")
    p.add_argument("--die-at", default=None, metavar="POINT",
                   help="fault injection for tests: SIGKILL this volunteer at the first POINT of the protocol "
                        "(before_forward, during_forward, after_outputs, during_backward, after_input_grads, "
                        "mid_grad_push, after_grad_push, pulling_params)")
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
    from peer.worker import KILL_POINTS

    if args.die_at is not None and args.die_at not in KILL_POINTS:
        raise UsageError(f"--die-at {args.die_at!r}: choose from {', '.join(KILL_POINTS)}")
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
    t0 = last = time.monotonic()
    logger.info("waiting for %s", what)
    while not stop.is_set():
        try:
            value = await check()
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


async def probe_stage(links: list, nbytes: int, device: str, repeats: int = 3) -> tuple[list[float], list[float]]:
    """One-way delay (s) and bandwidth (bytes/s) to each server, from real P2P calls: a tiny ping
    gives the round trip, a ping carrying `nbytes` the transfer time."""
    import torch

    payload = torch.zeros(nbytes // 4, dtype=torch.float32)
    delays, bandwidths = [], []
    for link in links:
        small, big = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await link.call("ping", {"device": device}, timeout=30)
            small.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await link.call("ping", {"device": device}, [payload], timeout=60)
            big.append(time.perf_counter() - t0)
        rtt, transfer = min(small), min(big)
        delays.append(rtt / 2)
        bandwidths.append(nbytes / max(transfer - rtt, 1e-6))
    return delays, bandwidths


def stage_bytes(run, cfg) -> int:
    """Bytes a client moves per micro-batch share: activations forward and gradients back."""
    return 2 * (run.batch_size // run.micro_batches) * cfg.seq_len * cfg.hidden * 4


def planner_model(run, cfg):
    """The run as the cost model's model file sees it (fp32 on the wire)."""
    from peer.model.config import planner_model_file
    from scheduler import load_model

    return load_model(planner_model_file(cfg, run.batch_size, run.micro_batches, bytes_per_value=4))


def stages_now(stage_records: list[list[tuple[str, dict]]], layout, cfg, own_peer: str):
    """StageNow per stage from the stage keys' records: each server's and each online volunteer's
    announced compute (rows/s of its slice) as FLOP/s; our own record left out."""
    from peer.model.config import flops_per_token_per_layer
    from scheduler.balance import StageNow

    per_row_layer = cfg.seq_len * flops_per_token_per_layer(cfg)
    out = []
    for st, recs in zip(layout.stages, stage_records):
        n = st.layers[1] - st.layers[0]
        now = StageNow(frontal=list(st.frontal), backward=list(st.backward), layers=tuple(st.layers))
        for peer, rec in recs:
            if peer == own_peer or rec.get("state") != "online":
                continue
            flops = float(rec.get("compute") or 0.0) * per_row_layer * n
            if rec["kind"] == "server":
                if rec["device"] in st.servers:
                    now.server_flops[rec["device"]] = flops
            else:
                now.volunteer_flops.append(flops)
        out.append(now)
    return out


class StagePicker:
    """`--stage auto`: measures this volunteer's links to every stage once, then decides (and
    re-decides) its stage from the DHT records with scheduler.balance."""

    def __init__(self, run, layout, cfg, directory, p2p, links_emulator, peer_id: str, nbytes: int, own_rows_s: float):
        self.run, self.layout, self.cfg = run, layout, cfg
        self.directory, self.p2p, self.links_emulator = directory, p2p, links_emulator
        self.peer_id = peer_id
        self.nbytes = nbytes
        self.model = planner_model(run, cfg)
        from peer.model.config import flops_per_token_per_layer

        # measured on stage 0's slice: as FLOP/s
        self.own_flops = own_rows_s * cfg.seq_len * flops_per_token_per_layer(cfg) * (layout.stages[0].layers[1]
                                                                                     - layout.stages[0].layers[0])
        self.delays: list | None = None
        self.bandwidths: list | None = None

    async def measure(self) -> None:
        from parameter_server.server import StageServer

        delays, bandwidths = [], []
        for st in self.layout.stages:
            links = [self.directory.link(self.p2p, d, StageServer, self.links_emulator) for d in st.servers]
            dl, bw = await probe_stage(links, self.nbytes, self.links_emulator.own or "")
            delays.append(dl)
            bandwidths.append(bw)
            logger.info("stage %d: delays %s ms, bandwidths %s MB/s", st.index, [round(d * 1e3, 1) for d in dl],
                        [round(b / 1e6, 1) for b in bw])
        self.delays, self.bandwidths = delays, bandwidths

    async def decide(self, current: int | None):
        from peer.protocol import records
        from scheduler.balance import choose

        per_stage = []
        for k in range(self.layout.num_stages):
            per_stage.append([(peer, rec) for peer, rec, _ in await records.read_stage(self.directory.dht,
                                                                                      self.run.run_id, k)
                              if rec is not None])
        stages = stages_now(per_stage, self.layout, self.cfg, self.peer_id)
        decision = choose(stages, self.model, self.own_flops, self.delays, self.bandwidths, self.nbytes,
                          current=current)
        computing = [f"{(sum(s.server_flops.values()) + sum(s.volunteer_flops)) / 1e9:.3g}" for s in stages]
        logger.info("stage choice: %s; with this volunteer on each stage: %s; GFLOP/s computing now per stage: %s; "
                    "link scores %s ms", decision.reason,
                    ["%d empty" % p[0] if p[0] else "%.3g s" % p[1] for p in decision.predicted], computing,
                    [round(x * 1e3, 1) for x in decision.link_scores])
        return decision


async def join_main(args, stop: asyncio.Event) -> int:
    import random
    import secrets

    import torch

    from parameter_server.layout import RunLayout
    from parameter_server.server import StageServer
    from peer.errors import NetworkError
    from peer.model.config import get_preset
    from peer.node import Directory, NetworkStartError, start_dht
    from peer.protocol import records
    from peer.protocol.links import LinkEmulator
    from peer.worker import StageWorker

    torch.set_num_threads(1)
    try:  # a volunteer dials out only (client mode): it works behind NAT without opening a port
        dht = start_dht(args.initial_peers, client_mode=True, timeout=args.timeout or 120.0)
    except NetworkStartError as e:
        raise NetworkError(str(e)) from None
    p2p = await dht.replicate_p2p()
    peer_id = str(dht.peer_id)
    device = args.device_id or f"v-{secrets.token_hex(3)}"
    rng = random.Random(peer_id)
    try:
        async def config():
            value = await records.get(dht, records.config_key(args.run_id))
            return None if value is None else records.RunConfig.from_dict(value)

        run = await wait_until(stop, f"run {args.run_id!r} to appear in the DHT (its config record)", config)
        if run is None:
            return 0
        cfg = get_preset(run.model)
        layout = RunLayout.from_dict(run.layout, cfg.layers)
        if args.stage != "auto" and int(args.stage) >= layout.num_stages:
            raise UsageError(f"--stage {args.stage}: the run has {layout.num_stages} stages")
        directory = Directory(dht, run.run_id, layout.num_stages)
        everyone = [d for s in layout.stages for d in s.servers]

        async def all_servers():
            await directory.refresh()
            return True if all(d in directory.servers for d in everyone) else None

        if await wait_until(stop, f"the servers of run {run.run_id} ({' '.join(everyone)}) in the DHT",
                            all_servers) is None:
            return 0
        links_emulator = LinkEmulator.from_file(args.link_profile, device, args.link_scale)
        slowdown = args.slowdown or links_emulator.compute_slowdown()
        picker = None
        if args.stage == "auto":
            probe = StageWorker(run=run, layout=layout, cfg=cfg, stage=0, device_id=device, links={}, compute=1.0,
                                torch_device=args.device, slowdown=slowdown)
            picker = StagePicker(run, layout, cfg, directory, p2p, links_emulator, peer_id,
                                 args.probe_bytes, args.compute or probe.measure_compute())
            del probe

            async def measured():
                await picker.measure()
                return True

            if await wait_until(stop, "link measurements to every server", measured, poll=2.0) is None:
                return 0
            stage = (await picker.decide(None)).stage
        else:
            stage = int(args.stage)
        verb = "joined run"
        done = {"forward": 0, "backward": 0}
        stages_worked: list[int] = []
        while not stop.is_set():
            st = layout.stages[stage]
            links = {d: directory.link(p2p, d, StageServer, links_emulator) for d in st.servers}
            worker = StageWorker(run=run, layout=layout, cfg=cfg, stage=stage, device_id=device, links=links,
                                 compute=1.0, torch_device=args.device, slowdown=slowdown, die_at=args.die_at)
            worker.compute = args.compute or worker.measure_compute()
            stretched = f" (compute stretched x{slowdown:g} by the link profile)" if slowdown > 1 else ""
            print(f"{verb} {run.run_id} as {device} ({peer_id}) on stage {stage}, compute {worker.compute:.3g} rows/s"
                  f"{stretched}", flush=True)
            leave = asyncio.Event()  # set when the run stops us or another stage needs us more
            moving: list[int] = []

            async def relay_stop():
                await stop.wait()
                leave.set()

            async def announce(stage=stage, worker=worker):
                while not leave.is_set():
                    elapsed = max(time.time() - worker.stats["started"], 1e-6)
                    done = worker.stats["forward"] + worker.stats["backward"]
                    rec = {"kind": "client", "device": device, "stage": stage, "state": "online",
                           "compute": float(worker.compute), "tasks_done": done, "throughput": done / elapsed,
                           "time": time.time()}
                    try:
                        await records.store(dht, records.stage_key(run.run_id, stage), rec,
                                            ttl=3 * run.announce_period, subkey=peer_id)
                    except Exception as e:
                        logger.debug("announce failed: %r", e)
                    try:
                        await asyncio.wait_for(leave.wait(), run.announce_period)
                    except asyncio.TimeoutError:
                        pass

            async def offline(stage=stage, worker=worker):
                """Say at once that we left this stage, rather than let the record expire."""
                try:
                    await records.store(dht, records.stage_key(run.run_id, stage),
                                        {"kind": "client", "device": device, "stage": stage, "state": "offline",
                                         "compute": float(worker.compute), "time": time.time()},
                                        ttl=3 * run.announce_period, subkey=peer_id)
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
                        logger.warning("%s: moving from stage %d to stage %d: %s", device, stage, again.stage,
                                       again.reason)
                        moving.append(again.stage)
                        await offline()
                        leave.set()
                        return

            helpers = [asyncio.ensure_future(relay_stop()), asyncio.ensure_future(announce())]
            if picker is not None and args.rebalance_period > 0:
                helpers.append(asyncio.ensure_future(rebalance()))
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
            if not moving:
                break
            stage, verb = moving[0], "moved in run"
        print(f"left run {run.run_id} as {device}: {done['forward']} forward and {done['backward']} backward tasks "
              f"done on stage(s) {' -> '.join(map(str, stages_worked)) or 'none'}", flush=True)
        return 0
    finally:
        dht.shutdown()
