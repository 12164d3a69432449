"""The link emulator against a real network stack: the same small run on kernel-shaped links and on
the in-process emulator at the same rates, with the cost model's prediction beside them.

Kernel: five network namespaces on a bridge (tests/net/netns.py); the four servers (`--no-compute`)
on the first host, listening on its address; one volunteer on each of the other four (two per
stage), each volunteer host's link limited by `tc tbf` to RATE Mbit/s both ways. The kernel adds no
delay (netem is not available here), so the emulator runs at the same rates with zero delay: every
process on 127.0.0.1, `--link-profile` with the volunteers' bandwidth = RATE to every server and the
servers' links among themselves unshaped. Seconds per step are taken from the servers' checkpoint
records (the time each version first appears, steps 2..N), so both runs are measured the same way.

    sudo python scripts/bench_netns.py [--rates 20 50 200] [--steps 8] [--model small] [--out docs/bench_netns.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, Report, loadavg, md_table  # noqa: E402

from tests.net import netns  # noqa: E402

SERVERS = [("0", "frontal", "s0f0"), ("0", "backward", "s0b0"), ("1", "frontal", "s1f0"), ("1", "backward", "s1b0")]
# one host per volunteer: tbf shapes a host's link, and the emulator gives every volunteer a link of its own
VOLUNTEERS = [("vol0", "v0", 0), ("vol1", "v1", 1), ("vol2", "v2", 0), ("vol3", "v3", 1)]


def step_times(ckpt: Path, steps: int, timeout: float, procs, on_version=None) -> dict[int, float]:
    """Wall time at which every server's checkpoint first shows each version; `on_version(k)` is
    called once for each version k < steps as it is first seen. Every process in `procs` must
    stay alive."""
    seen: dict[int, float] = {}
    deadline = time.time() + timeout
    while True:
        versions = []
        for _, _, dev in SERVERS:
            try:
                versions.append(json.loads((ckpt / f"{dev}.json").read_text())["version"])
            except (OSError, ValueError, KeyError):
                versions.append(0)
        v = min(versions)
        for k in range(1, v + 1):
            if k not in seen:
                seen[k] = time.time()
                if on_version is not None and k < steps:
                    on_version(k)
        if v >= steps:
            return seen
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.time() > deadline:
            raise RuntimeError(f"run stopped at version {v} ({'a process exited' if dead else 'timed out'})")
        time.sleep(0.1)


def seconds_per_step(seen: dict[int, float], steps: int) -> float:
    return (seen[steps] - seen[2]) / (steps - 2)


def serve_args(model: str, steps: int, stage, role, ckpt: Path, key: Path, host: str, compute: bool) -> list[str]:
    return [
        "serve",
        "--reliable",
        "--hold",  # it stays until this launcher has read its final state
        "--stage",
        stage,
        "--role",
        role,
        "--stages",
        "2",
        "--model",
        model,
        "--steps",
        str(steps),
        "--run-id",
        "bench",
        *([] if compute else ["--no-compute"]),
        "--host-maddrs",
        f"/ip4/{host}/tcp/0",
        "--checkpoint-dir",
        str(ckpt),
        "--identity-path",
        str(key),
        "--run-key",
        str(ckpt.parent / "run.key"),
    ]


def start_servers(
    run: netns.Processes, model: str, steps: int, work: Path, host: str, prefix=(), compute=False, extra=()
) -> tuple[list[str], str]:
    """The four servers (SERVERS), listening on `host` (under `prefix`: a testbed host), their
    checkpoints in WORK/ckpt; returns (the first one's multiaddrs, the run id volunteers join)."""
    ckpt = work / "ckpt"
    first = run.start(
        "s0f0",
        serve_args(model, steps, *SERVERS[0][:2], ckpt, work / "s0f0.key", host, compute) + list(extra),
        prefix,
        stdout=subprocess.PIPE,
    )
    initial = first.stdout.readline().strip().split("=", 1)[1].split()
    run_id = first.stdout.readline().strip().split("=", 1)[1]  # bench@FINGERPRINT
    for stage, role, dev in SERVERS[1:]:
        run.start(
            dev,
            serve_args(model, steps, stage, role, ckpt, work / f"{dev}.key", host, compute)
            + list(extra)
            + ["--initial-peers", *initial],
            prefix,
        )
    return initial, run_id


def join_args(name: str, stage: int, run_id: str, initial: list[str]) -> list[str]:
    return ["join", "--stage", str(stage), "--device-id", name, "--run-id", run_id, "--initial-peers", *initial]


def run_kernel(a, rate: float, work: Path) -> tuple[float, list[float]]:
    bed = netns.Testbed(["srv"] + [host for host, _, _ in VOLUNTEERS], tag=f"hb{os.getpid() % 10000}")
    run = netns.Processes(str(work))
    try:
        for host, _, _ in VOLUNTEERS:
            bed.shape(host, rate)
        initial, run_id = start_servers(run, a.model, a.steps, work, bed.addrs["srv"], bed.prefix("srv"))
        for host, name, stage in VOLUNTEERS:
            run.start(name, join_args(name, stage, run_id, initial), bed.prefix(host))
        seen = step_times(work / "ckpt", a.steps, a.timeout, [p for _, p in run.procs])
        return seconds_per_step(seen, a.steps), joined_compute(work)
    finally:
        run.close()
        bed.close()


def cluster_file(rate: float) -> dict:
    servers = [d for _, _, d in SERVERS]
    n = len(servers)
    return {
        "reliable": [{"id": d, "tflops": 1.0} for d in servers],
        "unreliable": [{"id": name, "tflops": 1.0} for _, name, _ in VOLUNTEERS],
        "delay_ms": {"reliable": [[0.0] * n for _ in range(n)], "unreliable": [[0.0] * n for _ in VOLUNTEERS]},
        "bandwidth_mbps": {
            "reliable": [[100000.0] * n for _ in range(n)],
            "unreliable": [[rate] * n for _ in VOLUNTEERS],
        },
    }


def run_emulated(a, rate: float, work: Path) -> tuple[float, list[float]]:
    run = netns.Processes(str(work))
    profile = work / "cluster.json"
    profile.write_text(json.dumps(cluster_file(rate)))
    link = ["--link-profile", str(profile)]
    try:
        initial, run_id = start_servers(run, a.model, a.steps, work, "127.0.0.1", extra=link)
        for _, name, stage in VOLUNTEERS:
            run.start(name, join_args(name, stage, run_id, initial) + link)
        seen = step_times(work / "ckpt", a.steps, a.timeout, [p for _, p in run.procs])
        return seconds_per_step(seen, a.steps), joined_compute(work)
    finally:
        run.close()


def joined_compute(work: Path) -> list[float]:
    """Each volunteer's measured compute (rows/s of its slice), from its 'joined' line, in VOLUNTEERS order."""
    out = []
    for _, name, _ in VOLUNTEERS:
        found = re.search(
            r"on stage \d+, compute ([\d.e+]+) rows/s", (work / f"{name}.log").read_text(errors="replace")
        )
        out.append(float(found.group(1)) if found else float("nan"))
    return out


def predicted(a, rate: float, rows_per_s: list[float]) -> float:
    """The cost model's seconds per batch for this layout, the volunteers at their measured compute."""
    from core.model.config import flops_per_token_per_layer, get_preset, planner_model_file
    from scheduler import load_cluster, load_model, plan_cost
    from scheduler.files import Plan, Stage

    cfg = get_preset(a.model)
    half = cfg.layers // 2
    layers = [(0, half), (half, cfg.layers)]
    cluster = cluster_file(rate)
    for (_, name, stage), rows in zip(VOLUNTEERS, rows_per_s):
        n = layers[stage][1] - layers[stage][0]
        flops = rows * cfg.seq_len * flops_per_token_per_layer(cfg) * n
        next(u for u in cluster["unreliable"] if u["id"] == name)["tflops"] = flops / 1e12
    for r in cluster["reliable"]:
        r["tflops"] = 1e-12  # --no-compute: the servers take (almost) no rows
    model = load_model(planner_model_file(cfg, 16, 4, bytes_per_value=4))
    plan = Plan(
        stages=[
            Stage(
                frontal=[f"s{k}f0"],
                backward=[f"s{k}b0"],
                clients=[n for _, n, s in VOLUNTEERS if s == k],
                layers=layers[k],
            )
            for k in range(2)
        ]
    )
    return plan_cost(load_cluster(cluster), model, plan).total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rates", type=float, nargs="+", default=[20.0, 50.0, 200.0], help="Mbit/s of the volunteers' links"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default="small")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(REPO / "docs" / "bench_netns.md"))
    p.add_argument("--work", default=None)
    a = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every run's processes and namespaces are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = netns.unavailable()
    if why:
        print(f"bench_netns: cannot make network namespaces here: {why}", file=sys.stderr)
        return 2
    if a.steps < 4:
        p.error("--steps must be >= 4 (steps 2..N are timed)")
    work = Path(a.work or tempfile.mkdtemp(prefix="hivepipe-netns-"))
    report = Report(
        "Kernel-shaped links vs the link emulator",
        f"Model `{a.model}`, batch 16 in 4 micro-batches, 2 stages, 4 servers `--no-compute` on one host, "
        f"4 volunteers (two per stage, each on a host of its own), {a.steps} steps, seconds per step over steps "
        f"2..{a.steps}. Kernel: tbf on each volunteer host's veth, both ways, no added delay. Emulator: "
        "the same processes on 127.0.0.1 with a link profile of the same bandwidth and zero delay. "
        "Predicted: the cost model (plan_cost) with the volunteers' measured compute.",
    )
    rows = []
    for rate in a.rates:
        load = loadavg()
        kernel, rk = run_kernel(a, rate, work / f"kernel-{rate:g}")
        emulated, re_ = run_emulated(a, rate, work / f"emulated-{rate:g}")
        pred = predicted(a, rate, [statistics.mean(x) for x in zip(rk, re_)])
        rows.append([f"{rate:g}", kernel, emulated, emulated / kernel, pred, pred / kernel, load])
        print(f"{rate:g} Mbit/s: kernel {kernel:.3f} s/step, emulator {emulated:.3f}, predicted {pred:.3f}", flush=True)
    report.section(
        "Seconds per step",
        md_table(
            [
                "Mbit/s",
                "kernel (tbf) s/step",
                "emulator s/step",
                "emulator / kernel",
                "predicted s/step",
                "predicted / kernel",
                "load 1/5/15",
            ],
            rows,
        ),
    )
    report.write(Path(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
