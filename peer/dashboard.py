"""The run's status dashboard (issue #7), read from the DHT records alone: per stage its layers,
servers, volunteers, task pools and tokens/s; the run's step, loss, throughput and seconds per step;
and what blocks it.

`build_snapshot` is a pure function of the raw DHT values (the config record and one map of peer
records per stage) and the time, so it is tested without a DHT; `History` is what a long-running
dashboard remembers between snapshots (vanished peers, when steps were seen, past losses). The
snapshot renders as a rich table for the terminal, as JSON (`/api/state`, `--json`) for the web
page, and as Prometheus text (`/metrics`). `main` is the command line of scripts/dashboard.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import threading
import time
from typing import Any

from parameter_server.layout import RunLayout
from peer.protocol.records import RunConfig, config_key, stage_key, subkey_values, validate_record

logger = logging.getLogger("hivepipe.dashboard")

# hivemind cannot list the keys it stores, so a run cannot be discovered: the default is the one
# `peer swarm` uses (`peer serve` and `peer join` default to "hivepipe")
DEFAULT_RUN_ID = "swarm"
RUN_ID_HINT = (f"(check --run-id: `peer swarm` uses {DEFAULT_RUN_ID!r} by default, `peer serve` and `peer join` "
               "use 'hivepipe')")
LIVE_STATES = ("online", "joining")
POOL_FIELDS = ("queued", "leased", "done", "requeued", "duplicates", "oldest_queued_age")
STATS_FIELDS = ("microbatches_applied", "duplicates", "requeued", "clients", "clients_joined", "clients_left")
MAX_PROBED_STAGES = 64  # without a usable config, stage keys are read until the first empty one
RATE_WINDOW = 8  # steps over which seconds per step are measured


def short(peer: str | None) -> str:
    """The last 8 characters of a peer id (their common prefix says nothing)."""
    return peer[-8:] if peer else "-"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_keyed(d: Any, what: str) -> dict[int, float]:
    """{"3": 1.5} -> {3: 1.5}; ValueError when a key is not an integer or a value not a finite number."""
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected a map")
    out = {}
    for k, v in d.items():
        try:
            key = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: key {k!r} is not an integer") from None
        if not _number(v):
            raise ValueError(f"{what}[{k!r}]: {v!r} is not a finite number")
        out[key] = float(v)
    return out


def check_record(value: Any, stage: int) -> dict:
    """validate_record, plus what the dashboard reads inside the record: finite numbers, a pool and
    stats made of numbers, losses and step times keyed by batch. ValueError says what does not fit."""
    rec = validate_record(value)
    kind = rec["kind"]
    for name in ("time", "version", "compute", "throughput", "tasks_done"):
        if name in rec and not _number(rec[name]):
            raise ValueError(f"{kind} record: field {name!r} is not a finite number ({rec[name]!r})")
    if rec["stage"] != stage:
        raise ValueError(f"{kind} record announced under stage {stage} says stage {rec['stage']}")
    if kind == "server":
        if rec["version"] < 0:
            raise ValueError(f"server record: negative version {rec['version']}")
        for name, fields in (("pool", POOL_FIELDS), ("stats", STATS_FIELDS)):
            part = rec.get(name, {})
            for f in fields:
                if f in part and not _number(part[f]):
                    raise ValueError(f"server record: {name}.{f} is not a finite number ({part[f]!r})")
        _int_keyed(rec.get("losses", {}), "server record: losses")
        _int_keyed(rec.get("step_times", {}), "server record: step_times")
        layers = rec.get("layers")
        if layers is not None and not (len(layers) == 2 and all(isinstance(v, int) for v in layers)):
            raise ValueError(f"server record: layers {layers!r} is not [lo, hi]")
    return rec


def run_found(config: Any, stages: list[Any]) -> bool:
    """Whether the DHT holds anything of the run: its config record or any stage record."""
    return config is not None or any(s is not None for s in stages)


def derive_state(announced: str, age: float, stale_after: float) -> str:
    """online/joining/offline as announced, but "unreachable" when a live record is stale."""
    if announced == "offline":
        return "offline"
    return "unreachable" if age > stale_after else announced


def stage_count(config: Any) -> int | None:
    """How many stage keys the config's layout names, or None when it names none."""
    if isinstance(config, dict) and isinstance(config.get("layout"), dict):
        stages = config["layout"].get("stages")
        if isinstance(stages, list) and stages:
            return len(stages)
    return None


class History:
    """What a long-running dashboard remembers across snapshots: the last good record of every
    peer (so a peer that vanished from the DHT still shows, as unreachable, for `show_vanished_for`
    seconds, and counts as a lost volunteer), the wall time each new step was first seen (rates when
    the servers publish no step times), and the losses of past batches."""

    def __init__(self, show_vanished_for: float = 30.0):
        self.show_vanished_for = show_vanished_for
        self.servers: dict[tuple[int, str, str], tuple[str, dict]] = {}  # (stage, role, device) -> (peer, rec)
        self.clients: dict[tuple[int, str], dict] = {}  # (stage, peer) -> last record
        self.step_seen: list[tuple[float, int]] = []  # (first seen at, step)
        self.stage_seen: dict[int, list[tuple[float, int]]] = {}
        self.losses: dict[int, float] = {}  # batch -> mean token loss

    @staticmethod
    def note(seen: list[tuple[float, int]], now: float, value: int | None) -> None:
        if value is not None and (not seen or value > seen[-1][1]):
            seen.append((now, value))
            del seen[:-64]

    @staticmethod
    def seconds_per_step(seen: list[tuple[float, int]]) -> float | None:
        # the first entry is when the dashboard started watching, not when that step was reached
        changes = seen[1:][-(RATE_WINDOW + 1):]
        if len(changes) < 2:
            return None
        (t0, v0), (t1, v1) = changes[0], changes[-1]
        return (t1 - t0) / (v1 - v0) if t1 > t0 else None


def _seconds_per_step(recs: list[dict]) -> tuple[float | None, float | None]:
    """Seconds per step over the last steps the servers all published (`step_times`: version ->
    wall time it was reached; a version counts as reached when the slowest server reached it), and
    the wall time of the last such step."""
    maps = [_int_keyed(r["step_times"], "step_times") for r in recs if r.get("step_times")]
    if not maps or len(maps) < len(recs):
        return None, None
    common = sorted(set.intersection(*(set(m) for m in maps)))
    if not common:
        return None, None
    reached = {v: max(m[v] for m in maps) for v in common[-(RATE_WINDOW + 1):]}
    last = max(reached.values())
    if len(reached) < 2:
        return None, last
    lo, hi = min(reached), max(reached)
    span = reached[hi] - reached[lo]
    return (span / (hi - lo) if span > 0 else None), last


def _pool(rec: dict) -> dict:
    pool, stats = rec.get("pool", {}), rec.get("stats", {})
    return {"queued": pool.get("queued"), "leased": pool.get("leased"), "done": pool.get("done"),
            "requeued": pool.get("requeued"),
            # the server's count covers its pool, its shard and its relays; the pool's own is a part of it
            "duplicates": stats.get("duplicates", pool.get("duplicates")),
            "oldest_task_age": pool.get("oldest_queued_age")}


def _server_entry(peer: str | None, rec: dict | None, now: float, stale_after: float, device: str = "",
                  role: str = "") -> dict:
    if rec is None:  # named by the layout, never seen
        return {"device": device, "role": role, "peer": None, "short": "-", "state": "unreachable",
                "announced_state": None, "version": None, "last_seen": None, "compute": None,
                "microbatches_applied": None, "clients": None, "layers": None,
                "pool": {k: None for k in ("queued", "leased", "done", "requeued", "duplicates", "oldest_task_age")},
                "note": "no record in the DHT"}
    age = max(0.0, now - rec["time"])
    stats = rec.get("stats", {})
    return {"device": rec["device"], "role": rec["role"], "peer": peer, "short": short(peer),
            "state": derive_state(rec["state"], age, stale_after), "announced_state": rec["state"],
            "version": rec["version"], "last_seen": round(age, 3), "compute": rec.get("compute"),
            "microbatches_applied": stats.get("microbatches_applied"), "clients": stats.get("clients"),
            "layers": rec.get("layers"), "pool": _pool(rec)}


def _volunteer_entry(peer: str, rec: dict, now: float, stale_after: float, vanished: bool = False) -> dict:
    age = max(0.0, now - rec["time"])
    state = ("offline" if rec["state"] == "offline" else "unreachable") if vanished else \
        derive_state(rec["state"], age, stale_after)
    return {"device": rec["device"], "peer": peer, "short": short(peer), "state": state,
            "compute": rec["compute"], "throughput": rec.get("throughput"), "tasks_done": rec.get("tasks_done"),
            "last_seen": round(age, 3), "vanished": vanished}


def _parse_config(config: Any, errors: list[str]):
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
    from peer.model.config import get_preset

    seq_len, num_layers = None, None
    try:
        preset = get_preset(run.model)
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


def build_snapshot(run_id: str, config: Any, stages: list[Any], now: float, *, history: History | None = None,
                   stale_periods: float = 3.0) -> dict:
    """The dashboard's view of a run from raw DHT values: `config` is the `{run}.config` value (or
    None), `stages[k]` the `{run}.stage{k}` value (a map peer id -> record, or None). Never raises on
    bad records: they land in "malformed", config problems in "errors". `history` (optional) is
    read and updated."""
    errors: list[str] = []
    malformed: list[dict] = []
    run, layout, seq_len = _parse_config(config, errors)
    period = run.announce_period if run is not None and run.announce_period > 0 else 1.0
    stale_after = stale_periods * period
    tokens_per_step = run.batch_size * seq_len if run is not None and seq_len else None
    found = run_found(config, stages)
    if not found:
        errors.append(f"no run {run_id!r} in the DHT: neither its config record nor any stage record is there "
                      f"{RUN_ID_HINT}")
    elif config is None:
        errors.append("no config record (the servers publish it every announce period): showing the stage records alone")
    n_stages = layout.num_stages if layout is not None else len(stages)

    stage_views, live_recs, last_stage_recs = [], [], []
    for k in range(n_stages):
        raw = stages[k] if k < len(stages) else None
        servers: list[tuple[str, dict]] = []
        clients: list[tuple[str, dict]] = []
        if raw is not None and not isinstance(raw, dict):
            malformed.append({"stage": k, "peer": None, "short": "-",
                              "reason": f"the stage key holds a {type(raw).__name__}, not a map of peer records"})
        for peer, value in sorted((raw or {}).items(), key=lambda kv: str(kv[0])) if isinstance(raw, dict) else ():
            try:
                rec = check_record(value, k)
            except ValueError as e:
                malformed.append({"stage": k, "peer": str(peer), "short": short(str(peer)), "reason": str(e)})
                continue
            except Exception as e:  # a record odd enough to trip the checks themselves is still just malformed
                malformed.append({"stage": k, "peer": str(peer), "short": short(str(peer)),
                                  "reason": f"unreadable record: {e!r}"})
                continue
            (servers if rec["kind"] == "server" else clients).append((str(peer), rec))
        st = layout.stages[k] if layout is not None else None

        roles: dict[str, list[dict]] = {}
        stage_live: list[dict] = []
        for role in ("frontal", "backward"):
            expected = list(getattr(st, role)) if st is not None else []
            mine = [(p, r) for p, r in servers if r["role"] == role]
            entries = []
            for device in expected + sorted({r["device"] for _, r in mine} - set(expected)):
                recs = [(p, r) for p, r in mine if r["device"] == device]
                if not recs and history is not None and (k, role, device) in history.servers:
                    recs = [history.servers[(k, role, device)]]
                    entry = _server_entry(*recs[0], now, stale_after)
                    if entry["state"] != "offline":
                        entry["state"] = "unreachable"
                    entry["note"] = "its record left the DHT"
                    entries.append(entry)
                    continue
                if not recs:
                    entries.append(_server_entry(None, None, now, stale_after, device, role))
                for p, r in sorted(recs, key=lambda pr: -pr[1]["time"]):
                    entry = _server_entry(p, r, now, stale_after)
                    entries.append(entry)
                    if entry["state"] in LIVE_STATES:
                        stage_live.append(r)
                    if history is not None:
                        history.servers[(k, role, device)] = (p, r)
            roles[role] = entries
        live_recs += stage_live
        if k == n_stages - 1:
            last_stage_recs = [r for _, r in servers]

        # volunteers: the records there now, then (with a history) the ones that left the DHT
        vols = [_volunteer_entry(p, r, now, stale_after) for p, r in clients]
        present = {p for p, _ in clients}
        stage_lost = 0
        if history is not None:
            for p, r in clients:
                history.clients[(k, p)] = r
            for (hk, p), r in history.clients.items():
                if hk == k and p not in present:
                    v = _volunteer_entry(p, r, now, stale_after, vanished=True)
                    stage_lost += 1
                    if v["last_seen"] <= history.show_vanished_for:
                        vols.append(v)
            stage_joined = sum(1 for hk, _ in history.clients if hk == k)
        else:
            stage_joined = len(clients)
        vols.sort(key=lambda v: (v["state"] not in LIVE_STATES, v["device"], v["peer"]))
        live_vols = [v for v in vols if v["state"] in LIVE_STATES]
        stage_lost += sum(1 for v in vols if not v["vanished"] and v["state"] not in LIVE_STATES)
        # the servers count the volunteers that ever registered with them and the ones they dropped
        stage_joined = max([stage_joined] + [r.get("stats", {}).get("clients_joined", 0) for _, r in servers])
        stage_lost = max([stage_lost] + [r.get("stats", {}).get("clients_left", 0) for _, r in servers])

        compute = sum(v["compute"] for v in live_vols) + sum(r.get("compute") or 0.0 for r in stage_live)
        # a server from before the compute field: its registered clients say whether anything computes
        unknown = any("compute" not in r and r.get("stats", {}).get("clients", 0) > 0 for r in stage_live)
        live_pools = [_pool(r) for r in stage_live]
        pools = {f: sum(p[f] or 0 for p in live_pools) for f in ("queued", "leased", "done", "requeued", "duplicates")}
        pools["oldest_task_age"] = max([p["oldest_task_age"] or 0.0 for p in live_pools], default=None)
        sps, _ = _seconds_per_step(stage_live)
        version = min((r["version"] for r in stage_live), default=None)
        if history is not None:
            seen = history.stage_seen.setdefault(k, [])
            History.note(seen, now, version)
            sps = sps or History.seconds_per_step(seen)
        blocking = []
        for role in ("frontal", "backward"):
            if not any(e["state"] in LIVE_STATES for e in roles[role]):
                blocking.append(f"no live {role} server")
        if not live_vols and compute <= 0 and not unknown:
            blocking.append("no compute: no live volunteer and no server computes")
        layers = list(st.layers) if st is not None else next(
            (r["layers"] for _, r in servers if r.get("layers") is not None), None)
        # what the stage applied: its live servers agree once they all stepped; with none alive, the
        # highest count any of its records gives
        applied = [r["stats"]["microbatches_applied"] for r in stage_live if "microbatches_applied" in r.get("stats", {})]
        if not applied:
            known = [r["stats"]["microbatches_applied"] for _, r in servers if "microbatches_applied" in r.get("stats", {})]
            applied = [max(known)] if known else []
        stage_views.append({
            "index": k, "layers": layers, "frontal": roles["frontal"], "backward": roles["backward"],
            "volunteers": vols, "pools": pools, "version": version, "compute": round(compute, 6),
            "volunteers_live": len(live_vols), "volunteers_joined": stage_joined, "volunteers_lost": stage_lost,
            "microbatches_applied": min(applied) if applied else None,
            "seconds_per_step": sps, "tokens_per_second": tokens_per_step / sps if sps and tokens_per_step else None,
            "blocking": blocking,
        })

    # progress of the whole run
    step = min((r["version"] for r in live_recs), default=None)
    sps, last_step_at = _seconds_per_step(live_recs)
    if history is not None:
        History.note(history.step_seen, now, step)
        sps = sps or History.seconds_per_step(history.step_seen)
    losses = dict(history.losses) if history is not None else {}
    if tokens_per_step:
        for r in last_stage_recs:
            for batch, total in _int_keyed(r.get("losses", {}), "losses").items():
                losses[batch] = total / tokens_per_step
    if history is not None:
        history.losses = dict(sorted(losses.items())[-500:])
    loss_batch = max(losses, default=None)
    applied = [s["microbatches_applied"] for s in stage_views]
    progress = {
        "step": step, "steps": run.steps if run else None,
        "last_loss": losses[loss_batch] if loss_batch is not None else None, "loss_batch": loss_batch,
        "loss_history": [[b, losses[b]] for b in sorted(losses)[-200:]],
        "tokens_per_second": tokens_per_step / sps if sps and tokens_per_step else None,
        "seconds_per_step": sps,
        "predicted_seconds_per_step": layout.predicted_seconds_per_step if layout is not None else None,
        "seconds_since_last_step": round(max(0.0, now - last_step_at), 3) if last_step_at is not None else None,
        "microbatches_applied": sum(applied) if stage_views and None not in applied else None,
        "microbatches_expected": run.steps * run.micro_batches * n_stages if run and layout is not None else None,
        "volunteers_live": sum(s["volunteers_live"] for s in stage_views),
        "volunteers_joined": sum(s["volunteers_joined"] for s in stage_views),
        "volunteers_lost": sum(s["volunteers_lost"] for s in stage_views),
    }

    blocking = [{"stage": s["index"], "reason": r} for s in stage_views for r in s["blocking"]]
    warnings = []
    for s in stage_views:
        for e in s["frontal"] + s["backward"]:
            if e["state"] == "unreachable":
                seen = "never seen" if e["last_seen"] is None else f"last seen {e['last_seen']:.1f} s ago"
                warnings.append(f"stage {s['index']} {e['role']} {e['device']} ({e['short']}) unreachable, {seen}")
            elif e["state"] == "offline":
                warnings.append(f"stage {s['index']} {e['role']} {e['device']} ({e['short']}) is offline")
    if malformed:
        warnings.append(f"{len(malformed)} malformed record(s)")
    finished = run is not None and step is not None and step >= run.steps
    if not found:
        status = "not_found"
    elif run is None and not stage_views:
        status = "error"
    elif finished:
        status = "finished"
    elif blocking:
        status = "blocked"
    else:
        status = "ok"
    health = {"ok": status in ("ok", "finished"), "status": status, "blocking": blocking, "warnings": warnings}
    cfg_view = None
    if run is not None:
        cfg_view = {"model": run.model, "seed": run.seed, "steps": run.steps, "batch_size": run.batch_size,
                    "micro_batches": run.micro_batches, "lr": run.lr, "announce_period": run.announce_period,
                    "seq_len": seq_len, "tokens_per_step": tokens_per_step, "stages": n_stages}
    return _finite({"run_id": run_id, "time": now, "config": cfg_view, "stages": stage_views, "progress": progress,
                    "health": health, "malformed": malformed, "errors": errors})


def _finite(x: Any) -> Any:
    """Non-finite floats become None, so the snapshot is valid JSON for a browser."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def to_json(snapshot: dict, indent: int | None = None) -> str:
    return json.dumps(snapshot, indent=indent, allow_nan=False, default=str)


# ------------------------------------------------------------------------------------------------
# text formatting shared by the terminal view

def fmt(x: Any, spec: str = ".3g", none: str = "-", unit: str = "") -> str:
    if x is None:
        return none
    if isinstance(x, float):
        return format(x, spec) + unit
    return f"{x}{unit}"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 100:
        return f"{seconds:.1f}s"
    if seconds < 6000:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


STATE_STYLE = {"online": "green", "joining": "yellow", "offline": "dim", "unreachable": "bold red"}
STATUS_STYLE = {"ok": "bold green", "finished": "bold cyan", "blocked": "bold red", "not_found": "bold red",
                "error": "bold red"}


def summary_lines(snap: dict) -> list[str]:
    """The run's progress as short plain lines (the terminal header)."""
    p = snap["progress"]
    steps = f"{fmt(p['step'])}/{fmt(p['steps'])}"
    loss = fmt(p["last_loss"], ".4f") + (f" (batch {p['loss_batch']})" if p["loss_batch"] is not None else "")
    plan = fmt(p["predicted_seconds_per_step"], ".3g", unit=" s")
    return [
        f"step {steps}   loss {loss}   tokens/s {fmt(p['tokens_per_second'], '.0f')}",
        f"s/step {fmt(p['seconds_per_step'], '.3g')} measured, {plan} planned   "
        f"micro-batches {fmt(p['microbatches_applied'])}/{fmt(p['microbatches_expected'])}",
        f"volunteers {p['volunteers_live']} live, {p['volunteers_joined']} joined, {p['volunteers_lost']} lost",
    ]


def render_terminal(snap: dict):
    """A rich renderable of the snapshot, readable at 80 columns."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = []
    h = snap["health"]
    title = Text.assemble(("hivepipe ", "bold"), (f"run {snap['run_id']}", "bold magenta"), "  ",
                          (h["status"].upper().replace("_", " "), STATUS_STYLE.get(h["status"], "bold")))
    if snap.get("config"):
        c = snap["config"]
        title.append(f"  model {c['model']}, {c['stages']} stages, batch {c['batch_size']}x{c['seq_len']}", "dim")
    parts.append(title)
    for line in summary_lines(snap):
        parts.append(Text(line))
    for b in h["blocking"]:
        parts.append(Text(f"BLOCKING stage {b['stage']}: {b['reason']}", "bold red"))
    for w in h["warnings"]:
        parts.append(Text(f"warning: {w}", "yellow"))
    for e in snap["errors"]:
        parts.append(Text(f"error: {e}", "red"))
    for s in snap["stages"]:
        layers = "?" if s["layers"] is None else f"{s['layers'][0]}-{s['layers'][1]}"
        head = (f"stage {s['index']}  layers {layers}  v{fmt(s['version'])}  "
                f"{fmt(s['tokens_per_second'], '.0f')} tok/s  compute {fmt(s['compute'], '.3g')}")
        table = Table(title=head, title_justify="left", title_style="bold blue" if not s["blocking"] else "bold red",
                      box=box.SIMPLE_HEAD, pad_edge=False, padding=0, show_edge=False)
        # fixed widths: 71 characters and 7 one-character separators fit 80 columns
        for name, width, justify in (("role", 5, "left"), ("device", 9, "left"), ("peer", 8, "left"),
                                     ("state", 11, "left"), ("ver|cmp", 7, "right"), ("q/l/done/rq/dup|thr", 19, "left"),
                                     ("oldest", 6, "right"), ("seen", 6, "right")):
            table.add_column(name, width=width, justify=justify, no_wrap=True, overflow="ellipsis")
        for role, short_role in (("frontal", "front"), ("backward", "back")):
            for e in s[role]:
                pl = e["pool"]
                tasks = "/".join(fmt(pl[f]) for f in ("queued", "leased", "done", "requeued", "duplicates"))
                table.add_row(short_role, e["device"], e["short"], Text(e["state"], STATE_STYLE.get(e["state"], "")),
                              "-" if e["version"] is None else f"v{e['version']}", tasks, fmt_age(pl["oldest_task_age"]) if pl["queued"] else "-",
                              fmt_age(e["last_seen"]))
        for v in s["volunteers"]:
            thr = f"{fmt(v['throughput'], '.2f')}/s {fmt(v['tasks_done'])} done"
            table.add_row("vol", v["device"], v["short"], Text(v["state"], STATE_STYLE.get(v["state"], "")),
                          fmt(v["compute"], ".3g"), thr, "", fmt_age(v["last_seen"]))
        parts.append(table)
    if snap["malformed"]:
        parts.append(Text(f"malformed records ({len(snap['malformed'])}):", "bold yellow"))
        for m in snap["malformed"]:
            where = "?" if m["stage"] is None else m["stage"]
            parts.append(Text(f"  stage {where} peer {m['short']}: {m['reason']}", "yellow"))
    return Group(*parts)


# ------------------------------------------------------------------------------------------------
# Prometheus text exposition (format 0.0.4)

def _escape_label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: dict, value: Any) -> str | None:
    if value is None:
        return None
    v = float(value)
    if not math.isfinite(v):
        return None
    lab = ",".join(f'{k}="{_escape_label(val)}"' for k, val in labels.items())
    return f"{name}{{{lab}}} {v:.17g}" if lab else f"{name} {v:.17g}"


METRICS = {  # name -> help; every metric is a gauge
    "hivepipe_run_found": "1 when the run's config or stage records are in the DHT",
    "hivepipe_health_ok": "1 when no stage blocks the run (or it has finished)",
    "hivepipe_step": "the run's step: the lowest parameter version among live servers",
    "hivepipe_steps": "the steps the run is configured for",
    "hivepipe_loss": "mean token loss of the last batch applied",
    "hivepipe_tokens_per_second": "tokens per second of the whole pipeline, over the last steps",
    "hivepipe_seconds_per_step": "measured seconds per step, over the last steps",
    "hivepipe_predicted_seconds_per_step": "the plan's predicted seconds per step",
    "hivepipe_microbatches_applied": "micro-batches applied, summed over the stages",
    "hivepipe_microbatches_expected": "micro-batches the whole run applies: steps x micro-batches x stages",
    "hivepipe_volunteers_live": "volunteers whose records are live",
    "hivepipe_volunteers_joined": "volunteers seen to join the run",
    "hivepipe_volunteers_lost": "volunteers seen to leave the run",
    "hivepipe_malformed_records": "DHT records under the run's keys that do not fit the schema",
    "hivepipe_stage_blocked": "1 when the stage blocks the run (no live frontal or backward server, or no compute)",
    "hivepipe_stage_version": "the lowest parameter version among the stage's live servers",
    "hivepipe_stage_tokens_per_second": "tokens per second through the stage, over its last steps",
    "hivepipe_stage_compute": "compute power (rows/s) of the stage's live volunteers and computing servers",
    "hivepipe_stage_pool_tasks": "tasks in the stage's live servers' pools, by state",
    "hivepipe_stage_oldest_task_age_seconds": "age of the oldest queued task among the stage's live servers",
    "hivepipe_server_up": "1 for the server's state (online, joining, offline or unreachable), as a label",
    "hivepipe_server_version": "the server's parameter version",
    "hivepipe_server_last_seen_seconds": "seconds since the server's record was published",
    "hivepipe_server_pool_tasks": "tasks in the server's pool, by state",
    "hivepipe_volunteer_compute": "the volunteer's measured compute power (rows/s)",
    "hivepipe_volunteer_throughput": "the volunteer's tasks per second",
    "hivepipe_volunteer_last_seen_seconds": "seconds since the volunteer's record was published",
}


def prometheus_text(snap: dict) -> str:
    samples: dict[str, list[str]] = {name: [] for name in METRICS}

    def add(name, value, **labels):
        line = _sample(name, {"run_id": snap["run_id"], **labels}, value)
        if line is not None:
            samples[name].append(line)

    p, h = snap["progress"], snap["health"]
    add("hivepipe_run_found", 0 if h["status"] == "not_found" else 1)
    add("hivepipe_health_ok", 1 if h["ok"] else 0)
    for key in ("step", "steps", "tokens_per_second", "seconds_per_step", "predicted_seconds_per_step",
                "microbatches_applied", "microbatches_expected", "volunteers_live", "volunteers_joined",
                "volunteers_lost"):
        add(f"hivepipe_{key}", p[key])
    add("hivepipe_loss", p["last_loss"])
    add("hivepipe_malformed_records", len(snap["malformed"]))
    for s in snap["stages"]:
        k = str(s["index"])
        add("hivepipe_stage_blocked", 1 if s["blocking"] else 0, stage=k)
        add("hivepipe_stage_version", s["version"], stage=k)
        add("hivepipe_stage_tokens_per_second", s["tokens_per_second"], stage=k)
        add("hivepipe_stage_compute", s["compute"], stage=k)
        for f in ("queued", "leased", "done", "requeued", "duplicates"):
            add("hivepipe_stage_pool_tasks", s["pools"][f], stage=k, state=f)
        add("hivepipe_stage_oldest_task_age_seconds", s["pools"]["oldest_task_age"], stage=k)
        for e in s["frontal"] + s["backward"]:
            who = {"stage": k, "role": e["role"], "device": e["device"], "peer": e["peer"] or ""}
            add("hivepipe_server_up", 1 if e["state"] in LIVE_STATES else 0, **who, state=e["state"])
            add("hivepipe_server_version", e["version"], **who)
            add("hivepipe_server_last_seen_seconds", e["last_seen"], **who)
            for f in ("queued", "leased", "done", "requeued", "duplicates"):
                add("hivepipe_server_pool_tasks", e["pool"][f], **who, state=f)
        for v in s["volunteers"]:
            who = {"stage": k, "device": v["device"], "peer": v["peer"], "state": v["state"]}
            add("hivepipe_volunteer_compute", v["compute"], **who)
            add("hivepipe_volunteer_throughput", v["throughput"], **who)
            add("hivepipe_volunteer_last_seen_seconds", v["last_seen"], **who)
    out = []
    for name, lines in samples.items():
        if lines:
            out += [f"# HELP {name} {METRICS[name]}", f"# TYPE {name} gauge", *lines]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------
# the web page: plain HTML and a small script polling /api/state (no external resources); every
# string from the DHT is inserted as text, never as HTML

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>hivepipe dashboard</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2em;color:#1d2330;background:#f6f7f9}
h1{font-size:1.3em;margin:0 0 .4em} h2{font-size:1.05em;margin:1.1em 0 .3em}
.badge{display:inline-block;padding:.1em .6em;border-radius:.8em;font-weight:600;color:#fff;background:#6b7280}
.st-ok{background:#15803d}.st-finished{background:#0e7490}.st-blocked,.st-not_found,.st-error{background:#b91c1c}
#summary{display:grid;grid-template-columns:repeat(auto-fill,minmax(140px,1fr));gap:.4em;margin:.6em 0}
.kv{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:.35em .6em}
.kv b{display:block;font-size:1.15em} .kv span{color:#5b6473;font-size:.85em}
table{border-collapse:collapse;background:#fff;width:100%;margin-bottom:.4em}
th,td{border-bottom:1px solid #e5e7eb;padding:.2em .5em;text-align:left;white-space:nowrap}
th{background:#eef0f4;font-weight:600;font-size:.9em} td.n{text-align:right;font-variant-numeric:tabular-nums}
.online{color:#15803d}.joining{color:#a16207}.offline{color:#6b7280}.unreachable{color:#b91c1c;font-weight:600}
.blocking{color:#b91c1c;font-weight:600}.warn{color:#a16207}.err{color:#b91c1c}.good{color:#15803d}
.mono{font-family:ui-monospace,Menlo,Consolas,monospace} #stale{color:#b91c1c}
svg{background:#fff;border:1px solid #dde1e7;border-radius:6px}
</style></head>
<body>
<h1>hivepipe run <span id="run-id" class="mono"></span> <span id="status" class="badge">loading</span></h1>
<div id="stale"></div>
<div id="summary"></div>
<div id="health"></div>
<svg id="loss-chart" width="420" height="90" role="img" aria-label="loss per batch"></svg>
<div id="stages"></div>
<div id="malformed"></div>
<div id="errors"></div>
<noscript>This page needs JavaScript; the same data is at <a href="api/state">api/state</a>.</noscript>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
function f(x, digits) {
  if (x === null || x === undefined) return "-";
  if (typeof x === "number" && !Number.isInteger(x)) return Math.abs(x) >= 1000 ? x.toFixed(0) : x.toPrecision(digits || 3);
  return String(x);
}
const NUMERIC = /^(-|never|-?[0-9.]+(e[+-]?[0-9]+)?( s| min)?)$/;
function age(s) { return s === null || s === undefined ? "never" : s < 100 ? s.toFixed(1) + " s" : (s / 60).toFixed(0) + " min"; }
function kv(label, value, id) {
  const b = el("b", id ? {id: id} : {}, value);
  return el("div", {class: "kv"}, b, el("span", {}, label));
}
function table(head, rows) {
  const t = el("table", {}, el("tr", {}, ...head.map(h => el("th", {}, h))));
  for (const r of rows) t.append(el("tr", {}, ...r.map(c => c instanceof Node ? el("td", {}, c) :
    el("td", typeof c === "number" || NUMERIC.test(c) ? {class: "n"} : {}, c))));
  return t;
}
function state(s) { return el("span", {class: s}, s); }
function drawLoss(points) {
  const svg = document.getElementById("loss-chart");
  svg.replaceChildren();
  const ns = "http://www.w3.org/2000/svg", W = 420, H = 90, P = 6;
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", 8); label.setAttribute("y", 16); label.setAttribute("font-size", "12");
  const ys0 = points.map(p => p[1]);
  label.textContent = points.length ? "loss per batch (last " + points.length + "): " + Math.min(...ys0).toFixed(3) +
    " to " + Math.max(...ys0).toFixed(3) : "no loss yet";
  svg.append(label);
  if (points.length < 2) return;
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = x => P + (W - 2 * P) * (x - x0) / Math.max(x1 - x0, 1e-9);
  const sy = y => H - P - (H - 2 * P - 14) * (y - y0) / Math.max(y1 - y0, 1e-9);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.map(p => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "));
  line.setAttribute("fill", "none"); line.setAttribute("stroke", "#2563eb"); line.setAttribute("stroke-width", "2");
  svg.append(line);
}
function render(s) {
  document.getElementById("run-id").textContent = s.run_id;
  const st = document.getElementById("status");
  st.textContent = s.health.status.replace("_", " ");
  st.className = "badge st-" + s.health.status;
  const p = s.progress;
  document.getElementById("summary").replaceChildren(
    kv("step", f(p.step) + " / " + f(p.steps), "step"),
    kv("last loss" + (p.loss_batch === null ? "" : " (batch " + p.loss_batch + ")"), f(p.last_loss, 4), "last-loss"),
    kv("tokens / s", p.tokens_per_second === null ? "-" : p.tokens_per_second.toFixed(0), "tokens-per-second"),
    kv("s / step measured", f(p.seconds_per_step), "seconds-per-step"),
    kv("s / step planned", f(p.predicted_seconds_per_step), "predicted-seconds-per-step"),
    kv("micro-batches applied / expected", f(p.microbatches_applied) + " / " + f(p.microbatches_expected), "microbatches"),
    kv("volunteers live / joined / lost", p.volunteers_live + " / " + p.volunteers_joined + " / " + p.volunteers_lost, "volunteers"));
  const health = document.getElementById("health");
  health.replaceChildren(...(s.health.status === "ok" ? [el("div", {class: "good"}, "healthy: every stage has a live frontal and backward server and compute")] : []),
    ...s.health.blocking.map(b => el("div", {class: "blocking"}, "blocking: stage " + b.stage + ": " + b.reason)),
    ...s.health.warnings.map(w => el("div", {class: "warn"}, "warning: " + w)));
  drawLoss(p.loss_history);
  const stages = document.getElementById("stages");
  stages.replaceChildren();
  for (const g of s.stages) {
    const layers = g.layers ? g.layers[0] + "-" + g.layers[1] : "?";
    stages.append(el("h2", {id: "stage-" + g.index, class: g.blocking.length ? "blocking" : ""},
      "stage " + g.index + " · layers " + layers + " · v" + f(g.version) + " · " +
      (g.tokens_per_second === null ? "-" : g.tokens_per_second.toFixed(0)) + " tokens/s · compute " + f(g.compute)));
    for (const b of g.blocking) stages.append(el("div", {class: "blocking"}, "blocking: " + b));
    const rows = [];
    for (const e of g.frontal.concat(g.backward)) {
      const q = e.pool;
      rows.push([e.role, e.device, el("span", {class: "mono", title: e.peer || ""}, e.short), state(e.state),
                 e.version === null ? "-" : e.version, f(q.queued), f(q.leased), f(q.done), f(q.requeued),
                 f(q.duplicates), q.queued ? age(q.oldest_task_age) : "-", age(e.last_seen)]);
    }
    stages.append(table(["role", "device", "peer", "state", "version", "queued", "leased", "done", "re-queued",
                         "duplicates", "oldest task", "last seen"], rows));
    stages.append(table(["volunteer", "peer", "state", "compute (rows/s)", "throughput (tasks/s)", "tasks done", "last seen"],
      g.volunteers.length ? g.volunteers.map(v => [v.device, el("span", {class: "mono", title: v.peer}, v.short),
        state(v.state), f(v.compute), f(v.throughput), f(v.tasks_done), age(v.last_seen)])
        : [["no volunteers", "", "", "", "", "", ""]]));
  }
  const mal = document.getElementById("malformed");
  mal.replaceChildren();
  if (s.malformed.length) {
    mal.append(el("h2", {class: "warn"}, "malformed records (" + s.malformed.length + ")"),
      table(["stage", "peer", "reason"], s.malformed.map(m => [m.stage === null ? "-" : m.stage,
        el("span", {class: "mono", title: m.peer || ""}, m.short), m.reason])));
  }
  document.getElementById("errors").replaceChildren(...s.errors.map(e => el("div", {class: "err"}, "error: " + e)));
}
async function tick() {
  try {
    const r = await fetch("api/state", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    document.getElementById("stale").textContent = "";
  } catch (e) {
    document.getElementById("stale").textContent = "cannot reach the dashboard (" + e.message + "): showing the last state";
  }
  setTimeout(tick, REFRESH_MS);
}
tick();
</script>
</body></html>
"""


def render_html(refresh: float) -> str:
    return PAGE.replace("__REFRESH_MS__", str(max(200, int(refresh * 1000))))


# ------------------------------------------------------------------------------------------------
# reading the DHT

class DhtReader:
    """A client-mode DHT node (it stores nothing) reading the run's keys."""

    def __init__(self, initial_peers: list[str], run_id: str):
        from peer.node import start_dht

        self.run_id = run_id
        self.dht = start_dht(initial_peers, client_mode=True)

    def _get(self, key: str) -> Any:
        found = self.dht.get(key, latest=True)
        if found is None:
            return None
        value = found.value
        if isinstance(value, dict):  # a key with subkeys: peer id -> ValueWithExpiration
            return subkey_values(value)
        return value

    def fetch(self) -> tuple[Any, list[Any]]:
        """(config value, [stage values]): as many stages as the config's layout names, or, without a
        usable config, the stage keys up to the first empty one."""
        config = self._get(config_key(self.run_id))
        n = stage_count(config)
        if n is not None:
            return config, [self._get(stage_key(self.run_id, k)) for k in range(n)]
        stages = []
        for k in range(MAX_PROBED_STAGES):
            value = self._get(stage_key(self.run_id, k))
            if value is None:
                break
            stages.append(value)
        return config, stages

    def shutdown(self) -> None:
        self.dht.shutdown()


class Watcher:
    """Reads the DHT every `refresh` seconds on its own thread and keeps the latest snapshot (with a
    History), so that readers (HTTP handlers) never touch the DHT."""

    def __init__(self, reader: DhtReader, run_id: str, refresh: float, stale_periods: float):
        self.reader, self.run_id, self.refresh, self.stale_periods = reader, run_id, refresh, stale_periods
        self.history = History()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.snapshot = self.poll()
        self.thread = threading.Thread(target=self._loop, name="dashboard-poller", daemon=True)

    def poll(self) -> dict:
        """Read the DHT once; the new snapshot (kept as the current one)."""
        try:
            config, stages = self.reader.fetch()
        except Exception as e:  # the DHT node failing is shown, not raised: the last snapshot stays, flagged
            logger.debug("reading the DHT failed", exc_info=True)
            problem = f"reading the DHT failed: {e!r}"
            with self.lock:
                last = getattr(self, "snapshot", None)
            snap = dict(last) if last is not None else \
                build_snapshot(self.run_id, None, [], time.time(), stale_periods=self.stale_periods)
            snap["errors"] = [problem] + [m for m in snap["errors"] if not m.startswith("reading the DHT failed")]
        else:
            snap = build_snapshot(self.run_id, config, stages, time.time(), history=self.history,
                                  stale_periods=self.stale_periods)
        with self.lock:
            self.snapshot = snap
        return snap

    def _loop(self) -> None:
        while not self.stop.wait(self.refresh):
            self.poll()

    def current(self) -> dict:
        with self.lock:
            return self.snapshot


def serve(watcher: Watcher, port: int, refresh: float) -> int:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    page = render_html(refresh).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/api/state":
                self._send(200, "application/json", to_json(watcher.current()).encode())
            elif path == "/metrics":
                self._send(200, "text/plain; version=0.0.4; charset=utf-8", prometheus_text(watcher.current()).encode())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found: try /, /api/state or /metrics\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):
            logger.debug("%s %s", self.address_string(), format % args)

    try:
        httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as e:
        print(f"dashboard: error: cannot listen on 127.0.0.1:{port}: {e.strerror or e}", file=sys.stderr)
        return 2
    httpd.daemon_threads = True
    watcher.thread.start()
    print(f"serving on http://127.0.0.1:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.25)
    except KeyboardInterrupt:
        pass
    finally:
        watcher.stop.set()
        httpd.server_close()
    return 0


def live_view(watcher: Watcher, refresh: float) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        with Live(render_terminal(watcher.current()), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(refresh)
                live.update(render_terminal(watcher.poll()), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


# ------------------------------------------------------------------------------------------------
# command line

def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port {v} outside 0..65535")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dashboard.py",
        description="Status of a hivepipe run, read from its DHT records: stages, servers, volunteers, "
                    "task pools, progress and what blocks the run.")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                   help="multiaddrs of DHT peers (e.g. the initial_peers=... line printed by `peer swarm`)")
    p.add_argument("--run-id", default=DEFAULT_RUN_ID,
                   help=f"the run to show (default {DEFAULT_RUN_ID!r}, the default of `peer swarm`; `peer serve` "
                        "and `peer join` default to 'hivepipe'; the DHT cannot list runs, so there is no discovery)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print one JSON snapshot and exit")
    mode.add_argument("--serve", type=_port, default=None, metavar="PORT",
                      help="serve a web page, /api/state (JSON) and /metrics (Prometheus) on 127.0.0.1:PORT "
                           "(0: any free port; the address is printed)")
    p.add_argument("--refresh", type=_positive, default=2.0, metavar="S", help="seconds between DHT reads (default 2)")
    p.add_argument("--timeout", type=_positive, default=10.0, metavar="S",
                   help="--json: seconds to wait for the run to appear before exiting with code 2 (default 10)")
    p.add_argument("--stale-periods", type=_positive, default=3.0, metavar="N",
                   help="a live record older than N announce periods shows as unreachable (default 3)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-v info, -vv debug)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from multiaddr import Multiaddr

    for m in args.initial_peers:
        try:
            Multiaddr(m)
        except Exception as e:
            parser.error(f"--initial-peers: {m!r} is not a multiaddr ({e})")
        if "/p2p/" not in m:
            parser.error(f"--initial-peers: {m!r} lacks the peer id (/p2p/...)")
    from peer.cli import setup_logging

    setup_logging(args.verbose)
    try:
        reader = DhtReader(args.initial_peers, args.run_id)
    except Exception as e:
        logger.debug("joining the DHT failed", exc_info=True)
        print(f"dashboard: error: cannot join the DHT through {' '.join(args.initial_peers)}: {e}", file=sys.stderr)
        return 2
    def on_sigterm(signum, frame):  # SIGTERM stops the dashboard as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if args.json:
            return one_shot(reader, args)
        watcher = Watcher(reader, args.run_id, args.refresh, args.stale_periods)
        if args.serve is not None:
            return serve(watcher, args.serve, args.refresh)
        return live_view(watcher, args.refresh)
    except KeyboardInterrupt:
        return 130 if args.json else 0
    finally:
        reader.shutdown()


def one_shot(reader: DhtReader, args) -> int:
    deadline = time.monotonic() + args.timeout
    while True:
        config, stages = reader.fetch()
        if run_found(config, stages):
            break
        if time.monotonic() > deadline:
            print(f"dashboard: error: no run {args.run_id!r} found in the DHT after {args.timeout:g} s {RUN_ID_HINT}",
                  file=sys.stderr)
            return 2
        time.sleep(0.5)
    snap = build_snapshot(args.run_id, config, stages, time.time(), stale_periods=args.stale_periods)
    print(to_json(snap, indent=2), flush=True)
    return 0
