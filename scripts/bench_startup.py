"""How long a local swarm takes to start: every process forked from the preloaded forker
(the default on Linux, peer/launcher/forker.py) against every process a fresh interpreter
(`--no-fork-processes`).

For each layout and mode: seconds from the launcher's start until every server has announced
itself online and until the run's first step is done, and the CPU seconds that every process of
the swarm (servers, their DHT processes and p2p daemons, volunteers, the forker) had used by then.
The tiny model, so that start-up is what is measured. Prints a markdown table (and writes it with
--out).

    python scripts/bench_startup.py [--repeats 2] [--out docs/bench_startup.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench_common import Report, loadavg, md_table  # noqa: E402


def swarm_cpu_seconds() -> float:
    import psutil

    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


async def one_start(servers_per_stage: int, volunteers: int, fresh: bool) -> dict:
    from peer.addresses import visible_maddrs
    from peer.cli import build_parser
    from peer.launcher.monitor import Monitor
    from peer.launcher.processes import Swarm
    from peer.node import start_dht, stop_dht
    from peer.reachability import DialBackService
    from peer.swarm_flags import validate

    work = tempfile.mkdtemp(prefix="hivepipe-bench-startup-")
    argv = [
        "swarm",
        "--model",
        "tiny",
        "--steps",
        "1000",
        "--servers-per-stage",
        str(servers_per_stage),
        "--volunteers",
        str(volunteers),
        "--work-dir",
        work,
        "--run-id",
        f"startup-{os.getpid()}",
        "--no-progress",
    ]
    args = build_parser().parse_args(argv + (["--no-fork-processes"] if fresh else []))
    cfg, layout, frontal, backward = validate(args)
    t0 = time.monotonic()
    cpu0 = swarm_cpu_seconds()
    dht = start_dht([], run_id=args.run_id, run_fp=Swarm.run_key(work).fingerprint)
    swarm = Swarm(args, layout, frontal, backward, visible_maddrs(dht), work)
    out = {}
    try:
        p2p = await dht.replicate_p2p()
        await DialBackService().add_p2p_handlers(p2p)
        swarm.start_servers()
        swarm.start_volunteers()
        monitor = Monitor(dht, p2p, args.run_id, layout, args.batch_size * cfg.seq_len)
        while time.monotonic() - t0 < 300:
            swarm.check_alive()
            await monitor.refresh()
            if "online" not in out and monitor.all_online():
                out["online"] = time.monotonic() - t0
            if "online" in out and monitor.min_version() >= 1:
                out["first_step"] = time.monotonic() - t0
                out["cpu"] = swarm_cpu_seconds() - cpu0
                break
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError(f"the swarm in {work} did not reach its first step in 300 s")
    finally:
        swarm.close()
        stop_dht(dht)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--layouts", default="2x2+2,2x4+2", help="STAGESxSERVERS_PER_STAGE+VOLUNTEERS, comma-separated (2 stages only)"
    )
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    report = Report(
        "Start-up of a local swarm: forked processes vs fresh interpreters",
        "The tiny model; medians over the repeats; CPU-s of every process of the swarm until the first "
        f"step. {os.cpu_count()} cores; load average before: {loadavg()}.",
    )
    rows = []
    for layout in a.layouts.split(","):
        shape, vols = layout.split("+")
        stages, per_stage = (int(x) for x in shape.split("x"))
        if stages != 2:
            raise SystemExit(f"--layouts {layout}: 2 stages only")
        for fresh in (False, True):
            runs = [asyncio.run(one_start(per_stage, int(vols), fresh)) for _ in range(a.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("online", "first_step", "cpu")}
            rows.append(
                [
                    f"{stages * per_stage} servers + {vols} volunteers",
                    "fresh" if fresh else "forked",
                    med["online"],
                    med["first_step"],
                    med["cpu"],
                ]
            )
            print(rows[-1], flush=True)
    report.add(md_table(["swarm", "processes", "s to servers online", "s to first step", "CPU-s until then"], rows))
    report.add(f"\nload average after: {loadavg()}")
    if a.out:
        report.write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
