"""What a volunteer did over its life, stage by stage: its tasks, how long its passes lasted, how long
its tasks waited for their version's parameters, and the share of its time it computed. Said in one
line when it leaves (`peer join`'s last line)."""

from __future__ import annotations

import time

from core.protocol.records import ClientRecord, RecordState

# the worker's counters a volunteer adds up over the stages it worked on
COUNTED = ("forward", "backward", "recompute_avoided", "compute_seconds", "param_seconds", "delta_pulls")


class Tally:
    def __init__(self):
        self.done = dict.fromkeys(COUNTED, 0)
        self.first_task: float | None = None  # (monotonic) when its first task arrived, on any stage
        self.stages_worked: list[int] = []

    def add(self, stage: int, stats: dict) -> None:
        """A stage's worker is done: its counters (peer/volunteer/worker.py's `stats`) join the tally."""
        for kind in self.done:
            self.done[kind] += stats.get(kind, 0)
        if "first_task" in stats and self.first_task is None:
            self.first_task = stats["first_task"]
        self.stages_worked.append(stage)

    def tasks(self) -> str:
        return f"{self.done['forward']} forward and {self.done['backward']} backward tasks"

    def said(self, now: float | None = None) -> str:
        """What it did, and how busy it was: the seconds its passes lasted (on the device it
        emulates, if any) over its time in the run since its first task, and how long its tasks
        waited for their version's parameters; the rest went to pushing gradients, calls and
        waiting for work (docs/bench_wan.md)."""
        d = self.done
        said = (
            f"{self.tasks()} done on stage(s) {' -> '.join(map(str, self.stages_worked)) or 'none'}, "
            f"{d['recompute_avoided']} of the backward tasks on their kept forward pass"
        )
        if self.first_task is None:
            return said
        span = max((time.monotonic() if now is None else now) - self.first_task, 1e-9)
        return (
            f"{said}; computing {d['compute_seconds']:.1f} s of the {span:.1f} s since its first task "
            f"({d['compute_seconds'] / span:.0%}), {d['param_seconds']:.1f} s waiting for parameters"
            f" ({d['delta_pulls']} shard versions pulled as differences)"
        )


def client_record(device: str, stage: int, worker, state: str) -> ClientRecord:
    """The record a volunteer announces of its work on `stage` (a StageWorker): its compute, and while
    online the tasks it did and their rate since the worker started."""
    elapsed = max(time.time() - worker.stats["started"], 1e-6)
    tasks = worker.stats["forward"] + worker.stats["backward"]
    online = state == RecordState.ONLINE
    return ClientRecord(
        device=device,
        stage=stage,
        state=state,
        compute=float(worker.compute),
        tasks_done=tasks if online else None,
        throughput=tasks / elapsed if online else None,
        time=time.time(),
    )
