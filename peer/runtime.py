"""Process plumbing shared by `peer serve` and `peer join`: argument groups, signals, the loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys

from peer.errors import UsageError

logger = logging.getLogger("hivepipe.runtime")


def add_common_arguments(p) -> None:
    p.add_argument(
        "--run-id",
        default="hivepipe",
        metavar="NAME[@FINGERPRINT]",
        help="the run to serve or join (every DHT key starts with NAME); @FINGERPRINT names the run key "
        "its records must be signed with (its first server prints it; without it, a volunteer trusts "
        "the only run key that publishes NAME)",
    )
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddrs of DHT peers to join, with /p2p/<peer id> (the initial_peers= line a server prints)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the initial peers to answer (and, for a volunteer, for the run to appear)",
    )
    p.add_argument(
        "--link-profile",
        default=None,
        metavar="CLUSTER.json",
        help="emulate the delays and bandwidths of this cluster file on every send",
    )
    p.add_argument("--link-scale", type=float, default=1.0, help="multiply emulated link times by this factor")
    p.add_argument(
        "--slowdown",
        type=float,
        default=None,
        help="stretch every compute step by this factor (default: from --link-profile's tflops)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the slice computes")
    p.add_argument(
        "--activation-memory",
        type=float,
        default=1024,
        metavar="MB",
        help="keep forward passes (their activations, on --device) up to this many MB so that the "
        "backward task of the same rows needs no recompute, oldest dropped first (0: always recompute)",
    )
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (used by peer swarm)")


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). Tensors under glibc's
    mmap threshold (64 KiB rows and the like) stay in its arenas when freed otherwise, and a process's
    RSS keeps a burst's high-water mark for the rest of a run. (What a stage-0 server gains at a
    failover is not that: it is the lost server's share, held live; README "Measured".) False where
    there is no glibc (nothing to do there)."""
    import ctypes
    import ctypes.util

    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # (AttributeError where the C library is not glibc)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    _libc.malloc_trim(0)
    return True


_libc = None


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # asctime: "2026-11-27 14:09:05,069"


def log_time(stamp: str) -> float:
    """Wall seconds of a log line's stamp (its first 23 characters, as LOG_FORMAT writes them);
    ValueError if it is not one. For the scripts that read the processes' logs."""
    from datetime import datetime

    return datetime.strptime(stamp[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def setup_logging(verbosity: int) -> None:
    """Quiet by default (warnings), -v info, -vv debug (hivemind too)."""
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("hivepipe").setLevel(level)
    if verbosity < 2:  # hivemind is chatty at INFO
        for name in ("hivemind", "hivemind.dht", "hivemind.p2p"):
            logging.getLogger(name).setLevel(logging.WARNING if verbosity <= 0 else logging.INFO)


def check_maddrs(flag: str, values, *, need_peer_id: bool = False, need_port: bool = False) -> None:
    """Every value parses as a multiaddr (and names a peer id / an explicit port where asked)."""
    from multiaddr import Multiaddr

    for m in values or ():
        try:
            parsed = Multiaddr(m)
        except Exception as e:
            raise UsageError(f"{flag}: {m!r} is not a multiaddr ({e})") from None
        protocols = [p.name for p in parsed.protocols()]
        if need_peer_id and "p2p" not in protocols:
            raise UsageError(
                f"{flag}: {m!r} lacks the peer id: add /p2p/<peer id> (the initial_peers= line a server prints has it)"
            )
        if not any(p in protocols for p in ("ip4", "ip6", "dns", "dns4", "dns6")) or "tcp" not in protocols:
            raise UsageError(
                f"{flag}: {m!r} needs an IP (or DNS) address and a TCP port, e.g. /ip4/203.0.113.7/tcp/31337"
            )
        if need_port and parsed.value_for_protocol("tcp") == "0":
            raise UsageError(f"{flag}: {m!r} needs an explicit port (others dial it; port 0 means any)")


def parse_run_id(args) -> None:
    """--run-id NAME[@FINGERPRINT] -> args.run_id = NAME, args.run_fp = FINGERPRINT or None."""
    from core.protocol.runid import split_run_id

    if hasattr(args, "run_fp"):
        return  # parsed already
    try:
        args.run_id, args.run_fp = split_run_id(args.run_id)
    except ValueError as e:
        raise UsageError(f"--run-id: {e}") from None


def check_common(args) -> None:
    parse_run_id(args)
    check_maddrs("--initial-peers", args.initial_peers, need_peer_id=True)
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be positive seconds, got {args.timeout}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device")
    if args.activation_memory < 0:
        raise UsageError(f"--activation-memory must be >= 0 MB, got {args.activation_memory}")
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


def link_emulator(args, device: str | None):
    """The link emulator of `--link-profile` (checked by check_common) for this device."""
    from core.protocol.links import LinkEmulator

    if not args.link_profile:
        return LinkEmulator(None, device)
    from scheduler import load_cluster

    return LinkEmulator(load_cluster(args.link_profile), device, args.link_scale)


def quiet_peer_departures(loop: asyncio.AbstractEventLoop) -> None:
    """Make `loop` log, at debug level and not as an ERROR with a traceback, the two reports that a
    peer's connection closing leaves behind in hivemind's stream handler (p2p_daemon._handle_stream):
    - a cancellation: hivemind cancels the handler when the connection closes, and asyncio's stream
      callback reports it as "Exception in callback ... CancelledError" (a failed-over server that
      comes back, is refused and leaves, closes such connections);
    - an IncompleteReadError in "Task exception was never retrieved": when the handler's processing
      task and its read of the next message finish in the same pass, hivemind cancels the finished
      read, which leaves its exception (the connection closed mid-read) unretrieved, and asyncio
      reports it when the task is collected (a restarted server's log showed it).
    A peer leaving is not an error. Nor is Interrupted reaching the loop: SIGTERM inside
    `interruptible` while the loop was idle (uvloop runs the handler from its own signal callback,
    asyncio from a callback) raises it into the loop's callback, not into blocking code; the handler
    has set the stop event, which ends the run (a volunteer SIGTERMed while it waited for the run
    printed "Exception in callback ... Interrupted: SIGTERM" with a traceback). Every other
    exception is reported as before."""

    def handler(loop, context):
        if isinstance(context.get("exception"), (asyncio.CancelledError, asyncio.IncompleteReadError)):
            logger.debug("a peer's connection closed: %s", context.get("message"))
            return
        if isinstance(context.get("exception"), Interrupted):
            logger.debug("stop signal while the loop was idle: %s", context.get("message"))
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def freeze_startup_objects() -> None:
    """Move what start-up built (modules, the model, the DHT's and P2P's state, ~200,000 objects) out
    of the garbage collector's sight (gc.freeze): it lives as long as the process, and every full
    collection walked it, 0.1-0.2 s of processor time in whichever thread tripped it, a stall of the
    server's loop or in the middle of a pass. Collections then walk only what the run made since."""
    gc.collect()
    gc.freeze()


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived during a blocking call (see `interruptible`). A BaseException, as
    KeyboardInterrupt is: no `except Exception` on the way (a retry loop) takes it for a failure."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class interruptible:
    """While inside, SIGTERM and SIGINT raise Interrupted in the main thread, also in the middle of a
    blocking call (starting a DHT node waits for its initial peers up to --timeout without giving the
    event loop a turn); `stop` is set too. On the way out the Python-level handlers that were there
    (the event loop's) are back; the loop's own registration is never touched. A process forked
    inside (hivemind's DHT process, started by the blocking call) inherits the handler: there the
    signal does what it does by default, it ends the process (it raised Interrupted into the child's
    own event loop instead, which logged a traceback and went on running)."""

    def __init__(self, stop: asyncio.Event):
        self.stop = stop

    def __enter__(self):
        pid = os.getpid()

        def raise_interrupted(signum, frame):
            if os.getpid() != pid:  # a forked child: as if this handler had never been set
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            self.stop.set()
            raise Interrupted(signal.Signals(signum).name)

        self.before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            signal.signal(sig, raise_interrupted)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        return False


async def until_stopped(coro, stop: asyncio.Event):
    """`coro`'s result, or Interrupted (the coroutine cancelled) as soon as `stop` is set."""
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise Interrupted("stopped")


def run_until_signalled(main_coro_factory) -> int:
    """Run `main_coro_factory(stop_event)` until it returns or SIGTERM/SIGINT sets the event."""

    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        quiet_peer_departures(loop)
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        try:
            return await main_coro_factory(stop)
        except Interrupted:
            return 0  # stopped by a signal before it had started: nothing to hand back

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(runner()) or 0
