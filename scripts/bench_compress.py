#!/usr/bin/env python3
"""`--compress` on emulated slow links: tokens/s, bytes on the wire and the loss after a fixed number of
steps for each mode (none, fp16, bf16, 8bit), with the volunteers behind 20 and 100 Mbit/s links.

    python scripts/bench_compress.py [--out DIR] [--steps 8] [--model small] [--bandwidths 20,100]
                                     [--modes none,fp16,bf16,8bit] [--work DIR]

The swarm: 2 stages x (1 frontal + 1 backward server) that do not compute, 4 volunteers. The link
profile gives every volunteer DELAY ms and the named bandwidth to every server (servers among
themselves: 1 ms, 1 Gbit/s); every device has the same tflops, so no compute is stretched. The link
emulation (core/protocol/links.py) sleeps delay + bytes / bandwidth on each send, so what compression
saves shows in seconds per step. Writes DIR/bench_compress.md and DIR/compress.png (DIR: docs/).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _bench_common import REPO, Report, exactly_once, loadavg, md_table, run_swarm

SERVERS = ["s0f0", "s0b0", "s1f0", "s1b0"]
# what crosses a volunteer's link (its calls to the servers, both directions), and of it what
# --compress may compress (core/protocol/methods.py)
VOLUNTEER_METHODS = (
    "register",
    "take",
    "complete",
    "fail",
    "get_params",
    "push_grads",
    "get_inputs",
    "push_input_grads",
    "push_outputs",
)
COMPRESSIBLE = (
    ("push_grads", "request"),
    ("push_input_grads", "request"),
    ("push_outputs", "request"),
    ("take", "response"),
    ("get_inputs", "response"),
)
VOLUNTEERS = 4
DELAY = 50.0


def cluster(bandwidth: float) -> dict:
    n = len(SERVERS)
    return {
        "reliable": [{"id": s, "tflops": 1.0} for s in SERVERS],
        "unreliable": [{"id": f"v{u}", "tflops": 1.0} for u in range(VOLUNTEERS)],
        "delay_ms": {
            "reliable": [[0.0 if i == j else 1.0 for j in range(n)] for i in range(n)],
            "unreliable": [[DELAY] * n for _ in range(VOLUNTEERS)],
        },
        "bandwidth_mbps": {
            "reliable": [[0.0 if i == j else 1000.0 for j in range(n)] for i in range(n)],
            "unreliable": [[bandwidth] * n for _ in range(VOLUNTEERS)],
        },
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for bw in sorted({r["bandwidth"] for r in rows}):
        sel = [r for r in rows if r["bandwidth"] == bw]
        a.plot([r["mode"] for r in sel], [r["tok_s"] for r in sel], "o-", label=f"{bw:g} Mbit/s")
        b.plot([r["mode"] for r in sel], [r["last_loss"] for r in sel], "o-", label=f"{bw:g} Mbit/s")
    a.set_ylabel("tokens/s")
    a.set_title("throughput")
    b.set_ylabel("loss after the last step")
    b.set_title("what it costs the model")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "docs"))
    p.add_argument("--work", default="/tmp/bench_compress")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default="small")
    p.add_argument("--bandwidths", default="20,100")
    p.add_argument("--modes", default="none,fp16,bf16,8bit")
    p.add_argument("--run-timeout", type=float, default=900)
    a = p.parse_args(argv)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(
        "Compression on slow links (scripts/bench_compress.py)",
        f"Measured {time.strftime('%Y-%m-%d')} on this machine (2 cores); load at start {loadavg()}. "
        f"Model {a.model}, {a.steps} steps, 2 stages x 2 servers (not computing), {VOLUNTEERS} volunteers "
        f"behind {DELAY:g} ms links of the named bandwidth.",
    )
    rows = []
    for bw in [float(x) for x in a.bandwidths.split(",")]:
        profile = work / f"cluster-{bw:g}.json"
        profile.write_text(json.dumps(cluster(bw), indent=1))
        for mode in a.modes.split(","):
            name = f"bw{bw:g}-{mode}"
            print(f"[{time.strftime('%H:%M:%S')}] {name} (load {loadavg()})", flush=True)
            s = run_swarm(
                name,
                [
                    "--model",
                    a.model,
                    "--steps",
                    str(a.steps),
                    "--servers-compute",
                    "no",
                    "--volunteers",
                    str(VOLUNTEERS),
                    "--link-profile",
                    str(profile),
                    "--compress",
                    mode,
                    "--run-id",
                    f"bc-{name}",
                    "--task-timeout",
                    "120",
                ],
                work,
                timeout=a.run_timeout,
            )
            traffic = s["traffic"]
            volunteer = sum(v for k, v in traffic.items() if k.split(".")[0] in VOLUNTEER_METHODS)
            squeezed = sum(traffic.get(f"{m}.{d}", 0) for m, d in COMPRESSIBLE)
            rows.append(
                {
                    "bandwidth": bw,
                    "mode": mode,
                    "sps": s["wall_seconds"] / s["steps"],
                    "tok_s": s["tokens_per_second"],
                    "mb_step": s["bytes_on_wire"] / s["steps"] / 1e6,
                    "vol_mb_step": volunteer / s["steps"] / 1e6,
                    "squeezed_mb_step": squeezed / s["steps"] / 1e6,
                    "last_loss": s["last_loss"],
                    "applied": exactly_once(s),
                    "load": s["load"],
                    "banned": len(s["banned"]),
                }
            )
    base = {r["bandwidth"]: r for r in rows if r["mode"] == "none"}
    report.section(
        "Seconds per step, bytes and loss per mode",
        "MB/step: everything the servers received and "
        "sent (every RPC, replicas between servers included); volunteer links: the volunteers' calls; "
        "compressible: activations, their gradients and gradient pushes, the part --compress touches "
        "(parameter pulls stay exact). Loss: the last step's mean token loss; 'vs none' is the "
        "difference from the exact run's.",
    )
    report.add(
        md_table(
            [
                "Mbit/s",
                "--compress",
                "s/step",
                "tokens/s",
                "vs none",
                "MB/step",
                "volunteer links",
                "compressible",
                "last loss",
                "loss vs none",
                "banned",
                "micro-batches",
                "load",
            ],
            [
                [
                    r["bandwidth"],
                    r["mode"],
                    r["sps"],
                    r["tok_s"],
                    r["tok_s"] / base[r["bandwidth"]]["tok_s"] if r["bandwidth"] in base else "-",
                    r["mb_step"],
                    r["vol_mb_step"],
                    r["squeezed_mb_step"],
                    r["last_loss"],
                    r["last_loss"] - base[r["bandwidth"]]["last_loss"] if r["bandwidth"] in base else "-",
                    r["banned"],
                    r["applied"],
                    r["load"],
                ]
                for r in rows
            ],
        )
    )
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "compress.png")
    report.write(out / "bench_compress.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
