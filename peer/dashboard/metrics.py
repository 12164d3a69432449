"""The run as Prometheus metrics (/metrics), through prometheus_client: one collector that turns
the current snapshot into gauge families (every metric is a gauge, labelled by run id and the
stage, role, device, peer and state it concerns), written in the text exposition format 0.0.4.
Must not read the DHT."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from peer.dashboard.entries import LIVE_STATES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

METRICS = {  # name -> help; every metric is a gauge
    "hivepipe_run_found": "1 when the run's config or stage records are in the DHT",
    "hivepipe_health_ok": "1 when no stage blocks the run (or it has finished)",
    "hivepipe_run_finished": "1 once the run was seen finished (it stays so after its servers left)",
    "hivepipe_step": "the run's step: the lowest parameter version among live servers",
    "hivepipe_steps": "the steps the run is configured for",
    "hivepipe_loss": "mean token loss of the last batch applied",
    "hivepipe_eval_loss": "held-out loss of the last version evaluated (peer serve --eval-every)",
    "hivepipe_eval_version": "the version the last held-out loss was computed on",
    "hivepipe_grad_norm": "the whole model's gradient norm before clipping, of the last batch (--clip-grad-norm)",
    "hivepipe_tokens_per_second": "tokens per second of the whole pipeline, over the last steps",
    "hivepipe_seconds_per_step": "measured seconds per step, over the last steps",
    "hivepipe_seconds_left": "seconds until the run's last step at the measured pace",
    "hivepipe_predicted_seconds_per_step": "the plan's predicted seconds per step",
    "hivepipe_microbatches_applied": "micro-batches applied, summed over the stages",
    "hivepipe_microbatches_expected": "micro-batches the whole run applies: steps x micro-batches x stages",
    "hivepipe_volunteers_live": "volunteers whose records are live",
    "hivepipe_volunteers_joined": "volunteers seen to join the run",
    "hivepipe_volunteers_lost": "volunteers seen to leave the run",
    "hivepipe_volunteers_banned": "volunteers banned because a server's re-run of their work disagreed",
    "hivepipe_checks": "volunteer contributions re-run by the live servers (checked work)",
    "hivepipe_ban_reach": "versions a ban can roll the run back now (the live server keeping the fewest)",
    "hivepipe_run_stopped": "1 while a server says the run is stopped (a role lost its last server)",
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


class SnapshotCollector:
    """A prometheus_client collector of one snapshot's gauges."""

    def __init__(self, snap: dict):
        self.snap = snap

    def collect(self):
        samples: dict[str, list[tuple[dict, float]]] = {name: [] for name in METRICS}
        snap = self.snap

        def add(name: str, value: Any, **labels) -> None:
            if value is None:
                return
            v = float(value)
            if math.isfinite(v):
                samples[name].append(({"run_id": snap["run_id"], **labels}, v))

        p, h = snap["progress"], snap["health"]
        add("hivepipe_run_found", 0 if h["status"] in ("not_found", "unreachable") else 1)
        add("hivepipe_health_ok", 1 if h["ok"] else 0)
        add("hivepipe_run_finished", 1 if h.get("finished") else 0)
        add("hivepipe_run_stopped", 1 if h.get("stopped") else 0)
        for key in (
            "step",
            "steps",
            "tokens_per_second",
            "seconds_per_step",
            "seconds_left",
            "predicted_seconds_per_step",
            "microbatches_applied",
            "microbatches_expected",
            "volunteers_live",
            "volunteers_joined",
            "volunteers_lost",
            "volunteers_banned",
            "checks",
            "ban_reach",
        ):
            add(f"hivepipe_{key}", p[key])
        add("hivepipe_loss", p["last_loss"])
        add("hivepipe_eval_loss", p["eval_loss"])
        add("hivepipe_eval_version", p["eval_version"])
        add("hivepipe_grad_norm", p["grad_norm"])
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
        for name, rows in samples.items():
            if not rows:
                continue
            labels = list(rows[0][0])
            family = GaugeMetricFamily(name, METRICS[name], labels=labels)
            for lab, v in rows:
                family.add_metric([str(lab[n]) for n in labels], v)
            yield family


def prometheus_text(snap: dict) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snap))
    return generate_latest(registry).decode()
