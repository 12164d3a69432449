"""DHT records: keys, schemas and validation. Every key starts with the run id, so several runs
share one DHT. Like Petals' module records: a key per stage, a subkey per peer id, a value with
role, state, load and version, re-announced on a period and expiring by itself."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

logger = logging.getLogger("hivepipe.records")


class RecordState(str, enum.Enum):
    """What a peer's DHT record says it is doing (its `state`). Equal to its value as a str, so a state
    read from a record compares and hashes the same."""

    JOINING = "joining"  # a server that has not yet seen every server of the layout
    ONLINE = "online"
    OFFLINE = "offline"  # it said it left
    FINISHED = "finished"  # a server that saw every server of the run reach the last step

    __str__ = str.__str__
    __format__ = str.__format__


STATES = tuple(RecordState)

# An announcement is stored to live STALE_PERIODS announce periods, and never less than
# MIN_RECORD_TTL: a store that meets a silent DHT peer (frozen, gone, behind a dead NAT) waits
# peer.node.DHT_CALL_TIMEOUT (5 s) for it, to find the key's nodes and again to store, and a record
# that expired before it arrived was never seen by anyone (with a 3 s life, one frozen server hid
# every stage-0 record from every reader while it was frozen). Whether its writer is still there is
# judged by how fresh the record is (its `time`: is_fresh, Directory.silent_for), not by whether a
# record is there.
STALE_PERIODS = 3
MIN_RECORD_TTL = 15.0
# Every peer stores its record once per announce period and a server reads the stage records as
# often, each a DHT traversal through the p2p daemons: at 1 s the DHT processes alone were 12% of the
# default swarm's processor time (5-6% at 3 s), and its steps took 17-30% longer than at 3 s (measured
# with scripts/bench_swarm.py). A server still announces every JOINING_PERIOD until it has
# seen every server of the run, so that a run comes online as soon as at 1 s.
DEFAULT_ANNOUNCE_PERIOD = 3.0
JOINING_PERIOD = 1.0
# A volunteer's own record is read by dashboards only (a volunteer choosing its stage reads the
# servers' counts of their volunteers): it is stored every VOLUNTEER_PERIODS announce periods, so
# that what the nodes holding a stage's volunteers' key receive stays a few percent of a home link
# at 10,000 volunteers (docs/scale.md); a dashboard judges its freshness by that period.
VOLUNTEER_PERIODS = 5


def volunteer_period(announce_period: float) -> float:
    """How often a volunteer stores its own record, in a run that announces every `announce_period`."""
    return VOLUNTEER_PERIODS * announce_period


def record_ttl(period: float) -> float:
    """How long an announcement made every `period` seconds is stored for."""
    return max(STALE_PERIODS * period, MIN_RECORD_TTL)


def stale_after(period: float) -> float:
    """How old a record may be while its writer still counts as there: STALE_PERIODS periods."""
    return STALE_PERIODS * period


def is_fresh(rec: dict, period: float, now: float | None = None) -> bool:
    """Whether `rec` (a valid record) was written within stale_after(period) seconds of `now`."""
    return (time.time() if now is None else now) - float(rec["time"]) <= stale_after(period)


ROLES = ("frontal", "backward")


def config_key(run_id: str) -> str:
    from core.protocol.trust import config_name

    return config_name(run_id)


def stage_key(run_id: str, stage: int) -> str:
    """The key of a stage's servers' records."""
    from core.protocol.trust import stage_name

    return stage_name(run_id, stage)


def clients_key(run_id: str, stage: int) -> str:
    """The key of a stage's volunteers' records (read by the dashboard, not by every peer)."""
    from core.protocol.trust import clients_name

    return clients_name(run_id, stage)


PRECISIONS = ("fp32", "bf16")  # a run's --precision (core.model.precision says what each means)


@dataclass(frozen=True)
class RunConfig:
    """What every peer of a run must agree on; servers publish it, volunteers read it."""

    run_id: str
    model: str
    seed: int
    steps: int
    batch_size: int
    micro_batches: int
    lr: float
    layout: dict  # RunLayout.to_dict()
    announce_period: float = DEFAULT_ANNOUNCE_PERIOD
    # the model's architecture (ModelConfig.to_dict()) for a run started from a Transformers
    # checkpoint (`--init-from`): a volunteer builds its slice from it; None for a preset
    arch: dict | None = None
    # activations, their gradients and gradient pushes on the wire: none (exact) | fp16 | bf16 | 8bit
    compress: str = "none"
    # the learning-rate schedule and AdamW's settings (core.protocol.recipe.Recipe.record(); None: defaults)
    recipe: dict | None = None
    # the volunteers' compute precision: fp32 | bf16 (autocast on parameters sent in bf16; core.model.precision)
    precision: str = "fp32"
    # the corpus's fingerprint (core.model.data.Corpus.fingerprint), from a server that reads the data
    # (stage 0's and the last stage's frontal servers); None from the others
    data: str | None = None
    # the held-out loss of every N-th version (and the last) is computed (parameter_server/evaluate.py); 0: none
    eval_every: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def training_recipe(self):
        """The run's core.protocol.recipe.Recipe (lr and the recipe map)."""
        from core.protocol.recipe import Recipe

        return Recipe.from_record(self.lr, self.recipe)

    @classmethod
    def from_dict(cls, d: Any) -> "RunConfig":
        if not isinstance(d, dict):
            raise ValueError("run config record: expected a map")
        kinds = {
            "run_id": str,
            "model": str,
            "seed": int,
            "steps": int,
            "batch_size": int,
            "micro_batches": int,
            "lr": (int, float),
            "layout": dict,
            "announce_period": (int, float),
        }
        for k, kind in kinds.items():
            if k not in d:
                raise ValueError(f"run config record: missing field {k!r}")
            if not isinstance(d[k], kind) or isinstance(d[k], bool):
                raise ValueError(f"run config record: field {k!r} has the wrong type {type(d[k]).__name__}")
        arch = d.get("arch")
        if arch is not None and not isinstance(arch, dict):
            raise ValueError(f"run config record: field 'arch' has the wrong type {type(arch).__name__}")
        from core.protocol.codecs import COMPRESSION

        compress = d.get("compress", "none")
        if compress not in COMPRESSION:
            raise ValueError(
                f"run config record: field 'compress' must be one of {', '.join(COMPRESSION)}, got {compress!r}"
            )
        from core.protocol.recipe import Recipe

        try:
            recipe = Recipe.from_record(d["lr"], d.get("recipe"))
            recipe.check(d["steps"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"run config record: field 'recipe': {e}") from None
        precision = d.get("precision", "fp32")
        if precision not in PRECISIONS:
            raise ValueError(
                f"run config record: field 'precision' must be one of {', '.join(PRECISIONS)}, got {precision!r}"
            )
        eval_every = d.get("eval_every", 0)
        if not isinstance(eval_every, int) or isinstance(eval_every, bool) or eval_every < 0:
            raise ValueError(f"run config record: field 'eval_every' must be an integer >= 0, got {eval_every!r}")
        data = d.get("data")
        if data is not None and not isinstance(data, str):
            raise ValueError(f"run config record: field 'data' has the wrong type {type(data).__name__}")
        return cls(
            **{k: d[k] for k in kinds},
            arch=arch,
            compress=compress,
            recipe=recipe.record(),
            precision=precision,
            data=data,
            eval_every=eval_every,
        )


def _kinds(*types) -> dict:
    return {"types": types}


@dataclass
class ServerRecord:
    """A server's announcement under its stage key (subkey: its peer id), re-published every
    announce period and expiring by itself: who it is, where to dial it, how far it is."""

    device: str = field(metadata=_kinds(str))
    role: str = field(metadata=_kinds(str))
    stage: int = field(metadata=_kinds(int))
    state: str = field(metadata=_kinds(str))
    version: int = field(metadata=_kinds(int))
    maddrs: list = field(metadata=_kinds(list))  # the multiaddrs it announces: peers connect there
    time: float = field(metadata=_kinds(int, float))
    epoch: int | None = field(default=None, metadata=_kinds(int))
    pool: dict | None = field(default=None, metadata=_kinds(dict))
    loss: float | None = field(default=None, metadata=_kinds(int, float, type(None)))
    losses: dict | None = field(default=None, metadata=_kinds(dict))
    # version -> held-out loss (--eval-every; the server that evaluates) and batch -> the gradient's
    # global norm before clipping (--clip-grad-norm), the last few of each
    eval_losses: dict | None = field(default=None, metadata=_kinds(dict))
    grad_norms: dict | None = field(default=None, metadata=_kinds(dict))
    stats: dict | None = field(default=None, metadata=_kinds(dict))
    layers: list | None = field(default=None, metadata=_kinds(list))
    compute: float | None = field(default=None, metadata=_kinds(int, float))
    step_times: dict | None = field(default=None, metadata=_kinds(dict))
    # set while the run is stopped: why (a role's last server is gone), what brings it back
    halted: str | None = field(default=None, metadata=_kinds(str))
    # its state line, as it last said it (peer.host.state): "waiting: for the run's servers s0b0 ..."
    says: str | None = field(default=None, metadata=_kinds(str))
    kind = "server"


@dataclass
class ClientRecord:
    """A volunteer's announcement under the stage key it computes for (subkey: its peer id)."""

    device: str = field(metadata=_kinds(str))
    stage: int = field(metadata=_kinds(int))
    state: str = field(metadata=_kinds(str))
    compute: float = field(metadata=_kinds(int, float))
    time: float = field(metadata=_kinds(int, float))
    throughput: float | None = field(default=None, metadata=_kinds(int, float))
    tasks_done: int | None = field(default=None, metadata=_kinds(int))
    kind = "client"


RECORD_KINDS = {"server": ServerRecord, "client": ClientRecord}


def record_to_dict(rec: "ServerRecord | ClientRecord") -> dict:
    """What goes into the DHT: the kind and every field that is set (a RecordState as its plain str: the
    DHT's serializer takes exact types only)."""
    out = {"kind": rec.kind}
    for f in fields(rec):
        value = getattr(rec, f.name)
        if value is not None:
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
    return out


def parse_record(value: Any) -> "ServerRecord | ClientRecord":
    """The typed record of a raw DHT value; ValueError saying what does not fit."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a map, got {type(value).__name__}")
    kind = value.get("kind")
    cls = RECORD_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown record kind {kind!r}")
    for f in fields(cls):
        if f.name not in value:
            if f.default is MISSING:
                raise ValueError(f"{kind} record: missing field {f.name!r}")
            continue
        types = f.metadata["types"]
        v = value[f.name]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise ValueError(f"{kind} record: field {f.name!r} has the wrong type {type(v).__name__}")
    if value["state"] not in STATES:
        raise ValueError(f"{kind} record: state {value['state']!r} not one of {STATES}")
    if kind == "server" and value["role"] not in ROLES:
        raise ValueError(f"server record: role {value['role']!r} not one of {ROLES}")
    return cls(**{f.name: value[f.name] for f in fields(cls) if f.name in value})


def validate_record(value: Any) -> dict:
    """Return the record (the raw map, as readers use it) if it fits its typed schema, else raise
    ValueError saying what does not fit."""
    parse_record(value)
    return value


def halted_reason(recs) -> str | None:
    """Why the run is stopped, as one of these (valid) records of its live servers says; None while
    none of them says it is."""
    reasons = sorted(
        {
            r["halted"]
            for r in recs
            if r.get("kind") == "server" and r["state"] != RecordState.OFFLINE and isinstance(r.get("halted"), str)
        }
    )
    return reasons[0] if reasons else None
