"""The dashboard's command line (scripts/dashboard.py): a live terminal view, one JSON snapshot
(`--json`), or the web page (`--serve PORT`)."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import time

from peer.dashboard.reader import DhtReader, Watcher, merge_reads
from peer.dashboard.snapshot import DEFAULT_RUN_ID, RUN_ID_HINT, build_snapshot, run_found, to_json
from peer.dashboard.terminal import live_view
from peer.dashboard.web import serve

ONE_SHOT_EXTRA_READS = 2  # --json reads the run 3 times, an announce period apart (merge_reads)

logger = logging.getLogger("hivepipe.dashboard")


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port {v} outside 0..65535")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dashboard.py",
        description="Status of a hivepipe run, read from its DHT records: stages, servers, volunteers, "
        "task pools, progress and what blocks the run.",
    )
    p.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="multiaddrs of DHT peers (e.g. the initial_peers=... line printed by `peer swarm`)",
    )
    p.add_argument(
        "--run-id",
        default=DEFAULT_RUN_ID,
        metavar="NAME[@FINGERPRINT]",
        help=f"the run to show (default {DEFAULT_RUN_ID!r}, the default of `peer swarm`; `peer serve` and `peer join` "
        "default to 'hivepipe'; the DHT cannot list runs, so there is no discovery), with @FINGERPRINT "
        "(the run= line of `peer serve` and `peer swarm`) to believe only the records its run key signed",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--json",
        action="store_true",
        help="print one JSON snapshot and exit (three reads an announce period apart, merged: one DHT read can miss a record)",
    )
    mode.add_argument(
        "--serve",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve a web page, /api/state (JSON) and /metrics (Prometheus) on 127.0.0.1:PORT "
        "(0: any free port; the address is printed)",
    )
    p.add_argument("--refresh", type=_positive, default=2.0, metavar="S", help="seconds between DHT reads (default 2)")
    p.add_argument(
        "--timeout",
        type=_positive,
        default=30.0,
        metavar="S",
        help="seconds to keep trying initial peers that do not answer yet, and (--json) to wait for the run to "
        "appear, before exiting with code 2 (default 30: a join across slow links, or on a busy machine, "
        "can take more than 10)",
    )
    p.add_argument(
        "--stale-periods",
        type=_positive,
        default=3.0,
        metavar="N",
        help="a live record older than N announce periods shows as unreachable (default 3)",
    )
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        metavar="PID",
        help="exit, with the DHT process and p2p daemon, when process PID is gone (for launchers and "
        "tests that start a dashboard: a killed starter leaves none behind)",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-v info, -vv debug)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from peer.errors import UsageError
    from peer.runtime import check_maddrs, parse_run_id, setup_logging

    try:
        check_maddrs("--initial-peers", args.initial_peers, need_peer_id=True)
        parse_run_id(args)
    except UsageError as e:
        parser.error(str(e))

    setup_logging(args.verbose)
    from peer.lifetime import watch_parent

    watch_parent(args.parent_pid)
    try:
        reader = DhtReader(args.initial_peers, args.run_id, args.run_fp, timeout=args.timeout)
    except Exception as e:
        logger.debug("joining the DHT failed", exc_info=True)
        from peer.node import NOBODY_ANSWERED

        hint = ""
        if NOBODY_ANSWERED in str(e):  # a run that ended has no peer left to answer
            hint = "; is the run still on? its servers leave at its last step unless started with --hold"
        print(
            f"dashboard: error: cannot join the DHT through {' '.join(args.initial_peers)}: {e}{hint}", file=sys.stderr
        )
        return 2

    def on_sigterm(signum, frame):  # SIGTERM stops the dashboard as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if args.json:
            return one_shot(reader, args)
        watcher = Watcher(reader, args.run_id, args.refresh, args.stale_periods)
        if args.serve is not None:
            return serve(watcher, args.serve, args.refresh)
        return live_view(watcher, args.refresh)
    except KeyboardInterrupt:
        return 130 if args.json else 0
    finally:
        reader.shutdown()


def one_shot(reader: DhtReader, args) -> int:
    deadline = time.monotonic() + args.timeout
    while True:
        config, stages = reader.fetch()
        if run_found(config, stages):
            break
        if time.monotonic() > deadline:
            print(
                f"dashboard: error: no run {args.run_id!r} found in the DHT after {args.timeout:g} s {RUN_ID_HINT}",
                file=sys.stderr,
            )
            return 2
        time.sleep(0.5)
    # one read can miss a record (see merge_reads): read again over two announce periods, keep the latest
    reads, rejected = [(config, stages, dict(reader.seen_at))], list(reader.rejected)
    period = config.get("announce_period") if isinstance(config, dict) else None
    period = min(float(period), 5.0) if isinstance(period, (int, float)) and 0 < period < math.inf else 1.0
    for _ in range(ONE_SHOT_EXTRA_READS):
        if time.monotonic() + period > deadline:  # (--timeout bounds the snapshot: it shows what it read)
            break
        time.sleep(period)
        reads.append((*reader.fetch(), dict(reader.seen_at)))
        rejected += [r for r in reader.rejected if r not in rejected]
    config, stages, seen_at = merge_reads(reads)
    snap = build_snapshot(
        args.run_id, config, stages, time.time(), stale_periods=args.stale_periods, rejected=rejected, seen_at=seen_at
    )
    print(to_json(snap, indent=2), flush=True)
    return 0
