#!/usr/bin/env python3
"""Do volunteers add throughput? Tokens/s against the number of volunteers, calm and under churn, the
task pool against `--no-requeue`, with the step model's prediction beside every point; and what a
server spends per volunteer and per task.

    python scripts/bench_scale.py [--quick] [--counts 2,4,8,16] [--steps 10] [--churn 0.5] [--series fixed,weak]
                                  [--pace 32] [--link-scale 0.1] [--out DIR] [--work DIR]

The swarm: `peer swarm --model small --servers-compute no`, 2 stages x (frontal + backward server),
batch 64 = 4 micro-batches, `--client-batch-tokens 1024` (a volunteer computes at least 8 rows of a
batch, so a batch has work for up to 8 volunteers a stage: 16 in all), on the one-site cluster of
scripts/bench_fidelity.py (the servers in one data centre, volunteers at home 20-80 ms and 20-100
Mbit/s away) with every delay and bandwidth x --link-scale. Every volunteer is an emulated device
declared --pace times slower than this CPU: it stretches its passes to that speed by sleeping
(peer/volunteer/device.py), so 16 volunteers ask for 16/--pace of a core of compute and this
machine's two cores are not what runs out; the protocol's own work (serialization, p2p daemons,
the servers' handlers) is real and shares the cores.

Per point (N volunteers): calm with the task pool; at --churn (a fraction of the volunteers
SIGKILLed and replaced each step) with the task pool and with `--no-requeue` (a lost task waits for
its lease to run out, as SWARM's). Measured: tokens/s in the steady state (the servers' logged
version times from version 3 on, as bench_fidelity reads them), duplicate work (tasks whose result
was dropped because another copy was credited first, per task completed), the bytes the servers
moved, and the processor seconds of every kind of process (psutil). Predicted, calm: the step
model (scheduler/stepsim.py) on the same cluster with costs measured here first (bench_fidelity's
calibration), fed what each volunteer registered of its own speed; under churn: the calm
prediction x the share of volunteer time churn leaves (scheduler/scale.py `churn_factor`, with the
re-join time measured in the run's own logs).

The weak series (`--series weak`; both by default): calm, the batch grows with the volunteers
(ROWS_PER_VOLUNTEER rows of the batch a volunteer, in micro-batches of the fixed series' size; each
volunteer works on one of the 2 stages, so it computes 2 x that of its stage a version), so a volunteer's tokens
a version, and its fixed work a version (its stage's parameters down, their gradient up), stay the
same at every count.

Last, `peer simulate`'s model (scheduler/scale.py) on every measured point and to 10,000 volunteers.

Writes DIR/bench_scale.md, DIR/scale.png and DIR/scale_whatif.png (DIR defaults to docs/); the results
and the calibration as JSON under the work folder (`peer simulate --check WORK/results.json
--calibration WORK/calibration.json` compares its model with them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, Report, exactly_once, loadavg, md_table, model_flops_per_second, out_folder, run_swarm  # noqa: E402
from bench_churn import scaled, swarm_plan  # noqa: E402
from bench_fidelity import (  # noqa: E402
    calibrate_apply,
    calibrate_calls,
    calibrate_compute,
    device_factors,
    measured_compute,
    one_site_cluster,
    version_times,
    workload,
)

from core.model.config import get_preset  # noqa: E402
from scheduler import load_cluster, load_plan  # noqa: E402
from scheduler.scale import churn_factor  # noqa: E402
from scheduler.step_io import Calibration, steady_seconds_per_step
from scheduler.stepsim import simulate  # noqa: E402

BATCH, MICRO, STAGES, CLIENT_TOKENS = 64, 4, 2, 1024
# the weak series: the batch grows with the volunteers, this many rows a volunteer (2 volunteers: the fixed
# batch), in micro-batches of the fixed series' size, so a volunteer's tokens a version stay the same
ROWS_PER_VOLUNTEER, MICRO_ROWS = BATCH // 2, BATCH // MICRO
WARMUP = 3
TASK_TIMEOUT = 20.0  # peer swarm's default lease of an unproven client is shorter; this bounds --no-requeue's wait


JOINED = re.compile(r"^(\S+ \S+) .*hivepipe\.server: (\S+): client \S+ \((v\d+)\) registered")


def rejoin_seconds(log: Path) -> float | None:
    """Median seconds from a volunteer's SIGKILL (the launcher's `churn: killing volunteer vN`) to its
    replacement's first registration at a server, from the run's logs (-v); None without churn."""
    from peer.runtime import log_time

    kills = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"^(\S+ \S+) INFO hivepipe\.swarm: churn: killing volunteer (\S+)", line)
        if m:
            kills.append((log_time(m.group(1)), m.group(2)))
    if not kills:
        return None
    joins: dict[str, list[float]] = {}
    for server_log in log.parent.glob(f"{log.stem}/s*.log"):
        for line in server_log.read_text(errors="replace").splitlines():
            m = JOINED.match(line)
            if m:
                joins.setdefault(m.group(3), []).append(log_time(m.group(1)))
    gaps = []
    for t, name in kills:
        later = [j for j in joins.get(name, []) if j > t]
        if later:
            gaps.append(min(later) - t)
    return statistics.median(gaps) if gaps else None


def server_cost(s: dict, n: int) -> dict:
    """What the servers spent over the training: processor seconds (the server processes with their
    DHT processes and p2p daemons) and bytes, per volunteer-second and per task."""
    cpu = s.get("cpu_by_owner", {})
    server_cpu = cpu.get("server", 0.0)
    tasks = max(s["tasks_completed"], 1)
    wall = max(s["wall_seconds"], 1e-9)
    servers = len(s.get("servers", ())) or 4
    return {
        "server_cpu_s": server_cpu,
        "cpu_ms_per_task": 1e3 * server_cpu / tasks,
        "cpu_share_per_volunteer": server_cpu / wall / servers / max(n, 1),
        "bytes_per_task": s["bytes_on_wire"] / tasks,
        "mbit_per_volunteer": s["bytes_on_wire"] * 8 / 1e6 / wall / servers / max(n, 1),
        "by_kind": cpu,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 and 4 volunteers, 6 steps (a smoke check)")
    p.add_argument("--counts", default="2,4,8,16", help="volunteer counts")
    p.add_argument("--steps", type=int, default=None, help="steps a run (default 10, --quick 6)")
    p.add_argument("--churn", type=float, default=0.5)
    p.add_argument(
        "--series",
        default="fixed,weak",
        help="fixed: batch 64 at every count, calm, churn and --no-requeue; weak: the batch grows with the "
        f"volunteers ({ROWS_PER_VOLUNTEER} rows of the batch a volunteer), calm",
    )
    p.add_argument("--pace", type=float, default=32.0, help="volunteers compute this many times slower than this CPU")
    p.add_argument("--link-scale", type=float, default=0.1)
    p.add_argument("--model", default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="the volunteers' --device (cuda where torch sees a GPU)")
    p.add_argument("--out", type=Path, default=REPO / "docs")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument(
        "--from-results",
        type=Path,
        metavar="WORK",
        help="write the report from a finished run's work folder (its measurements and calibration), "
        "with the model as it is now",
    )
    args = p.parse_args(argv)
    out_folder(p, args.out)
    if args.from_results:
        return rewrite(args)
    counts = [2, 4] if args.quick else [int(c) for c in args.counts.split(",")]
    steps = args.steps or (6 if args.quick else 10)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = get_preset(args.model)
    t_start = time.perf_counter()

    flops, _ = model_flops_per_second(args.model, BATCH // MICRO)
    vol_tflops = flops / 1e12 / args.pace
    compute = calibrate_compute(cfg, BATCH // MICRO, 5)
    apply_s = calibrate_apply(cfg, 5)
    call_s, byte_s, _ = calibrate_calls(20)
    cal = Calibration(call_seconds=call_s, byte_seconds=byte_s, ref_flops=flops, apply_seconds=apply_s, **compute)
    (work / "calibration.json").write_text(json.dumps(dataclasses.asdict(cal), indent=1))

    results = []
    series = set(args.series.split(","))
    if not series or series - {"fixed", "weak"}:
        p.error(f"--series {args.series}: fixed, weak or both")
    for n in counts:
        profile = work / f"one-site-{n}v.json"
        profile.write_text(json.dumps(one_site_cluster(n, vol_tflops, 1.0, args.seed, flops / 1e12)))
        planner = load_cluster(scaled(one_site_cluster(n, vol_tflops, 1.0, args.seed), args.link_scale))
        plan = load_plan(swarm_plan(cfg, n), planner)
        calm_pred: dict[int, float] = {}  # batch rows -> the step model's calm seconds a step
        modes = []  # (kind, churn, mode, batch rows, micro-batches)
        if "fixed" in series:
            modes += [("calm", 0.0, "pool"), ("churn", args.churn, "pool"), ("churn", args.churn, "no-requeue")]
            modes = [m + (BATCH, MICRO) for m in modes]
        if "weak" in series:
            modes.append(("weak", 0.0, "pool", ROWS_PER_VOLUNTEER * n, ROWS_PER_VOLUNTEER * n // MICRO_ROWS))
        for kind, churn, mode, batch, micro in modes:
            name = f"n{n}-{kind}-{mode}"
            print(f"[{time.strftime('%H:%M:%S')}] {name} (load {loadavg()})", flush=True)
            argv = [
                "-v",
                "--model",
                args.model,
                "--steps",
                str(steps),
                "--stages",
                str(STAGES),
                "--servers-per-stage",
                "2",
                "--volunteers",
                str(n),
                "--servers-compute",
                "no",
                "--batch-size",
                str(batch),
                "--micro-batches",
                str(micro),
                "--client-batch-tokens",
                str(CLIENT_TOKENS),
                "--link-profile",
                str(profile),
                "--link-scale",
                str(args.link_scale),
                "--task-timeout",
                str(TASK_TIMEOUT),
                "--seed",
                str(args.seed),
                "--churn",
                str(churn),
                "--device",
                args.device,
            ] + (["--no-requeue"] if mode == "no-requeue" else [])
            s = run_swarm(name, argv, work, timeout=args.run_timeout, sample_cpu=True)
            sps = steady_seconds_per_step(version_times(work / name), WARMUP)
            registered = measured_compute(work / name)
            if batch not in calm_pred:
                factors = device_factors(registered, plan, planner, cal)
                cf = statistics.median(factors.values()) if factors else 1.0
                trace = simulate(
                    planner,
                    plan,
                    workload(cfg, steps, batch, micro, CLIENT_TOKENS),
                    dataclasses.replace(cal, compute_factor=cf, weights=registered),
                    servers_compute=False,
                )
                calm_pred[batch] = trace.seconds_per_step(WARMUP)
            rejoin = rejoin_seconds(work / f"{name}.log")
            predicted = calm_pred[batch]
            if churn:
                predicted = predicted / churn_factor(
                    churn, predicted, rejoin or 10.0, requeue=mode == "pool", task_timeout=TASK_TIMEOUT, tasks=micro
                )
            tokens = batch * cfg.seq_len
            r = {
                "volunteers": n,
                "kind": kind,
                "churn": churn,
                "mode": mode,
                "batch_rows": batch,
                "micro_batches": micro,
                "seconds_per_step": sps,
                "tokens_per_second": tokens / sps,
                "predicted_seconds_per_step": predicted,
                "predicted_tokens_per_second": tokens / predicted,
                "rejoin_seconds": rejoin,
                "compute_factor": cf,
                "tasks_completed": s["tasks_completed"],
                "duplicates": s["duplicates_dropped"],
                "requeued": s["requeued"],
                "killed": s["volunteers_killed"],
                "applied": exactly_once(s),
                "bytes_per_step": s["bytes_on_wire"] / steps,
                "load": s["load"],
                "cost": server_cost(s, n),
                "tasks_by_worker": s.get("tasks_by_worker", {}),
            }
            results.append(r)
            setup = {
                "model": args.model,
                "volunteer_tflops": vol_tflops,
                "volunteer_mbps": [20.0 / args.link_scale, 100.0 / args.link_scale],
                "volunteer_delay_ms": [20.0 * args.link_scale, 80.0 * args.link_scale],
                "server_mbps": 10_000.0 / args.link_scale,
                "server_delay_ms": 0.5 * args.link_scale,
                "task_timeout": TASK_TIMEOUT,
                "client_batch_tokens": CLIENT_TOKENS,
                "batch_rows": BATCH,
                "compute_factor": statistics.median(x["compute_factor"] for x in results),
            }
            (work / "results.json").write_text(json.dumps({"setup": setup, "results": results}, indent=1))
            print(
                f"    {r['tokens_per_second']:,.0f} tokens/s (predicted {r['predicted_tokens_per_second']:,.0f}), "
                f"duplicates {r['duplicates']}/{r['tasks_completed']}, applied {r['applied']}",
                flush=True,
            )
    write_report(args, cfg, cal, results, work, time.perf_counter() - t_start)
    return 0


def rewrite(args) -> int:
    """The report of a finished run again: its measurements as they are, each churn point's
    prediction from its calm point's and the churn factor as the model now says."""
    work = args.from_results
    data = json.loads((work / "results.json").read_text())
    cal = Calibration(**json.loads((work / "calibration.json").read_text()))
    cfg = get_preset(data["setup"].get("model", args.model))
    results = data["results"]
    calm = {r["volunteers"]: r["predicted_seconds_per_step"] for r in results if r["kind"] == "calm"}
    for r in results:
        if r["churn"]:
            s0 = calm[r["volunteers"]]
            factor = churn_factor(
                r["churn"],
                s0,
                r["rejoin_seconds"] or 10.0,
                requeue=r["mode"] == "pool",
                task_timeout=TASK_TIMEOUT,
                tasks=r.get("micro_batches", MICRO),
            )
            r["predicted_seconds_per_step"] = s0 / factor
            r["predicted_tokens_per_second"] = (
                r.get("batch_rows", BATCH) * cfg.seq_len / r["predicted_seconds_per_step"]
            )
    args.work, args.churn = work, next((r["churn"] for r in results if r["churn"]), args.churn)
    # (the run's length: from its calibration to its last point)
    seconds = (work / "results.json").stat().st_mtime - (work / "calibration.json").stat().st_mtime
    write_report(args, cfg, cal, results, work, seconds)
    return 0


def by(results, kind, mode):
    return {r["volunteers"]: r for r in results if r["kind"] == kind and r["mode"] == mode}


def cores_busy(r: dict, work: Path) -> float | None:
    """Cores the swarm's processes kept busy during the training (processor seconds of the whole
    tree / wall seconds, from the run's summary)."""
    path = work / f"n{r['volunteers']}-{r['kind']}-{r['mode']}.json"
    by_owner = r["cost"].get("by_kind") or {}
    if not path.exists() or not by_owner:
        return None
    wall = json.loads(path.read_text())["wall_seconds"]
    return sum(by_owner.values()) / max(wall, 1e-9)


def short_of(r: dict, work: Path, cores: int = 2) -> str:
    """Which resource ran out in a run: this machine's cores when the swarm kept nearly all busy,
    else the volunteers' fixed work a step (each pulls its stage's parameters and pushes their
    gradient every step, however few rows it computes)."""
    busy = cores_busy(r, work)
    if busy is not None and busy >= 0.85 * cores:
        return f"this machine's {cores} cores ({busy:.2f} busy)"
    return (
        f"the volunteers' fixed work a step ({r['bytes_per_step'] / 1e6 / max(r['volunteers'], 1):.1f} MB "
        f"through the servers per volunteer a step; {busy:.2f} of {cores} cores busy)"
        if busy is not None
        else "not measured"
    )


def per_volunteer_base(series: dict) -> float | None:
    """The smallest count's calm tokens/s per volunteer: what `linear` multiplies."""
    if not series:
        return None
    n = min(series)
    return series[n]["tokens_per_second"] / n


def write_report(args, cfg, cal, results, work: Path, seconds: float) -> None:
    calm, pool, nore = by(results, "calm", "pool"), by(results, "churn", "pool"), by(results, "churn", "no-requeue")
    weak = by(results, "weak", "pool")
    report = Report(
        "Scaling with volunteers (scripts/bench_scale.py)",
        f"""
`python scripts/bench_scale.py{" --quick" if args.quick else ""}` on this machine (2 cores, no GPU): model
`{args.model}`, batch {BATCH} = {MICRO} micro-batches (the weak series: {ROWS_PER_VOLUNTEER} rows of the batch a volunteer, in
micro-batches of {MICRO_ROWS}), 2 stages x (frontal + backward server), servers that do not
compute, `--client-batch-tokens {CLIENT_TOKENS}`, one-site cluster x {args.link_scale:g}, every volunteer an
emulated device {args.pace:g}x slower than this CPU, churn {args.churn:g} (a fraction of the volunteers SIGKILLed
and replaced each step). {seconds / 60:.0f} minutes in all. The script's docstring says what is measured and how.""",
    )
    goals = []
    if calm:
        fixed_batch(report, goals, args, calm, pool, nore, results, work)
    if weak:
        weak_scaling(report, goals, weak, work)
    report.section("Goals", "\n".join(goals))
    whatif(report, cfg, cal, results, work, args.out / "scale_whatif.png")
    report.write(args.out / "bench_scale.md")
    plot(results, args.out / "scale.png")


def weak_scaling(report: Report, goals: list, weak: dict, work: Path) -> None:
    counts = sorted(weak)
    per_volunteer = per_volunteer_base(weak)
    rows = []
    for n in counts:
        r = weak[n]
        busy = cores_busy(r, work)
        rows.append(
            [
                n,
                r["batch_rows"],
                r["micro_batches"],
                round(r["tokens_per_second"]),
                round(r["predicted_tokens_per_second"]),
                f"{r['tokens_per_second'] / (per_volunteer * n):.0%}",
                f"{r['seconds_per_step']:.2f}",
                f"{r['bytes_per_step'] / 1e6 / n:.1f}",
                "-" if busy is None else f"{busy:.2f}",
                r["applied"],
                r["load"],
            ]
        )
    report.section(
        "Weak scaling: the batch grows with the volunteers",
        md_table(
            [
                "volunteers",
                "batch (rows)",
                "micro-batches",
                "tokens/s",
                "predicted",
                "of linear",
                "s a step",
                "MB a step per volunteer",
                "cores busy (of 2)",
                "micro-batches applied",
                "load",
            ],
            rows,
        )
        + f"\n\nEach volunteer computes about {STAGES * ROWS_PER_VOLUNTEER} rows of its stage a version whatever "
        "their number, so "
        "its fixed work a version (its stage's parameters down, their gradient up) is spread over the same "
        f"tokens at every count. Linear: {counts[0]} volunteers' tokens/s per volunteer x N.",
    )
    top, low = counts[-1], weak[counts[0]]
    eff = weak[top]["tokens_per_second"] / (per_volunteer * top)
    busy = cores_busy(weak[top], work)
    if eff >= 0.9:
        why = "."
    elif busy is not None and busy >= 0.85 * 2:
        why = f"; short of: this machine's 2 cores ({busy:.2f} busy)."
    else:
        # a volunteer's fixed work a token is the same at every count here: what grew is the step
        why = (
            f"; the step took {weak[top]['seconds_per_step']:.1f} s against {low['seconds_per_step']:.1f} s at "
            f"{counts[0]} volunteers, with {'-' if busy is None else f'{busy:.2f}'} of 2 cores busy and the same "
            "bytes a volunteer a version, so neither the cores nor a volunteer's fixed work; the step model, "
            "which counts each micro-batch's calls through the servers, predicted "
            f"{weak[top]['predicted_tokens_per_second']:,.0f} tokens/s "
            f"({weak[top]['predicted_tokens_per_second'] / (per_volunteer * top):.0%} of linear); what the rest "
            "of the longer step is, is not measured here."
        )
    goals.append(
        f"- weak scaling, {top} volunteers (batch {weak[top]['batch_rows']} rows): {eff:.0%} of linear (goal: at least "
        "90%)" + why
    )


def fixed_batch(report: Report, goals: list, args, calm: dict, pool: dict, nore: dict, results, work: Path) -> None:
    counts = sorted(calm)
    base_n = counts[0]
    per_volunteer = per_volunteer_base(calm)
    rows = []
    for n in counts:
        c = calm[n]
        linear = per_volunteer * n
        rows.append(
            [
                n,
                round(c["tokens_per_second"]),
                round(c["predicted_tokens_per_second"]),
                f"{c['tokens_per_second'] / linear:.0%}",
                f"{c['duplicates']}/{c['tasks_completed']} ({c['duplicates'] / max(c['tasks_completed'], 1):.1%})",
                round(pool[n]["tokens_per_second"]) if n in pool else "-",
                round(pool[n]["predicted_tokens_per_second"]) if n in pool else "-",
                round(nore[n]["tokens_per_second"]) if n in nore else "-",
                round(nore[n]["predicted_tokens_per_second"]) if n in nore else "-",
                f"{pool[n]['tokens_per_second'] / nore[n]['tokens_per_second']:.2f}x"
                if n in pool and n in nore
                else "-",
                f"{c['bytes_per_step'] / 1e6:.1f}",
                "-" if cores_busy(c, work) is None else f"{cores_busy(c, work):.2f}",
                " / ".join(r["applied"] for r in (c, pool.get(n), nore.get(n)) if r),
                c["load"],
            ]
        )
    report.section(
        "Throughput against volunteers",
        md_table(
            [
                "volunteers",
                "calm tokens/s",
                "predicted",
                "of linear",
                "duplicates (calm)",
                f"churn {args.churn:g}: pool",
                "predicted",
                "--no-requeue",
                "predicted",
                "pool / no-requeue",
                "MB a step (calm)",
                "cores busy (calm, of 2)",
                "micro-batches",
                "load",
            ],
            rows,
        )
        + f"\n\nLinear: {base_n} volunteers' calm tokens/s per volunteer x N. Duplicates: tasks whose result "
        "was dropped because another copy was credited first, of the tasks completed.\n\n![throughput and efficiency](scale.png)",
    )
    cost_rows = []
    for r in results:
        c = r["cost"]
        cost_rows.append(
            [
                r["volunteers"],
                f"{r['kind']} {r['mode']}",
                f"{c['server_cpu_s']:.1f}",
                f"{c['cpu_ms_per_task']:.1f}",
                f"{c['cpu_share_per_volunteer']:.2%}",
                f"{c['bytes_per_task'] / 1e3:,.0f}",
                f"{c['mbit_per_volunteer']:.2f}",
            ]
        )
    report.section(
        "A server's cost per volunteer and per task",
        md_table(
            [
                "volunteers",
                "run",
                "servers' processor s (with their DHT and p2p daemons)",
                "ms a task",
                "of a core per server per volunteer",
                "kB a task",
                "Mbit/s per server per volunteer",
            ],
            cost_rows,
        )
        + "\n\nAn operator sizes a reliable host from the last two columns: a server whose stage has V volunteers "
        "spends about V x that share of a core and V x that bandwidth (the parameters each volunteer fetches "
        "and the gradients it pushes every step dominate the bytes).",
    )
    top = counts[-1]
    eff = calm[top]["tokens_per_second"] / (per_volunteer * top)
    goals.append(
        f"- {top} volunteers calm: {eff:.0%} of linear (goal: at least 90%)"
        + ("." if eff >= 0.9 else f"; short of: {short_of(calm[top], work)}.")
    )
    if top in pool and top in nore:
        ratio = pool[top]["tokens_per_second"] / nore[top]["tokens_per_second"]
        goals.append(
            f"- churn {args.churn:g}, {top} volunteers: the task pool {ratio:.2f}x --no-requeue (goal: 1.3x)"
            + ("." if ratio >= 1.3 else f"; the pool's run was short of: {short_of(pool[top], work)}.")
        )
    dup = max(c["duplicates"] / max(c["tasks_completed"], 1) for c in calm.values())
    goals.append(f"- duplicate work with no churn: at most {dup:.1%} of tasks (goal: at most 5%).")


WHATIF_COUNTS = [16, 32, 64, 128, 256, 512, 1000, 2000, 4000, 10000]


def whatif(report: Report, cfg, cal, results, work: Path, path: Path) -> None:
    """`peer simulate` on the measured points (the same model, fed the bench's setup), then the curve
    to 10,000 volunteers at home (peer simulate's defaults) with this machine's calibration."""
    from core.model.config import planner_model_file
    from scheduler import load_model
    from scheduler.scale import Swarm, predict, predict_measured

    model = load_model(planner_model_file(cfg, BATCH, MICRO, bytes_per_value=4))
    setup = json.loads((work / "results.json").read_text())["setup"]
    setup.setdefault("batch_rows", BATCH)  # (a results file from before it was written there)
    rows = []
    for r in results:
        p = predict_measured(
            Swarm(volunteers=1), dict(setup, batch_rows=r.get("batch_rows", BATCH)), r, model, cfg.seq_len, cal
        )
        rows.append(
            [
                r["volunteers"],
                f"{r['kind']} {r['mode']}",
                round(r["tokens_per_second"]),
                round(p.tokens_per_second),
                f"{p.tokens_per_second / r['tokens_per_second']:.2f}",
                p.bottleneck,
            ]
        )
    curve = [predict(Swarm(volunteers=n), model, cfg.seq_len, cal) for n in WHATIF_COUNTS]
    first = {}
    for p in curve:
        if p.bottleneck != "volunteers":
            first.setdefault(p.bottleneck, p.volunteers)
        if p.dht_share > 1:
            first.setdefault("the DHT (the nodes that hold a stage's key)", p.volunteers)
    report.section(
        "What-if: `peer simulate` on every measured point, then to 10,000 volunteers",
        md_table(["volunteers", "run", "measured tokens/s", "peer simulate", "model / measured", "its limit"], rows)
        + "\n\nThe same model to 10,000 volunteers at home (peer simulate's defaults: 0.005-0.02 TFLOP/s, "
        "20-100 Mbit/s, 20-80 ms; 2 stages x 2 servers of 1 Gbit/s and 10 TFLOP/s; a volunteer computes "
        f"{CLIENT_TOKENS} tokens a step), with this machine's calibration:\n\n"
        + md_table(
            ["volunteers", "tokens/s", "s/step", "limit", "servers a stage needs", "DHT: a key holder serves"],
            [
                [
                    f"{p.volunteers:,}",
                    f"{p.tokens_per_second:,.0f}",
                    f"{p.step_s:.2f}",
                    p.bottleneck,
                    p.servers_per_stage_needed,
                    f"{p.dht_mbps_per_holder:,.1f} Mbit/s ({p.dht_share:.0%} of a volunteer's link)",
                ]
                for p in curve
            ],
        )
        + "\n\nFirst to saturate: "
        + ", ".join(f"{what} at {n:,} volunteers" for what, n in sorted(first.items(), key=lambda kv: kv[1]))
        + ".\n\n![what-if](scale_whatif.png)",
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ns = [p.volunteers for p in curve]
    ax.plot(ns, [p.tokens_per_second for p in curve], "o-", label="2 servers a stage")
    ax.plot(
        ns,
        [p.calm_tokens_per_second * p.step_s / p.group_step_s for p in curve],
        "k--",
        lw=0.8,
        label="servers never the limit",
    )
    for what, n in first.items():
        ax.axvline(n, color="grey", ls=":", lw=0.8)
        ax.text(
            n, 0.03, f" {what}", rotation=90, fontsize=7, va="bottom", ha="right", transform=ax.get_xaxis_transform()
        )
    ax.set(xscale="log", yscale="log", xlabel="volunteers", ylabel="tokens/s (predicted)", title="peer simulate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = {
        ("calm", "pool"): ("o-", "calm"),
        ("churn", "pool"): ("s-", "churn, task pool"),
        ("churn", "no-requeue"): ("^-", "churn, --no-requeue"),
        ("weak", "pool"): ("D-", "calm, batch grows (weak)"),
    }
    for (kind, mode), (style, label) in labels.items():
        pts = sorted(by(results, kind, mode).items())
        if not pts:
            continue
        ns = [n for n, _ in pts]
        # each series' linear: the fixed batch's calm base for the fixed series, its own for the weak one
        per_volunteer = per_volunteer_base(by(results, "weak" if kind == "weak" else "calm", "pool"))
        if per_volunteer is None:
            continue
        line = ax.plot(ns, [r["tokens_per_second"] for _, r in pts], style, label=f"{label} (measured)")[0]
        ax.plot(
            ns,
            [r["predicted_tokens_per_second"] for _, r in pts],
            ":",
            color=line.get_color(),
            label=f"{label} (model)",
        )
        ax2.plot(ns, [r["tokens_per_second"] / (per_volunteer * n) for n, r in pts], style, label=label)
    ns = sorted({r["volunteers"] for r in results})
    base = per_volunteer_base(by(results, "calm", "pool")) or per_volunteer_base(by(results, "weak", "pool"))
    ax.plot(ns, [base * n for n in ns], "k--", lw=0.8, label="linear")
    ax.set(xlabel="volunteers", ylabel="tokens/s", title="Throughput", xscale="log", yscale="log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax2.axhline(1.0, color="k", ls="--", lw=0.8)
    ax2.axhline(0.9, color="grey", ls=":", lw=0.8)
    ax2.set(xlabel="volunteers", ylabel="of linear", title="Efficiency", xscale="log", ylim=(0, 1.2))
    ax2.set_xticks(ns, [str(n) for n in ns])
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
