#!/usr/bin/env python3
"""What a ban's reach on disk costs a server (parameter_server/old_versions.py): a shard's step with
and without the versions its memory lets go written to disk, at several shard sizes, and what a
rollback that reads one back takes.

    python scripts/bench_ban_reach.py [--sizes 1,10,50] [--steps 24] [--out docs]

Each point: one ShardState of N million fp32 parameters (one tensor), memory keeping 7 versions (2
stages' 3 + 2 x stages), AdamW; a step credits one gradient and steps, as a server does when a
batch's sum is in. "off": memory only; "on": --ban-reach 64 on disk in a temporary folder (the writer
thread writes each version of the grid memory lets go: every 8th and the one before it, 3 x the
shard's bytes each). One torch thread, as `peer serve`
runs. The table gives the median step (seconds) over the steps after the window filled, the
process's processor seconds a step over them (the writer thread's included), the disk written a step
(MB, averaged), and one rollback to the newest multiple of 8 on disk (seconds: it reads that version
and the one before it). Writes DIR/bench_ban_reach.md (DIR defaults to docs/)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _bench_common import Report, loadavg, md_table, out_folder  # noqa: E402

KEEP = 7  # versions memory keeps in a 2-stage run (3 + 2 x stages)


def point(millions: float, steps: int, reach: bool) -> tuple[float, float, float, float | None]:
    """(median step seconds, processor seconds a step, MB written a step, rollback seconds or None)
    for one shard size."""
    import torch

    torch.set_num_threads(1)  # (as `peer serve` runs)

    from parameter_server.old_versions import DEFAULT_BAN_REACH, STRIDE, OldVersions
    from parameter_server.shard import ShardState

    n = int(millions * 1e6)
    shard = ShardState(
        {"w": torch.zeros(n)}, lr=1e-3, rows_per_micro=1, micro_batches=1, steps=steps + 1, keep_versions=KEEP
    )
    old = OldVersions(tempfile.mkdtemp(prefix="bench-ban-reach-"), DEFAULT_BAN_REACH) if reach else None
    if old is not None:
        shard.old = old.slot(0)
    gen = torch.Generator().manual_seed(0)
    times, grads = [], [torch.randn(n, generator=gen) for _ in range(steps)]
    try:
        for t in range(steps):
            if t == KEEP + 1:  # (the window is full: the writer writes a version a step from here)
                cpu = time.process_time()
            started = time.perf_counter()
            shard.credit(batch=t, pieces=[(f"B{t}.0.0.0-1", 0, (0, 1))], grads=[grads[t]])
            shard.step()
            times.append(time.perf_counter() - started)
        if old is not None:
            old.writer.submit(lambda: None).result()  # (its writes done: their processor time counted)
        cpu = (time.process_time() - cpu) / (steps - KEEP - 1)
        rollback = None
        if old is not None:
            target = max(v for v in shard.old.versions() if v % STRIDE == 0)
            started = time.perf_counter()
            shard.rollback(target, epoch=1)
            rollback = time.perf_counter() - started
    finally:
        if old is not None:
            old.close()
    written = 3 * n * 4 / 1e6 * 2 / STRIDE if reach else 0.0
    return statistics.median(times[KEEP + 1 :]), cpu, written, rollback


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,10,50", help="shard sizes in millions of parameters")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    a = p.parse_args(argv)
    out = out_folder(p, a.out)
    sizes = [float(s) for s in a.sizes.split(",")]
    from parameter_server.old_versions import STRIDE

    if a.steps < KEEP + 2 * STRIDE + 1:
        p.error(f"--steps must be at least {KEEP + 2 * STRIDE + 1}: the window fills first, then two of the grid's")
    report = Report(
        "A ban's reach on disk: what it costs a server's step (scripts/bench_ban_reach.py)",
        f"Measured {time.strftime('%Y-%m-%d')} on this machine (2 cores, no GPU, the work area's disk); "
        f"load at start {loadavg()}.\n\n" + __doc__.split("\n\n", 2)[2],
    )
    rows = []
    for m in sizes:
        off, off_cpu, _, _ = point(m, a.steps, reach=False)
        on, on_cpu, written, rollback = point(m, a.steps, reach=True)
        rows.append([f"{m:g} M", off, on, on / off, off_cpu, on_cpu, written, rollback])
        print(rows[-1], flush=True)
    report.section(
        "Step time",
        md_table(
            ["shard", "step, memory only (s)", "step, with the reach (s)", "ratio"]
            + ["processor s a step, memory only", "processor s a step, with the reach"]
            + ["written a step (MB)", "rollback (s)"],
            rows,
        ),
    )
    report.write(out / "bench_ban_reach.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
