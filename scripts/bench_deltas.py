#!/usr/bin/env python3
"""What pulling parameter versions as differences saves (core/protocol/param_delta.py): the bytes a
version's difference from the one before weighs against the version, offline at several learning
rates; then a swarm's parameter traffic per volunteer and version with and without it, fp32 and bf16,
and each run's final parameters against `peer reference`.

    python scripts/bench_deltas.py [--model small] [--steps 20] [--volunteers 4] [--out docs]

Offline: the whole model, AdamW (weight decay 0.1) for --offline-steps steps on random tokens at each
learning rate, then the last step's two versions: each deflated alone (byte planes regrouped, as a
difference against zeros) and as a difference, in fp32 and rounded to bfloat16, and the seconds the
difference takes to make and to apply a MB. Swarm: `peer swarm --model M --servers-compute no` (lr
2e-3, the benchmarks' default), the servers' `get_params` answer bytes (every pull of every
volunteer, and the servers' own checks and the final assembly, which pull whole) over volunteers x
steps, and the differences the servers sent. Writes DIR/bench_deltas.md (DIR defaults to docs/)."""

from __future__ import annotations

import sys
import time
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

LRS = (1e-3, 3e-4, 1e-4)


def offline(model: str, steps: int) -> list[list]:
    import torch

    from core.model.config import get_preset
    from core.model.transformer import build_slice, loss_sum
    from core.protocol import param_delta

    cfg = get_preset(model)
    rows = []
    for lr in LRS:
        net = build_slice(cfg, 0, cfg.layers, seed=0)
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)
        gen = torch.Generator().manual_seed(0)
        versions = []
        for _ in range(steps):
            x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=gen)
            y = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss_sum(net(x), y).backward()
            opt.step()
            versions.append([p.detach().clone() for p in net.parameters()])
        row = [f"{lr:g}"]
        for dtype in (torch.float32, torch.bfloat16):
            base, target = ([t.to(dtype) for t in v] for v in versions[-2:])
            size = sum(t.numel() * t.element_size() for t in target)
            alone = len(param_delta.difference([torch.zeros_like(t) for t in target], target))
            t0 = time.perf_counter()
            blob = param_delta.difference(base, target)
            made = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = param_delta.decode(base, blob)
            applied = time.perf_counter() - t0
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(back, target))
            row += [
                f"{alone / size:.2f}x",
                f"{len(blob) / size:.2f}x",
                f"{made / size * 1e6:.3f} / {applied / size * 1e6:.3f}",
            ]
        rows.append(row)
    return rows


def main() -> int:
    p = swarm_bench_parser(__doc__, steps=20)
    p.add_argument("--offline-steps", type=int, default=6)
    args = p.parse_args()
    out = out_folder(p, args.out)
    work = work_folder(args.work, "bench_deltas.")

    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    report = Report(
        "Parameter versions pulled as differences (scripts/bench_deltas.py)",
        f"`python scripts/bench_deltas.py --model {args.model} --steps {args.steps} --volunteers "
        f"{args.volunteers}` on this machine (2 cores, no GPU). Load at the start: {loadavg()}.",
    )
    report.section(
        "A version's difference from the one before, offline",
        f"`{args.model}`, AdamW (weight decay 0.1), step {args.offline_steps} of {args.offline_steps} on random "
        "tokens; each figure a share of the version's bytes in that dtype; making and applying a "
        "difference in seconds a MB (zlib at its fastest level, this machine's CPU).\n\n"
        + md_table(
            [
                "learning rate",
                "fp32: version deflated",
                "fp32: difference",
                "fp32: s/MB make / apply",
                "bf16: version deflated",
                "bf16: difference",
                "bf16: s/MB make / apply",
            ],
            offline(args.model, args.offline_steps),
        ),
    )
    rows = []
    references = {}
    for precision in ("fp32", "bf16"):
        if precision not in references:
            references[precision] = train_run_reference(args.model, args.steps, precision=precision)
        per_pull = {}
        for deltas in (False, True):
            name = f"{precision}-{'deltas' if deltas else 'whole'}"
            flags = ["--model", args.model, "--steps", str(args.steps), "--volunteers", str(args.volunteers)]
            flags += [
                "--servers-compute",
                "no",
                "--precision",
                precision,
                "--checkpoint-out",
                str(work / name / "final"),
            ]
            if not deltas:
                flags.append("--no-param-deltas")
            s = run_swarm(name, flags, work)
            state = load_file(str(work / name / "final" / "model.safetensors"))
            pulled = s["traffic"].get("get_params.response", 0)
            per_pull[deltas] = pulled / (args.volunteers * args.steps)
            rows.append(
                [
                    precision,
                    "differences" if deltas else "whole",
                    f"{per_pull[deltas] / 1e6:.2f}",
                    f"{per_pull[deltas] / per_pull[False]:.2f}x" if deltas else "1x",
                    f"{s['param_deltas']['sent']} / {s['param_deltas']['declined']}",
                    f"{s['tokens_per_second']:,.0f}",
                    exactly_once(s),
                    f"{rel_l2(state, references[precision]):.1e}",
                    s["load"],
                ]
            )
            print(rows[-1], flush=True)
    report.section(
        "A swarm's parameter pulls",
        f"`peer swarm --model {args.model} --steps {args.steps} --volunteers {args.volunteers} --servers-compute "
        "no --precision P` with and without `--no-param-deltas`. MB per volunteer and version: the servers' "
        "`get_params` answers over volunteers x steps (the servers' checks and the final assembly pull "
        "whole in both). Differences: sent / asked for and sent whole (no smaller, or the base not the "
        "server's).\n\n"
        + md_table(
            [
                "precision",
                "versions pulled",
                "MB per volunteer and version",
                "vs whole",
                "differences sent / declined",
                "tokens/s",
                "micro-batches",
                "final vs reference (rel. L2)",
                "load",
            ],
            rows,
        ),
    )
    saved = {r[0]: r[3] for r in rows if r[1] == "differences"}
    report.section(
        "Reading it",
        f"Pulled as differences, a volunteer's parameter bytes a version were {saved.get('fp32', '-')} of whole "
        f"in fp32 and {saved.get('bf16', '-')} in bf16 here, less than offline: the swarm's learning rate "
        "(2e-3) moves more bits a step, and a version a volunteer pulls after it is no longer its slot's newest "
        "goes whole (the declined ones). The runs' final parameters are as far from the reference with "
        "differences as without (a bf16 run whose micro-batches are cut into rows rounds otherwise than the "
        "reference, with or without them: tests/swarm/test_precision.py). Tokens/s are one run each, on "
        "loopback where bytes cost nothing and the machine's load moved between runs: they do not measure the "
        "differences' cost, which is the processor time in the first table (made once per version at the "
        "server, applied once per pull), against a link's time for the bytes saved (1 MB at 50 Mbit/s: 0.16 s).",
    )
    report.write(out / "bench_deltas.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
