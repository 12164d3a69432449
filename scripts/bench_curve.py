#!/usr/bin/env python3
"""A practitioner's run, end to end: a corpus prepared from local text, `peer swarm` with warm-up,
cosine decay, global clipping and held-out evaluation under churn, against `peer reference` with the
same flags, and a bf16 swarm beside them; per-step and held-out losses compared, one plot of the
held-out curves.

    python scripts/bench_curve.py [--model small] [--steps 500] [--churn 0.25] [--out docs] [--work DIR]

The corpus is `peer data prepare` of some folders of the Python standard library's sources (local
text, nothing to download: email, json, http, asyncio, logging at weight 1, unittest at 0.5). The
swarm's per-step losses come from its training log (WORK/<run>/logs/train.csv), its held-out losses
from its summary; the reference's from `peer reference --summary-json`. Writes DIR/bench_curve.md and
DIR/bench_curve.png (DIR defaults to docs/)."""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, Report, exactly_once, loadavg, md_table, out_folder, run_swarm  # noqa: E402

MICRO_BATCHES = 4  # the run's default
SOURCES = [("email", 1.0), ("json", 1.0), ("http", 1.0), ("asyncio", 1.0), ("logging", 1.0), ("unittest", 0.5)]


def recipe_flags(steps: int) -> list[str]:
    every = max(1, steps // 20)
    return [
        "--lr",
        "3e-3",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        str(max(1, steps // 20)),
        "--min-lr",
        "3e-4",
        "--clip-grad-norm",
        "1.0",
        "--eval-every",
        str(every),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--churn", type=float, default=0.25)
    p.add_argument("--volunteers", type=int, default=4)
    p.add_argument("--out", type=Path, default=REPO / "docs")
    p.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument(
        "--reuse", action="store_true", help="with --work: a run whose summary is there already is read, not run again"
    )
    args = p.parse_args()
    out = out_folder(p, args.out)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_curve."))
    work.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = work / "corpus"
    if not corpus.exists():
        srcs = [f"{stdlib / name}:{weight}" for name, weight in SOURCES]
        subprocess.run(
            [sys.executable, "-m", "peer.cli", "data", "prepare", *srcs, "--include", "*.py", "-o", str(corpus)]
            + ["--no-progress"],
            check=True,
            cwd=REPO,
        )
    manifest = json.loads((corpus / "manifest.json").read_text())
    flags = ["--model", args.model, "--steps", str(args.steps), "--data", str(corpus), *recipe_flags(args.steps)]

    def reference(name: str, extra: list[str]) -> dict:
        path = work / f"{name}.json"
        if not (args.reuse and path.exists()):
            subprocess.run(
                [sys.executable, "-m", "peer.cli", "reference", *flags, *extra, "--summary-json", str(path)]
                + ["--no-progress"],
                check=True,
                cwd=REPO,
            )
        return json.loads(path.read_text())

    ref = reference("reference", [])
    # the control: one process again, its batch cut into twice the micro-batches. The same data and
    # the same update, summed in another order: how far rounding alone takes a run from the reference
    control = reference("reference_split", ["--micro-batches", str(2 * MICRO_BATCHES)])
    runs = {}
    for name, extra in (("fp32", []), ("bf16", ["--precision", "bf16"])):
        swarm_flags = [*flags, "--volunteers", str(args.volunteers), "--churn", str(args.churn), *extra]
        if args.reuse and (work / f"{name}.json").exists():
            runs[name] = json.loads((work / f"{name}.json").read_text())
        else:
            runs[name] = run_swarm(name, swarm_flags, work, timeout=7200)
        with open(work / name / "logs" / "train.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["loss"]]
        runs[name]["step_losses"] = {int(r["step"]) - 1: float(r["loss"]) for r in rows}

    ref_losses = dict(enumerate(ref["losses"]))
    ref_eval = {int(v): x for v, x in ref["eval_losses"].items()}
    report = Report(
        "A training run end to end: held-out curves",
        f"`python scripts/bench_curve.py --model {args.model} --steps {args.steps} --churn {args.churn}`: a "
        f"corpus of {sum(s['tokens'] for s in manifest['sources']):,} tokens prepared from the Python "
        f"standard library's {', '.join(n for n, _ in SOURCES)} sources, then `peer swarm` "
        f"({args.volunteers} volunteers, {args.churn:.0%} of them killed each step) and `peer reference` with "
        f"`{' '.join(recipe_flags(args.steps))}`. "
        + ("Runs read from the work folder (`--reuse`)." if args.reuse else f"Load at the start: {loadavg()}."),
    )
    rows = []
    for name, s in runs.items():
        common = sorted(set(s["step_losses"]) & set(ref_losses))
        step_gap = max(abs(s["step_losses"][t] - ref_losses[t]) / ref_losses[t] for t in common)
        evals = {int(v): x for v, x in s["eval_losses"].items()}
        eval_gap = max(abs(evals[v] - ref_eval[v]) / ref_eval[v] for v in ref_eval if v in evals)
        rows.append(
            [
                name,
                f"{s['tokens_per_second']:,.0f}",
                exactly_once(s),
                s["volunteers_killed"],
                f"{s['last_loss']:.4f}",
                f"{evals[max(evals)]:.4f}",
                f"{step_gap:.1e}",
                f"{eval_gap:.1e}",
            ]
        )
    report.section(
        "Runs",
        md_table(
            [
                "swarm",
                "tokens/s",
                "micro-batches",
                "volunteers killed",
                "last loss",
                "last held-out loss",
                "largest step-loss gap to the reference (relative)",
                "largest held-out gap (relative)",
            ],
            rows,
        )
        + f"\n\n`peer reference` (fp32): last loss {ref['last_loss']:.4f}, last held-out loss "
        f"{ref_eval[max(ref_eval)]:.4f}.",
    )
    report.section("Rounding alone, as a yardstick", rounding(ref, control, runs["fp32"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sorted(ref_eval), [ref_eval[v] for v in sorted(ref_eval)], "k-", label="peer reference (fp32)")
    for name, style in (("fp32", "o"), ("bf16", "x")):
        evals = {int(v): x for v, x in runs[name]["eval_losses"].items()}
        ax.plot(sorted(evals), [evals[v] for v in sorted(evals)], style, label=f"peer swarm, churn ({name})")
    ax.set_xlabel("version")
    ax.set_ylabel("held-out loss (8 windows)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_curve.png", dpi=110)
    report.add("\n![held-out loss against version](bench_curve.png)\n")
    report.write(out / "bench_curve.md")
    return 0


def gaps(losses: dict[int, float], ref_losses: dict[int, float]) -> dict[int, float]:
    return {t: abs(losses[t] - ref_losses[t]) / ref_losses[t] for t in sorted(set(losses) & set(ref_losses))}


def rounding(ref: dict, control: dict, swarm: dict) -> str:
    """The swarm's distance to the reference beside the control's: one process whose batch is cut
    into twice the micro-batches, the same update summed in another order."""
    ref_losses = dict(enumerate(ref["losses"]))
    ctl = gaps(dict(enumerate(control["losses"])), ref_losses)
    swm = gaps(swarm["step_losses"], ref_losses)
    ref_eval = {int(v): x for v, x in ref["eval_losses"].items()}
    ctl_eval = gaps({int(v): x for v, x in control["eval_losses"].items()}, ref_eval)
    swm_eval = gaps({int(v): x for v, x in swarm["eval_losses"].items()}, ref_eval)
    marks = [t for t in (2, 10, 25, 50, 100, 200, 300, 400, 500) if t - 1 in ctl and t - 1 in swm]
    rows = [[f"step {t}", f"{ctl[t - 1]:.1e}", f"{swm[t - 1]:.1e}"] for t in marks]
    rows.append(["largest, any step", f"{max(ctl.values()):.1e}", f"{max(swm.values()):.1e}"])
    rows.append(["largest held-out gap", f"{max(ctl_eval.values()):.1e}", f"{max(swm_eval.values()):.1e}"])
    return (
        f"`peer reference` again with `--micro-batches {2 * MICRO_BATCHES}`: the same data and the same "
        "update, summed in another order, as the swarm's pushes sum it (each volunteer adds up the "
        "micro-batches it computed before it pushes). Relative gap of the step loss to the reference:\n\n"
        + md_table(["", f"one process, {2 * MICRO_BATCHES} micro-batches", "fp32 swarm, churn"], rows)
        + "\n\nTraining amplifies a rounding difference step by step, whoever makes it: over a long run the swarm is as far from the reference as one process that only sums in "
        "another order. The guarantee is the update rule and the data, exact up to the order of a sum, "
        "not the bits of the 500th step."
    )


if __name__ == "__main__":
    sys.exit(main())
