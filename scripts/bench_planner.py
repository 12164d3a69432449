#!/usr/bin/env python3
"""Planner benchmark: algorithm x scenario, scaling, and cost against time budget.

    python scripts/bench_planner.py [--quick] [--budget S] [--small N] [--out FILE.md] [--plot FILE.png]

Parts (each a markdown table on standard output, and in --out):

1. small: N random small clusters (2-6 reliable, 0-4 volunteers, scheduler.scenarios.
   small_random_cluster) planned by every algorithm; the ratio is to the exact optimum.
2. scenarios: the four cases of section 4.1 of the design paper, cases 1-3 of the
   decentralized-FM scheduler paper and a random 64+512 cluster, every algorithm with the same
   time budget; the ratio is to the best plan any algorithm found.
3. scaling: refined and paper on random clusters up to 1,000 reliable + 10,000 volunteers, with
   the default time limit (30 s), one process on one core.
4. budget: cost against time budget per algorithm on two scenarios, plotted to --plot.

The targets of the planner issue are checked at the end (exit status 0 either way: they are
measurements, not tests). --quick runs a smaller version in about two minutes.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: numpy's BLAS must not spread over more

from scheduler import (  # noqa: E402
    load_cluster,
    load_model,
    make_plan,
    plan_cost,
    scenarios,  # noqa: E402
)

SEARCHERS = ("refined", "paper", "random", "ga")


def timed_plan(cluster, model, algorithm, budget, seed=0, cpu=False):
    """(cost, wall seconds, plan), or (cost, (wall, CPU seconds), plan) with cpu."""
    t, c = time.perf_counter(), time.process_time()
    plan = make_plan(cluster, model, algorithm, seed=seed, time_limit=budget)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    return plan_cost(cluster, model, plan).total, ((dt, dc) if cpu else dt), plan


def fmt_ratio(r: float) -> str:
    return "inf" if not math.isfinite(r) else f"{r:.4f}"


def small_part(n: int, budget: float, out: list) -> dict:
    ratios = {a: [] for a in SEARCHERS}
    times = {a: [] for a in ("exact",) + SEARCHERS}
    for seed in range(n):
        cluster = load_cluster(scenarios.small_random_cluster(seed))
        model = load_model(scenarios.small_model(seed))
        opt, dt, _ = timed_plan(cluster, model, "exact", 120.0)
        times["exact"].append(dt)
        for a in SEARCHERS:
            cost, dt, _ = timed_plan(cluster, model, a, budget, seed)
            ratios[a].append(cost / opt)
            times[a].append(dt)
    out.append(f"### Small clusters: ratio to the exact optimum ({n} random clusters, budget {budget:g} s)\n")
    out.append("| algorithm | median ratio | mean ratio | worst ratio | optimum found | mean time (s) | max time (s) |")
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    out.append(f"| exact | 1 | 1 | 1 | {n}/{n} | {statistics.mean(times['exact']):.3f} | {max(times['exact']):.3f} |")
    for a in SEARCHERS:
        r = ratios[a]
        finite = [x for x in r if math.isfinite(x)]
        mean = statistics.mean(finite) if len(finite) == len(r) else math.inf
        hits = sum(1 for x in r if x <= 1 + 1e-9)
        out.append(
            f"| {a} | {fmt_ratio(statistics.median(r))} | {fmt_ratio(mean)} | {fmt_ratio(max(r))} | {hits}/{n} "
            f"| {statistics.mean(times[a]):.3f} | {max(times[a]):.3f} |"
        )
    out.append("")
    return ratios


def scenario_part(budget: float, out: list, names=None) -> dict:
    model = load_model(scenarios.EXAMPLE_MODEL)
    results = {}
    names = names or list(scenarios.SCENARIOS)
    for name in names:
        cluster = load_cluster(scenarios.SCENARIOS[name](0))
        row = {}
        for a in SEARCHERS:
            cost, dt, plan = timed_plan(cluster, model, a, budget)
            row[a] = (cost, dt, len(plan.stages), len(plan.idle))
        results[name] = (cluster, row)
        print(f"  {name}: " + ", ".join(f"{a} {c:.3f}" for a, (c, *_) in row.items()), file=sys.stderr, flush=True)
    out.append(
        f"### Scenarios: cost (s per batch), ratio to the best plan found, run time (budget {budget:g} s each)\n"
    )
    out.append("Model: " + ", ".join(f"{k} {v}" for k, v in scenarios.EXAMPLE_MODEL.items()) + ".\n")
    out.append("| scenario | devices | " + " | ".join(SEARCHERS) + " |")
    out.append("| --- | --- | " + " | ".join("---" for _ in SEARCHERS) + " |")
    for name, (cluster, row) in results.items():
        best = min(c for c, *_ in row.values())
        cells = []
        for a in SEARCHERS:
            c, dt, K, idle = row[a]
            cells.append(f"{c:.3f} ({fmt_ratio(c / best)}, {dt:.2f} s, K={K})")
        out.append(f"| {name} | {cluster.n_reliable}+{cluster.n_unreliable} | " + " | ".join(cells) + " |")
    out.append("")
    return {name: row for name, (_, row) in results.items()}


def scaling_part(sizes, out: list) -> dict:
    """CPU seconds of this one-threaded process are what "on one core" means on a machine shared
    with other work; the wall time is shown beside them."""
    model = load_model(scenarios.EXAMPLE_MODEL)
    out.append("### Scaling: random clusters, default time limit (30 s), one thread\n")
    out.append(
        "| reliable + volunteers | paper: cost, CPU s | refined: cost | refined: CPU s (wall s) | refined stages, idle |"
    )
    out.append("| --- | --- | --- | --- | --- |")
    res = {}
    for R, U in sizes:
        cluster = load_cluster(scenarios.random_cluster(0, R, U, as_arrays=True))
        pc, (_, pcpu), _ = timed_plan(cluster, model, "paper", 30.0, cpu=True)
        rc, (rwall, rcpu), plan = timed_plan(cluster, model, "refined", 30.0, cpu=True)
        res[(R, U)] = rcpu
        out.append(
            f"| {R} + {U} | {pc:.3f}, {pcpu:.2f} | {rc:.3f} | {rcpu:.2f} ({rwall:.2f}) "
            f"| {len(plan.stages)}, {len(plan.idle)} |"
        )
        print(f"  scaling {R}+{U}: refined {rcpu:.2f} CPU s, {rwall:.2f} wall s", file=sys.stderr, flush=True)
    out.append("")
    return res


def budget_part(budgets, names, plot: str | None, out: list) -> None:
    model = load_model(scenarios.EXAMPLE_MODEL)
    data = {}
    for name in names:
        cluster = load_cluster(scenarios.SCENARIOS[name](0))
        data[name] = {a: [timed_plan(cluster, model, a, b)[0] for b in budgets] for a in SEARCHERS}
    out.append("### Cost against time budget\n")
    out.append("| scenario | algorithm | " + " | ".join(f"{b:g} s" for b in budgets) + " |")
    out.append("| --- | --- | " + " | ".join("---" for _ in budgets) + " |")
    for name in names:
        for a in SEARCHERS:
            out.append(f"| {name} | {a} | " + " | ".join(f"{c:.3f}" for c in data[name][a]) + " |")
    out.append("")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker

        fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4))
        axes = [axes] if len(names) == 1 else axes
        for ax, name in zip(axes, names):
            for a in SEARCHERS:
                ax.plot(budgets, data[name][a], marker="o", label=a)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(budgets)
            ax.set_xticklabels([f"{b:g}" for b in budgets])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("time budget (s)")
            ax.set_ylabel("predicted seconds per batch")
            ax.set_title(name)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(plot) or ".", exist_ok=True)
        fig.savefig(plot, dpi=110)
        out.append(f"![cost against time budget]({os.path.basename(plot)})\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller run (about two minutes)")
    ap.add_argument(
        "--budget", type=float, default=None, help="time budget per plan on the scenarios (default 5 s, quick 2 s)"
    )
    ap.add_argument("--small", type=int, default=None, help="number of small clusters (default 50, quick 15)")
    ap.add_argument("--out", help="also write the tables to this markdown file")
    ap.add_argument("--plot", default=None, help="cost-against-budget plot (PNG), e.g. docs/planner_budget.png")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: small, scenarios, scaling, budget")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    quick = args.quick
    budget = args.budget or (2.0 if quick else 5.0)
    n_small = args.small or (15 if quick else 50)
    out = []
    checks = []
    if "small" not in skip:
        print("small clusters ...", file=sys.stderr, flush=True)
        r = small_part(n_small, 1.0 if quick else 2.0, out)["refined"]
        med, worst = statistics.median(r), max(r)
        checks.append((f"refined: median within 1% of exact over {n_small} small clusters", med <= 1.01, f"{med:.4f}"))
        checks.append(("refined: never worse than 10% of exact", worst <= 1.10, f"worst {worst:.4f}"))
    if "scenarios" not in skip:
        print("scenarios ...", file=sys.stderr, flush=True)
        rows = scenario_part(budget, out)
        for name, row in rows.items():
            ok = all(row["refined"][0] <= row[a][0] * (1 + 1e-9) for a in SEARCHERS)
            checks.append(
                (
                    f"{name}: refined at least as good as ga, random, paper",
                    ok,
                    ", ".join(f"{a} {row[a][0]:.3f}" for a in SEARCHERS),
                )
            )
    if "scaling" not in skip:
        print("scaling ...", file=sys.stderr, flush=True)
        sizes = [(16, 64), (64, 512), (250, 2500)] + ([] if quick else [(1000, 10000)])
        t = scaling_part(sizes, out)
        checks.append(("64 + 512 planned in under 5 s (one core)", t[(64, 512)] < 5, f"{t[(64, 512)]:.2f} CPU s"))
        if (1000, 10000) in t:
            checks.append(
                (
                    "1,000 + 10,000 planned in under 60 s (one core)",
                    t[(1000, 10000)] < 60,
                    f"{t[(1000, 10000)]:.2f} CPU s",
                )
            )
    if "budget" not in skip:
        print("budget ...", file=sys.stderr, flush=True)
        budgets = [0.25, 0.5, 1, 2, 4] + ([] if quick else [8, 16])
        budget_part(budgets, ["dfm3-2dc", "random-64+512"], args.plot, out)
    out.append("### Targets\n")
    out.append("| target | met | measured |")
    out.append("| --- | --- | --- |")
    for what, ok, detail in checks:
        out.append(f"| {what} | {'yes' if ok else 'NO'} | {detail} |")
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
