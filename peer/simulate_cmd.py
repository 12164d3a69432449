"""`peer simulate`: what a swarm of thousands of volunteers would do, from the step model of a group of
them and the load they put on the servers and the DHT (scheduler/scale.py).

    peer simulate [--volunteers 1000,10000] [--model small] [--stages 2] [--servers-per-stage 2]
                  [--volunteer-tflops 0.005-0.02] [--volunteer-mbps 20-100] [--volunteer-delay-ms 20-80]
                  [--server-tflops 10] [--server-mbps 1000] [--churn 0.1] [--calibration FILE]
                  [--check RESULTS.json] [--json]

Imports only the scheduler and the model presets: no torch, no hivemind.
"""

from __future__ import annotations

import argparse
import json
import math

from peer.errors import UsageError
from peer.simulate_links import ACT_BYTES, choose, link_budget, parse_range

# Measured on the 2-core development machine (scripts/bench_fidelity.py, model small): a P2P call's
# own cost and its cost per payload byte, this CPU's FLOP/s, and how a forward pass and a backward
# pass from kept activations compare with forward+loss+backward. A `--calibration` file (written by
# scripts/bench_scale.py) replaces them with what another machine measured.
CALL_SECONDS = 0.49e-3
BYTE_SECONDS = 3.73e-9
REF_FLOPS = 50.7e9
FORWARD_SHARE, BACKWARD_SHARE = 0.39, 0.67
ADAM_SECONDS_PER_PARAM = 2.3e-9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--volunteers", default="1000,10000", help="volunteer counts, comma-separated")
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--servers-per-stage", type=int, default=2, help="frontal + backward servers of a stage")
    p.add_argument("--volunteer-tflops", default="0.005-0.02", help="each volunteer's compute, drawn from LO-HI")
    p.add_argument("--volunteer-mbps", default="20-100", help="each volunteer's link to the servers, LO-HI")
    p.add_argument("--volunteer-delay-ms", default="20-80", help="each volunteer's one-way delay, LO-HI")
    p.add_argument("--server-tflops", type=float, default=10.0, help="a server's processor (re-runs of checked work)")
    p.add_argument("--server-mbps", type=float, default=1000.0, help="each server's uplink and downlink")
    p.add_argument("--client-batch-tokens", type=int, default=1024, help="the piece of a batch a volunteer computes")
    p.add_argument("--churn", type=float, default=0.0, help="fraction of the volunteers lost and replaced a step")
    p.add_argument("--rejoin-seconds", type=float, default=10.0, help="a replacement's time to join")
    p.add_argument("--no-requeue", action="store_true", help="a lost task waits for its lease to run out")
    p.add_argument("--task-timeout", type=float, default=30.0)
    p.add_argument("--verify-rate", type=float, default=0.05)
    p.add_argument("--announce-period", type=float, default=5.0)
    p.add_argument("--group", type=int, default=8, help="volunteers a stage the step model plays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration", metavar="FILE", help="costs measured on another machine (bench_scale's)")
    p.add_argument("--check", metavar="RESULTS.json", help="compare with bench_scale's measured points")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument(
        "--link-budget",
        action="store_true",
        help="print instead the tokens a volunteer must compute a version for its link not to idle it "
        "(the fastest of --volunteer-tflops, on each of --link-mbps), and the batch that makes",
    )
    p.add_argument("--link-mbps", default="20,50,200", help="with --link-budget: volunteer links, comma-separated")
    p.add_argument("--utilisation", default="0.5,0.9", help="with --link-budget: targets in (0, 1), comma-separated")
    p.add_argument(
        "--mfu",
        type=float,
        default=0.4,
        help="with --link-budget or --choose-layout: the share of its peak a volunteer sustains",
    )
    p.add_argument(
        "--choose-layout",
        action="store_true",
        help="print instead, for each count of --volunteers and each --utilisation, the number of stages "
        "and the batch that keep every volunteer busy that share of the time on its link, and choose one",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16"],
        help="with --choose-layout: the run's --precision (bf16: volunteers pull parameters in bf16)",
    )
    p.add_argument(
        "--compress",
        default="none",
        choices=list(ACT_BYTES),
        help="with --choose-layout: the run's --compress, the activations' codec between stages",
    )
    p.add_argument(
        "--volunteer-memory-gb",
        type=float,
        default=24.0,
        help="with --choose-layout: a volunteer's device memory (GB) for its stage's parameters",
    )


def calibration(args, cfg, model):
    from scheduler.scale import segment_layers
    from scheduler.step_io import Calibration

    if args.calibration:
        try:
            with open(args.calibration) as f:
                data = json.load(f)
            return Calibration(**data)
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise UsageError(f"--calibration {args.calibration}: {e}") from None
    fb = []
    for k in range(args.stages):
        lo, hi = segment_layers(cfg.layers, args.stages, k)
        fb.append(cfg.seq_len * (hi - lo) * model.flops_per_token_per_layer / REF_FLOPS)
    slot_params = model.params_per_layer * cfg.layers / args.stages / args.servers_per_stage
    return Calibration(
        call_seconds=CALL_SECONDS,
        byte_seconds=BYTE_SECONDS,
        ref_flops=REF_FLOPS,
        forward_row=[FORWARD_SHARE * x for x in fb],
        fb_row=fb,
        backward_row=[BACKWARD_SHARE * x for x in fb[:-1]] + [0.0],
        slice_build=[0.0] * args.stages,
        apply_seconds=ADAM_SECONDS_PER_PARAM * slot_params,
    )


def swarm_for(args, n: int, **over):
    from scheduler.scale import Swarm

    kw = dict(
        volunteers=n,
        stages=args.stages,
        servers_per_stage=args.servers_per_stage,
        volunteer_tflops=parse_range(args.volunteer_tflops, "--volunteer-tflops"),
        volunteer_mbps=parse_range(args.volunteer_mbps, "--volunteer-mbps"),
        volunteer_delay_ms=parse_range(args.volunteer_delay_ms, "--volunteer-delay-ms"),
        server_tflops=args.server_tflops,
        server_mbps=args.server_mbps,
        client_batch_tokens=args.client_batch_tokens,
        churn=args.churn,
        rejoin_s=args.rejoin_seconds,
        requeue=not args.no_requeue,
        task_timeout=args.task_timeout,
        verify_rate=args.verify_rate,
        announce_period=args.announce_period,
        seed=args.seed,
    )
    kw.update(over)
    return Swarm(**kw)


def validate(args) -> list[int]:
    try:
        counts = [int(x) for x in args.volunteers.split(",")]
    except ValueError:
        raise UsageError(f"--volunteers is a comma-separated list of counts, got {args.volunteers!r}") from None
    if not counts or min(counts) < args.stages:
        raise UsageError(f"--volunteers: every count must be at least --stages ({args.stages}), got {args.volunteers}")
    if args.stages < 1 or args.servers_per_stage < 2 or args.servers_per_stage % 2:
        raise UsageError("--stages must be >= 1 and --servers-per-stage an even number >= 2 (frontal + backward)")
    if not 0 <= args.churn < 1:
        raise UsageError(f"--churn is a fraction in [0, 1), got {args.churn}")
    for name in ("server_tflops", "server_mbps", "rejoin_seconds", "task_timeout", "announce_period"):
        v = getattr(args, name)
        if not (v > 0 and math.isfinite(v)):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    if not 0 <= args.verify_rate <= 1 or args.client_batch_tokens < 1 or args.group < 1:
        raise UsageError("--verify-rate is in [0, 1]; --client-batch-tokens and --group are >= 1")
    for name in ("volunteer_tflops", "volunteer_mbps", "volunteer_delay_ms"):
        parse_range(getattr(args, name), "--" + name.replace("_", "-"))
    return counts


def run(args: argparse.Namespace) -> int:
    from core.model.config import PRESETS, get_preset, planner_model_file
    from scheduler import load_model
    from scheduler.scale import predict

    if args.model not in PRESETS:
        raise UsageError(f"--model {args.model!r} is not a preset ({', '.join(PRESETS)})")
    counts = validate(args)
    cfg = get_preset(args.model)
    model = load_model(planner_model_file(cfg, 64, 4, bytes_per_value=4))
    if args.link_budget and args.choose_layout:
        raise UsageError("--link-budget and --choose-layout are two reports: give one")
    if args.link_budget:
        return link_budget(args, model, counts)
    if args.choose_layout:
        return choose(args, model, counts, cfg.seq_len)
    cal = calibration(args, cfg, model)
    if args.check:
        return check(args, cfg, model, cal)
    preds = [predict(swarm_for(args, n), model, cfg.seq_len, cal, group=args.group) for n in counts]
    if args.json:
        print(json.dumps([p.__dict__ for p in preds], indent=1))
        return 0
    print(
        f"{args.model}, {args.stages} stages x {args.servers_per_stage} servers ({args.server_mbps:g} Mbit/s, "
        f"{args.server_tflops:g} TFLOP/s each), volunteers {args.volunteer_tflops} TFLOP/s, "
        f"{args.volunteer_mbps} Mbit/s, {args.volunteer_delay_ms} ms, churn {args.churn:g}"
    )
    head = [
        "volunteers",
        "tokens/s",
        "s/step",
        "volunteer busy",
        "limit",
        "uplink s",
        "processor s",
        "servers/stage needed",
        "DHT holder",
    ]
    rows = []
    for p in preds:
        uplink, processor = p.resource_s["a server's uplink"], p.resource_s["a server's processor"]
        rows.append(
            [
                f"{p.volunteers:,}",
                f"{p.tokens_per_second:,.0f}",
                f"{p.step_s:.2f}",
                f"{p.volunteer_utilisation:.1%}",
                p.bottleneck,
                f"{uplink:.2f}",
                f"{processor:.2f}",
                str(p.servers_per_stage_needed),
                f"{p.dht_mbps_per_holder:,.1f} Mbit/s ({p.dht_share:.0%} of a volunteer's link)",
            ]
        )
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def check(args, cfg, model, cal) -> int:
    """bench_scale's measured points beside this model's prediction for each."""
    from scheduler.scale import predict_measured

    try:
        with open(args.check) as f:
            points = json.load(f)
        setup = points["setup"]
        measured = points["results"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"--check {args.check}: not bench_scale's results ({e})") from None
    print("volunteers  run                  measured tokens/s  model  model/measured")
    worst = 0.0
    for r in measured:
        p = predict_measured(swarm_for(args, r["volunteers"]), setup, r, model, cfg.seq_len, cal)
        ratio = p.tokens_per_second / r["tokens_per_second"]
        worst = max(worst, abs(ratio - 1))
        run_name = f"{r['kind']} {r['mode']}"
        print(
            f"{r['volunteers']:<10}  {run_name:<19}  {r['tokens_per_second']:>17,.0f}  {p.tokens_per_second:>5,.0f}  {ratio:.2f}"
        )
    print(f"largest difference: {worst:.0%}")
    return 0
