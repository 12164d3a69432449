#!/usr/bin/env python3
"""Churn of whole volunteers for scripts/bench_trust.py, not a tool for users: keeps SLOTS `peer join`
processes against a run, each replaced by a fresh one (new process, new peer id) as soon as it leaves.
With --cheat KIND each is a liar (`peer join --cheat KIND`) that leaves when the servers ban it (ban
cycling: fresh liars replaced as they are banned); with --lifetime S each is honest and is SIGKILLed
(with its DHT process and p2p daemon) S seconds after it started: the same churn by honest volunteers.
Starts once the run's servers announce version --after-version and measures the run's pace meanwhile
from the servers' announced versions (with --slots 0 it only measures: the calm figure). Prints one
JSON line at the end (SIGTERM, --seconds, or the run's end).

    python scripts/_cycler.py --initial-peers MADDR --run-id NAME@FP --slots 2 (--cheat scale | --lifetime 12)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _observer import add_run_arguments

REPO = Path(__file__).resolve().parent.parent


class Slot:
    """One volunteer place: the process in it now, and what became of those before."""

    def __init__(self, index: int, stage: int, a, log_dir: Path):
        self.index, self.stage, self.a, self.log_dir = index, stage, a, log_dir
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.count = 0

    def start(self) -> None:
        name = f"c{self.index}-{self.count}"
        self.count += 1
        argv = ["join", "--stage", str(self.stage), "--device-id", name, "--run-id", self.a.run_id]
        argv += ["--initial-peers", self.a.initial_peers, "--rebalance-period", "0"]
        argv += ["--cheat", self.a.cheat] if self.a.cheat else []
        argv += ["--slowdown", str(self.a.slowdown)] if self.a.slowdown else []
        with open(self.log_dir / f"{name}.log", "wb") as log:
            # its own process group: a SIGKILL takes its DHT process and p2p daemon with it
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "peer.cli", *argv],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.started = time.monotonic()

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def poll(self) -> tuple[float, int | str] | None:
        """(lifetime, exit code or 'killed') of the volunteer that just left, replaced by a new one;
        None while it stays."""
        age = time.monotonic() - self.started
        rc = self.proc.poll()
        if rc is None and self.a.lifetime and age >= self.a.lifetime:
            rc = "killed"
        if rc is None:
            return None
        self.kill()  # (its group: the volunteer whose lifetime is up, or what is left of one that left)
        self.start()
        return age, rc


async def cycle(a) -> dict:
    from _observer import RunObserver

    got = {"slots": a.slots, "left": []}
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    slots: list[Slot] = []
    async with RunObserver(a) as run:
        try:
            if not await run.wait_for_start():
                return got | {"versions": run.versions}
            stages = len(run.run.layout["stages"])
            slots = [Slot(i, i % stages, a, log_dir) for i in range(a.slots)]
            for s in slots:
                s.start()
            t0 = time.monotonic()
            await run.note_version()
            last_read = time.monotonic()
            while not run.stop.is_set() and time.monotonic() - t0 < a.seconds:
                for s in slots:
                    left = s.poll()
                    if left is not None:
                        got["left"].append([round(left[0], 2), left[1]])
                if time.monotonic() - last_read >= 1.0:
                    last_read = time.monotonic()
                    if await run.note_version():
                        break
                await run.pause(0.25)
            got["seconds"] = time.monotonic() - t0
        finally:
            for s in slots:
                s.kill()
    return got | {"versions": run.versions}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    p.add_argument("--slots", type=int, default=2, help="volunteers kept in the run at a time")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--cheat", default=None, metavar="KIND", help="liars (peer join --cheat KIND), each until banned")
    who.add_argument("--lifetime", type=float, default=None, help="honest volunteers, each SIGKILLed after S seconds")
    p.add_argument("--slowdown", type=float, default=None, help="peer join --slowdown for each volunteer")
    p.add_argument("--log-dir", default="/tmp/cycler", help="one log per volunteer started")
    a = p.parse_args(argv)
    if a.slots and not (a.cheat or a.lifetime):
        p.error("--slots needs --cheat KIND (liars) or --lifetime S (honest volunteers)")
    print(json.dumps(asyncio.run(cycle(a))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
