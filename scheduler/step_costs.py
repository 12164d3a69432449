"""What each thing costs in the step model (scheduler/stepsim.py), in simulated seconds:

- a message on a link, as core/protocol/links.py emulates it: `delay + bytes / bandwidth`, with no
  sharing of a link between messages;
- every RPC costs `call_seconds` beyond its link time (packing, the two p2p daemons, the handler),
  and `byte_seconds` per payload byte (serialization and copies through the daemons); a server's
  own worker calls it in-process, for free;
- a task's compute is what was measured for that stage's slice (seconds per row of a forward pass,
  of a forward+loss+backward pass and of a backward pass from kept activations, on a reference
  device of `ref_flops` FLOP/s), scaled by `ref_flops / flops` of the device and by how much slower
  passes run in the swarm than alone (`compute_factor`), and counted in the trace as the device's
  compute; a micro-batch's rows are split by the compute each device registered (`weights`);
- a worker builds the slice of each new parameter version (`slice_build`, a compute cost);
- a server's step of its shard takes `apply_seconds`."""

from __future__ import annotations

from scheduler.files import Cluster
from scheduler.step_io import Calibration, StepTrace, Workload
from scheduler.step_state import SimWorker, device_flops


class Costs:
    def __init__(self, cluster: Cluster, cal: Calibration, work: Workload, trace: StepTrace):
        self.cluster, self.cal, self.work, self.trace = cluster, cal, work, trace

    def flops(self, device: str) -> float:
        return device_flops(self.cluster, device)

    def one_way(self, src: str, dst: str, nbytes: float) -> float:
        if src == dst:
            return 0.0
        return self.cluster.delay(src, dst) + nbytes / self.cluster.bandwidth(src, dst)

    def rpc(self, caller: str, host: str | None, callee: str, req: float, resp: float) -> float:
        """A call from a worker (or server) `caller` to server `callee`; free in-process (own server)."""
        if host == callee or caller == callee:
            return 0.0
        self.trace.calls += 1
        return (
            self.one_way(caller, callee, req)
            + self.one_way(callee, caller, resp)
            + self.cal.call_seconds
            + (req + resp) * self.cal.byte_seconds
        )

    def arrival(self, caller: str, host: str | None, callee: str, req: float) -> float:
        """Seconds until a request from `caller` is at server `callee` (its handler acts then)."""
        if host == callee or caller == callee:
            return 0.0
        return self.one_way(caller, callee, req) + self.cal.call_seconds / 2 + req * self.cal.byte_seconds

    def compute(self, w: SimWorker, kind: str, rows: int) -> float:
        per = {"forward": self.cal.forward_row, "fb": self.cal.fb_row, "backward": self.cal.backward_row}[kind][w.stage]
        return self.busy(w, rows * per * self.cal.ref_flops / w.flops * self.cal.compute_factor)

    def busy(self, w: SimWorker, seconds: float) -> float:
        """`seconds` of compute by `w`, counted in the trace; returned for the worker to wait."""
        self.trace.compute_seconds[w.device] = self.trace.compute_seconds.get(w.device, 0.0) + seconds
        return seconds

    def shard_bytes(self, stage: int) -> float:
        return self.work.param_bytes[stage] / 2  # two slots: the frontal's and the backward's
