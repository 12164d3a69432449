"""The stress tier: the tests of the run's riskiest paths (failover, a failed-over server's comeback,
replicas, hoarders, checked work, the operator's run, a live identity), those marked `stress`, run
`--count` times each under CPU load, and a table of what passed.

    python scripts/stress.py --count 20            # about an hour on 2 cores; writes docs/stress.md
    python scripts/stress.py --count 2 --load 0    # a quick look, no report written

Load: `--load` processes that spin for the whole run beside the tests' own (two on a 2-core machine
doubles every test's wall time), the way a loaded CI machine or a server sharing its host runs them.
Each failure's log stays in the junit file (`--junit`), and its first line is in the table: a test
that fails here fails for a reason to find and fix, never to retry. pytest-repeat gives `--count`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from _bench_common import Report, loadavg, md_table, spin  # noqa: E402


def base_name(nodeid: str) -> str:
    """A test's id without pytest-repeat's `-K-N` suffix (and what is left of its brackets)."""
    name, _, params = nodeid.partition("[")
    params = params.rstrip("]")
    parts = params.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        params = parts[0]
    elif len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
        params = ""
    return f"{name}[{params}]" if params else name


def outcomes(junit: Path) -> dict[str, dict]:
    """Per test (its repeats together): passed, failed, seconds, and the first line of each failure."""
    out: dict[str, dict] = defaultdict(lambda: {"passed": 0, "failed": 0, "seconds": [], "why": []})
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        test = base_name(f"{cls.replace('.', '/')}.py::{name}")
        row = out[test]
        row["seconds"].append(float(case.get("time", 0.0)))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            row["failed"] += 1
            row["why"].append((bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else "?")
        elif case.find("skipped") is None:
            row["passed"] += 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=20, help="runs of each test (default 20)")
    parser.add_argument("--load", type=int, default=2, help="spinning processes beside the tests (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="test processes (pytest-xdist -n; default 2)")
    parser.add_argument("-k", dest="keyword", default=None, help="only the stress tests matching this (pytest -k)")
    parser.add_argument("--junit", type=Path, default=Path("stress-junit.xml"), help="where the junit log goes")
    parser.add_argument("--out", type=Path, default=None, help="the report (default docs/stress.md at --count >= 10)")
    args = parser.parse_args()
    if args.count < 1 or args.load < 0 or args.workers < 1:
        parser.error("--count and --workers must be at least 1, --load at least 0")
    out = args.out or (REPO / "docs" / "stress.md" if args.count >= 10 else None)

    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "stress",
        "--count",
        str(args.count),
        "-p",
        "no:cacheprovider",
        "-q",
        "--log-level=INFO",
        f"--junitxml={args.junit}",
        *(["-n", str(args.workers)] if args.workers > 1 else []),
        *(["-k", args.keyword] if args.keyword else []),
    ]
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    t0 = time.monotonic()
    try:
        rc = subprocess.call(command, cwd=REPO)
    finally:
        for p in spinners:
            p.kill()
            p.join()
    wall = time.monotonic() - t0
    if not args.junit.exists():
        print(f"pytest wrote no junit log (exit {rc})", file=sys.stderr)
        return rc or 1
    results = outcomes(args.junit)
    rows = [
        [
            test,
            f"{r['passed']}/{r['passed'] + r['failed']}",
            f"{min(r['seconds']):.0f}-{max(r['seconds']):.0f}",
            "; ".join(sorted(set(r["why"])))[:300] or "",
        ]
        for test, r in sorted(results.items())
    ]
    table = md_table(["test", "passed", "seconds a run", "failures"], rows)
    passed = sum(r["passed"] for r in results.values())
    total = passed + sum(r["failed"] for r in results.values())
    summary = (
        f"{passed} of {total} runs passed, {len(results)} tests x {args.count}, in {wall / 60:.0f} min beside "
        f"{args.load} spinning processes on {os.cpu_count()} cores (load average at the end {loadavg()})"
    )
    report = Report(
        "The stress tier",
        "The tests of the riskiest paths (marked `stress`: failover, a failed-over server's comeback, "
        "replicas, hoarders, checked work, the operator's run, a live identity), each run many times under "
        "CPU load: a failure that happens once in twenty runs shows here, not in a user's run. "
        "`--load` processes spin beside the tests for the whole run; pytest-repeat gives `--count`; the "
        "junit log keeps each failure's output.",
    )
    report.add(f"    python scripts/stress.py --count {args.count} --load {args.load} --workers {args.workers}\n")
    report.add(table + "\n")
    report.add(summary + "\n")
    if out is not None:
        report.write(out)
    return 0 if passed == total and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
