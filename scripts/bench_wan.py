#!/usr/bin/env python3
"""Volunteers on home links: how busy a volunteer is, the bytes it and a server move per token, and
the tokens/s, on kernel-shaped links, with `peer simulate`'s step model beside each point.

Testbed: network namespaces on a bridge (tests/net/netns.py). The four servers of a 2-stage run
(`--no-compute`: committed hosts that leave the compute to the volunteers) on one unshaped host, as
in a data centre; each volunteer on a host of its own whose link `tc tbf` limits to RATE Mbit/s each
way (the kernel adds no delay: netem is not available here). Every volunteer's passes last
--slowdown times this CPU's processor time (`peer join --slowdown`: an emulated device of a stated
speed, which also leaves the machine's two cores room for the servers and the other volunteers).

The lever is the batch: every volunteer fetches its stage's parameters and pushes a gradient of the
same size once a version, whatever its share of the batch, so the tokens it computes a version set
how much of its time goes to compute. Per point:

- utilisation: the seconds a volunteer's passes lasted on its emulated device over the seconds since
  its first task (the closing line of `peer join`), the mean over the volunteers;
- bytes per token: what the kernel counted on each volunteer host's link, both ways, from the run's
  first version to its last, over the tokens trained meanwhile (a volunteer's: the mean; a server's:
  the server host's link over its four servers);
- tokens/s: batch tokens x (steps - 1) over the time from version 1 to the last, from the servers'
  checkpoints;
- predicted: the step model of `peer simulate` (scheduler/scale.py) for the same layout, batch and
  links, the volunteers at the speed they measured of themselves when they joined.

Beside hivepipe, at the largest batch: `peer swarm --no-requeue`-style runs (`peer serve
--no-requeue`) and hivepipe, each with --churn of the volunteers SIGKILLed and replaced per version,
and hivemind's own data parallelism (hivemind.Optimizer, scripts/_hivemind_dp.py) with the same
number of peers and global batch on the same links, calm.

    sudo python scripts/bench_wan.py [--rate 50] [--volunteers 4] [--batches 16 64 256] [--steps 6]
                                     [--slowdown 4] [--churn 0.25] [--model small] [--out docs/bench_wan.md]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, Report, loadavg, md_table  # noqa: E402
from bench_netns import SERVERS, join_args, start_servers, step_times  # noqa: E402

from tests.net import netns  # noqa: E402

MICRO_BATCHES = 4  # the run's default


def volunteer_line(log: str) -> tuple[float, float, float] | None:
    """(seconds computing, seconds since its first task, seconds waiting for parameters) from a `peer
    join` log's closing line."""
    found = re.findall(
        r"computing ([\d.]+) s of the ([\d.]+) s since its first task \(\d+%\), ([\d.]+) s waiting for parameters", log
    )
    return tuple(float(x) for x in found[-1]) if found else None


def joined_rows_per_s(log: str) -> float | None:
    found = re.search(r"on stage \d+, compute ([\d.e+]+) rows/s", log)
    return float(found.group(1)) if found else None


def run_hivepipe(a, batch: int, work: Path, churn: float = 0.0, requeue: bool = True) -> dict:
    """One run of the testbed; the measured point."""
    from bench_peers import replace_some

    hosts = [f"v{i}" for i in range(a.volunteers)]
    bed = netns.Testbed(["srv", *hosts], tag=f"bw{os.getpid() % 10000}")
    run = netns.Processes(str(work))
    rng = random.Random(0)
    procs, names, incarnation = {}, {}, dict.fromkeys(hosts, 0)
    counters: dict[int, dict] = {}
    killed = 0
    load = loadavg()

    def start(host: str) -> None:
        name = f"{host}n{incarnation[host]}"
        names.setdefault(host, []).append(name)
        argv = join_args(name, hosts.index(host) % 2, run_id, initial) + ["--slowdown", str(a.slowdown)]
        procs[host] = run.start(name, argv, bed.prefix(host))

    def at_version(k: int) -> None:
        nonlocal killed
        if k == 1:
            counters[1] = {h: bed.counters(h) for h in ["srv", *hosts]}
        if churn:
            killed += replace_some(rng, hosts, churn, procs, incarnation, start)

    try:
        for host in hosts:
            bed.shape(host, a.rate)
        extra = ["--batch-size", str(batch), "--task-timeout", "30", *([] if requeue else ["--no-requeue"])]
        initial, run_id = start_servers(
            run, a.model, a.steps, work, bed.addrs["srv"], bed.prefix("srv"), compute=False, extra=extra
        )
        servers = [p for _, p in run.procs]
        for host in hosts:
            start(host)
        seen = step_times(work / "ckpt", a.steps, a.timeout, servers, on_version=at_version)
        counters[a.steps] = {h: bed.counters(h) for h in ["srv", *hosts]}
        deadline = time.monotonic() + 120  # the volunteers learn the end and say what they did
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        run.close()
        bed.close()
    from core.model.config import get_preset

    cfg = get_preset(a.model)
    tokens = (a.steps - 1) * batch * cfg.seq_len
    moved = {h: sum(counters[a.steps][h].values()) - sum(counters[1][h].values()) for h in ["srv", *hosts]}
    busy, fetching = [], []
    for host in hosts:
        for name in names[host]:
            said = volunteer_line(run.log(name))
            if said is not None and said[1] > 0:
                busy.append(said[0] / said[1])
                fetching.append(said[2] / said[1])
    speeds = [r for host in hosts for n in names[host][:1] if (r := joined_rows_per_s(run.log(n))) is not None]
    return {
        "tokens_per_second": tokens / (seen[a.steps] - seen[1]),
        "utilisation": statistics.mean(busy) if busy else float("nan"),
        "fetching": statistics.mean(fetching) if fetching else float("nan"),
        "said": len(busy),
        "volunteer_bytes_per_token": statistics.mean(moved[h] for h in hosts) / tokens,
        "server_bytes_per_token": moved["srv"] / len(SERVERS) / tokens,
        "rows_per_s": speeds,
        "killed": killed,
        "load": load,
    }


def predicted(a, batch: int, rows_per_s: list[float]) -> dict:
    """The step model's tokens/s and volunteer utilisation for this testbed: 2 stages of 2 servers on
    one unshaped host, the volunteers at the FLOP/s their measured rows/s mean for a stage's pass."""
    from core.model.config import get_preset, planner_model_file
    from peer.simulate_cmd import REF_FLOPS, calibration
    from scheduler import load_model
    from scheduler.scale import Swarm, predict

    cfg = get_preset(a.model)
    model = load_model(planner_model_file(cfg, batch, MICRO_BATCHES, bytes_per_value=4))  # an fp32 run
    args = argparse.Namespace(calibration=None, stages=2, servers_per_stage=2)
    cal = calibration(args, cfg, model)
    # a row of a stage's forward + backward on the reference device takes fb_row[k] s; a volunteer
    # measuring r rows/s is a device of REF_FLOPS x r x fb_row[k]
    flops = [r * statistics.mean(cal.fb_row) * REF_FLOPS for r in rows_per_s] or [REF_FLOPS / a.slowdown]
    s = Swarm(
        volunteers=a.volunteers,
        stages=2,
        servers_per_stage=2,
        volunteer_tflops=(min(flops) / 1e12, max(flops) / 1e12),
        volunteer_mbps=(a.rate, a.rate),
        volunteer_delay_ms=(0.05, 0.05),
        server_mbps=10_000.0,
        server_delay_ms=0.05,
        batch_rows=batch,
        client_batch_tokens=batch * cfg.seq_len // max(1, a.volunteers // 2),
    )
    p = predict(s, model, cfg.seq_len, cal, group=max(1, a.volunteers // 2), steps=a.steps, warmup=1)
    return {"tokens_per_second": p.tokens_per_second, "utilisation": p.volunteer_utilisation}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=50.0, help="each volunteer host's link, Mbit/s each way")
    p.add_argument("--volunteers", type=int, default=4, help="volunteers, half a stage")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256], help="sequences per batch")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--slowdown", type=float, default=4.0, help="each volunteer's passes last this x its CPU time")
    p.add_argument("--churn", type=float, default=0.25, help="share of the volunteers replaced a version")
    p.add_argument("--model", default="small")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds a run may take")
    p.add_argument("--no-baselines", action="store_true", help="only hivepipe's calm points")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_wan.md"))
    a = p.parse_args()
    why = netns.unavailable()
    if why is not None:
        print(f"bench_wan: {why}", file=sys.stderr)
        return 2
    from core.model.config import get_preset

    seq = get_preset(a.model).seq_len
    per_stage = max(1, a.volunteers // 2)
    report = Report(
        "Volunteers on home links: utilisation, bytes per token, tokens/s",
        f"Model `{a.model}`, 2 stages, 4 servers `--no-compute` on one unshaped host, {a.volunteers} "
        f"volunteers ({per_stage} a stage) each on a host of its own behind `tc tbf` at {a.rate:g} Mbit/s "
        f"each way, no added delay; each volunteer an emulated device {a.slowdown:g}x slower than this "
        f"CPU; {a.steps} steps of {MICRO_BATCHES} micro-batches. Measured from version 1 to {a.steps}; "
        "utilisation from each volunteer's closing line (its compute over its time since its first "
        "task); bytes as the kernel counted them on each host's link, both ways. Predicted: the step "
        "model of `peer simulate` for the same layout, batch and links. Written by "
        "`scripts/bench_wan.py`; load 1/5/15 is the machine's when the run started.",
    )
    points = []  # per batch: the measured point and the step model's
    largest = max(a.batches)
    with tempfile.TemporaryDirectory(prefix="bench_wan_") as tmp:
        for batch in sorted(a.batches):
            m = run_hivepipe(a, batch, Path(tmp) / f"b{batch}")
            points.append(
                {"batch": batch, "tokens": batch * seq / per_stage, "m": m, "pr": predicted(a, batch, m["rows_per_s"])}
            )
            print(table_row(points[-1]), flush=True)
        headers = [
            "system",
            "batch (sequences)",
            "tokens a volunteer a version",
            "utilisation",
            "predicted utilisation",
            "waiting for parameters",
            "tokens/s",
            "predicted tokens/s",
            "predicted / measured",
            "volunteer bytes/token",
            "server bytes/token",
            "load 1/5/15",
        ]
        rows = [table_row(p) for p in points]
        report.section("hivepipe, calm, by batch", md_table(headers, rows) + "\n\n" + reading(points))
        if not a.no_baselines:
            report.section("Against the alternatives, on the same links", baselines(a, largest, Path(tmp), seq))
    report.write(Path(a.out))
    return 0


def table_row(p: dict) -> list:
    m, pr = p["m"], p["pr"]
    return [
        "hivepipe",
        p["batch"],
        f"{p['tokens']:,.0f}",
        m["utilisation"],
        pr["utilisation"],
        m["fetching"],
        m["tokens_per_second"],
        pr["tokens_per_second"],
        pr["tokens_per_second"] / m["tokens_per_second"],
        m["volunteer_bytes_per_token"],
        m["server_bytes_per_token"],
        m["load"],
    ]


def reading(points: list[dict]) -> str:
    """The table in sentences, from its own numbers."""
    first, last = points[0]["m"], points[-1]["m"]
    ratios = [p["pr"]["tokens_per_second"] / p["m"]["tokens_per_second"] for p in points]
    within = sum(1 for x in ratios if 0.75 <= x <= 1.25)
    over = [p["pr"]["utilisation"] - p["m"]["utilisation"] for p in points]
    return (
        f"A volunteer computes {first['utilisation']:.0%} of its time at {points[0]['tokens']:,.0f} tokens a "
        f"version and {last['utilisation']:.0%} at {points[-1]['tokens']:,.0f}: its fixed cost a version (the "
        "stage's parameters down, their gradient up) is spread over more tokens, so the bytes it moves a "
        f"token fall from {first['volunteer_bytes_per_token']:,.0f} to {last['volunteer_bytes_per_token']:,.0f}. "
        f"It waits for parameters {first['fetching']:.0%} to {last['fetching']:.0%} of its time (the next "
        "version is fetched while it computes); the rest goes to pushing gradients, calls and waiting for "
        f"work. The step model's tokens/s is {min(ratios):.2f}-{max(ratios):.2f}x the measured ({within} of "
        f"{len(points)} points within 25%); it puts utilisation {min(over):+.2f} to {max(over):+.2f} from the "
        "measured."
    )


def baselines(a, batch: int, work: Path, seq: int) -> str:
    from bench_peers import netns_places, run_hivemind

    rows = []
    for name, requeue in (("hivepipe", True), ("--no-requeue", False)):
        m = run_hivepipe(a, batch, work / f"churn-{name.strip('-')}", churn=a.churn, requeue=requeue)
        rows.append([f"{name}, churn {a.churn:g}", m["tokens_per_second"], m["utilisation"], m["killed"], m["load"]])
        print(rows[-1], flush=True)
    bed, place = netns_places(a.rate, a.volunteers, tag=f"bh{os.getpid() % 10000}")
    try:
        h = run_hivemind(
            "hivemind",
            a.model,
            a.steps,
            a.volunteers,
            0.0,
            work,
            place=place,
            extra=["--batch-size", str(batch), "--slowdown", str(a.slowdown)],
        )
    finally:
        bed.close()
    rows.append(["hivemind.Optimizer, calm", h["tokens_per_second"], h["utilisation"], 0, h["load"]])
    return (
        f"Batch {batch} sequences ({batch * seq:,} tokens), the same links (hivepipe calm at this batch: the "
        "last row above). hivemind: every peer holds the "
        "whole model and averages its gradients with the others each epoch; its utilisation is its "
        "peers' forward and backward time over their time since their first local step.\n\n"
        + md_table(["system", "tokens/s", "utilisation", "volunteers killed", "load 1/5/15"], rows)
    )


if __name__ == "__main__":
    sys.exit(main())
