"""Process plumbing shared by `peer serve` and `peer join`: argument groups, signals, the loop."""
from __future__ import annotations

import asyncio
import signal

from peer.errors import UsageError


def add_common_arguments(p) -> None:
    p.add_argument("--run-id", default="hivepipe", help="the run to serve or join (every DHT key starts with it)")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="multiaddrs of DHT peers to join")
    p.add_argument("--link-profile", default=None, metavar="CLUSTER.json",
                   help="emulate the delays and bandwidths of this cluster file on every send")
    p.add_argument("--link-scale", type=float, default=1.0, help="multiply emulated link times by this factor")
    p.add_argument("--slowdown", type=float, default=None,
                   help="stretch every compute step by this factor (default: from --link-profile's tflops)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the slice computes")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (used by peer swarm)")


def check_common(args) -> None:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device")
    if args.slowdown is not None and args.slowdown < 1:
        raise UsageError(f"--slowdown must be >= 1, got {args.slowdown}")
    if args.link_scale <= 0:
        raise UsageError("--link-scale must be positive")
    if args.link_profile:
        from scheduler import PlanInputError, load_cluster

        try:
            load_cluster(args.link_profile)
        except (OSError, PlanInputError) as e:
            raise UsageError(f"--link-profile {args.link_profile}: {e}") from None


def run_until_signalled(main_coro_factory) -> int:
    """Run `main_coro_factory(stop_event)` until it returns or SIGTERM/SIGINT sets the event."""
    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await main_coro_factory(stop)

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(runner()) or 0
