#!/usr/bin/env python3
"""How far a gradient push's direction tells a sign-flipping liar from an honest volunteer: the
server's direction check (parameter_server/arrivals.py `unusual_direction`) replayed on the pushes of
a real training run, without a swarm.

    python scripts/bench_directions.py [--models tiny,small] [--steps 100,40] [--rows 2,4] [--out DIR]

The run is `peer reference`'s (AdamW, the default recipe, batch 16 of 4 micro-batches, delay 1), in
2 stages, each stage's parameters cut into 2 shard slots as the servers cut them (core.layout's
`assign_shards`). At every step from the fifth on, the batch is cut into pushes of `rows` rows, as
tasks of that many rows would push them; for each push and each slot, its cosine with the slot's
AdamW first moment (the server's `momentum_cosine`) goes through the server's rule in the order the
pushes came: re-run when the slot's recent pushes agree with the moment (median cosine at least
DIRECTION_MIN_MEDIAN over at least DIRECTION_MIN_HISTORY of them) and this one agrees less than all
but DIRECTION_QUANTILE of them. Beside each honest push, the same push negated (a sign flip, which
keeps its norm) is put to the same rule against the same history (and not added to it).

Per model, stage, slot and push size: the pushes, the median cosine, the share of the time the
slot's pushes agreed enough for the check to apply, the share of honest pushes re-run, and the
share of sign flips re-run. Writes DIR/bench_directions.md (DIR defaults to docs/)."""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, Report, loadavg, md_table  # noqa: E402

BATCH, MICRO, STAGES, SLOTS, WARM = 16, 4, 2, 2, 5


def slot_names(cfg, layout) -> list[list[list[str]]]:
    """stage -> slot -> parameter names, as the stage's servers cut them."""
    from core.layout import assign_shards
    from core.model.transformer import build_slice

    out = []
    for st in layout.stages:
        params = dict(build_slice(cfg, st.layers[0], st.layers[1], 0, "cpu").named_parameters())
        out.append(assign_shards({n: p.numel() for n, p in params.items()}, SLOTS))
    return out


class Rule:
    """The server's direction rule for one slot (parameter_server.arrivals.Arrivals.unusual_direction:
    the part itself), fed cosines in order, each from another volunteer."""

    def __init__(self):
        import random

        from parameter_server.arrivals import Arrivals

        self.server = Arrivals(
            verify_rate=0.0,
            probation=0,
            rng=random.Random(0),
            drift=None,
            counts={},
            banned={},
            clients={},
            is_server=lambda peer: False,
            replaying=lambda: False,
            kept_from=lambda: 0,
        )
        self.pushes = 0

    def judge(self, cosine: float, keep: bool = True) -> tuple[bool, bool]:
        """(whether the check applied, whether this push would be re-run)."""
        from parameter_server.arrivals import direction_bar

        self.pushes += 1
        sender = f"volunteer-{self.pushes}"
        history = self.server.push_cosines.get(0)
        applies = direction_bar(history or (), sender) is not None
        kept = None if history is None else collections.deque(history, maxlen=history.maxlen)
        shard = SimpleNamespace(momentum_cosine=lambda grads: cosine)
        rerun = self.server.unusual_direction(0, shard, [], sender)
        if not keep:  # (a push put to the rule and not added to what it remembers)
            if kept is None:
                del self.server.push_cosines[0]
            else:
                self.server.push_cosines[0] = kept
        return applies, rerun


def measure(model: str, steps: int, rows: int) -> list[dict]:
    import torch

    from core.layout import RunLayout
    from core.model.config import get_preset
    from core.model.data import load_corpus, make_batch
    from core.model.optim import apply_update, batch_gradient, make_optimizer
    from core.model.transformer import build_slice, loss_sum
    from core.protocol.recipe import Recipe

    cfg = get_preset(model)
    layout = RunLayout.even(STAGES, cfg.layers)
    slots = slot_names(cfg, layout)
    corpus = load_corpus(None, seq_len=cfg.seq_len)
    torch.manual_seed(0)
    net = build_slice(cfg, 0, cfg.layers, 0, "cpu")
    recipe = Recipe(lr=2e-3)
    optimizer = make_optimizer(net.parameters(), recipe)
    params = dict(net.named_parameters())
    rules = {(k, j): Rule() for k in range(STAGES) for j in range(SLOTS)}
    seen = {key: {"cos": [], "applied": 0, "honest": 0, "flips": 0} for key in rules}
    pending = []
    for t in range(steps):
        x, y = make_batch(corpus, 0, t, BATCH, cfg.seq_len)
        if t >= WARM:
            for lo in range(0, BATCH, rows):
                for p in params.values():
                    p.grad = None
                loss_sum(net(x[lo : lo + rows]), y[lo : lo + rows]).backward()
                for (k, j), rule in rules.items():
                    names = slots[k][j]
                    g = torch.cat([params[n].grad.reshape(-1) for n in names])
                    m = torch.cat([optimizer.state[params[n]]["exp_avg"].reshape(-1) for n in names])
                    cosine = float(g @ m) / float((g @ g) * (m @ m)) ** 0.5
                    flipped_applies, flipped_rerun = rule.judge(-cosine, keep=False)
                    applies, rerun = rule.judge(cosine)
                    s = seen[(k, j)]
                    s["cos"].append(cosine)
                    s["applied"] += applies
                    s["honest"] += rerun
                    s["flips"] += flipped_rerun
            for p in params.values():
                p.grad = None
        _, grads = batch_gradient(net, x, y, MICRO)
        pending.append(grads)
        while len(pending) > 1:
            apply_update(optimizer, net, pending.pop(0), recipe.lr_at(t, steps), None)
    out = []
    for (k, j), s in seen.items():
        n = len(s["cos"])
        head = any(name.startswith(("lm_head", "norm.")) for name in slots[k][j])
        embed = any(name.startswith("embed") for name in slots[k][j])
        out.append(
            {
                "model": model,
                "stage": k,
                "slot": j,
                "holds": "head" if head else "embedding" if embed else "layers",
                "rows": rows,
                "pushes": n,
                "median": statistics.median(s["cos"]),
                "applied": s["applied"] / n,
                "honest": s["honest"] / n,
                "flips": s["flips"] / n,
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--steps", default="100,40", help="steps of each model's run (comma-separated, in order)")
    p.add_argument("--rows", default="2,4", help="rows a push (comma-separated)")
    p.add_argument("--out", type=Path, default=REPO / "docs")
    a = p.parse_args(argv)
    models, steps = a.models.split(","), [int(s) for s in a.steps.split(",")]
    if len(steps) != len(models) or any(s <= WARM for s in steps):
        p.error(f"--steps needs one count over {WARM} per model")
    rows = [int(r) for r in a.rows.split(",")]
    if any(r < 1 or BATCH % r for r in rows):
        p.error(f"--rows must divide the batch of {BATCH}")
    start = loadavg()
    results = []
    for model, n in zip(models, steps):
        for r in rows:
            print(f"[{time.strftime('%H:%M:%S')}] {model}, {n} steps, pushes of {r} rows", flush=True)
            results += measure(model, n, r)
    table = md_table(
        [
            "model",
            "stage",
            "slot (holds)",
            "rows a push",
            "pushes",
            "median cosine",
            "check applies",
            "honest pushes re-run",
            "sign flips re-run",
        ],
        [
            [
                r["model"],
                r["stage"],
                f"{r['slot']} ({r['holds']})",
                r["rows"],
                r["pushes"],
                f"{r['median']:.2f}",
                f"{r['applied']:.0%}",
                f"{r['honest']:.1%}",
                f"{r['flips']:.0%}",
            ]
            for r in results
        ],
    )
    print(table)
    report = Report(
        "A push's direction against a sign-flipping liar (scripts/bench_directions.py)",
        f"Measured {time.strftime('%Y-%m-%d')} on this machine (2 cores, no GPU; counts, not times: the load, "
        f"{start} at the start, does not change them).",
    )
    report.section(
        "The server's direction rule on a real run's pushes", __doc__.split("\n\n", 2)[2].split("\n\nPer")[0]
    )
    report.add(table)
    report.add(
        "'check applies': the share of pushes that met a slot whose recent pushes agree with its moment "
        "(the rule's gate); 'honest pushes re-run': the re-runs the check costs on honest work (on top of "
        "the sample's `--verify-rate`); 'sign flips re-run': the chance a sign-flipped push is re-run, so "
        "caught, whatever the sample draws."
    )
    report.write(a.out / "bench_directions.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
