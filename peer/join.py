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
    p.add_argument("--stage", default="auto", help="'auto' (measure links, pick by the planner's rule) or a stage index")
    p.add_argument("--device-id", default=None, help="this volunteer's id (in --link-profile); default: a fresh one")
    p.add_argument("--probe-bytes", type=int, default=1 << 20, help="payload of the bandwidth probe")
    p.add_argument("--compute", type=float, default=None, help="override the measured compute power (rows/s)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the run to appear")
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
    if not args.initial_peers:
        raise UsageError("--initial-peers is required: the multiaddr printed by `peer swarm` or a server")
    from peer.node import watch_parent

    watch_parent(args.parent_pid)
    return run_until_signalled(lambda stop: join_main(args, stop))


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


async def choose_stage(run, layout, cfg, directory, p2p, links_emulator, nbytes: int) -> tuple[int, list]:
    from parameter_server.server import StageServer
    from peer.node import P2PLink
    from scheduler import choose_stage_for_volunteer

    delays, bandwidths = [], []
    for st in layout.stages:
        links = [P2PLink(p2p, directory.servers[d], d, StageServer, links_emulator) for d in st.servers]
        dl, bw = await probe_stage(links, nbytes, links_emulator.own or "")
        delays.append(dl)
        bandwidths.append(bw)
    # bytes a client moves per micro-batch share: activations forward and gradients back
    t_bytes = 2 * (run.batch_size // run.micro_batches) * cfg.seq_len * cfg.hidden * 4
    return choose_stage_for_volunteer(delays, bandwidths, t_bytes), list(zip(delays, bandwidths))


async def join_main(args, stop: asyncio.Event) -> int:
    import secrets

    import torch

    from parameter_server.layout import RunLayout
    from parameter_server.server import StageServer
    from peer.model.config import get_preset
    from peer.node import Directory, P2PLink, start_dht
    from peer.protocol import records
    from peer.protocol.links import LinkEmulator
    from peer.worker import StageWorker

    torch.set_num_threads(1)
    dht = start_dht(args.initial_peers, client_mode=True)
    p2p = await dht.replicate_p2p()
    peer_id = str(dht.peer_id)
    device = args.device_id or f"v-{secrets.token_hex(3)}"
    try:
        run = await records.read_config(dht, args.run_id, timeout=args.timeout)
        cfg = get_preset(run.model)
        layout = RunLayout.from_dict(run.layout, cfg.layers)
        directory = Directory(dht, run.run_id, layout.num_stages)
        await directory.wait_for([d for s in layout.stages for d in s.servers], timeout=args.timeout)
        links_emulator = LinkEmulator.from_file(args.link_profile, device, args.link_scale)
        if args.stage == "auto":
            stage, measured = await choose_stage(run, layout, cfg, directory, p2p, links_emulator, args.probe_bytes)
            for k, (dl, bw) in enumerate(measured):
                logger.info("stage %d: delays %s ms, bandwidths %s MB/s", k, [round(d * 1e3, 1) for d in dl],
                            [round(b / 1e6, 1) for b in bw])
        else:
            stage = int(args.stage)
            if stage >= layout.num_stages:
                raise UsageError(f"--stage {stage}: the run has {layout.num_stages} stages")
        st = layout.stages[stage]
        links = {d: P2PLink(p2p, directory.servers[d], d, StageServer, links_emulator) for d in st.servers}
        slowdown = args.slowdown or links_emulator.compute_slowdown()
        worker = StageWorker(run=run, layout=layout, cfg=cfg, stage=stage, device_id=device, links=links,
                             compute=1.0, torch_device=args.device, slowdown=slowdown, die_at=args.die_at)
        worker.compute = args.compute or worker.measure_compute()
        stretched = f" (compute stretched x{slowdown:g} by the link profile)" if slowdown > 1 else ""
        print(f"joined run {run.run_id} as {device} ({peer_id}) on stage {stage}, compute {worker.compute:.3g} rows/s"
              f"{stretched}", flush=True)

        async def announce():
            while not stop.is_set():
                elapsed = max(time.time() - worker.stats["started"], 1e-6)
                rec = {"kind": "client", "device": device, "stage": stage, "state": "online",
                       "compute": float(worker.compute), "tasks_done": worker.stats["forward"] + worker.stats["backward"],
                       "throughput": (worker.stats["forward"] + worker.stats["backward"]) / elapsed, "time": time.time()}
                try:
                    await records.store(dht, records.stage_key(run.run_id, stage), rec, ttl=3 * run.announce_period,
                                        subkey=peer_id)
                except Exception as e:
                    logger.debug("announce failed: %r", e)
                try:
                    await asyncio.wait_for(stop.wait(), run.announce_period)
                except asyncio.TimeoutError:
                    pass

        ann = asyncio.ensure_future(announce())
        await worker.run_loop(stop)
        ann.cancel()
        if worker.current is not None:  # a clean stop hands its task back at once
            dev, task = worker.current
            try:
                await links[dev].call("fail", {"task": task}, timeout=5)
            except Exception:
                pass
        return 0
    finally:
        dht.shutdown()
