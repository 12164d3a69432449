"""How long a failover takes, idle and under CPU load: `peer swarm --lose-server` runs, each server's
log read for when the loss was decided and when each server adopted the new layout epoch.

    python scripts/bench_failover.py                 # 3 runs idle, 3 beside 2 spinning processes
    python scripts/bench_failover.py --runs 5 --load 0 2 4

A server is lost when its record has been silent for records.stale_after(period) (3 announce periods)
plus --failover-after, and it does not answer a direct ping either (PROBE_S at most); the first
remaining server then reads every server's status and sends the new epoch. Per run: from the SIGKILL
to the coordinator's decision, from the decision to the last server's adoption, and the whole, beside
that bound. Writes docs/bench_failover.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from _bench_common import Report, loadavg, md_table, spin  # noqa: E402

STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_run(work: Path, args, tag: str) -> dict:
    """One `peer swarm` that loses s0b1 at version --lose-at; the times read from its logs."""
    command = [
        sys.executable,
        "-m",
        "peer.cli",
        "swarm",
        "--model",
        "tiny",
        "--steps",
        str(args.steps),
        "--stages",
        "1",
        "--servers-per-stage",
        "4",
        "--volunteers",
        "1",
        "--volunteer-slowdown",
        str(args.slowdown),
        "--lose-server",
        f"s0b1@{args.lose_at}",
        "--failover-after",
        str(args.failover_after),
        "--announce-period",
        str(args.period),
        "--no-progress",
        "--work-dir",
        str(work),
        "--run-id",
        f"failover-{tag}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=900)
    out = {"ok": done.returncode == 0, "why": done.stderr.strip().splitlines()[-1:] if done.returncode else []}
    logs = {p.stem: p.read_text(errors="replace") for p in work.glob("s*.log")}
    # the kill's moment, from the lost server's own last line (it SIGKILLs itself right after it)
    lost = re.search(STAMP + r".*s0b1: applied step (\d+): lost here for good", logs.get("s0b1", ""), re.M)
    decided = [
        (stamp(m.group(1)), int(m.group(2)))
        for text in logs.values()
        for m in re.finditer(STAMP + r".*failed over \['s0b1'\]: layout epoch 1 from batch (\d+)", text, re.M)
    ]
    adopted = [
        stamp(m.group(1))
        for name, text in logs.items()
        if name != "s0b1"
        for m in re.finditer(STAMP + r".*: layout epoch 1 from batch", text, re.M)
    ]
    if lost and decided and adopted:
        t0 = stamp(lost.group(1))
        out.update(
            lost_at=int(lost.group(2)),
            from_batch=decided[0][1],
            detect=decided[0][0] - t0,
            spread=max(adopted) - min(adopted),
            whole=max(adopted) - t0,
        )
    return out


def main() -> int:
    from core.protocol import records
    from peer.host.failures import PROBE_S

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs at each load (default 3)")
    parser.add_argument("--load", type=int, nargs="+", default=[0, 2], help="spinning processes (default 0 2)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lose-at", type=int, default=4, help="the version s0b1 is lost at (default 4)")
    parser.add_argument("--failover-after", type=float, default=3.0)
    parser.add_argument("--period", type=float, default=1.0, help="--announce-period (default 1)")
    parser.add_argument(
        "--slowdown", type=float, default=3.0, help="the volunteer's device speed (default 3x slower than here)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench_failover.md")
    args = parser.parse_args()
    bound = records.stale_after(args.period) + args.failover_after + PROBE_S + args.period
    rows, by_load = [], {}
    for load in args.load:
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(load)]
        for p in spinners:
            p.start()
        try:
            for i in range(args.runs):
                with tempfile.TemporaryDirectory(prefix="bench-failover-") as work:
                    r = one_run(Path(work), args, f"{load}-{i}")
                la = loadavg()
                by_load.setdefault(load, []).append(r)
                if "whole" in r:
                    rows.append(
                        [
                            load,
                            i + 1,
                            r["lost_at"],
                            r["from_batch"],
                            round(r["detect"], 1),
                            round(r["spread"], 2),
                            round(r["whole"], 1),
                            "yes" if r["ok"] else f"no: {r['why']}",
                            la,
                        ]
                    )
                else:
                    rows.append([load, i + 1, "-", "-", "-", "-", "-", f"no failover seen: {r['why']}", la])
                print(rows[-1], flush=True)
        finally:
            for p in spinners:
                p.kill()
                p.join()
    report = Report(
        "Failover time, idle and under load",
        "A server is lost when its record has been silent for 3 announce periods plus --failover-after and "
        "it does not answer a direct ping either; the first remaining server then reads every server's "
        "status and sends the new layout epoch. Each run SIGKILLs s0b1 through `peer swarm --lose-server`; "
        "the times come from each server's log. Spinning processes load the 2 cores beside the swarm.",
    )
    report.add(
        f"    python scripts/bench_failover.py --runs {args.runs} --load {' '.join(map(str, args.load))}\n\n"
        f"`peer swarm --model tiny --steps {args.steps} --stages 1 --servers-per-stage 4 --volunteers 1 "
        f"--lose-server s0b1@{args.lose_at} --failover-after {args.failover_after:g} --announce-period "
        f"{args.period:g}`; the bound: stale_after ({records.stale_after(args.period):g} s) + --failover-after "
        f"({args.failover_after:g} s) + a probe ({PROBE_S:g} s) + a detector period ({args.period:g} s) = "
        f"{bound:g} s.\n"
    )
    report.add(
        md_table(
            [
                "spinning processes",
                "run",
                "lost at version",
                "re-run from batch",
                "kill -> decided (s)",
                "decided -> last adopted (s)",
                "kill -> all adopted (s)",
                "swarm exit 0",
                "load average",
            ],
            rows,
        )
        + "\n"
    )
    summary = []
    for load, rs in by_load.items():
        whole = [r["whole"] for r in rs if "whole" in r]
        if whole:
            summary.append(
                f"{load} spinning: median {statistics.median(whole):.1f} s, most {max(whole):.1f} s "
                f"(bound {bound:g} s), {sum(r['ok'] for r in rs)}/{len(rs)} runs ended by themselves"
            )
    report.add("\n".join(f"- {s}" for s in summary) + "\n")
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
