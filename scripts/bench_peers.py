#!/usr/bin/env python3
"""hivepipe against what a user would pick instead, on one machine: the same model, corpus, global
batch and number of steps trained by

  (a) `peer swarm` (2 stages x 2 servers, which leave the compute to the --volunteers volunteers: its default);
  (b) hivemind's own collaborative data-parallel training (`hivemind.Optimizer`, as in DeDLOC and the
      hivemind quickstart; matchmaking 1 s, averaging timeout 10 s, progress re-read every 0.5 s: this
      run's epochs are short) with the same number of volunteer
      processes, each holding the whole model (scripts/_hivemind_dp.py);
  (c) `peer swarm --no-requeue` (SWARM-like: a departed volunteer's leases run out their full task
      timeout before another volunteer gets them, as a SWARM trainer waits out a request to a dead
      peer; still exact).

each calm and with --churn of the volunteers SIGKILLed and replaced per step (hivemind: per epoch of
the collaboration; its first peer, which measures, is never killed, as the swarm's servers are not).

    python scripts/bench_peers.py [--steps 20] [--volunteers 4] [--churn 0.25] [--model small]
                                  [--out docs/bench_peers.md] [--work DIR]
                                  [--netns-rates 20 100 [--only-netns]]   (root)

With --netns-rates, every system also runs across hosts on this machine: network namespaces on a
bridge (tests/net/netns.py), each volunteer (and each hivemind peer) on a host of its own whose link
`tc tbf` limits to RATE Mbit/s both ways, the swarm's four servers on one unshaped host (a data
centre). The kernel adds no delay (netem is not available here): these rows measure bandwidth, not
latency.

A second table gives each run's wall time to the same held-out loss (the highest final held-out
loss among the runs): tokens/s alone does not say which trains a model sooner.

Columns: tokens/s over the training (from the end of the first step/epoch for hivemind, whose peers
start by matchmaking; from the moment every server is online for the swarm), and the mean token loss
of the final parameters on 4 batches of the held-out split (the same batches for every row), with
`peer reference` (one process, the swarm's exact update rule) as the yardstick. Writes the markdown
table to --out and docs/peers.png beside it (docs/peers_netns.png with --only-netns).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _bench_common import (  # noqa: E402
    REPO,
    Report,
    exactly_once,
    loadavg,
    md_table,
    run_peer,
    run_swarm,
    train_run_reference,
)

from core.model.config import get_preset  # noqa: E402
from parameter_server import blob  # noqa: E402
from tests.net import netns  # noqa: E402

EVAL_BATCHES = 4
BATCH, MICRO_BATCHES = 16, 4  # the run's defaults, which every system here trains with


def eval_loss(model: str, state: dict) -> float:
    """Mean token cross-entropy of `state` (a full-model state dict) on the held-out split."""
    from core.model.data import load_corpus, make_batch
    from core.model.transformer import loss_sum, slice_from_state

    cfg = get_preset(model)
    corpus = load_corpus(None, seq_len=cfg.seq_len)
    net = slice_from_state(cfg, 0, cfg.layers, state)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for b in range(EVAL_BATCHES):
            x, y = make_batch(corpus, 0, b, 16, cfg.seq_len, split="val")
            total += float(loss_sum(net(x), y))
            tokens += y.numel()
    return total / tokens


def load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def run_reference(model: str, steps: int, work: Path) -> dict:
    out = work / "reference"
    run_peer(
        [
            "reference",
            "--model",
            model,
            "--steps",
            str(steps),
            "--summary-json",
            str(work / "reference.json"),
            "--checkpoint-out",
            str(out),
            "--no-progress",
        ],
        work / "reference.log",
        900,
    )
    summary = json.loads((work / "reference.json").read_text())
    return {
        "tokens_per_second": summary["tokens_per_second"],
        "final_loss": summary["last_loss"],
        "eval_loss": eval_loss(model, load_safetensors(out / "model.safetensors")),
        "applied": "-",
    }


def reference_curve(model: str, steps: int) -> dict[int, float]:
    """The held-out loss of `peer reference`'s parameters after each of its updates (version ->
    loss): an exact run's parameters at version v are these, so its loss at a time is this curve at
    the version it had reached by then. (Under the delayed update no step computes on version
    steps - 1, so the curve skips it: a run that got under the target there is timed at the last.)"""
    curve: dict[int, float] = {}

    def note(info) -> None:
        if info.updates_applied not in curve:
            curve[info.updates_applied] = eval_loss(model, info.model.state_dict())

    final = train_run_reference(model, steps, on_step=note)
    curve[steps] = eval_loss(model, final)
    return curve


def time_to_loss(row: dict, target: float, curve: dict[int, float]) -> float | None:
    """Seconds from the start of training until the run's parameters first had a held-out loss at or
    under `target` (None: never): for the exact systems the first version whose reference loss is
    that low (`version_seconds`), for hivemind the first epoch whose parameters are."""
    if "epoch_losses" in row:
        return next((t for t, loss in row["epoch_losses"] if loss <= target), None)
    times = row.get("version_seconds") or {}
    v = next((v for v in sorted(curve) if curve[v] <= target), None)
    return None if v is None or str(v) not in times else times[str(v)]


def run_peer_swarm(
    name: str, model: str, steps: int, volunteers: int, churn: float, extra: list[str], work: Path
) -> dict:
    out = work / f"{name}-model"
    args = [
        "--model",
        model,
        "--steps",
        str(steps),
        "--volunteers",
        str(volunteers),
        "--run-id",
        f"{name}-{time.time_ns()}",
        "--checkpoint-out",
        str(out),
        *extra,
    ]
    if churn:
        args += ["--churn", str(churn)]
    s = run_swarm(name, args, work, timeout=1800)
    return {
        "tokens_per_second": s["tokens_per_second"],
        "final_loss": s["last_loss"],
        "eval_loss": eval_loss(model, load_safetensors(out / "model.safetensors")),
        "applied": exactly_once(s),
        "killed": s.get("volunteers_killed", 0),
        "load": s["load"],
        "version_seconds": s.get("version_seconds", {}),
    }


def kill_peer(proc: subprocess.Popen) -> None:
    """SIGKILL a hivemind peer with its process group: its DHT process and p2p daemon go too, as
    when a machine vanishes (killing the peer alone left them running: ghosts in the DHT that also
    took CPU from every later run)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the group's members exit a moment after the signal
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def run_hivemind(
    name: str,
    model: str,
    steps: int,
    volunteers: int,
    churn: float,
    work: Path,
    timeout: float = 1800,
    place=lambda i: ([], "127.0.0.1"),
    extra: list[str] = (),
) -> dict:
    """`volunteers` peers of scripts/_hivemind_dp.py; with churn, that share of peers 1.. is SIGKILLed
    and replaced each time peer 0 reports a new epoch. `place(i)` is (argv prefix, listen address) of
    peer i: this machine, or a testbed host (a network namespace behind a shaped link)."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).resolve().parent / "_hivemind_dp.py")
    run_id = f"{name}-{time.time_ns()}"
    go = out / "go"
    common = ["--run-id", run_id, "--out", str(out), "--model", model, "--steps", str(steps), *extra]
    procs: dict[int, subprocess.Popen] = {}
    incarnations = {i: 0 for i in range(volunteers)}
    logs = []
    load = loadavg()

    def start(i: int, initial: list[str]) -> subprocess.Popen:
        log = open(out / f"peer{i}.{incarnations[i]}.log", "wb")
        logs.append(log)
        together = ["--go-file", str(go)] if incarnations[i] == 0 else []  # replacements join at once
        prefix, host = place(i)
        return subprocess.Popen(
            [
                *prefix,
                sys.executable,
                script,
                *common,
                "--index",
                str(i),
                "--incarnation",
                str(incarnations[i]),
                "--host",
                host,
                *together,
                "--initial-peers",
                *initial,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE if i == 0 else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    rng = random.Random(0)
    killed = 0
    deadline = time.monotonic() + timeout
    try:
        procs[0] = start(0, [])
        first = procs[0].stdout.readline().decode()
        if not first.startswith("initial_peers="):
            raise RuntimeError(f"hivemind peer 0 did not start: {first!r}; see {out}")
        initial = [first.strip().split("=", 1)[1]]
        for i in range(1, volunteers):
            procs[i] = start(i, initial)
        while not all(Path(f"{go}.ready.{i}").exists() for i in range(volunteers)):  # every peer is up
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"{name}: the hivemind peers did not all start; see {out}")
            time.sleep(0.1)
        go.touch()
        for line in procs[0].stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: ran past {timeout:.0f} s")
            if not line.startswith(b"{"):
                continue
            if churn and volunteers > 1:
                n = min(max(1, round(churn * volunteers)), volunteers - 1)
                for i in rng.sample(range(1, volunteers), n):
                    kill_peer(procs[i])
                    killed += 1
                    incarnations[i] += 1
                    procs[i] = start(i, initial)
        if procs[0].wait() != 0:
            raise RuntimeError(f"{name}: hivemind peer 0 exited with {procs[0].returncode}; see {out}")
    finally:
        for p in procs.values():
            kill_peer(p)
        for log in logs:
            log.close()
    summary = json.loads((out / "summary.json").read_text())
    state = torch.load(out / "model.pt")
    epochs = torch.load(out / "epochs.pt")
    return {
        "epoch_losses": [(e["since_start"], eval_loss(model, e["state"])) for e in epochs],
        "tokens_per_second": summary["tokens_per_second"],
        "final_loss": summary["losses"][-1],
        "eval_loss": eval_loss(model, state),
        "applied": f"{summary['epochs']} epochs",
        "killed": killed,
        "load": load,
        "sequences": hivemind_sequences(out),
        "utilisation": hivemind_utilisation(out),
    }


def run_netns_swarm(
    name: str,
    model: str,
    steps: int,
    volunteers: int,
    churn: float,
    rate: float,
    extra: list[str],
    work: Path,
    timeout: float = 1800,
) -> dict:
    """hivepipe across hosts: the 4 servers (which compute) on one unshaped host, as in a data centre,
    each volunteer on a host of its own behind `rate` Mbit/s both ways (scripts/bench_netns.py's
    testbed, no added delay: netem is not available here); with churn, that share of the volunteers
    is SIGKILLed (with its DHT process and p2p daemon) and a new one started on the same host each
    time the run reaches a new version. Tokens/s from the first version to the last, as hivemind's."""
    from bench_netns import SERVERS, join_args, start_servers, step_times

    from parameter_server.checkpoint import read_model

    out = work / name
    hosts = [f"v{i}" for i in range(volunteers)]
    bed = netns.Testbed(["srv", *hosts], tag=f"bp{os.getpid() % 10000}")
    run = netns.Processes(str(out))
    rng = random.Random(0)
    procs: dict[str, subprocess.Popen] = {}
    incarnations = dict.fromkeys(hosts, 0)
    killed = 0
    load = loadavg()

    def start(host: str) -> None:
        device = f"{host}n{incarnations[host]}"
        procs[host] = run.start(device, join_args(device, hosts.index(host) % 2, run_id, initial), bed.prefix(host))

    def kill_some(_version: int) -> None:
        nonlocal killed
        killed += replace_some(rng, hosts, churn, procs, incarnations, start)

    try:
        for host in hosts:
            bed.shape(host, rate)
        initial, run_id = start_servers(
            run,
            model,
            steps,
            out,
            bed.addrs["srv"],
            bed.prefix("srv"),
            compute=True,
            extra=["--task-timeout", "30", *extra],
        )
        servers = [p for _, p in run.procs]
        for host in hosts:
            start(host)
        seen = step_times(out / "ckpt", steps, timeout, servers, on_version=kill_some if churn else None)
        deadline = time.monotonic() + 60
        while True:  # the last checkpoint of every shard (its summary file is written after it)
            state, versions = read_model([out / "ckpt"])
            if min(versions.values()) >= steps or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        applied = checkpoint_applied(out / "ckpt", [d for _, _, d in SERVERS])
    finally:
        run.close()
        bed.close()
    cfg = get_preset(model)
    stages = len({dev[:2] for _, _, dev in SERVERS})
    return {
        "tokens_per_second": (steps - 1) * BATCH * cfg.seq_len / (seen[steps] - seen[1]),
        "final_loss": None,
        "eval_loss": eval_loss(model, state),
        "applied": f"{applied}/{steps * MICRO_BATCHES * stages}",
        "killed": killed,
        "load": load,
    }


def replace_some(rng: random.Random, hosts: list[str], churn: float, procs: dict, incarnations: dict, start) -> int:
    """SIGKILL `churn` of the hosts' volunteers (at least one; with their DHT process and p2p daemon)
    and start a new one on each of those hosts (`start(host)`); returns how many were killed."""
    chosen = rng.sample(hosts, min(max(1, round(churn * len(hosts))), len(hosts)))
    for host in chosen:
        kill_peer(procs[host])
        incarnations[host] += 1
        start(host)
    return len(chosen)


def checkpoint_applied(ckpt: Path, devices: list[str]) -> int:
    """Micro-batches applied, summed over the stages, from the servers' last checkpoints (each
    server's own slot; a stage's count is its smallest)."""
    by_stage: dict[str, int] = {}
    for dev in devices:
        saved = blob.load(str(ckpt / f"{dev}.shard.pt"))
        n = saved["slots"][saved["own_slot"]]["microbatches_applied"]
        by_stage[dev[:2]] = min(by_stage.get(dev[:2], n), n)
    return sum(by_stage.values())


def netns_places(rate: float, volunteers: int, tag: str):
    """A testbed of one host per hivemind peer, each behind `rate` Mbit/s; (testbed, place)."""
    bed = netns.Testbed([f"h{i}" for i in range(volunteers)], tag=tag)
    for i in range(volunteers):
        bed.shape(f"h{i}", rate)
    return bed, lambda i: (bed.prefix(f"h{i}"), bed.addrs[f"h{i}"])


def hivemind_utilisation(out: Path) -> float:
    """The mean over a run's first peers of their forward and backward time over their time since
    their first local step (peer 0's from summary.json, the others' from their logs' last line)."""
    said = [json.loads((out / "summary.json").read_text())]
    for log in out.glob("peer*.0.log"):
        last = [line for line in log.read_text(errors="replace").splitlines() if line.startswith('{"epoch"')]
        if not log.name.startswith("peer0.") and last:
            said.append(json.loads(last[-1]))
    shares = [d["compute_seconds"] / d["since_first_step"] for d in said if d.get("since_first_step")]
    return sum(shares) / len(shares) if shares else float("nan")


def hivemind_sequences(out: Path, local_rows: int = 4) -> int:
    """Sequences every hivemind peer of a run trained on, replaced ones included: each peer's log
    ends with its local step count (peer 0's is in summary.json). A peer trains until it sees the
    collaboration's target, so an epoch can take more than --batch-size sequences."""
    steps = json.loads((out / "summary.json").read_text())["local_steps"]
    for log in out.glob("peer*.log"):
        if log.name.startswith("peer0."):
            continue
        last = [line for line in log.read_text(errors="replace").splitlines() if line.startswith('{"epoch"')]
        if last:
            steps += json.loads(last[-1])["local_steps"]
    return steps * local_rows


def plot(rows: list[tuple[str, str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{system}\n{cond}" for system, cond, _ in rows]
    colors = [
        "#888"
        if s == "peer reference"
        else "#1f77b4"
        if s == "peer swarm"
        else "#d62728"
        if "hivemind" in s
        else "#2ca02c"
        for s, _, _ in rows
    ]
    ax1.bar(labels, [r["tokens_per_second"] for _, _, r in rows], color=colors)
    ax1.set_ylabel("tokens/s")
    ax1.set_yscale("log")
    ax2.bar(labels, [r["eval_loss"] for _, _, r in rows], color=colors)
    ax2.set_ylabel("held-out loss of the final parameters")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=7, rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--volunteers", type=int, default=4)
    p.add_argument("--churn", type=float, default=0.25)
    p.add_argument("--model", default="small")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_peers.md"))
    p.add_argument("--work", default=None)
    p.add_argument(
        "--netns-rates",
        type=float,
        nargs="*",
        default=[],
        help="also run every system across hosts: network namespaces with each volunteer (and each hivemind "
        "peer) behind this many Mbit/s (root; tc tbf, no added delay)",
    )
    p.add_argument(
        "--only-netns",
        action="store_true",
        help="skip the runs on this machine's loopback (the reference still runs: it is the yardstick)",
    )
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every run's processes and namespaces are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = netns.unavailable() if args.netns_rates else None
    if why:
        p.error(f"--netns-rates: cannot make network namespaces here: {why}")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-peers-"))
    report = Report(
        "hivepipe against hivemind's data parallelism and SWARM-like pipelines", __doc__.split("\n\n", 1)[1]
    )
    rows: list[tuple[str, str, dict]] = []
    rows.append(("peer reference", "one process", run_reference(args.model, args.steps, work)))
    for cond, churn in () if args.only_netns else (("calm", 0.0), (f"churn {args.churn:g}", args.churn)):
        tag = "calm" if not churn else "churn"
        rows.append(
            (
                "peer swarm",
                cond,
                run_peer_swarm(f"swarm-{tag}", args.model, args.steps, args.volunteers, churn, [], work),
            )
        )
        rows.append(
            (
                "hivemind.Optimizer",
                cond,
                run_hivemind(f"hivemind-{tag}", args.model, args.steps, args.volunteers, churn, work),
            )
        )
        rows.append(
            (
                "peer swarm --no-requeue",
                cond,
                run_peer_swarm(
                    f"norequeue-{tag}", args.model, args.steps, args.volunteers, churn, ["--no-requeue"], work
                ),
            )
        )
    for rate in args.netns_rates:
        for cond, churn in (("calm", 0.0), (f"churn {args.churn:g}", args.churn)):
            tag, cond = f"{'calm' if not churn else 'churn'}-{rate:g}", f"{cond}, hosts at {rate:g} Mbit/s"
            rows.append(
                (
                    "peer swarm",
                    cond,
                    run_netns_swarm(f"swarm-{tag}", args.model, args.steps, args.volunteers, churn, rate, [], work),
                )
            )
            bed, place = netns_places(rate, args.volunteers, tag=f"bh{os.getpid() % 10000}")
            try:
                rows.append(
                    (
                        "hivemind.Optimizer",
                        cond,
                        run_hivemind(
                            f"hivemind-{tag}", args.model, args.steps, args.volunteers, churn, work, place=place
                        ),
                    )
                )
            finally:
                bed.close()
            rows.append(
                (
                    "peer swarm --no-requeue",
                    cond,
                    run_netns_swarm(
                        f"norequeue-{tag}", args.model, args.steps, args.volunteers, churn, rate, ["--no-requeue"], work
                    ),
                )
            )
    table = md_table(
        [
            "system",
            "volunteers",
            "tokens/s",
            "loss of the last step",
            "held-out loss (final params)",
            "sequences trained on",
            "applied",
            "killed",
            "load",
        ],
        [
            [
                s,
                c,
                r["tokens_per_second"],
                "-" if r["final_loss"] is None else round(r["final_loss"], 3),
                round(r["eval_loss"], 3),
                r.get("sequences", args.steps * 16),
                r["applied"],
                r.get("killed", "-"),
                r.get("load", "-"),
            ]
            for s, c, r in rows
        ],
    )
    report.section(
        f"{args.model}, {args.steps} steps of 16 sequences, {args.volunteers} volunteers "
        f"(loadavg at start {loadavg()})",
        table,
    )
    timed = [(s, c, r) for s, c, r in rows if "version_seconds" in r or "epoch_losses" in r]
    if timed:
        curve = reference_curve(args.model, args.steps)
        # the loss every system reaches: the worst of their final held-out losses
        target = max(r["eval_loss"] for _, _, r in timed)
        report.section(
            "Time to the same held-out loss",
            f"Seconds from the start of training until the parameters' held-out loss (the table's 4 batches) "
            f"was first at or under **{target:.3f}**, the highest final held-out loss among these runs (so every "
            "run reaches it). hivepipe and `--no-requeue` are exact: their parameters at version v are "
            "`peer reference`'s after v updates, so their loss at a time is the reference's at the version "
            "the servers had reached by then (the summary's `version_seconds`, from the moment every server "
            "was online); hivemind's first peer keeps its parameters at the end of every epoch, each "
            "evaluated the same way, timed from its first local step (its matchmaking included, as the "
            "swarm's joining is).",
        )
        report.add(
            md_table(
                ["system", "volunteers", "seconds to the loss", "held-out loss (final params)"],
                [
                    [
                        s,
                        c,
                        "never" if (t := time_to_loss(r, target, curve)) is None else round(t, 1),
                        round(r["eval_loss"], 3),
                    ]
                    for s, c, r in timed
                ],
            )
        )
    out = Path(args.out)
    report.write(out)
    plot(rows, out.parent / ("peers_netns.png" if args.only_netns else "peers.png"))
    print(f"work dir: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
