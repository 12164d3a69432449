"""`peer simulate --link-budget` and `--choose-layout`: what a volunteer's home link costs its GPU,
and the stages and batch that keep a fleet of them busy (scheduler/linkbudget.py, docs/scale.md).

Imports only the scheduler: no torch, no hivemind.
"""

from __future__ import annotations

import json
import math

from peer.errors import UsageError

# bytes an activation value takes on the wire under each --compress codec (8bit: hivemind's 256-level
# codebook, about a byte a value)
ACT_BYTES = {"none": 4, "fp16": 2, "bf16": 2, "8bit": 1}


def parse_range(text: str, name: str) -> tuple[float, float]:
    """'LO-HI' or one number, positive."""
    try:
        parts = [float(x) for x in text.split("-")] if "-" in text.strip("-") else [float(text)]
    except ValueError:
        raise UsageError(f"{name} is a number or a range LO-HI, got {text!r}") from None
    lo, hi = parts[0], parts[-1]
    if len(parts) > 2 or not (0 < lo <= hi and math.isfinite(hi)):
        raise UsageError(f"{name} must be positive numbers LO-HI with LO <= HI, got {text!r}")
    return lo, hi


def _numbers(text: str, name: str, lo: float, hi: float) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or not all(lo < x < hi and math.isfinite(x) for x in out):
        raise UsageError(f"{name} is a comma-separated list of numbers in ({lo:g}, {hi:g}), got {text!r}")
    return out


def link_budget(args, model, counts: list[int]) -> int:
    """`--link-budget`: per link and wire format, the tokens a volunteer computes per version for each
    target utilisation, overlapped and serial (scheduler/linkbudget.py), and the batch it makes."""
    from scheduler.linkbudget import MODES, Volunteer, tokens_for

    links = _numbers(args.link_mbps, "--link-mbps", 0, math.inf)
    targets = _numbers(args.utilisation, "--utilisation", 0, 1)
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu is a share of the peak in (0, 1], got {args.mfu}")
    tflops = parse_range(args.volunteer_tflops, "--volunteer-tflops")[1]
    rows = []
    for mbps in links:
        for pull, push in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")):
            size = {"fp32": 4, "bf16": 2}
            v = Volunteer(tflops=tflops, mbps=mbps, mfu=args.mfu, down_bytes=size[pull], up_bytes=size[push])
            for mode in MODES:
                need = {u: tokens_for(model, args.stages, v, u, mode) for u in targets}
                rows.append({"mbps": mbps, "pull": pull, "push": push, "mode": mode, "tokens": need})
    if args.json:
        print(json.dumps({"tflops": tflops, "mfu": args.mfu, "stages": args.stages, "rows": rows}, indent=1))
        return 0
    per_stage = [max(1, n // args.stages) for n in counts]
    print(
        f"{args.model}, {args.stages} stages; a volunteer of {tflops:g} TFLOP/s at {args.mfu:.0%} of it; tokens a "
        f"volunteer computes per version for its link not to idle it below each utilisation, and the batch "
        f"(tokens per version) with {', '.join(f'{n:,}' for n in counts)} volunteers"
    )
    head = ["link", "pull/push", "mode"] + [f"{u:.0%}: tokens" for u in targets]
    head += [f"{u:.0%}: batch ({n:,})" for u in targets for n in counts]
    table = [
        [f"{r['mbps']:g} Mbit/s", f"{r['pull']}/{r['push']}", r["mode"]]
        + [f"{r['tokens'][u]:,}" for u in targets]
        + [_tokens(r["tokens"][u] * k) for u in targets for k in per_stage]
        for r in rows
    ]
    widths = [max(len(r[i]) for r in table + [head]) for i in range(len(head))]
    for r in [head] + table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def choose(args, model, counts: list[int], seq_len: int) -> int:
    """`--choose-layout`: per volunteer count and target utilisation, every number of stages with the
    batch it needs or why it cannot (scheduler/linkbudget.py `choose_layout`), and the one chosen."""
    from scheduler.linkbudget import Fleet, Wire, choose_layout

    targets = _numbers(args.utilisation, "--utilisation", 0, 1)
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu is a share of the peak in (0, 1], got {args.mfu}")
    if not (args.volunteer_memory_gb > 0 and math.isfinite(args.volunteer_memory_gb)):
        raise UsageError(f"--volunteer-memory-gb must be a positive number, got {args.volunteer_memory_gb}")
    wire = Wire(down=4 if args.precision == "fp32" else 2, up=4, act=ACT_BYTES[args.compress])
    tflops = parse_range(args.volunteer_tflops, "--volunteer-tflops")
    mbps = parse_range(args.volunteer_mbps, "--volunteer-mbps")
    results = []
    for n in counts:
        fleet = Fleet(n, tflops, mbps, mfu=args.mfu, memory_gb=args.volunteer_memory_gb)
        for u in targets:
            rows, best = choose_layout(model, fleet, u, wire, args.server_mbps)
            results.append({"volunteers": n, "utilisation": u, "rows": rows, "chosen": best and best["stages"]})
    if args.json:
        print(json.dumps({"seq_len": seq_len, "results": results}, indent=1))
        return 0
    print(
        f"{args.model} on volunteers of {args.volunteer_tflops} TFLOP/s ({args.mfu:.0%} sustained), "
        f"{args.volunteer_mbps} Mbit/s and {args.volunteer_memory_gb:g} GB; parameters pulled in "
        f"{args.precision}, gradients pushed in fp32, activations {args.compress}; servers of "
        f"{args.server_mbps:g} Mbit/s. Each volunteer computes while it pulls the next version."
    )
    for r in results:
        print()
        print(f"{r['volunteers']:,} volunteers, each busy at least {r['utilisation']:.0%} of the time:")
        print(_layout_table(r["rows"], seq_len))
        print(_chosen_line(r, seq_len))
    return 0


def _layout_table(rows: list[dict], seq_len: int) -> str:
    """One line per number of stages; a run of refused ones at the end shown once, as a range."""
    head = ["stages", "tokens a volunteer a version", "batch (tokens a version)", "version", "tokens/s"]
    head += ["servers a stage", "memory"]
    shown = list(rows)
    while len(shown) > 1 and shown[-1]["reason"] is not None and shown[-2]["reason"] is not None:
        shown.pop()
    table, refused = [], {}
    for r in shown:
        name = str(r["stages"]) if r is not shown[-1] or r is rows[-1] else f"{r['stages']}-{rows[-1]['stages']}"
        if r["reason"] is not None:
            refused[len(table)] = f"no: {r['reason']}"
            table.append([name])
            continue
        lo, mean, hi = r["tokens"]
        table.append(
            [
                name,
                f"{_tokens(mean)} ({_tokens(lo)}-{_tokens(hi)})",
                f"{_tokens(r['batch'])} ({r['batch'] / seq_len:,.0f} sequences)",
                f"{r['version_s']:,.0f} s",
                f"{r['tokens_per_s']:,.0f}",
                str(max(r["servers"])),
                f"{r['memory_gb']:.3g} GB",
            ]
        )
    widths = [max(len(x[i]) for x in table + [head] if i < len(x)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths)).rstrip()]
    for i, x in enumerate(table):
        cells = [x[0].ljust(widths[0]), refused[i]] if i in refused else [c.ljust(w) for c, w in zip(x, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _chosen_line(r: dict, seq_len: int) -> str:
    best = next((x for x in r["rows"] if x["stages"] == r["chosen"]), None)
    if best is None:
        return f"chosen: none; no number of stages keeps every volunteer busy {r['utilisation']:.0%} of the time"
    return (
        f"chosen: {best['stages']} stage(s), {max(best['servers'])} servers a stage; a batch of "
        f"{best['batch']:,.0f} tokens ({best['batch'] / seq_len:,.0f} sequences of {seq_len:,}) a version, "
        f"each volunteer computing {best['tokens'][1]:,.0f} tokens a version on average; a version every "
        f"{best['version_s']:,.0f} s, {best['tokens_per_s']:,.0f} tokens/s"
    )


def _tokens(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"
