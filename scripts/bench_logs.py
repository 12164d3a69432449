"""Log lines per minute of every process of a swarm while one server is down: quiet under
faults.

A swarm of the tiny model (2 stages x 2 servers, --volunteers volunteers, failover off) runs until
version 2; then a backward server of the last stage is SIGKILLed and stays down for --down seconds,
then comes back from its checkpoint. Each process's log lines (default verbosity: warnings and
errors) are counted inside the outage window and after the return, and printed as a table.
`--root DIR` runs another checkout of the code (e.g. an older commit, for a before/after).

    python scripts/bench_logs.py --down 120
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--down", type=float, default=120.0, help="seconds the server stays down (default 120)")
p.add_argument("--after", type=float, default=30.0, help="seconds counted after it is back (default 30)")
p.add_argument("--volunteers", type=int, default=4)
p.add_argument("--victim", default="s1b0")
p.add_argument("--work-dir", default="/tmp/hivepipe-bench-logs")
p.add_argument(
    "--root",
    default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    help="the checkout whose code runs (default: this one)",
)
args = p.parse_args()
os.chdir(args.root)
sys.path.insert(0, args.root)

from peer.addresses import visible_maddrs  # noqa: E402
from peer.cli import build_parser  # noqa: E402
from peer.launcher.monitor import Monitor  # noqa: E402
from peer.launcher.processes import Swarm, kill_group  # noqa: E402
from peer.node import start_dht  # noqa: E402

try:
    from peer.node import stop_dht  # noqa: E402
except ImportError:  # an older checkout (--root)

    def stop_dht(dht):
        dht.shutdown()


from peer.swarm_flags import validate  # noqa: E402

STAMP = re.compile(rb"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def lines_between(path: str, t0: float, t1: float) -> int:
    """Log lines stamped in [t0, t1) (a line without a stamp, e.g. a traceback's, counts with the last stamped one)."""
    count, inside = 0, False
    with open(path, "rb") as f:
        for line in f:
            m = STAMP.match(line)
            if m:
                t = time.mktime(time.strptime(m.group(1).decode(), "%Y-%m-%d %H:%M:%S"))
                inside = t0 <= t < t1
            if inside:
                count += 1
    return count


async def main() -> None:
    import shutil
    import signal

    shutil.rmtree(args.work_dir, ignore_errors=True)
    sargs = build_parser().parse_args(
        [
            "swarm",
            "--model",
            "tiny",
            "--steps",
            "100000",
            "--volunteers",
            str(args.volunteers),
            "--failover-after",
            "0",
            "--work-dir",
            args.work_dir,
            "--no-progress",
            "--run-id",
            f"bench-logs-{os.getpid()}",
        ]
    )
    sargs.verbose = 0
    cfg, layout, frontal, backward = validate(sargs)
    os.makedirs(args.work_dir, exist_ok=True)
    dht = start_dht([], run_id=sargs.run_id, run_fp=Swarm.run_key(args.work_dir).fingerprint)
    swarm = Swarm(sargs, layout, frontal, backward, visible_maddrs(dht), args.work_dir)
    try:
        p2p = await dht.replicate_p2p()
        try:
            from peer.reachability import DialBackService

            await DialBackService().add_p2p_handlers(p2p)
        except ImportError:
            pass
        swarm.start_servers()
        swarm.start_volunteers()
        monitor = Monitor(dht, p2p, sargs.run_id, layout, sargs.batch_size * cfg.seq_len)
        while monitor.min_version() < 2:
            await monitor.refresh()
            await asyncio.sleep(0.5)
        print(f"version {monitor.min_version()}: SIGKILL {args.victim} for {args.down:.0f} s", file=sys.stderr)
        await asyncio.sleep(1.0)
        t0 = time.time()
        kill_group(swarm.servers[args.victim], signal.SIGKILL)
        swarm.servers[args.victim].wait()
        await asyncio.sleep(args.down)
        t1 = time.time()
        swarm.servers[args.victim] = swarm.spawn(args.victim, swarm.server_argv[args.victim])
        await asyncio.sleep(args.after)
        t2 = time.time()
        await monitor.refresh()
        print(f"back; version {monitor.min_version()}", file=sys.stderr)
    finally:
        swarm.close()
        stop_dht(dht)
    logs = sorted(f for f in os.listdir(args.work_dir) if f.endswith(".log"))
    print(
        f"| process | lines while {args.victim} was down ({args.down:.0f} s) | per minute | lines in the "
        f"{args.after:.0f} s after |"
    )
    print("| --- | --- | --- | --- |")
    total = 0
    for name in logs:
        path = os.path.join(args.work_dir, name)
        down = lines_between(path, int(t0), int(t1))
        total += down
        print(f"| {name[:-4]} | {down} | {down * 60 / args.down:.1f} | {lines_between(path, int(t1), int(t2) + 1)} |")
    print(f"| all | {total} | {total * 60 / args.down:.1f} | |")


asyncio.run(main())
