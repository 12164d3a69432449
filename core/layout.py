"""The run's layout: which servers hold which stage and role, which layers each stage owns, and the
row arithmetic of section 3.2.1 (even segmentation of a micro-batch between p senders and q
receivers, and a split of rows in proportion to compute power). Pure Python: no torch, no network."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler.rows import clients_per_batch, cut_rows, in_flight, local_first, note_cut, owed_more, split_by_weights  # noqa: F401 (the frontal servers' cut; the step model's too)


@dataclass(frozen=True)
class StageLayout:
    index: int
    layers: tuple[int, int]
    frontal: tuple[str, ...]
    backward: tuple[str, ...]
    clients: tuple[str, ...] = ()
    # which server hosts each shard slot of the stage's parameters: empty means slot i is hosted by
    # servers[i]; after a failover (a later layout epoch) a lost server's slot is hosted by the server
    # that held its replica
    shard_hosts: tuple[str, ...] = ()

    @property
    def servers(self) -> tuple[str, ...]:
        """All servers of the stage in shard order: frontal first, then backward."""
        return self.frontal + self.backward

    @property
    def hosts(self) -> tuple[str, ...]:
        """The host of each shard slot (slot i of `assign_shards(..., len(hosts))`)."""
        return self.shard_hosts or self.servers

    def slots_of(self, device: str) -> list[int]:
        return [i for i, d in enumerate(self.hosts) if d == device]


@dataclass(frozen=True)
class RunLayout:
    stages: tuple[StageLayout, ...]
    idle: tuple[str, ...] = field(default=())
    # the plan's predicted seconds per step (its `predicted_seconds_per_batch`), when laid out from a plan
    predicted_seconds_per_step: float | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def locate(self, device_id: str) -> tuple[int, str, int]:
        """(stage, role, index within that role) of a server device id."""
        for st in self.stages:
            if device_id in st.frontal:
                return st.index, "frontal", st.frontal.index(device_id)
            if device_id in st.backward:
                return st.index, "backward", st.backward.index(device_id)
        raise ValueError(f"device {device_id!r} is not a server of this layout")

    def stage_of_client(self, device_id: str) -> int | None:
        for st in self.stages:
            if device_id in st.clients:
                return st.index
        return None

    def to_dict(self) -> dict:
        return {
            "stages": [
                {
                    "layers": list(s.layers),
                    "frontal": list(s.frontal),
                    "backward": list(s.backward),
                    "clients": list(s.clients),
                }
                | ({"shard_hosts": list(s.shard_hosts)} if s.shard_hosts else {})
                for s in self.stages
            ],
            "idle": list(self.idle),
        } | (
            {}
            if self.predicted_seconds_per_step is None
            else {"predicted_seconds_per_step": self.predicted_seconds_per_step}
        )

    @classmethod
    def from_dict(cls, data: dict, num_layers: int) -> "RunLayout":
        """From a plan file's dict (docs/cost-model.md); checks the tiling of the layers."""
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list) or not data["stages"]:
            raise ValueError("plan.stages: expected a non-empty list")
        stages = []
        expected_lo = 0
        seen: set[str] = set()
        for k, s in enumerate(data["stages"]):
            where = f"plan.stages[{k}]"
            if not isinstance(s, dict):
                raise ValueError(f"{where}: expected an object")
            layers = s.get("layers")
            if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(v, int) for v in layers)):
                raise ValueError(f"{where}.layers: expected [lo, hi]")
            if layers[0] != expected_lo or layers[1] <= layers[0]:
                raise ValueError(f"{where}.layers: {layers} does not continue the tiling at {expected_lo}")
            expected_lo = layers[1]
            roles = {}
            for role in ("frontal", "backward", "clients"):
                ids = s.get(role, [] if role == "clients" else None)
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    raise ValueError(f"{where}.{role}: expected a list of device ids")
                if role != "clients" and not ids:
                    raise ValueError(f"{where}.{role}: a stage needs at least one {role} server")
                for i in ids:
                    if i in seen:
                        raise ValueError(f"{where}.{role}: device {i!r} appears twice in the plan")
                    seen.add(i)
                roles[role] = tuple(ids)
            hosts = s.get("shard_hosts", [])
            servers = set(roles["frontal"]) | set(roles["backward"])
            if (
                not isinstance(hosts, list)
                or not all(isinstance(h, str) and h in servers for h in hosts)
                or (hosts and not servers <= set(hosts))
            ):
                raise ValueError(f"{where}.shard_hosts: expected a list of this stage's servers, each hosting a slot")
            stages.append(
                StageLayout(
                    k, (layers[0], layers[1]), roles["frontal"], roles["backward"], roles["clients"], tuple(hosts)
                )
            )
        if expected_lo != num_layers:
            raise ValueError(f"plan.stages: layers end at {expected_lo}, the model has {num_layers}")
        idle = data.get("idle", [])
        if not isinstance(idle, list) or not all(isinstance(i, str) for i in idle):
            raise ValueError("plan.idle: expected a list of device ids")
        # a plan file says predicted_seconds_per_batch; a layout carried in a run config says per_step
        key = "predicted_seconds_per_step" if "predicted_seconds_per_step" in data else "predicted_seconds_per_batch"
        # (informative only, for the dashboard: anything but a finite non-negative number is dropped)
        pred = data.get(key)
        if not isinstance(pred, (int, float)) or isinstance(pred, bool) or not math.isfinite(pred) or pred < 0:
            pred = None
        return cls(tuple(stages), tuple(idle), None if pred is None else float(pred))

    @classmethod
    def even(
        cls, num_stages: int, num_layers: int, frontal_per_stage: int = 1, backward_per_stage: int = 1
    ) -> "RunLayout":
        """The default layout: layers split evenly, servers named s{k}f{i} and s{k}b{i}."""
        if not 1 <= num_stages <= num_layers:
            raise ValueError(f"--stages must be between 1 and the model's {num_layers} layers, got {num_stages}")
        if frontal_per_stage < 1 or backward_per_stage < 1:
            raise ValueError("every stage needs at least one frontal and one backward server")
        stages = []
        for k in range(num_stages):
            lo, hi = segment(num_layers, num_stages, k)
            stages.append(
                StageLayout(
                    k,
                    (lo, hi),
                    tuple(f"s{k}f{i}" for i in range(frontal_per_stage)),
                    tuple(f"s{k}b{i}" for i in range(backward_per_stage)),
                )
            )
        return cls(tuple(stages))

    def stranded(self, lost) -> list[tuple[int, str, tuple[str, ...]]]:
        """The roles that `lost` leaves without a server, as (stage, role, its servers): a failover
        cannot absorb those losses (`without` refuses them), so the run stops until one comes back."""
        gone = set(lost)
        return [
            (st.index, role, devs)
            for st in self.stages
            for role, devs in (("frontal", st.frontal), ("backward", st.backward))
            if devs and set(devs) <= gone
        ]

    def without(self, lost: dict[str, str]) -> "RunLayout":
        """The layout after a failover: each lost server (device -> the server now hosting its shard
        slots) removed from its role, the rows re-segmented among the rest of that role (the row
        arithmetic follows from the roles), its slots hosted by the given server. ValueError if a
        role would be left empty or a host is not a remaining server of that stage."""
        stages = []
        for st in self.stages:
            frontal = tuple(d for d in st.frontal if d not in lost)
            backward = tuple(d for d in st.backward if d not in lost)
            if not frontal or not backward:
                role = "frontal" if not frontal else "backward"
                raise ValueError(f"stage {st.index} would have no {role} server left")
            hosts = tuple(lost.get(d, d) for d in st.hosts)
            if not set(hosts) <= set(frontal + backward):
                raise ValueError(
                    f"stage {st.index}: a lost server's shard must move to a remaining server of the stage"
                )
            stages.append(
                StageLayout(
                    st.index, st.layers, frontal, backward, st.clients, hosts if hosts != frontal + backward else ()
                )
            )
        return RunLayout(tuple(stages), self.idle, self.predicted_seconds_per_step)


def halt_reason(stranded: list[tuple[int, str, tuple[str, ...]]], failover: bool = True) -> str | None:
    """What a stopped run tells its peers and the dashboard: which role has no server left, and what
    brings the run back (None when nothing is stranded). `failover` False: failover is off, so every
    lost server stops the run, not only a role's last."""
    if not stranded:
        return None
    parts = [f"stage {k} has no {role} server ({', '.join(devs)} gone)" for k, role, devs in stranded]
    why = "a role's last server cannot be failed over" if failover else "failover is off (--failover-after 0)"
    devs = [d for _, _, ds in stranded for d in ds]
    back = "it comes" if len(devs) == 1 else "they come"
    return (
        f"run stopped: {'; '.join(parts)}; {why}, so the run waits until {back} back from the checkpoint "
        f"(restart with the same --device-id, --identity-path and --checkpoint-dir)"
    )


def segment(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of `parts` even, contiguous pieces of range(n): [i*n//parts, (i+1)*n//parts)."""
    return i * n // parts, (i + 1) * n // parts


def owners(n: int, parts: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Which of `parts` even segments of range(n) cover rows [lo, hi): (segment index, lo, hi) pieces."""
    out = []
    for i in range(parts):
        s_lo, s_hi = segment(n, parts, i)
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            out.append((i, a, b))
    return out


# the fewest tokens a forward task carries when a micro-batch has more clients than such tasks
# (`peer serve --task-tokens`): 4 rows of the small model, 16 of tiny, 1 row of a 2,048-token model
DEFAULT_TASK_TOKENS = 512

# the fewest tokens of a batch a client computes at a frontal server (`peer serve --client-batch-tokens`):
# a client that computes any part of a batch pulls its stage's parameters of the batch's version and
# pushes a gradient sum as large, 8 bytes a parameter in all, against 6 FLOPs a parameter and token of
# compute: at 2,048 tokens 1 byte moves for every 1,500 FLOPs whatever the model's size. The default
# swarm's whole batch (16 rows of 128 tokens) goes to one client a stage and the next batch to the next.
DEFAULT_CLIENT_BATCH_TOKENS = 2048


def assign_shards(sizes: dict[str, int], n_servers: int) -> list[list[str]]:
    """Split parameter names among servers, balanced by element count (greedy, largest first,
    deterministic). Every client and server computes the same assignment."""
    loads = [0] * n_servers
    out: list[list[str]] = [[] for _ in range(n_servers)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        j = min(range(n_servers), key=lambda i: (loads[i], i))
        out[j].append(name)
        loads[j] += sizes[name]
    return [sorted(names) for names in out]
