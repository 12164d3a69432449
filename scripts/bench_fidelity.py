#!/usr/bin/env python3
"""Does the model of a step tell the truth? Predicted against measured seconds per step of `peer swarm`
at several points: two clusters, two volunteer counts, two link scales.

    python scripts/bench_fidelity.py [--quick] [--out DIR] [--steps 14] [--repeats 2] [--work DIR]

Predicted: scheduler/stepsim.py (the swarm's protocol played on the cluster's links, call by call),
with costs measured here first, never fitted to the points:
- a P2P call's own cost and its cost per byte: an echo between two hivemind peers on loopback,
  metadata only and 4 MiB (scripts/bench_swarm.py's hop);
- compute: each stage's slice of the model timed on one thread, per row, for the three kinds of
  pass a task runs (a forward pass kept for its backward, forward+loss+backward, a backward from
  the kept pass), with the real task functions (core/model/task_math.py);
- a server's step of its shard (Adam, core/model/optim.py).
Beside it, `plan_cost` of the same plan (the planner's contract, docs/cost-model.md).

Measured: each server logs when it applies a batch (`-v`); a version is reached when the last server
reaches it, and seconds per step are the mean gap from version 3 to the last (steady state: the
volunteers have joined, and both sides leave out the start). The simulation is read the same way.
Each point runs --repeats times (single runs of one point differ by up to 1.7x); the means are
compared. The prediction takes from a run only what its devices measured of themselves at its start
(the rows/s each registered with its servers, in their logs), as a planner would read them from the
devices' records: the split of a micro-batch's rows, and the median slowdown of passes against the
calibration.

Keeping two cores from being the bottleneck (the issue's condition): devices are declared slower
than this CPU (servers at 1/--pace of it, volunteers at half a server) and every process stretches
its compute to its declared speed by sleeping `slowdown x processor time - wall time` after each pass
(peer/volunteer/device.py), so a pass that waited for a core is not stretched further, and the
processor time of a garbage collection that falls inside a pass is left out (stretched x10-20 it
stalled steps by 2 s: a one-sided gap); with 4
servers and at most 4 volunteers the compute asks for under 0.6 of a core. The protocol's own work
(serialization, p2p daemons) is real and shares the cores: its cost per call is the calibration's.

Clusters (delays and bandwidths x --link-scale... as the link emulation sleeps them):
- case3: the design paper's case 3 scaled down (scripts/bench_churn.py): two sites 20 ms / 1 Gb/s
  apart, stage 0's servers in one, stage 1's in the other; volunteers 100-150 ms, 50-300 Mb/s;
- one-site: the four servers in one data centre (0.5 ms, 10 Gb/s); volunteers at home, 20-80 ms,
  20-100 Mb/s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, Report, exactly_once, loadavg, md_table, model_flops_per_second, out_folder, run_swarm  # noqa: E402
from bench_churn import PACE_DEVICE, SERVERS, case3_cluster, scaled, swarm_plan  # noqa: E402

from core.model.config import get_preset, planner_model_file  # noqa: E402
from peer.runtime import log_time  # noqa: E402
from scheduler import load_cluster, load_model, load_plan, plan_cost  # noqa: E402
from scheduler.step_io import Calibration, Workload, steady_seconds_per_step
from scheduler.step_state import device_flops
from scheduler.stepsim import simulate  # noqa: E402

BATCH, MICRO, STAGES = 16, 4, 2
WARMUP = 3  # versions left out of the steady state, measured and simulated alike


def one_site_cluster(
    n_volunteers: int, server_tflops: float, volunteer_fraction: float, seed: int, pace_tflops: float | None = None
) -> dict:
    reliable = list(SERVERS) + ([PACE_DEVICE] if pace_tflops else [])
    vol_delay, vol_bw = [], []
    for u in range(n_volunteers):
        rng = random.Random(seed * 7_919 + u)
        d, b = rng.uniform(20, 80), rng.uniform(20, 100)
        vol_delay.append([round(d, 1)] * len(reliable))
        vol_bw.append([round(b, 1)] * len(reliable))
    return {
        "reliable": [{"id": r, "tflops": pace_tflops if r == PACE_DEVICE else server_tflops} for r in reliable],
        "unreliable": [{"id": f"v{u}", "tflops": server_tflops * volunteer_fraction} for u in range(n_volunteers)],
        "delay_ms": {
            "reliable": [[0.0 if a == b else 0.5 for b in reliable] for a in reliable],
            "unreliable": vol_delay,
        },
        "bandwidth_mbps": {
            "reliable": [[0.0 if a == b else 10_000.0 for b in reliable] for a in reliable],
            "unreliable": vol_bw,
        },
    }


CLUSTERS = {"case3": case3_cluster, "one-site": one_site_cluster}


# ---- calibration ----
def calibrate_compute(cfg, rows: int, repeats: int) -> dict:
    """Seconds per row of each stage's three kinds of pass on this CPU, one thread, with the task
    functions the workers run (median of `repeats` after a warm-up)."""
    import torch

    from core.layout import segment
    from core.model.task_math import backward_kept, backward_rows, forward_keeping
    from core.model.transformer import build_slice, init_state, slice_from_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {"forward_row": [], "fb_row": [], "backward_row": [], "slice_build": []}
    try:
        gen = torch.Generator().manual_seed(0)
        for k in range(STAGES):
            lo, hi = segment(cfg.layers, STAGES, k)
            model = build_slice(cfg, lo, hi, seed=0)
            if model.is_first:
                x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
            else:
                x = torch.randn(rows, cfg.seq_len, cfg.hidden, generator=gen)
            labels = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
            g = torch.randn(rows, cfg.seq_len, cfg.hidden, generator=gen)
            last = hi == cfg.layers
            times = {"forward_row": [], "fb_row": [], "backward_row": []}
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                _, kept = forward_keeping(model, x, torch.device("cpu"))
                t1 = time.perf_counter()
                if not last:
                    backward_kept(model, kept, g, torch.device("cpu"))
                t2 = time.perf_counter()
                backward_rows(
                    model,
                    x,
                    torch.device("cpu"),
                    BATCH * cfg.seq_len,
                    out_grad=None if last else g,
                    labels=labels if last else None,
                )
                t3 = time.perf_counter()
                if i:
                    times["forward_row"].append((t1 - t0) / rows)
                    times["backward_row"].append((t2 - t1) / rows)
                    times["fb_row"].append((t3 - t2) / rows)
            state = init_state(cfg, lo, hi, 0)
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                slice_from_state(cfg, lo, hi, state)
                if i:
                    times.setdefault("slice_build", []).append(time.perf_counter() - t0)
            for key in out:
                out[key].append(statistics.median(times[key]))
    finally:
        torch.set_num_threads(threads)
    return out


def calibrate_apply(cfg, repeats: int) -> float:
    """Seconds of one server's step of its shard: Adam over half of a stage's parameters."""
    import torch

    from core.layout import segment
    from core.model.transformer import init_state

    lo, hi = segment(cfg.layers, STAGES, 0)
    state = init_state(cfg, lo, hi, 0)
    names = sorted(state)[: len(state) // 2]
    params = [state[n].clone().requires_grad_(True) for n in names]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(params, lr=1e-3)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate_calls(repeats: int) -> tuple[float, float, list]:
    """(seconds of a metadata-only call, seconds per payload byte, the hop table's rows): a real
    hivemind P2P echo on loopback, packed and unpacked as the swarm packs them, over an open session as
    the swarm calls (the table shows a stream call of its own beside it)."""
    from bench_swarm import SESSION_ROW, hop_costs

    rows = asyncio.run(hop_costs([("metadata only", ()), ("4 MiB", (1 << 20,))], repeats))
    calls = [r for r in rows if r[0].endswith(SESSION_ROW)]
    total = [float(r[6]) / 1e3 for r in calls]
    nbytes = [int(str(r[1]).replace(",", "")) for r in calls]
    per_byte = (total[1] - total[0]) / (nbytes[1] - nbytes[0])
    return total[0], per_byte, rows


# ---- one point ----
LINE = re.compile(r"^(\S+ \S+) INFO hivepipe\.server: (\S+): applied batch \d+ -> version (\d+)")


def version_times(run_dir: Path) -> list[float]:
    """When the last server reached each version 1, 2, ... (wall seconds), from the servers' logs."""
    first: dict[tuple[str, int], float] = {}
    for log in run_dir.glob("s*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                t = log_time(m.group(1))
                first.setdefault((m.group(2), int(m.group(3))), t)
    devices = {d for d, _ in first}
    top = min(max(v for d2, v in first if d2 == d) for d in devices)
    return [max(first[(d, v)] for d in devices) for v in range(1, top + 1)]


REGISTERED = re.compile(r"INFO hivepipe\.server: (\S+): client \S+ \((\S+)\) registered, compute ([\d.]+)")


def measured_compute(run_dir: Path) -> dict[str, float]:
    """The rows per second of forward+backward each device measured for itself and registered with
    its stage's servers (the first registration each server logged; the median over the servers)."""
    seen: dict[tuple[str, str], float] = {}
    for log in run_dir.glob("s*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = REGISTERED.search(line)
            if m:
                seen.setdefault((m.group(1), m.group(2)), float(m.group(3)))
    by_device: dict[str, list[float]] = {}
    for (_, device), rows_s in seen.items():
        by_device.setdefault(device, []).append(rows_s)
    return {d: statistics.median(v) for d, v in by_device.items()}


def device_factors(measured: dict[str, float], plan, cluster, cal: Calibration) -> dict[str, float]:
    """How much slower than the calibration each device computes, by its own measurement: its
    seconds per row of forward+backward over the calibration's at its declared FLOP/s."""
    out = {}
    for k, st in enumerate(plan.stages):
        for d in list(st.frontal) + list(st.backward) + list(st.clients):
            if d in measured and measured[d] > 0:
                out[d] = float(1.0 / measured[d]) / (cal.fb_row[k] * cal.ref_flops / device_flops(cluster, d))
    return out


def workload(cfg, steps: int, batch: int = BATCH, micro: int = MICRO, client_tokens: int | None = None) -> Workload:
    """The step model's workload of `steps` batches of `batch` rows in `micro` micro-batches, each
    volunteer computing at least `client_tokens` of a batch (default: peer serve's)."""
    from core.layout import DEFAULT_CLIENT_BATCH_TOKENS, DEFAULT_TASK_TOKENS, segment
    from core.model.transformer import init_state

    client_tokens = client_tokens or DEFAULT_CLIENT_BATCH_TOKENS

    params = []
    for k in range(STAGES):
        lo, hi = segment(cfg.layers, STAGES, k)
        params.append(sum(t.numel() for t in init_state(cfg, lo, hi, 0).values()) * 4)
    act = cfg.seq_len * cfg.hidden * 4
    labels = cfg.seq_len * 8
    return Workload(
        steps=steps,
        micro_batches=micro,
        rows=batch // micro,
        min_task_rows=max(1, -(-DEFAULT_TASK_TOKENS // cfg.seq_len)),
        min_client_rows=max(1, -(-client_tokens // cfg.seq_len)),
        input_bytes=[2 * labels] + [act + labels] * (STAGES - 1),
        act_bytes=act,
        label_bytes=labels,
        param_bytes=params,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two points, 8 steps (a smoke check)")
    p.add_argument("--out", type=Path, default=REPO / "docs")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 14, --quick 8)")
    p.add_argument("--pace", type=float, default=10.0, help="servers compute this many times slower than this CPU")
    p.add_argument("--volunteer-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=None, help="runs per point, their means compared (default 2, --quick 1)"
    )
    p.add_argument("--run-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    out_folder(p, args.out)
    steps = args.steps or (8 if args.quick else 14)
    args.repeats = args.repeats or (1 if args.quick else 2)
    points = (
        [("case3", 2, 0.1), ("one-site", 4, 1.0)]
        if args.quick
        else [(c, n, s) for c in CLUSTERS for n in (2, 4) for s in (0.1, 1.0)]
    )
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = get_preset(args.model)
    t_start = time.perf_counter()

    flops, _ = model_flops_per_second(args.model, BATCH // MICRO)
    server_tflops = flops / 1e12 / args.pace
    compute = calibrate_compute(cfg, BATCH // MICRO, 7)
    apply_s = calibrate_apply(cfg, 7)
    call_s, byte_s, hop_rows = calibrate_calls(20)
    cal = Calibration(call_seconds=call_s, byte_seconds=byte_s, ref_flops=flops, apply_seconds=apply_s, **compute)
    work_model = workload(cfg, steps)
    report = Report(
        "Fidelity of the model of a step",
        f"""
`python scripts/bench_fidelity.py{" --quick" if args.quick else ""}` (model `{args.model}`, {steps} steps a run,
batch {BATCH} = {MICRO} micro-batches, 2 stages x (FS + BS), servers compute, pace {args.pace:g}, volunteers at
{args.volunteer_fraction:g}x a server) on this 2-core machine. Work folder: `{work}`. The script's docstring says
what is measured and how the two cores are kept from being the bottleneck.""",
    )
    report.section(
        "Calibration (measured here, before any point)",
        md_table(
            ["what", "value"],
            [
                ["a P2P call, metadata only (pack + unpack + echo round trip)", f"{call_s * 1e3:.2f} ms"],
                ["per payload byte", f"{byte_s * 1e9:.2f} ns ({1 / byte_s / 1e6:.0f} MB/s)"],
                ["this CPU, forward+backward of the model (planner's FLOP count)", f"{flops / 1e9:.1f} GFLOP/s"],
                *[
                    [
                        f"stage {k}: forward / forward+loss+backward / backward from kept, per row",
                        f"{compute['forward_row'][k] * 1e3:.2f} / {compute['fb_row'][k] * 1e3:.2f} / "
                        f"{compute['backward_row'][k] * 1e3:.2f} ms",
                    ]
                    for k in range(STAGES)
                ],
                *[
                    [
                        f"stage {k}: building the slice of a new parameter version",
                        f"{compute['slice_build'][k] * 1e3:.2f} ms",
                    ]
                    for k in range(STAGES)
                ],
                ["a server's step of its shard (Adam)", f"{apply_s * 1e3:.2f} ms"],
            ],
        )
        + f"\n\nDevices: servers {server_tflops * 1e3:.2f} GFLOP/s (1/{args.pace:g} of this CPU), volunteers "
        f"{server_tflops * args.volunteer_fraction * 1e3:.2f}; a task's compute on a device is the measured time x "
        "(this CPU / the device).",
    )

    rows, results = [], []
    model_file = planner_model_file(cfg, BATCH, MICRO, bytes_per_value=4)
    for cname, n, scale in points:
        make = CLUSTERS[cname]
        profile = work / f"{cname}-{n}v.json"
        profile.write_text(json.dumps(make(n, server_tflops, args.volunteer_fraction, args.seed, flops / 1e12)))
        planner = load_cluster(scaled(make(n, server_tflops, args.volunteer_fraction, args.seed), scale))
        plan = load_plan(swarm_plan(cfg, n), planner)
        spec = plan_cost(planner, load_model(model_file), plan).total
        runs = []
        for rep in range(args.repeats):
            name = f"{cname}-n{n}-x{scale:g}-r{rep}"
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
                "yes",
                "--batch-size",
                str(BATCH),
                "--micro-batches",
                str(MICRO),
                "--link-profile",
                str(profile),
                "--link-scale",
                str(scale),
                "--seed",
                str(args.seed),
            ]
            load = loadavg()
            summary = run_swarm(name, argv, work, timeout=args.run_timeout)
            measured = steady_seconds_per_step(version_times(work / name), WARMUP)
            # the prediction takes from the run only what its devices measured of themselves at its
            # start (the rows/s each registered), as a planner would read them from their records
            registered = measured_compute(work / name)
            factors = device_factors(registered, plan, planner, cal)
            trace = simulate(
                planner,
                plan,
                work_model,
                dataclasses.replace(cal, compute_factor=statistics.median(factors.values()), weights=registered),
            )
            predicted = trace.seconds_per_step(WARMUP)
            runs.append(
                {
                    "measured": measured,
                    "predicted": predicted,
                    "factors": factors,
                    "load": load,
                    "calls_simulated": trace.calls / steps,
                    "applied": exactly_once(summary),
                    "rpc_calls": sum(summary["rpc_calls"].values()) / steps,
                }
            )
            print(f"    measured {measured:.2f} s/step, predicted {predicted:.2f}, plan_cost {spec:.2f}", flush=True)
        measured = statistics.mean(r["measured"] for r in runs)
        predicted = statistics.mean(r["predicted"] for r in runs)
        factors = [statistics.median(r["factors"].values()) for r in runs]
        everyone = [f for r in runs for f in r["factors"].values()]
        results.append(
            {
                "cluster": cname,
                "volunteers": n,
                "scale": scale,
                "measured": measured,
                "predicted": predicted,
                "plan_cost": spec,
                "runs": runs,
            }
        )
        rows.append(
            [
                cname,
                n,
                f"{scale:g}",
                " / ".join(f"{f:.2f}" for f in factors) + f" ({min(everyone):.2f}-{max(everyone):.2f})",
                f"{spec:.2f}",
                " / ".join(f"{r['predicted']:.2f}" for r in runs),
                " / ".join(f"{r['measured']:.2f}" for r in runs),
                f"{measured / predicted:.2f}",
                f"{measured / spec:.2f}",
                f"{statistics.mean(r['calls_simulated'] for r in runs):.0f} / "
                f"{statistics.mean(r['rpc_calls'] for r in runs):.0f}",
                " ".join(r["applied"] for r in runs),
                " ".join(r["load"].split("/")[0] for r in runs),
            ]
        )
    (work / "results.json").write_text(json.dumps(results, indent=1))
    ratios = [r["measured"] / r["predicted"] for r in results]
    worst = max(ratios, key=lambda x: abs(x - 1))
    within = sum(0.75 <= x <= 1.25 for x in ratios)
    report.section(
        "Predicted and measured seconds per step",
        md_table(
            [
                "cluster",
                "volunteers",
                "link scale",
                "devices' own compute / calibration: median per run (range)",
                "plan_cost",
                "step model, per run",
                "measured, per run",
                "measured / model (means)",
                "measured / plan_cost",
                "RPCs per step (model / run)",
                "micro-batches applied",
                "load (1 min) at each start",
            ],
            rows,
        )
        + f"\n\nStep model: median measured / predicted {statistics.median(ratios):.2f}, worst {worst:.2f}; "
        f"{within} of {len(ratios)} points within +-25%. plan_cost: median "
        f"{statistics.median(r['measured'] / r['plan_cost'] for r in results):.2f}, worst "
        f"{max((r['measured'] / r['plan_cost'] for r in results), key=lambda x: abs(x - 1)):.2f}.",
    )
    report.section(
        "P2P hop (the call calibration)",
        md_table(
            [
                "payload",
                "bytes",
                "calls",
                "serialize ms",
                "deserialize ms",
                "round trip ms",
                "total ms",
                "transport processor ms",
                "MB/s",
                "load",
            ],
            hop_rows,
        ),
    )
    plot(results, args.out / "fidelity_step_model.png")
    report.add(f"\nWhole benchmark: {(time.perf_counter() - t_start) / 60:.1f} min; load at the end {loadavg()}.")
    report.write(args.out / "bench_fidelity.md")
    return 0


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    top = max(max(r["measured"], r["predicted"], r["plan_cost"]) for r in results) * 1.15
    ax.plot([0, top], [0, top], color="gray", lw=1)
    ax.fill_between([0, top], [0, 0.75 * top], [0, 1.25 * top], color="gray", alpha=0.15, label="+-25%")
    for r in results:
        marker = "o" if r["cluster"] == "case3" else "s"
        ax.scatter(r["predicted"], r["measured"], marker=marker, color="C0")
        ax.scatter(r["plan_cost"], r["measured"], marker=marker, color="C3", alpha=0.5)
        ax.annotate(
            f"{r['volunteers']}v x{r['scale']:g}",
            (r["predicted"], r["measured"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.scatter([], [], color="C0", label="step model (scheduler/stepsim.py)")
    ax.scatter([], [], color="C3", alpha=0.5, label="plan_cost (the spec)")
    ax.scatter([], [], marker="o", color="k", label="case3")
    ax.scatter([], [], marker="s", color="k", label="one-site")
    ax.set(
        xlim=(0, top),
        ylim=(0, top),
        xlabel="predicted s/step",
        ylabel="measured s/step",
        title="predicted vs measured seconds per step",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
