"""The state the step model (scheduler/stepsim.py) keeps of a simulated swarm: its tasks, its servers
(one frontal and one backward a stage) and its workers, and the FLOP/s a cluster file gives a device."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.files import Cluster


@dataclass
class SimTask:
    kind: str  # "forward" | "fb" | "backward"
    stage: int
    batch: int
    micro: int
    rows: int
    server: str
    preferred: str | None
    open_at: float
    seq: int
    forward_worker: str | None = None


@dataclass
class SimServer:
    device: str
    stage: int
    role: str
    version: int = 0
    tasks: list = field(default_factory=list)
    credited: dict = field(default_factory=dict)  # batch -> rows credited (of every micro-batch)
    outputs: dict = field(default_factory=dict)  # (batch, micro) -> rows arrived (backward server)
    credit: dict = field(default_factory=dict)  # worker -> rows owed (frontal server)
    members: dict = field(default_factory=dict)  # batch -> the workers its forward tasks are cut for (frontal server)
    cut: dict = field(default_factory=dict)  # batch -> (micro-batches cut, the workers that got a piece of each)


@dataclass
class SimWorker:
    device: str
    stage: int
    flops: float
    host: str | None  # the server whose process runs this worker, if any
    versions: set = field(default_factory=set)
    worked: set = field(default_factory=set)  # versions of its last tasks (scheduler/prefetch.py)
    fetching: set = field(default_factory=set)  # versions it fetches ahead of need
    built: set = field(default_factory=set)  # versions whose slice it has built
    pending: dict = field(default_factory=dict)  # batch -> [task]
    kept: set = field(default_factory=set)  # (batch, micro) whose forward pass it keeps
    awaiting: dict = field(default_factory=dict)  # batch held while idle (owed tasks of it) -> since when
    owed_forward: set = field(default_factory=set)  # batches its frontal server cuts more tasks of for it
    idle: bool = False


def device_flops(cluster: Cluster, device: str) -> float:
    """The FLOP/s a cluster file declares for a device, reliable or not."""
    if cluster.kind(device) == "reliable":
        return float(cluster.reliable_flops[cluster.index(device)])
    return float(cluster.unreliable_flops[cluster.index(device)])
