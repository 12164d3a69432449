"""The dashboard's model of a run: `build_snapshot` is a pure function of the raw DHT values (the
config record and one map of peer records per stage) and the time, so it is tested without a DHT;
what it makes of each record, and the `History` a long-running dashboard keeps between snapshots,
are peer/dashboard/entries.py's. Must not read the DHT or render anything."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from core.protocol.records import halted_reason
from peer.dashboard.entries import (
    LIVE_STATES,
    History,
    check_record,
    config_view,
    int_keyed,
    pace_of,
    parse_config,
    pool_view,
    server_entry,
    short,
    volunteer_entry,
)

logger = logging.getLogger("hivepipe.dashboard")

# hivemind cannot list the keys it stores, so a run cannot be discovered: the default is the one
# `peer swarm` uses (`peer serve` and `peer join` default to "hivepipe")
DEFAULT_RUN_ID = "swarm"
RUN_ID_HINT = (
    f"(check --run-id: `peer swarm` uses {DEFAULT_RUN_ID!r} by default, `peer serve` and `peer join` use 'hivepipe')"
)
MAX_PROBED_STAGES = 64  # without a usable config, stage keys are read until the first empty one


def run_found(config: Any, stages: list[Any]) -> bool:
    """Whether the DHT holds anything of the run: its config record or any stage record."""
    return config is not None or any(s is not None for s in stages)


def stage_count(config: Any) -> int | None:
    """How many stage keys the config's layout names, or None when it names none."""
    if isinstance(config, dict) and isinstance(config.get("layout"), dict):
        stages = config["layout"].get("stages")
        if isinstance(stages, list) and stages:
            return len(stages)
    return None


def _stage_view(
    k: int,
    raw: Any,
    st: Any,
    now: float,
    stale_after: float,
    seen_at: Mapping[tuple[int, str], float],
    history: History | None,
    malformed: list[dict],
    tokens_per_step: int | None,
) -> tuple[dict, list[dict], list[dict]]:
    """Stage k of the snapshot from its raw stage value (`st`: its place in the layout, None without
    one): (its view, the records of its live servers, every server record found); what does not
    check is added to `malformed`."""
    servers: list[tuple[str, dict]] = []
    clients: list[tuple[str, dict]] = []
    if raw is not None and not isinstance(raw, dict):
        malformed.append(
            {
                "stage": k,
                "peer": None,
                "short": "-",
                "reason": f"the stage key holds a {type(raw).__name__}, not a map of peer records",
            }
        )
    for peer, value in sorted((raw or {}).items(), key=lambda kv: str(kv[0])) if isinstance(raw, dict) else ():
        try:
            rec = check_record(value, k)
        except ValueError as e:
            malformed.append({"stage": k, "peer": str(peer), "short": short(str(peer)), "reason": str(e)})
            continue
        except Exception as e:  # a record odd enough to trip the checks themselves is still just malformed
            malformed.append(
                {"stage": k, "peer": str(peer), "short": short(str(peer)), "reason": f"unreadable record: {e!r}"}
            )
            continue
        (servers if rec["kind"] == "server" else clients).append((str(peer), rec))

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
                entry = server_entry(*recs[0], now, stale_after)
                if entry["state"] != "offline":
                    entry["state"] = "unreachable"
                entry["note"] = "its record left the DHT"
                entries.append(entry)
                continue
            if not recs:
                entries.append(server_entry(None, None, now, stale_after, device, role))
            for p, r in sorted(recs, key=lambda pr: -pr[1]["time"]):
                entry = server_entry(p, r, seen_at.get((k, p), now), stale_after)
                entries.append(entry)
                if entry["state"] in LIVE_STATES:
                    stage_live.append(r)
                if history is not None:
                    history.servers[(k, role, device)] = (p, r)
        roles[role] = entries

    # volunteers: the records there now, then (with a history) the ones that left the DHT
    vols = [volunteer_entry(p, r, seen_at.get((k, p), now), stale_after) for p, r in clients]
    present = {p for p, _ in clients}
    stage_lost = 0
    if history is not None:
        for p, r in clients:
            history.clients[(k, p)] = r
        for (hk, p), r in history.clients.items():
            if hk == k and p not in present:
                v = volunteer_entry(p, r, now, stale_after, vanished=True)
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

    # the volunteers registered now, as the servers count them (fresher than a volunteer's own record,
    # stored every 5 announce periods); a server from before the count: the records that are live
    counts = [r["stats"] for r in stage_live if isinstance(r.get("stats", {}).get("volunteers"), int)]
    best = max(counts, key=lambda c: (c["volunteers"], c.get("volunteer_compute", 0.0)), default=None)
    live = len(live_vols) if best is None else best["volunteers"]
    helping = sum(v["compute"] for v in live_vols) if best is None else best.get("volunteer_compute", 0.0)
    compute = helping + sum(r.get("compute") or 0.0 for r in stage_live)
    # a server from before the compute field: its registered clients say whether anything computes
    unknown = any("compute" not in r and r.get("stats", {}).get("clients", 0) > 0 for r in stage_live)
    live_pools = [pool_view(r) for r in stage_live]
    pools = {f: sum(p[f] or 0 for p in live_pools) for f in ("queued", "leased", "done", "requeued", "duplicates")}
    pools["oldest_task_age"] = max([p["oldest_task_age"] or 0.0 for p in live_pools], default=None)
    sps, _ = pace_of(stage_live)
    version = min((r["version"] for r in stage_live), default=None)
    if history is not None:
        seen = history.stage_seen.setdefault(k, [])
        History.note(seen, now, version)
        sps = sps or History.seconds_per_step(seen)
    blocking = []
    for role in ("frontal", "backward"):
        if not any(e["state"] in LIVE_STATES for e in roles[role]):
            blocking.append(f"no live {role} server")
    if not live and compute <= 0 and not unknown:
        blocking.append("no compute: no live volunteer and no server computes")
    layers = (
        list(st.layers)
        if st is not None
        else next((r["layers"] for _, r in servers if r.get("layers") is not None), None)
    )
    # what the stage applied: its live servers agree once they all stepped; with none alive, the
    # highest count any of its records gives
    applied = [r["stats"]["microbatches_applied"] for r in stage_live if "microbatches_applied" in r.get("stats", {})]
    if not applied:
        known = [r["stats"]["microbatches_applied"] for _, r in servers if "microbatches_applied" in r.get("stats", {})]
        applied = [max(known)] if known else []
    view = {
        "index": k,
        "layers": layers,
        "frontal": roles["frontal"],
        "backward": roles["backward"],
        "volunteers": vols,
        "pools": pools,
        "version": version,
        "compute": round(compute, 6),
        "volunteers_live": live,
        "volunteers_joined": stage_joined,
        "volunteers_lost": stage_lost,
        "microbatches_applied": min(applied) if applied else None,
        "seconds_per_step": sps,
        "tokens_per_second": tokens_per_step / sps if sps and tokens_per_step else None,
        "blocking": blocking,
    }
    return view, stage_live, [r for _, r in servers]


def build_snapshot(
    run_id: str,
    config: Any,
    stages: list[Any],
    now: float,
    *,
    history: History | None = None,
    stale_periods: float = 3.0,
    rejected: list[dict] = (),
    seen_at: Mapping[tuple[int, str], float] | None = None,
) -> dict:
    """The dashboard's view of a run from raw DHT values: `config` is the `{run}.config` value (or
    None), `stages[k]` the `{run}.stage{k}` value (a map peer id -> record, or None). Never raises on
    bad records: they land in "malformed", config problems in "errors". `history` (optional) is
    read and updated. `seen_at`: {(stage, peer): when its record was read} (default: `now`). A
    record's age, which says whether its peer is still reachable, is taken at the moment it was read:
    a read that takes seconds (a slow DHT node, a loaded reader) must not age what it found first."""
    seen_at = seen_at or {}
    errors: list[str] = []
    malformed: list[dict] = list(rejected)  # records that failed their signatures (the reader says why)
    run, layout, seq_len = parse_config(config, errors)
    period = run.announce_period if run is not None and run.announce_period > 0 else 1.0
    stale_after = stale_periods * period
    tokens_per_step = run.batch_size * seq_len if run is not None and seq_len else None
    found = run_found(config, stages)
    if not found:
        errors.append(
            f"no run {run_id!r} in the DHT: neither its config record nor any stage record is there {RUN_ID_HINT}"
        )
    elif config is None:
        errors.append(
            "no config record (the servers publish it every announce period): showing the stage records alone"
        )
    n_stages = layout.num_stages if layout is not None else len(stages)

    stage_views, live_recs, last_stage_recs, every_server_rec = [], [], [], []
    for k in range(n_stages):
        view, stage_live, server_recs = _stage_view(
            k,
            stages[k] if k < len(stages) else None,
            layout.stages[k] if layout is not None else None,
            now,
            stale_after,
            seen_at,
            history,
            malformed,
            tokens_per_step,
        )
        stage_views.append(view)
        live_recs += stage_live
        every_server_rec += server_recs
        if k == n_stages - 1:
            last_stage_recs = server_recs

    # progress of the whole run
    step = min((r["version"] for r in live_recs), default=None)
    sps, last_step_at = pace_of(live_recs)
    if history is not None:
        History.note(history.step_seen, now, step)
        sps = sps or History.seconds_per_step(history.step_seen)
    losses = dict(history.losses) if history is not None else {}
    if tokens_per_step:
        for r in last_stage_recs:
            for batch, total in int_keyed(r.get("losses", {}), "losses").items():
                losses[batch] = total / tokens_per_step
    evals = dict(history.eval_losses) if history is not None else {}
    norms = dict(history.grad_norms) if history is not None else {}
    for r in live_recs:
        evals.update(int_keyed(r.get("eval_losses", {}), "eval_losses"))
        norms.update(int_keyed(r.get("grad_norms", {}), "grad_norms"))
    if history is not None:
        history.losses = dict(sorted(losses.items())[-500:])
        history.eval_losses = dict(sorted(evals.items())[-500:])
        history.grad_norms = dict(sorted(norms.items())[-500:])
    loss_batch = max(losses, default=None)
    eval_version = max(evals, default=None)
    norm_batch = max(norms, default=None)
    applied = [s["microbatches_applied"] for s in stage_views]
    reaches = [r.get("stats", {}).get("ban_reach") for r in live_recs]
    progress = {
        "step": step,
        "steps": run.steps if run else None,
        "last_loss": losses[loss_batch] if loss_batch is not None else None,
        "loss_batch": loss_batch,
        "loss_history": [[b, losses[b]] for b in sorted(losses)[-200:]],
        # held-out loss (peer serve --eval-every) of the version it was computed on, and its curve
        "eval_loss": evals[eval_version] if eval_version is not None else None,
        "eval_version": eval_version,
        "eval_history": [[v, evals[v]] for v in sorted(evals)[-200:]],
        # the whole model's gradient norm before clipping (--clip-grad-norm runs), of its batch
        "grad_norm": norms[norm_batch] if norm_batch is not None else None,
        "grad_norm_batch": norm_batch,
        "tokens_per_second": tokens_per_step / sps if sps and tokens_per_step else None,
        "seconds_per_step": sps,
        # the steps still to go at the measured pace (null before a pace is measured, 0 at the end)
        "seconds_left": max(0, run.steps - step) * sps if run and step is not None and sps else None,
        "predicted_seconds_per_step": layout.predicted_seconds_per_step if layout is not None else None,
        "seconds_since_last_step": round(max(0.0, now - last_step_at), 3) if last_step_at is not None else None,
        "microbatches_applied": sum(applied) if stage_views and None not in applied else None,
        "microbatches_expected": run.steps * run.micro_batches * n_stages if run and layout is not None else None,
        "volunteers_live": sum(s["volunteers_live"] for s in stage_views),
        "volunteers_joined": sum(s["volunteers_joined"] for s in stage_views),
        "volunteers_lost": sum(s["volunteers_lost"] for s in stage_views),
        # checked work (parameter_server/verify.py): re-runs done by the live servers, and volunteers
        # banned (a ban reaches every server, so the most any server counts)
        "checks": sum(r.get("stats", {}).get("checked", 0) for r in live_recs),
        "volunteers_banned": max([r.get("stats", {}).get("banned", 0) for r in live_recs], default=0),
        # how far back a ban can roll the run now (versions): the live server that keeps the fewest says
        "ban_reach": min([v for v in reaches if v is not None], default=None),
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
    # finished once every server of the layout has announced the last version: the live ones alone
    # can all be there while a lost server's slot is not (a role's last server gone: the others of its
    # stage step their own slots to the end)
    reached: dict[str, int] = {}
    for r in every_server_rec:
        reached[r["device"]] = max(reached.get(r["device"], -1), r["version"])
    devices = [d for st_ in layout.stages for d in st_.servers] if layout is not None else []
    finished = (
        run is not None
        and step is not None
        and step >= run.steps
        and all(reached.get(d, -1) >= run.steps for d in devices)
    )
    # a role lost its last server: the servers say so, and what brings the run back
    # (any record in the DHT now, live or late: a record leaves the DHT a few announce periods after
    # its last announcement, and a busy reader finds them all late)
    stopped = None if finished else halted_reason(every_server_rec)
    if not found:
        status = "not_found"
    elif run is None and not stage_views:
        status = "error"
    elif finished:
        status = "finished"
    elif stopped:
        status = "stopped"
    elif blocking:
        status = "blocked"
    else:
        status = "ok"
    seen_done = None
    if status == "finished":  # the run's end as this read sees it
        seen_done = {"step": run.steps, "loss": progress["last_loss"], "eval_loss": progress["eval_loss"], "at": now}
    if history is not None:
        if found:
            history.seen_at = now
        if seen_done is not None and history.finished is None:
            history.finished = seen_done
        elif history.finished is not None:
            status, stopped, blocking = "finished", None, []  # its servers left after the end
        elif status == "not_found" and history.seen_at is not None:
            status = "unreachable"  # seen before: its servers are away or cannot be reached from here
            errors = [e for e in errors if not e.startswith("no run ")]  # (its id was right)
    done = history.finished if history is not None and history.finished is not None else seen_done
    health = {
        "ok": status in ("ok", "finished"),
        "status": status,
        # the run's end as seen: {"step", "loss", "eval_loss", "at"} (null until it finished)
        "finished": done,
        # seconds since the run's records were last found (null when they are found now, or never were)
        "unseen_for": round(now - history.seen_at, 1) if status == "unreachable" else None,
        "stopped": stopped,
        "blocking": blocking,
        "warnings": warnings,
    }
    cfg_view = config_view(run, seq_len, n_stages) if run is not None else None
    return _finite(
        {
            "run_id": run_id,
            "time": now,
            "config": cfg_view,
            "stages": stage_views,
            "progress": progress,
            "health": health,
            "malformed": malformed,
            "errors": errors,
        }
    )


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
