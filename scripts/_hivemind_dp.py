#!/usr/bin/env python3
"""One volunteer of hivemind's own collaborative data-parallel training (`hivemind.Optimizer`, as in
DeDLOC and the hivemind quickstart), for scripts/bench_peers.py: the whole model on every peer, a
global batch of --batch-size sequences gathered from every peer's local steps, gradients averaged
by all-reduce, then the same AdamW (core/model/optim.py) on every peer.

    python scripts/_hivemind_dp.py --run-id R --index I --out DIR [--initial-peers MADDR ...]

The peer of --index 0 prints `initial_peers=<multiaddr>` and, once the collaboration reaches epoch
--steps, writes DIR/model.pt (its parameters), DIR/epochs.pt (its parameters at the end of each epoch,
with the seconds since its first local step) and DIR/summary.json (wall time from its first epoch
to the last, tokens/s, its loss per epoch), then exits; the others train until they are stopped.
Each peer draws its own rows from the corpus (batches of its own stream, seeded by --index and
its restart count), so peers that die and are replaced never repeat a stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-id", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=0, help="how many peers ran under this index before")
    p.add_argument("--out", required=True)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--host", default="127.0.0.1", help="the address its DHT and p2p daemon listen on")
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--local-rows", type=int, default=4, help="sequences per local step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="a local step's forward and backward last this x their processor time (an emulated "
        "device, as `peer join --slowdown`)",
    )
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    p.add_argument("--averaging-timeout", type=float, default=10.0)
    p.add_argument(
        "--refresh",
        type=float,
        default=0.5,
        help="how often the progress tracker re-reads the collaboration's progress (hivemind: 3 s)",
    )
    p.add_argument(
        "--go-file",
        default=None,
        help="write GO_FILE.ready.INDEX once the optimizer is up, then train only once GO_FILE "
        "exists (the first peers of a run start together, so that none trains alone while "
        "the others load; replacements join at once)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)  # as every swarm process runs

    import hivemind
    from hivemind.utils.logging import use_hivemind_log_handler

    from core.model.config import get_preset
    from core.model.data import load_corpus, make_batch
    from core.model.optim import make_optimizer
    from core.model.transformer import build_slice, loss_sum
    from core.protocol.recipe import Recipe

    use_hivemind_log_handler("nowhere")
    cfg = get_preset(args.model)
    corpus = load_corpus(None, seq_len=cfg.seq_len)
    model = build_slice(cfg, 0, cfg.layers, seed=args.seed)
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    if args.index == 0:
        print("initial_peers=" + str(dht.get_visible_maddrs()[0]), flush=True)
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.batch_size,
        batch_size_per_step=args.local_rows,
        optimizer=lambda params: make_optimizer(params, Recipe(lr=args.lr)),
        params=model.parameters(),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        use_local_updates=False,
        tracker_opts={
            "min_refresh_period": args.refresh / 5,
            "default_refresh_period": args.refresh,
            "max_refresh_period": 2 * args.refresh,
        },
        verbose=False,
    )
    if args.go_file:
        Path(f"{args.go_file}.ready.{args.index}").touch()
        while not os.path.exists(args.go_file):
            time.sleep(0.05)
    stream = 1_000_003 * (args.index + 1) + 10_007 * args.incarnation
    epochs: list[dict] = []
    started = None
    began = time.perf_counter()  # the first local step: what a time to a loss counts from
    snapshots: list[dict] = []  # peer 0: its parameters at each epoch's end, for their held-out loss
    local_step = 0
    computing = 0.0  # seconds its forward and backward passes lasted (on the emulated device)
    while opt.local_epoch < args.steps:
        x, y = make_batch(corpus, args.seed + stream, local_step, args.local_rows, cfg.seq_len)
        local_step += 1
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = loss_sum(model(x), y) / y.numel()
        loss.backward()
        lasts = max(time.perf_counter() - t0, args.slowdown * (time.thread_time() - c0))
        time.sleep(max(0.0, t0 + lasts - time.perf_counter()))
        computing += lasts
        before = opt.local_epoch
        opt.step()
        opt.zero_grad()
        if opt.local_epoch != before and args.index != 0:  # in its log: which epochs it took part in
            said = {"epoch": opt.local_epoch, "local_steps": local_step, "compute_seconds": computing}
            print(json.dumps({**said, "since_first_step": time.perf_counter() - began}), flush=True)
        if args.index == 0 and opt.local_epoch != before:
            now = time.perf_counter()
            if started is None:  # the first epoch's end: from here on, as the swarm's wall clock
                started = now
            epochs.append({"epoch": opt.local_epoch, "t": now - started, "loss": loss.item()})
            print(json.dumps(epochs[-1]), flush=True)
            snapshots.append(
                {
                    "epoch": opt.local_epoch,
                    "since_start": now - began,
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                }
            )
    if args.index == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "model.pt")
        torch.save(snapshots, out / "epochs.pt")
        wall = epochs[-1]["t"] if len(epochs) > 1 else float("nan")
        timed = len(epochs) - 1  # epochs after the first one's end
        summary = {
            "epochs": opt.local_epoch,
            "wall_seconds": wall,
            "epochs_timed": timed,
            "tokens_per_second": timed * args.batch_size * cfg.seq_len / wall if timed else 0.0,
            "losses": [e["loss"] for e in epochs],
            "local_steps": local_step,
            "compute_seconds": computing,
            "since_first_step": time.perf_counter() - began,
        }
        (out / "summary.json").write_text(json.dumps(summary))
    opt.shutdown()
    dht.shutdown()
    os._exit(0)  # hivemind's background threads and processes must not hold the exit


if __name__ == "__main__":
    sys.exit(main())
