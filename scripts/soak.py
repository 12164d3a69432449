"""Soak: a swarm that runs for --minutes under churn, server restarts and a failover, sampling every
process's memory, file descriptors and threads.

The swarm: the small model, 2 stages x 4 servers (2 frontal + 2 backward each, so a server can be
lost for good; they compute too unless --servers-compute no), --volunteers volunteers (default 6). Faults: --churn of the volunteers SIGKILLed
and replaced per step, one server SIGKILLed and restarted from its checkpoint every
--restart-every minutes, one lost for good once (at --lose-at minutes; failed over after --failover-after s).
Restarts are --restarts supervised (the default: `peer serve --supervise`, the server process SIGKILLed and
forked again by its supervisor) or cold (the whole server SIGKILLed and started as a new process).
Every --sample seconds each process (with its DHT process and p2p daemon) is sampled with psutil.
At the end the model at the version every shard reached is compared with `peer reference` for that
many steps. Each volunteer process is followed from its start to its "joined" line to its kill: how
many replacements joined before they were killed, how long joining took, and how many volunteers
were joined at a time on average (summary.json "volunteers"): under fast churn a replacement can be
killed before it ever joins, and then the swarm runs on fewer volunteers than it starts.

Writes, under --out: soak.csv (time, process, pid, rss_mb, fds, threads, version), versions.csv (when
each version was reached, by the servers' own clocks: peer.launcher.monitor.StepTimes), events.csv (kills, restarts, the loss), soak.png (RSS per process over
time with the step rate and the faults marked) and summary.json, and prints a table; --replot draws
soak.png again from those files and prints the memory table from them.

    python scripts/soak.py --minutes 30 --out docs/soak
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import glob
import json
import math
import os
import random
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _bench_common import process_tree  # noqa: E402  (scripts/, beside this file)

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--minutes", type=float, default=30.0)
p.add_argument("--volunteers", type=int, default=6)
p.add_argument("--churn", type=float, default=0.2, help="share of volunteers SIGKILLed and replaced per step")
p.add_argument("--restart-every", type=float, default=10.0, help="minutes between server restarts")
p.add_argument(
    "--lose-at",
    type=float,
    default=None,
    help="minute at which a server is lost for good (default: a third of --minutes plus 2.5, away from the restarts)",
)
p.add_argument(
    "--failover-after",
    type=float,
    default=120.0,
    help="seconds of silence before a server is failed over; longer than a restart takes on a loaded "
    "machine (on 2 cores a restart of the small model took over 60 s; default 120)",
)
p.add_argument(
    "--servers-compute",
    choices=["yes", "no"],
    default="yes",
    help="servers run a local worker too (the default of peer swarm and peer serve); with 'no' a "
    "stage whose volunteers were all just replaced waits for them to load",
)
p.add_argument(
    "--restarts",
    choices=["supervised", "cold"],
    default="supervised",
    help="supervised (default): servers run under `peer serve --supervise` and the soak SIGKILLs the "
    "server process, which the supervisor forks again (its DHT node, held by the supervisor, lives on); cold: "
    "the soak SIGKILLs the whole server and starts a new process, which imports torch and hivemind "
    "again (26 s on this machine under the soak's load)",
)
p.add_argument(
    "--start-nice",
    type=int,
    default=10,
    help="niceness of a volunteer process until it has joined (then 0; needs root, else 0 throughout): "
    "on one machine a new volunteer's start-up (imports, DHT node, model build: about 3 CPU-s) "
    "takes the cores the running swarm steps on, where on a network it runs on the volunteer's "
    "own machine; 0 turns this off",
)
p.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
p.add_argument(
    "--no-fork-processes",
    action="store_true",
    help="start each process of the swarm as a new interpreter (peer swarm --no-fork-processes)",
)
p.add_argument("--model", default="small")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--out", default="docs/soak")
p.add_argument("--work-dir", default="/tmp/hivepipe-soak")
p.add_argument(
    "--replot",
    default=None,
    metavar="DIR",
    help="only draw DIR/soak.png again from DIR's soak.csv, versions.csv and events.csv (or the "
    "summary's events), and print the memory table from them",
)
p.add_argument(
    "-v", "--verbose", action="count", default=0, help="the swarm's processes log at INFO (their logs: --work-dir)"
)
# (imported rather than run, for its log accounting: tests/protocol/test_soak_accounting.py, the defaults)
args = p.parse_args(None if __name__ == "__main__" else [])


class Arrivals:
    """Every volunteer process of the run: when it started, when it joined (its log says so) and when
    it was killed. A replacement that is killed before it has joined never worked for the run, so
    the churn's cost (and what the swarm really ran on) is in these figures, not in the kill count.
    Volunteers also start at --start-nice and are set back to 0 once they joined: the start-up of a
    replacement (a process every few seconds under the soak's churn) then waits for the cores the
    swarm's steps need instead of taking them, as it would on its own machine (only where this
    process may lower a niceness again: root)."""

    def __init__(self, swarm, nice: int):
        self.swarm, self.nice = swarm, nice if os.geteuid() == 0 else 0
        self.starting: dict[str, tuple[int, int]] = {}  # name -> (pid, its log's size when it started)
        self.current: dict[str, list] = {}  # name -> [started, joined or None] of its current process
        self.done: list[tuple[float, float | None, float]] = []  # (started, joined or None, killed)

    def started(self, name: str, now: float) -> None:
        import psutil

        proc = self.swarm.volunteers[name][0]
        log = os.path.join(self.swarm.work_dir, f"{name}.log")
        self.current[name] = [now, None]
        try:
            self.starting[name] = (proc.pid, os.path.getsize(log) if os.path.exists(log) else 0)
            if self.nice > 0:
                psutil.Process(proc.pid).nice(self.nice)  # before it forks its DHT process and daemon
        except (psutil.Error, OSError):
            pass

    def killed(self, name: str, now: float) -> None:
        if name in self.current:
            started, joined = self.current.pop(name)
            self.done.append((started, joined, now))
        self.starting.pop(name, None)

    def poll(self, now: float) -> None:
        import psutil

        for name, (pid, offset) in list(self.starting.items()):
            current = self.swarm.volunteers.get(name)
            if current is None or current[0].pid != pid:
                del self.starting[name]  # gone before it joined
                continue
            try:
                with open(os.path.join(self.swarm.work_dir, f"{name}.log"), "rb") as f:
                    f.seek(offset)
                    joined = f" as {name} (".encode() in f.read()
            except OSError:
                continue
            if joined:
                del self.starting[name]
                self.current[name][1] = now
                for proc in process_tree(pid) if self.nice > 0 else []:
                    try:
                        proc.nice(0)
                    except psutil.Error:
                        pass

    def summary(self, end: float) -> dict:
        """Of the processes started after the first ones (the replacements): how many joined before
        they were killed and how long joining took; and the volunteers joined at a time, on average
        over the run."""
        runs = self.done + [(s, j, end) for s, j in self.current.values()]
        later = [r for r in runs if r[0] > 0]
        delays = sorted(j - s for s, j, _ in later if j is not None)
        joined_time = sum(k - j for _, j, k in runs if j is not None)
        return {
            "replacements": len(later),
            "replacements_joined": len(delays),
            "replacements_killed_before_joining": sum(1 for _, j, k in later if j is None and k < end),
            "join_s_median": round(statistics.median(delays), 1) if delays else None,
            "join_s_p90": round(delays[int(0.9 * len(delays))], 1) if delays else None,
            "kills_of_joined_volunteers": sum(1 for _, j, k in self.done if j is not None),
            "mean_volunteers_joined": round(joined_time / end, 2) if end > 0 else None,
        }


def launcher_tree():
    """This process, its DHT process and that one's p2p daemon, and the forker (which forks the
    swarm's processes): not the swarm's processes (each `peer.cli` process, forked or not, is
    sampled on its own) nor their DHT processes and daemons."""
    import psutil

    out = [psutil.Process(os.getpid())]

    def walk(proc) -> None:
        for child in proc.children():
            try:
                if "peer.cli" in " ".join(child.cmdline() or []):
                    continue
                out.append(child)
                walk(child)
            except psutil.Error:
                pass

    walk(out[0])
    return out


def sample(procs: list) -> tuple[float, int, int]:
    """RSS (MB), open fds and threads summed over a process and its children."""
    import psutil

    rss = fds = threads = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
        except psutil.Error:
            pass
    return rss / 2**20, fds, threads


async def main() -> dict:
    import shutil

    from peer.addresses import visible_maddrs
    from peer.cli import build_parser
    from peer.launcher.monitor import Monitor
    from peer.launcher.processes import Swarm, child_groups
    from peer.node import start_dht, stop_dht
    from peer.reachability import DialBackService
    from peer.swarm_flags import validate

    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    sargs = build_parser().parse_args(
        [
            "swarm",
            "--model",
            args.model,
            "--steps",
            "1000000",
            "--volunteers",
            str(args.volunteers),
            "--servers-per-stage",
            "4",
            "--servers-compute",
            args.servers_compute,
            "--failover-after",
            str(args.failover_after),
            "--client-timeout",
            "3",
            "--seed",
            str(args.seed),
            "--work-dir",
            args.work_dir,
            "--no-progress",
            "--run-id",
            f"soak-{os.getpid()}",
        ]
        + (["--supervise-servers"] if args.restarts == "supervised" else [])
        + (["--no-fork-processes"] if args.no_fork_processes else [])
    )
    sargs.verbose = args.verbose
    cfg, layout, frontal, backward = validate(sargs)
    dht = start_dht([], run_id=sargs.run_id, run_fp=Swarm.run_key(args.work_dir).fingerprint)
    swarm = Swarm(sargs, layout, frontal, backward, visible_maddrs(dht), args.work_dir)
    rng = random.Random(args.seed)
    events: list[tuple[float, str]] = []
    rows: list[dict] = []
    versions: list[tuple[float, int]] = []
    started: dict[str, float] = {}  # process name -> when its current process started
    lose_at = (args.lose_at if args.lose_at is not None else args.minutes / 3 + 2.5) * 60
    lost = None
    try:
        p2p = await dht.replicate_p2p()
        await DialBackService().add_p2p_handlers(p2p)
        swarm.start_servers()
        swarm.start_volunteers()
        arrivals = Arrivals(swarm, args.start_nice)
        for name in swarm.volunteers:
            arrivals.started(name, 0.0)
        monitor = Monitor(dht, p2p, sargs.run_id, layout, sargs.batch_size * cfg.seq_len)
        t0 = time.time()
        for name in list(swarm.servers) + list(swarm.volunteers):
            started[name] = 0.0
        next_sample, next_restart = 0.0, args.restart_every * 60
        last_version = 0
        from tqdm import tqdm

        bar = tqdm(total=int(args.minutes * 60), desc="soak", unit="s", file=sys.stderr)
        while (now := time.time() - t0) < args.minutes * 60:
            bar.update(int(now) - bar.n)
            swarm.check_alive()
            arrivals.poll(now)
            try:
                await monitor.refresh()
            except Exception:
                pass
            version = monitor.min_version()
            if version > last_version:
                versions.append((now, version))
                for _ in range(version - last_version):  # churn: a share of the volunteers per step
                    share = args.churn * len(swarm.volunteers)
                    n = int(share) + (rng.random() < share - int(share))
                    for name in rng.sample(sorted(swarm.volunteers), min(n, len(swarm.volunteers))):
                        # each kill's own time: the replacement forked for the one before takes a
                        # while, and the servers' "left" lines are read against these times
                        killed_at = time.time() - t0
                        arrivals.killed(name, killed_at)
                        swarm.kill_volunteer(name)
                        arrivals.started(name, killed_at)
                        started[name] = killed_at
                        events.append((killed_at, f"kill {name}"))
                last_version = version
            if lost is None and now >= lose_at:
                candidates = [d for st in monitor.layout.stages for d in st.backward[1:]]
                lost = candidates[0]
                swarm.lose_server(lost)
                events.append((now, f"lose {lost}"))
            if now >= next_restart:
                alive = [d for d in monitor.all_devices() if d in swarm.servers and d != lost]
                name = rng.choice(alive)
                swarm.restart_server(name)
                started[name] = now
                events.append((now, f"restart {name}"))
                next_restart += args.restart_every * 60
            if now >= next_sample:
                groups = {"launcher": launcher_tree()}
                for name, proc in list(swarm.servers.items()):
                    if args.restarts == "supervised":  # the server process (a new pid after each restart),
                        everything = process_tree(proc.pid)  # its supervisor on its own, and the supervisor's DHT
                        groups[f"{name} supervisor"] = everything[:1]  # node (DHT process and p2p daemon)
                        workers = child_groups(proc.pid)
                        server = process_tree(workers[0]) if workers else []  # (none while it forks again)
                        if server:
                            groups[name] = server
                        groups[f"{name} node"] = [q for q in everything[1:] if q.pid not in {w.pid for w in server}]
                    else:
                        groups[name] = process_tree(proc.pid)
                for name, (proc, _) in list(swarm.volunteers.items()):
                    groups[name] = process_tree(proc.pid)
                for name, procs in groups.items():
                    if not procs:
                        continue
                    rss, fds, threads = sample(procs)
                    rows.append(
                        {
                            "t": round(now, 1),
                            "process": name,
                            "pid": procs[0].pid,
                            "rss_mb": round(rss, 1),
                            "fds": fds,
                            "threads": threads,
                            "version": version,
                        }
                    )
                next_sample += args.sample
            await asyncio.sleep(0.5)
        bar.close()
        participation = arrivals.summary(time.time() - t0)
        from peer.swarm import wait_for_failovers

        await wait_for_failovers(monitor, swarm.lost, args.failover_after + 120, asyncio.Event())
        for attempt in range(20):  # a server restarted in the last minute may not serve yet
            await monitor.refresh()
            final = monitor.min_version()
            try:
                statuses, state = await monitor.final(final)
                break
            except Exception as e:
                if attempt == 19:
                    raise
                print(f"soak: the final parameters are not readable yet ({e}); trying again", file=sys.stderr)
                await asyncio.sleep(3.0)
    finally:
        swarm.close()
        stop_dht(dht)
    # when each version was reached, from the servers' clocks (their records' step_times): the polled
    # minimum above (for the churn's pace) pauses and jumps whenever a DHT read misses a record
    steps = [(t - t0, v) for v, t in monitor.reached.completed().items() if 0 < v <= final]
    return {
        "rows": rows,
        "events": events,
        "versions": versions,
        "steps": steps,
        "final": final,
        "state": state,
        "participation": participation,
        "t0": t0,
        "statuses": statuses,
        "layout": monitor.layout,
        "started": started,
        "cfg": cfg,
        "sargs": sargs,
    }


_REGISTERED = re.compile(r"client (\S+) \((v\d+)\) registered")
_LEFT = re.compile(r"client (\S+) left \((.*?)\); (\d+) tasks")


def client_lines(work_dir: str) -> list[tuple[int, float, str, str, str | None, int]]:
    """The servers' lines about their clients, read once from every server log of the swarm:
    (stage, when, "registered" or the reason it left, peer, its name vN when registered, tasks it
    left re-queued), in each log's order."""
    from peer.runtime import log_time

    out = []
    for log in sorted(glob.glob(os.path.join(work_dir, "s[0-9]*.log"))):
        stage = int(os.path.basename(log)[1])
        with open(log, errors="replace") as f:
            for line in f:
                m = _REGISTERED.search(line) or _LEFT.search(line)
                if m is None:
                    continue
                try:
                    at = log_time(line)
                except ValueError:
                    continue
                if m.re is _REGISTERED:
                    out.append((stage, at, "registered", m.group(1), m.group(2), 0))
                else:
                    out.append((stage, at, m.group(2), m.group(1), None, int(m.group(3))))
    return out


def join_steps(work_dir: str) -> dict | None:
    """Where the volunteers' joins went (their `-v` logs' "joined in" line, peer/host/join_clock.py):
    per step, the median and 90th percentile seconds over every join; None without such lines."""
    per_step: dict[str, list[float]] = {}
    totals = []
    for log in sorted(glob.glob(os.path.join(work_dir, "v*.log"))):
        with open(log, errors="replace") as f:
            for line in f:
                m = re.search(r": joined in ([\d.]+) s: (.*)$", line)
                if not m:
                    continue
                totals.append(float(m.group(1)))
                for step, seconds in re.findall(r"([a-zA-Z' -]+?) ([\d.]+) s(?:, |$)", m.group(2)):
                    per_step.setdefault(step, []).append(float(seconds))
    if not totals:
        return None

    def spread(values: list[float]) -> list[float]:
        values = sorted(values)
        return [round(statistics.median(values), 2), round(values[int(0.9 * (len(values) - 1))], 2)]

    return {"joins": len(totals), "total": spread(totals), **{k: spread(v) for k, v in per_step.items()}}


def departures(lines: list, t0: float, events: list) -> dict | None:
    """How long the servers took to drop a SIGKILLed volunteer: from each kill (events, seconds since
    t0) to every server's "client X left (its connection closed)" line (`client_lines`) for that
    volunteer's peer (named by its "client X (vN) registered" lines). A drop that no kill of its
    volunteer precedes by under 30 s is not counted; nor a volunteer killed before it registered."""
    kills: dict[str, list[float]] = {}
    for t, e in events:
        if e.startswith("kill "):
            kills.setdefault(e[5:], []).append(t0 + t)
    names = {peer: name for _, _, what, peer, name, _ in lines if what == "registered"}
    drops = [(at, names.get(peer), n) for _, at, what, peer, _, n in lines if what == "its connection closed"]
    delays, with_tasks = [], []
    for at, name, requeued in drops:
        killed = max((k for k in kills.get(name, []) if k <= at), default=None)
        if killed is not None and at - killed < 30:
            delays.append(at - killed)
            if requeued:
                with_tasks.append(at - killed)
    if not delays:
        return None

    def q(xs, p):
        return round(sorted(xs)[min(len(xs) - 1, int(p * len(xs)))], 2)

    return {
        "drops": len(delays),
        "median_s": q(delays, 0.5),
        "p90_s": q(delays, 0.9),
        "p99_s": q(delays, 0.99),
        "max_s": round(max(delays), 2),
        "drops_that_requeued": len(with_tasks),
        "requeued_median_s": q(with_tasks, 0.5) if with_tasks else None,
    }


def starved_windows(lines: list, t0: float, end: float) -> dict[int, list[tuple[float, float]]]:
    """stage -> the windows (seconds since t0) in which no volunteer was registered with the stage's
    servers: from the servers' own "client X (vN) registered" and "client X left (...)" lines
    (`client_lines`; a volunteer counts from its first registration with any server of its stage until
    it left the first). With servers that do not compute, such a stage has no compute and the run
    waits for a replacement to join: a stall the swarm cannot shorten, told apart from the others."""
    spans: dict[int, dict[str, list[float]]] = {}  # stage -> peer -> [registered, left]
    for stage, at, what, peer, _, _ in lines:
        span = spans.setdefault(stage, {}).setdefault(peer, [math.inf, math.inf])
        i = 0 if what == "registered" else 1
        span[i] = min(span[i], at - t0)
    out = {}
    for stage, peers in sorted(spans.items()):
        changes = sorted(
            [(a, 1) for a, _ in peers.values() if a < math.inf]
            + [(b, -1) for a, b in peers.values() if a < b < math.inf]
        )
        windows, n, since = [], 0, 0.0
        for at, d in changes:
            if n == 0 and d > 0 and at > since:
                windows.append((since, at))
            n += d
            if n == 0:
                since = at
        if n == 0 and since < end:
            windows.append((since, end))
        out[stage] = [(a, b) for a, b in windows if b > a]
    return out


def stalls_over(manned: list[tuple[float, float, float]], median: float, factor: float = 3.0) -> dict:
    """Of the steps outside the failover and restarts, as (second it began, seconds, of which some
    stage had no volunteer registered): how many took over `factor` x the median, how many of those
    overlap a time without a volunteer, and [began, seconds, without a volunteer] of each that is
    still over `factor` x the median less that time, longest first."""
    over = [s for s in manned if s[1] > factor * median]
    left = sorted((s for s in over if s[1] - s[2] > factor * median), key=lambda s: -(s[1] - s[2]))
    return {
        "count": len(over),
        "with_a_stage_without_volunteer": sum(1 for s in over if s[2] > 0),
        "over_less_that_time": [[round(a), round(d, 1), round(o, 1)] for a, d, o in left],
    }


def overlap(a: float, b: float, windows: list[tuple[float, float]]) -> float:
    """Seconds of [a, b] inside the union of `windows`."""
    covered, cur = 0.0, a
    for lo, hi in sorted(windows):
        lo, hi = max(lo, cur), min(hi, b)
        if hi > lo:
            covered += hi - lo
            cur = hi
    return covered


def rel_diff(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(v.double().pow(2).sum()) for v in b.values())
    return (num / den) ** 0.5


def plot(rows: list[dict], events: list, versions: list, path: str) -> None:
    """RSS per process over time (one line per process and pid) and steps per minute, faults marked."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_pid: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        by_pid.setdefault((row["process"], int(row["pid"])), []).append(row)
    for name, pid in [k for k in by_pid if (f"{k[0]} supervisor", k[1]) in by_pid]:
        del by_pid[
            (name, pid)
        ]  # a supervisor sampled under its server's name (soaks before the supervisor kept its node)
    # steps per minute in 30 s bins (two versions can be reached a millisecond apart: a rate per
    # gap would spike to tens of thousands)
    bin_s = 30.0
    reached = [(float(t), int(v)) for t, v in versions]
    end = max((t for t, _ in reached), default=0.0)
    bins = [i * bin_s for i in range(int(end // bin_s) + 1)]
    last_before = [max((v for t, v in reached if t < lo), default=0) for lo in bins]
    last_in = [max((v for t, v in reached if t < lo + bin_s), default=0) for lo in bins]
    rates = [(b - a) * 60 / bin_s for a, b in zip(last_before, last_in)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for (name, pid), samples in sorted(by_pid.items()):
        ax1.plot(
            [float(s["t"]) / 60 for s in samples],
            [float(s["rss_mb"]) for s in samples],
            lw=0.8,
            label=name if not name.startswith("v") else None,
        )
    ax1.set_ylabel("RSS (MB)")
    ax1.legend(fontsize=7, ncol=4)
    ax2.step([(lo + bin_s) / 60 for lo in bins], rates, where="pre", lw=0.8)
    ax2.set_ylabel("steps per minute")
    ax2.set_xlabel("minutes")
    for t, e in events:
        if not e.startswith("kill"):
            for ax in (ax1, ax2):
                ax.axvline(t / 60, color="red", ls="--", lw=0.8)
            ax2.text(t / 60, ax2.get_ylim()[1] * 0.9, e, fontsize=7, rotation=90, color="red")
    kills = [t / 60 for t, e in events if e.startswith("kill")]
    ax2.plot(kills, [0] * len(kills), "|", color="gray", label="volunteer SIGKILLed")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rss_growth(rows: list[dict], failover: list[tuple[float, float]]) -> dict:
    """RSS growth of the long-lived processes (the same pid for at least 10 minutes, from its minute 5
    to the end: a server restarted mid-run too, from 5 minutes after its restart), by sample and by
    the means over a minute; across the failover window (`failover`: [(start, end)] or []) and after
    it."""
    growth = {}
    by_pid: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        by_pid.setdefault((row["process"], row["pid"]), []).append(row)
    for (name, pid), samples in by_pid.items():
        if samples[-1]["t"] - samples[0]["t"] < 10 * 60:
            continue  # not long-lived
        base = [s for s in samples if s["t"] >= samples[0]["t"] + 300]
        if len(base) < 2:
            continue
        end = samples[-1]["t"]

        def mean_rss(lo: float, hi: float) -> float | None:
            window = [s["rss_mb"] for s in samples if lo <= s["t"] < hi]
            return statistics.mean(window) if window else None

        def pct(a, b):
            return None if a is None or b is None else round(100 * (b / a - 1), 1)

        # a single sample swings by +-5% with the tasks in flight: also the means over a minute
        start_mean, end_mean = mean_rss(base[0]["t"], base[0]["t"] + 60), mean_rss(end - 60, end + 1)
        started = samples[0]["t"]
        label = f"{name} ({pid})" if started <= 60 else f"{name} ({pid}, started at {started / 60:.1f} min)"
        g = growth[label] = {
            "rss_mb_at_5min": base[0]["rss_mb"],
            "rss_mb_end": samples[-1]["rss_mb"],
            "growth_pct": round(100 * (samples[-1]["rss_mb"] / base[0]["rss_mb"] - 1), 1),
            "minute_means_mb": [round(start_mean, 1), round(end_mean, 1)],
            "growth_pct_of_means": pct(start_mean, end_mean),
            "fds": [base[0]["fds"], samples[-1]["fds"]],
            "threads": [base[0]["threads"], samples[-1]["threads"]],
        }
        if failover and samples[0]["t"] < failover[0][0] and failover[0][1] + 180 < end:
            # the failover moves the lost server's slot (a second replica on the next server), rows
            # and tasks onto the others: a step; what grows after it is what a longer run would add
            (lo, hi) = failover[0]
            before, after = mean_rss(lo - 120, lo), mean_rss(hi, hi + 120)
            g["failover_step_pct"] = pct(before, after)
            g["growth_after_failover_pct"] = pct(after, end_mean)
    return growth


def report(r: dict) -> dict:
    from core.model.data import load_corpus
    from peer.reference import train_reference

    with open(os.path.join(args.out, "soak.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["t", "process", "pid", "rss_mb", "fds", "threads", "version"])
        w.writeheader()
        w.writerows(r["rows"])
    # step times and stalls
    polled = [t for t, _ in r["versions"]]
    times = [t for t, _ in r["steps"]] or polled
    gaps = [b - a for a, b in zip(times, times[1:])]
    median = statistics.median(gaps) if gaps else 0.0
    lose_t = next((t for t, e in r["events"] if e.startswith("lose")), None)
    failover = [(lose_t - 1, lose_t + args.failover_after + 60)] if lose_t is not None else []
    # a restarted server's stage waits for it (a task of batch t+1 needs version t on every server
    # of its stage): those pauses last as long as a restart
    restarts = [(t - 1, t + 120) for t, e in r["events"] if e.startswith("restart")]

    def outside_of(windows) -> list[float]:
        return [b - a for a, b in zip(times, times[1:]) if not any(lo <= b and a <= hi for lo, hi in windows)]

    outside, calm = outside_of(failover), outside_of(failover + restarts)
    # the same stalls less the time some stage had no volunteer registered (starved_windows): what
    # is left is the swarm's own wait
    lines = client_lines(args.work_dir)
    starved = [w for ws in starved_windows(lines, r["t0"], times[-1] if times else 0.0).values() for w in ws]
    manned = [
        (a, b - a, overlap(a, b, starved))
        for a, b in zip(times, times[1:])
        if not any(lo <= b and a <= hi for lo, hi in failover + restarts)
    ]
    longest_manned = max(manned, key=lambda x: x[1] - x[2], default=None)
    # each restart's own stall: the longest gap that overlaps the half minute after its kill
    restart_stalls = [
        max((b - a for a, b in zip(times, times[1:]) if t - 1 <= b and a <= t + 30), default=None)
        for t, e in r["events"]
        if e.startswith("restart")
    ]
    polled_gaps = [b - a for a, b in zip(polled, polled[1:])]
    growth = rss_growth(r["rows"], failover)
    sargs, cfg = r["sargs"], r["cfg"]
    corpus = load_corpus(None, seq_len=cfg.seq_len)
    run = dict(seed=sargs.seed, batch_size=sargs.batch_size, delay=1, lr=sargs.lr, progress=False)
    ref, ref_sum = train_reference(cfg, corpus, steps=r["final"], micro_batches=sargs.micro_batches, **run)
    # the floor of any comparison with the reference: the reference against itself with its
    # micro-batches' gradients summed in other groups (the same sum in another floating-point order)
    other = next(
        m
        for m in (sargs.micro_batches // 2, sargs.micro_batches * 2, 1)
        if m >= 1 and m != sargs.micro_batches and sargs.batch_size % m == 0
    )
    regrouped, regrouped_sum = train_reference(cfg, corpus, steps=r["final"], micro_batches=other, **run)
    tokens = sargs.batch_size * cfg.seq_len
    last = r["layout"].stages[-1].servers[0]
    swarm_losses = {int(k): v / tokens for k, v in r["statuses"][last]["losses"].items()}

    def compare(losses: dict[int, float]) -> dict:
        diffs = [abs(losses[t] - ref_sum["losses"][t]) for t in range(r["final"]) if t in losses]
        tail = [t for t in range(max(r["final"] - 50, 0), r["final"]) if t in losses]
        return {
            "max_abs_loss_diff_first_50": max(diffs[:50]),
            "first_step_loss_diff_over_1e-3": next((t for t, d in enumerate(diffs) if d > 1e-3), None),
            "mean_loss_last_50": sum(losses[t] for t in tail) / len(tail),
        }

    applied = sum(r["statuses"][st.servers[0]]["microbatches_applied"] for st in r["layout"].stages)
    summary = {
        "minutes": args.minutes,
        "servers_compute": args.servers_compute,
        "restarts": args.restarts,
        "steps": r["final"],
        # at the status call, after the steps compared (the run goes on until the swarm is stopped)
        "microbatches_applied": applied,
        "microbatches_expected": sum(r["statuses"][st.servers[0]]["version"] for st in r["layout"].stages)
        * sargs.micro_batches,
        "median_step_s": round(median, 2),
        "longest_stall_s": round(max(gaps), 1) if gaps else None,
        "longest_stall_outside_failover_s": round(max(outside), 1) if outside else None,
        "longest_stall_outside_failover_and_restarts_s": round(max(calm), 1) if calm else None,
        "restart_stalls_s": [round(x, 1) if x is not None else None for x in restart_stalls],
        # outside the failover and restarts: the longest stall less its seconds with a stage that had no
        # volunteer registered, and [second it began, seconds, of which without a volunteer] of the
        # longest stalls there
        "longest_stall_with_volunteers_s": round(longest_manned[1] - longest_manned[2], 1) if longest_manned else None,
        "stalls_outside_failover_and_restarts": [
            [round(a), round(d, 1), round(o, 1)] for a, d, o in sorted(manned, key=lambda x: -x[1])[:6]
        ],
        # every step over 3x the median there: how many, how many with a stage without a volunteer,
        # and each one still over 3x the median less that time
        "stalls_over_3x_median": stalls_over(manned, median),
        "seconds_a_stage_had_no_volunteer": round(sum(b - a for a, b in starved if times and a < times[-1]), 1),
        "t0": r["t0"],
        "step_times_from": "servers' step_times" if r["steps"] else "polled minimum version",
        "longest_stall_polled_s": round(max(polled_gaps), 1) if polled_gaps else None,
        "median_step_polled_s": round(statistics.median(polled_gaps), 2) if polled_gaps else None,
        "longest_stalls": sorted(([round(a), round(b - a, 1)] for a, b in zip(times, times[1:])), key=lambda x: -x[1])[
            :6
        ],  # [second it began, seconds]
        "rel_diff_vs_reference": rel_diff(r["state"], ref),
        "rel_diff_reference_regrouped": rel_diff(regrouped, ref),
        "regrouped_micro_batches": other,
        "swarm_vs_reference": compare(swarm_losses),
        "regrouped_vs_reference": compare(dict(enumerate(regrouped_sum["losses"]))),
        "reference_mean_loss_last_50": compare(dict(enumerate(ref_sum["losses"])))["mean_loss_last_50"],
        "rss_growth": growth,
        "events": [(round(t), e) for t, e in r["events"] if not e.startswith("kill")],
        "volunteer_kills": sum(1 for _, e in r["events"] if e.startswith("kill")),
        "volunteers": r["participation"],
        # kill -> each server's drop of the killed volunteer (parameter_server.clients.DISCONNECT_GRACE)
        "departures": departures(lines, r["t0"], r["events"]),
        # each step of a volunteer's join, [median, 90th percentile] seconds (-v logs only)
        "join_steps": join_steps(args.work_dir),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for name, header, data in (
        ("versions.csv", ["t", "version"], r["steps"] or r["versions"]),
        ("events.csv", ["t", "event"], r["events"]),
    ):
        with open(os.path.join(args.out, name), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(data)
    plot(r["rows"], r["events"], r["steps"] or r["versions"], os.path.join(args.out, "soak.png"))
    return summary


def print_growth(growth: dict) -> None:
    print(
        "| long-lived process | RSS at 5 min (MB) | RSS at end (MB) | growth | minute means (MB) | growth of "
        "means | failover step | growth after failover | fds | threads |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, g in sorted(growth.items()):
        step, after = g.get("failover_step_pct"), g.get("growth_after_failover_pct")
        print(
            f"| {name} | {g['rss_mb_at_5min']} | {g['rss_mb_end']} | {g['growth_pct']}% | "
            f"{g['minute_means_mb'][0]} -> {g['minute_means_mb'][1]} | {g['growth_pct_of_means']}% | "
            f"{'-' if step is None else f'{step}%'} | {'-' if after is None else f'{after}%'} | "
            f"{g['fds'][0]} -> {g['fds'][1]} | {g['threads'][0]} -> {g['threads'][1]} |"
        )


def replot(folder: str) -> None:
    def read(name):
        with open(os.path.join(folder, name), newline="") as f:
            return list(csv.DictReader(f))

    versions = [(float(row["t"]), int(row["version"])) for row in read("versions.csv")]
    if os.path.exists(os.path.join(folder, "events.csv")):
        events = [(float(row["t"]), row["event"]) for row in read("events.csv")]
    else:
        with open(os.path.join(folder, "summary.json")) as f:
            events = [(float(t), e) for t, e in json.load(f)["events"]]
    samples = [
        {
            "t": float(row["t"]),
            "process": row["process"],
            "pid": int(row["pid"]),
            "rss_mb": float(row["rss_mb"]),
            "fds": int(row["fds"]),
            "threads": int(row["threads"]),
        }
        for row in read("soak.csv")
    ]
    plot(samples, events, versions, os.path.join(folder, "soak.png"))
    # the memory table again, from the samples (a soak's summary.json predates a later change of it)
    lose_t = next((t for t, e in events if e.startswith("lose")), None)
    print_growth(rss_growth(samples, [(lose_t - 1, lose_t + args.failover_after + 60)] if lose_t is not None else []))


if __name__ == "__main__" and args.replot:
    replot(args.replot)
elif __name__ == "__main__":
    result = asyncio.run(main())
    s = report(result)
    print(
        "| steps | micro-batches applied / expected | median step | longest stall: all / outside failover / "
        "outside failover and restarts | final params vs reference (reference vs itself regrouped) |"
    )
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {s['steps']} | {s['microbatches_applied']} / {s['microbatches_expected']} | {s['median_step_s']} s | "
        f"{s['longest_stall_s']} / {s['longest_stall_outside_failover_s']} / "
        f"{s['longest_stall_outside_failover_and_restarts_s']} s | {s['rel_diff_vs_reference']:.2e} "
        f"({s['rel_diff_reference_regrouped']:.2e}) |"
    )
    print(
        f"\noutside the failover and restarts, the longest stall less its time with a stage that had no volunteer: "
        f"{s['longest_stall_with_volunteers_s']} s ({s['longest_stall_with_volunteers_s'] / s['median_step_s']:.1f}x "
        f"the median); longest stalls there [began at s, seconds, of which a stage had no volunteer]: "
        f"{s['stalls_outside_failover_and_restarts']}"
    )
    print(
        f"\nstep times from the {s['step_times_from']}; each restart's stall: {s['restart_stalls_s']} s; "
        f"polled minimum version: median {s['median_step_polled_s']} s, longest gap {s['longest_stall_polled_s']} s"
    )
    print()
    print(
        "| per-step loss vs the reference | max abs diff, first 50 steps | first step off by > 1e-3 | "
        "mean loss, last 50 steps |"
    )
    print("| --- | --- | --- | --- |")
    for name in ("swarm_vs_reference", "regrouped_vs_reference"):
        c = s[name]
        print(
            f"| {name.split('_vs_')[0]} | {c['max_abs_loss_diff_first_50']:.2e} | "
            f"{c['first_step_loss_diff_over_1e-3']} | {c['mean_loss_last_50']:.4f} |"
        )
    print(f"| reference | 0 | - | {s['reference_mean_loss_last_50']:.4f} |")
    print()
    print_growth(s["rss_growth"])
    print(f"\nevents: {s['events']}; {s['volunteer_kills']} volunteers SIGKILLed")
    v = s["volunteers"]
    print(
        f"volunteers: {v['replacements']} replacements started, {v['replacements_joined']} joined (start to joined: "
        f"median {v['join_s_median']} s, 90th percentile {v['join_s_p90']} s), {v['replacements_killed_before_joining']} "
        f"killed before joining; {v['kills_of_joined_volunteers']} kills hit a joined volunteer; "
        f"{v['mean_volunteers_joined']} volunteers joined at a time on average"
    )
    j = s.get("join_steps")
    if j:
        steps = ", ".join(f"{k} {m} s ({p} s)" for k, (m, p) in j.items() if k not in ("joins", "total"))
        print(f"joins ({j['joins']}, -v logs): {j['total'][0]} s median ({j['total'][1]} s 90th percentile): {steps}")
    d = s.get("departures")
    if d:
        print(
            f"departures: {d['drops']} drops of a killed volunteer by a server, kill to drop median {d['median_s']} s, "
            f"90th percentile {d['p90_s']} s, 99th {d['p99_s']} s, longest {d['max_s']} s; "
            f"{d['drops_that_requeued']} re-queued tasks (median {d['requeued_median_s']} s)"
        )
