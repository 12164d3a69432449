"""What the step model (scheduler/stepsim.py) is given, the costs it was calibrated with and the
workload it plays, and what it gives back: the trace of a simulated run (when each version was
reached, the calls, the tasks, each volunteer's compute)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Calibration:
    call_seconds: float  # one RPC's own cost beyond its link time
    byte_seconds: float  # per payload byte of an RPC
    ref_flops: float  # the device the compute below was measured on
    forward_row: list  # per stage: seconds per row (sequence) of a forward pass, on ref_flops
    fb_row: list  # per stage: forward + loss + backward (the last stage's task; a recompute elsewhere)
    backward_row: list  # per stage: backward from kept activations
    slice_build: list = field(default_factory=list)  # per stage: seconds to build the slice of a new version
    apply_seconds: float = 0.0  # a server's step of its shard
    # how much longer a pass takes in the run than the above says, the run's processes sharing the
    # machine (the devices' own measurements of themselves against the calibration, their median)
    compute_factor: float = 1.0
    # device -> the compute it registered with its servers (rows/s of its own measurement), which is
    # what the frontal servers split a micro-batch's rows by; its declared FLOP/s where not listed
    weights: dict = field(default_factory=dict)


@dataclass
class Workload:
    steps: int
    micro_batches: int
    rows: int  # sequences per micro-batch
    min_task_rows: int  # the fewest rows a forward task carries (peer serve --task-tokens / seq_len)
    input_bytes: list  # per stage: bytes per row a forward task's take brings (inputs and labels)
    act_bytes: float  # bytes per row of hidden activations at a stage boundary (and of their gradient)
    label_bytes: float  # bytes per row of labels (they travel with the activations)
    param_bytes: list  # per stage: bytes of all its parameters (split over its servers' slots)
    preference_grace: float = 0.5  # seconds a task waits for its preferred worker
    min_client_rows: int = (
        1  # the fewest rows of a batch a worker computes (peer serve --client-batch-tokens / seq_len)
    )
    local_first: bool = True  # a new batch goes first to a free worker of a stage server (peer serve --no-local-first)


def steady_seconds_per_step(version_times: list, warmup: int) -> float:
    """The mean seconds per step from version `warmup` to the last (`version_times[v - 1]`: when the
    run reached version v): a run's start (joining, the first parameter pulls, the pipeline's fill)
    left out, the same way for a simulated and a measured run."""
    if not 1 <= warmup < len(version_times):
        raise ValueError(f"{len(version_times)} versions leave no steady state after version {warmup}")
    return (version_times[-1] - version_times[warmup - 1]) / (len(version_times) - warmup)


@dataclass
class StepTrace:
    version_times: list  # when every server had reached version v (v = 1..steps)
    calls: int = 0  # RPCs made
    tasks: int = 0  # tasks computed
    recomputed: int = 0  # backward tasks run by another worker than their forward pass
    compute_seconds: dict = field(default_factory=dict)  # worker -> seconds of its passes and slice builds
    volunteers: list = field(default_factory=list)  # the workers that are volunteers (not a server's own)

    def utilisation(self) -> float:
        """The volunteers' mean share of the run spent computing (to the last version), as `peer
        join` reports its own: the seconds its passes last over the time it is in the run."""
        end = self.version_times[-1] if self.version_times else 0.0
        if not self.volunteers or end <= 0:
            return 0.0
        return statistics.mean(self.compute_seconds.get(d, 0.0) / end for d in self.volunteers)

    def seconds_per_step(self, warmup: int = 2) -> float:
        """Steady state: `steady_seconds_per_step` of the simulated versions."""
        return steady_seconds_per_step(self.version_times, warmup)

    def median_step(self) -> float:
        t = self.version_times
        return statistics.median(b - a for a, b in zip(t, t[1:]))
