#!/usr/bin/env python3
"""What the training recipe costs a swarm: tokens/s of `peer swarm` with global gradient-norm clipping
(`--clip-grad-norm`, one round of sums between the servers a batch) against the same run without it,
calm and under churn, each run's final parameters against `peer reference` with the same flags.

    python scripts/bench_train.py [--model small] [--steps 30] [--repeats 2] [--churn 0.25] [--out docs]

Runs alternate (without, with, with, without, ...) so that a drift of the machine's speed, or
being the first of a pair, falls on both; the table gives every run and the median ratio. Tokens/s are the swarm's own (steps x batch x
sequence length / training wall time, from the moment every server is online). Writes
DIR/bench_train.md (DIR defaults to docs/)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (  # noqa: E402
    Report,
    exactly_once,
    loadavg,
    md_table,
    out_folder,
    rel_l2,
    run_swarm,
    swarm_bench_parser,
    train_run_reference,
    work_folder,
)

CLIP = 1.0


def main() -> int:
    p = swarm_bench_parser(__doc__, steps=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--churn", type=float, default=0.25)
    args = p.parse_args()
    out = out_folder(p, args.out)
    work = work_folder(args.work, "bench_train.")

    import torch
    from safetensors.torch import load_file

    from core.protocol.recipe import Recipe

    references = {}

    def reference(clip):
        if clip not in references:
            summary = {}
            state = train_run_reference(
                args.model, args.steps, recipe=Recipe(lr=2e-3, clip_grad_norm=clip), summary=summary
            )
            references[clip] = (state, summary)
        return references[clip]

    report = Report(
        "Training recipe: what global gradient clipping costs",
        f"`python scripts/bench_train.py --model {args.model} --steps {args.steps} --repeats {args.repeats} "
        f"--churn {args.churn}`: `peer swarm --model {args.model}` ({args.volunteers} volunteers, servers "
        f"not computing), without and with `--clip-grad-norm {CLIP}`, calm and with {args.churn:.0%} of the "
        f"volunteers killed (and replaced) each step. Load at the start: {loadavg()}.",
    )
    rows, ratios = [], {}
    torch.set_num_threads(1)
    for churn in (0.0, args.churn):
        for r in range(args.repeats):
            for clip in (None, CLIP) if r % 2 == 0 else (CLIP, None):  # (ABBA: neither always goes first)
                name = f"c{churn}-r{r}-{'clip' if clip else 'none'}"
                flags = ["--model", args.model, "--steps", str(args.steps), "--volunteers", str(args.volunteers)]
                flags += ["--churn", str(churn), "--checkpoint-out", str(work / name / "final")]
                if clip:
                    flags += ["--clip-grad-norm", str(CLIP)]
                s = run_swarm(name, flags, work)
                state = load_file(str(work / name / "final" / "model.safetensors"))
                ref_state, ref_summary = reference(clip)
                rows.append(
                    [
                        "calm" if churn == 0 else f"churn {churn}",
                        "yes" if clip else "no",
                        r + 1,
                        f"{s['tokens_per_second']:,.0f}",
                        f"{s['wall_seconds'] / args.steps:.2f}",
                        exactly_once(s),
                        f"{rel_l2(state, ref_state):.1e}",
                    ]
                )
                ratios.setdefault(churn, {}).setdefault(bool(clip), []).append(s["tokens_per_second"])
                print(rows[-1], flush=True)
    report.section(
        "Runs",
        md_table(
            ["run", "clipped", "repeat", "tokens/s", "s/step", "micro-batches", "final vs reference (rel. L2)"], rows
        ),
    )
    lines, calm = [], None
    for churn, by in ratios.items():
        ratio = statistics.median(by[True]) / statistics.median(by[False])
        if churn == 0:
            calm = (ratio, min(by[False]), max(by[False]), min(by[True]), max(by[True]))
        lines.append(
            f"- {'calm' if churn == 0 else f'churn {churn}'}: median tokens/s {statistics.median(by[True]):,.0f} "
            f"clipped against {statistics.median(by[False]):,.0f} unclipped: **{ratio:.2f}x**"
        )
    norms = reference(CLIP)[1]["grad_norms"]
    lines.append(
        f"- the reference's gradient norms over the {args.steps} steps: {min(norms):.3g}-{max(norms):.3g} "
        f"(every step with a norm over {CLIP} is clipped)"
    )
    report.section("Clipping's cost", "\n".join(lines))
    report.section(
        "How the round is made cheap",
        "Each server sends the sum of squares of each slot it hosts to every other server once the slot's "
        "batch is complete (a few dozen bytes a server and batch) and steps when it knows every slot's. "
        "The delayed update is the slack: batch t's update is needed by the tasks of batch t + 2, so a "
        "stage waiting for the first stage's last backward of batch t waits while batch t + 1 is computed "
        "(parameter_server/clipping.py). What it does not hide: a stage's two slots live on two servers "
        "(frontal and backward), so each waits one message from the other after its own slot's batch is "
        "complete, and stage 0's frontal server publishes the next batch's tasks only after that step: one "
        "message between two servers on the critical path of every step: on this machine the calm runs' "
        + (
            f"{calm[0]:.2f}x (the repeats' tokens/s: {calm[1]:,.0f}-{calm[2]:,.0f} unclipped, "
            f"{calm[3]:,.0f}-{calm[4]:,.0f} clipped)"
            if calm
            else "cost (no calm runs here)"
        )
        + ". Under churn the step waits on volunteers far longer than that, and the cost is within the "
        "runs' spread.",
    )
    report.write(out / "bench_train.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
