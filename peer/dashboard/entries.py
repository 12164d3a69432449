"""What the dashboard makes of one record: the checks beyond a peer record's signature and schema
(finite numbers, maps keyed by batch), the run's config record as the snapshot reads it, the server
and volunteer entries of a snapshot, a stage's pace from its servers' step times, and `History`,
what a long-running dashboard remembers between snapshots. Pure functions of records and the time
(peer/dashboard/snapshot.py puts them together)."""

from __future__ import annotations

from typing import Any

from core.layout import RunLayout
from core.protocol.records import VOLUNTEER_PERIODS, RecordState, RunConfig, validate_record
from core.protocol.values import finite_number

LIVE_STATES = (RecordState.ONLINE, RecordState.JOINING)
POOL_FIELDS = ("queued", "leased", "done", "requeued", "duplicates", "oldest_queued_age")
STATS_FIELDS = (
    "microbatches_applied",
    "duplicates",
    "requeued",
    "clients",
    "clients_joined",
    "clients_left",
    "checked",
    "banned",
    "ban_reach",
)
RATE_WINDOW = 8  # steps over which seconds per step are measured


def short(peer: str | None) -> str:
    """The last 8 characters of a peer id (their common prefix says nothing)."""
    return peer[-8:] if peer else "-"


def int_keyed(d: Any, what: str) -> dict[int, float]:
    """{"3": 1.5} -> {3: 1.5}; ValueError when a key is not an integer or a value not a finite number."""
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected a map")
    out = {}
    for k, v in d.items():
        try:
            key = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: key {k!r} is not an integer") from None
        if not finite_number(v):
            raise ValueError(f"{what}[{k!r}]: {v!r} is not a finite number")
        out[key] = float(v)
    return out


def check_record(value: Any, stage: int) -> dict:
    """validate_record, plus what the dashboard reads inside the record: finite numbers, a pool and
    stats made of numbers, losses and step times keyed by batch. ValueError says what does not fit."""
    rec = validate_record(value)
    kind = rec["kind"]
    for name in ("time", "version", "compute", "throughput", "tasks_done"):
        if name in rec and not finite_number(rec[name]):
            raise ValueError(f"{kind} record: field {name!r} is not a finite number ({rec[name]!r})")
    if rec["stage"] != stage:
        raise ValueError(f"{kind} record announced under stage {stage} says stage {rec['stage']}")
    if kind == "server":
        if rec["version"] < 0:
            raise ValueError(f"server record: negative version {rec['version']}")
        for name, fields in (("pool", POOL_FIELDS), ("stats", STATS_FIELDS)):
            part = rec.get(name, {})
            for f in fields:
                if f in part and not finite_number(part[f]):
                    raise ValueError(f"server record: {name}.{f} is not a finite number ({part[f]!r})")
        for name in ("losses", "eval_losses", "grad_norms"):
            int_keyed(rec.get(name, {}), f"server record: {name}")
        int_keyed(rec.get("step_times", {}), "server record: step_times")
        layers = rec.get("layers")
        if layers is not None and not (len(layers) == 2 and all(isinstance(v, int) for v in layers)):
            raise ValueError(f"server record: layers {layers!r} is not [lo, hi]")
    return rec


def derive_state(announced: str, age: float, stale_after: float) -> str:
    """online/joining/offline as announced, but "unreachable" when a live record is stale."""
    if announced == "offline":
        return "offline"
    return "unreachable" if age > stale_after else announced


class History:
    """What a long-running dashboard remembers across snapshots: the last good record of every
    peer (so a peer that vanished from the DHT still shows, as unreachable, for `show_vanished_for`
    seconds, and counts as a lost volunteer), the wall time each new step was first seen (rates when
    the servers publish no step times), the losses and gradient norms of past batches and the held-out
    losses of past versions (a record carries only the last few)."""

    def __init__(self, show_vanished_for: float = 30.0):
        self.show_vanished_for = show_vanished_for
        self.servers: dict[tuple[int, str, str], tuple[str, dict]] = {}  # (stage, role, device) -> (peer, rec)
        self.clients: dict[tuple[int, str], dict] = {}  # (stage, peer) -> last record
        self.step_seen: list[tuple[float, int]] = []  # (first seen at, step)
        self.stage_seen: dict[int, list[tuple[float, int]]] = {}
        self.losses: dict[int, float] = {}  # batch -> mean token loss
        # the run as last seen finished (step, loss, held-out loss, when): once every server reached the
        # last step they leave, and their records with them; the run stays finished in this view
        self.finished: dict | None = None
        self.seen_at: float | None = None  # the last time the run's records were found
        self.eval_losses: dict[int, float] = {}  # version -> held-out loss (--eval-every)
        self.grad_norms: dict[int, float] = {}  # batch -> global gradient norm (--clip-grad-norm)

    @staticmethod
    def note(seen: list[tuple[float, int]], now: float, value: int | None) -> None:
        if value is not None and (not seen or value > seen[-1][1]):
            seen.append((now, value))
            del seen[:-64]

    @staticmethod
    def seconds_per_step(seen: list[tuple[float, int]]) -> float | None:
        # the first entry is when the dashboard started watching, not when that step was reached
        changes = seen[1:][-(RATE_WINDOW + 1) :]
        if len(changes) < 2:
            return None
        (t0, v0), (t1, v1) = changes[0], changes[-1]
        return (t1 - t0) / (v1 - v0) if t1 > t0 else None


def pace_of(recs: list[dict]) -> tuple[float | None, float | None]:
    """Seconds per step over the last steps the servers all published (`step_times`: version ->
    wall time it was reached; a version counts as reached when the slowest server reached it), and
    the wall time of the last such step."""
    maps = [int_keyed(r["step_times"], "step_times") for r in recs if r.get("step_times")]
    if not maps or len(maps) < len(recs):
        return None, None
    common = sorted(set.intersection(*(set(m) for m in maps)))
    if not common:
        return None, None
    reached = {v: max(m[v] for m in maps) for v in common[-(RATE_WINDOW + 1) :]}
    last = max(reached.values())
    if len(reached) < 2:
        return None, last
    lo, hi = min(reached), max(reached)
    span = reached[hi] - reached[lo]
    return (span / (hi - lo) if span > 0 else None), last


def pool_view(rec: dict) -> dict:
    pool, stats = rec.get("pool", {}), rec.get("stats", {})
    return {
        "queued": pool.get("queued"),
        "leased": pool.get("leased"),
        "done": pool.get("done"),
        "requeued": pool.get("requeued"),
        # the server's count covers its pool, its shard and its relays; the pool's own is a part of it
        "duplicates": stats.get("duplicates", pool.get("duplicates")),
        "oldest_task_age": pool.get("oldest_queued_age"),
    }


def server_entry(
    peer: str | None, rec: dict | None, now: float, stale_after: float, device: str = "", role: str = ""
) -> dict:
    if rec is None:  # named by the layout, never seen
        return {
            "device": device,
            "role": role,
            "peer": None,
            "short": "-",
            "state": "unreachable",
            "announced_state": None,
            "version": None,
            "last_seen": None,
            "compute": None,
            "microbatches_applied": None,
            "clients": None,
            "layers": None,
            "pool": {k: None for k in ("queued", "leased", "done", "requeued", "duplicates", "oldest_task_age")},
            "note": "no record in the DHT",
        }
    age = max(0.0, now - rec["time"])
    stats = rec.get("stats", {})
    return {
        "device": rec["device"],
        "role": rec["role"],
        "peer": peer,
        "short": short(peer),
        "state": derive_state(rec["state"], age, stale_after),
        "announced_state": rec["state"],
        "version": rec["version"],
        "last_seen": round(age, 3),
        "compute": rec.get("compute"),
        "microbatches_applied": stats.get("microbatches_applied"),
        "clients": stats.get("clients"),
        "layers": rec.get("layers"),
        "pool": pool_view(rec),
        "says": rec.get("says"),  # its state line
    }


def volunteer_entry(peer: str, rec: dict, now: float, stale_after: float, vanished: bool = False) -> dict:
    """A volunteer's row; `stale_after` is the servers' (in announce periods): a volunteer stores
    its record every VOLUNTEER_PERIODS of them (core/protocol/records.py), and is judged by that."""
    stale_after *= VOLUNTEER_PERIODS
    age = max(0.0, now - rec["time"])
    state = (
        ("offline" if rec["state"] == "offline" else "unreachable")
        if vanished
        else derive_state(rec["state"], age, stale_after)
    )
    return {
        "device": rec["device"],
        "peer": peer,
        "short": short(peer),
        "state": state,
        "compute": rec["compute"],
        "throughput": rec.get("throughput"),
        "tasks_done": rec.get("tasks_done"),
        "last_seen": round(age, 3),
        "vanished": vanished,
    }


def parse_config(config: Any, errors: list[str]):
    """(RunConfig, RunLayout, seq_len) with None for what the config record does not give."""
    if config is None:
        return None, None, None
    try:
        run = RunConfig.from_dict(config)
    except ValueError as e:
        errors.append(str(e))
        return None, None, None
    if run.announce_period <= 0:
        errors.append(f"run config record: announce_period {run.announce_period} is not positive")
    from core.model.config import run_model

    seq_len, num_layers = None, None
    try:
        preset = run_model(run.model, run.arch)
        seq_len, num_layers = preset.seq_len, preset.layers
    except ValueError as e:
        errors.append(f"run config record: {e}")
    stages = run.layout.get("stages")
    if num_layers is None and isinstance(stages, list) and stages and isinstance(stages[-1], dict):
        hi = (stages[-1].get("layers") or [None, None])[-1]
        num_layers = hi if isinstance(hi, int) else None
    try:
        layout = RunLayout.from_dict(run.layout, num_layers if num_layers is not None else -1)
    except Exception as e:  # ValueError says what does not fit; anything else is a layout too odd to say
        errors.append(f"run config record: layout: {e if isinstance(e, ValueError) else repr(e)}")
        layout = None
    return run, layout, seq_len


def config_view(run: RunConfig, seq_len: int | None, n_stages: int) -> dict:
    """The run's settings as a snapshot shows them."""
    return {
        "model": run.model,
        "seed": run.seed,
        "steps": run.steps,
        "batch_size": run.batch_size,
        "micro_batches": run.micro_batches,
        "lr": run.lr,
        "announce_period": run.announce_period,
        "seq_len": seq_len,
        "tokens_per_step": run.batch_size * seq_len if seq_len else None,
        "stages": n_stages,
    }
