"""`peer plan`: lay a cluster out into pipeline stages (docs/cost-model.md), or score a plan.

    peer plan CLUSTER.json MODEL.json -o PLAN.json [--algorithm refined|paper|exact|random|ga]
              [--seed N] [--time-limit S]
    peer plan --score PLAN.json CLUSTER.json MODEL.json

Imports only the scheduler (numpy): no torch, no hivemind.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from peer.errors import UsageError

ALGORITHMS = ("refined", "paper", "exact", "random", "ga")  # scheduler.ALGORITHMS, kept here so --help is fast


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("cluster", metavar="CLUSTER", help="cluster file: devices, delays, bandwidths")
    parser.add_argument("model", metavar="MODEL", help="model file (see `peer model-file`)")
    parser.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan here (default: only print it)")
    parser.add_argument(
        "--algorithm",
        default="refined",
        choices=ALGORITHMS,
        help="refined (default): the paper's plan improved under the exact cost; paper: section 3.3.3 "
        "of the design paper; exact: exhaustive (<= 6 reliable, 4 volunteers); random; ga: the "
        "hybrid genetic algorithm of the decentralized-FM scheduler",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--time-limit", type=float, default=30.0, metavar="S", help="seconds the search may take at most (default 30)"
    )
    parser.add_argument("--score", metavar="PLAN.json", help="score this plan instead of planning")


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def _ids(ids, most=6) -> str:
    if not ids:
        return "-"
    return ", ".join(ids) if len(ids) <= most else ", ".join(ids[:most]) + f", ... ({len(ids)} in all)"


def format_plan(plan, cost, model, algorithm: str | None = None, cluster=None) -> str:
    rows = [("stage", "layers", "frontal servers", "backward servers", "clients", "tau_k", "DT_k", "link_k", "AG max")]
    for k, st in enumerate(plan.stages):
        rows.append(
            (
                str(k),
                f"[{st.layers[0]}, {st.layers[1]})",
                _ids(st.frontal),
                _ids(st.backward),
                f"{len(st.clients)}: {_ids(st.clients, 4)}" if st.clients else "0",
                _fmt_s(cost.stage_tau[k]) if cost.stage_tau else "-",
                _fmt_s(cost.stage_dt[k]) if cost.stage_dt else "-",
                _fmt_s(cost.stage_link[k]) if cost.stage_link else "-",
                _fmt_s(cost.stage_ag[k]) if cost.stage_ag else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    head = f"plan by {algorithm}: " if algorithm else "plan: "
    lines.append(f"{head}{len(plan.stages)} stage(s), {model.layers} layers, {model.micro_batches} micro-batches")
    for n, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"idle volunteers: {len(plan.idle)}" + (f" ({_ids(plan.idle, 8)})" if plan.idle else ""))
    if cost.reason:
        lines.append(f"infeasible: {cost.reason}")
    else:
        lines.append(
            f"pipeline (d + K - 1) * max tau_k: {_fmt_s(cost.pipe)}; aggregation max AG: {_fmt_s(cost.aggregation)}"
        )
        lines.append(f"predicted seconds per batch: {cost.total:.4f}")
    lines += link_budget_lines(cluster, model, plan) if cluster is not None else []
    return "\n".join(lines)


def link_budget_lines(cluster, model, plan) -> list[str]:
    """What the volunteers' links leave of their compute at this batch, and the tokens a version
    each needs to be busy half the time (scheduler/linkbudget.py: the model file's bytes a value each
    way for parameters and activations, the next version pulled while one computes)."""
    from scheduler.linkbudget import plan_budget

    lines = []
    for k, b in enumerate(plan_budget(cluster, model, plan)):
        if b is None:
            continue
        need = (
            f"50% needs {b['need']:,} tokens a version each, a batch of {b['batch']:,} tokens"
            if b["need"] is not None
            else "no batch reaches 50%: the activations alone take longer on its links than their compute"
        )
        lines.append(
            f"link budget, stage {k}: each volunteer computes {b['share']:,.0f} tokens a version at this "
            f"batch, busy {b['busy'][0]:.1%}-{b['busy'][1]:.1%} of the time (pulling the stage's "
            f"parameters, pushing their gradient and moving its activations, {model.bytes_per_value} bytes "
            f"a value); {need}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from scheduler import PlanInputError, load_cluster, load_model, load_plan, make_plan, plan_cost

    if not (args.time_limit > 0 and math.isfinite(args.time_limit)):
        raise UsageError(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    try:
        cluster = load_cluster(args.cluster)
        model = load_model(args.model)
        if args.score:
            plan = load_plan(args.score, cluster)
        elif args.output and os.path.isdir(args.output):
            raise UsageError(f"-o {args.output!r} is a folder")
    except PlanInputError as e:
        raise UsageError(str(e)) from None
    if args.score:
        cost = plan_cost(cluster, model, plan)
        if cost.stage_tau:  # valid, or valid but for memory: the breakdown shows where
            print(format_plan(plan, cost, model, cluster=cluster))
        if not cost.valid:
            print(f"invalid plan: {cost.reason}", file=sys.stderr)
            return 2
        return 0
    try:
        plan = make_plan(cluster, model, args.algorithm, seed=args.seed, time_limit=args.time_limit)
    except PlanInputError as e:
        raise UsageError(str(e)) from None
    cost = plan_cost(cluster, model, plan)
    if args.output:
        try:
            plan.save(args.output)
        except OSError as e:
            raise UsageError(f"cannot write {args.output!r}: {e.strerror}") from None
    print(format_plan(plan, cost, model, args.algorithm, cluster=cluster))
    if args.output:
        print(f"written to {args.output}")
    if not cost.valid:
        print(f"peer plan: no plan fits: {cost.reason}", file=sys.stderr)
        return 1
    return 0
