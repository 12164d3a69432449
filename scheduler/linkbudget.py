"""What a volunteer's link costs its processor: the tokens a volunteer must compute on each parameter
version for its link not to leave it idle (`peer simulate --link-budget`).

Per version, a volunteer of stage s pulls the stage's parameters (P_s values of `down_bytes` each) and
pushes their gradient (P_s values of `up_bytes` each), and computes its tokens: k tokens take
k x F_s / R seconds, F_s the stage's training FLOPs per token (the planner's count: 6 per parameter
plus attention) and R the volunteer's sustained FLOP/s (its peak x `mfu`). Its link of B bytes/s:

- **overlapped** (the next version pulled while this one computes, the last gradient pushed meanwhile:
  what a volunteer that fetches ahead can do at best): busy = C / max(C, pull, push), so
  k = u x max(pull, push) x R / F_s for a utilisation u;
- **serial** (pull, compute, push, one after the other): busy = C / (pull + C + push), so
  k = u / (1 - u) x (pull + push) x R / F_s.

P_s / F_s is about 1/6 whatever the stage's size, so the tokens needed do not depend on the model's
size or the number of stages: they are set by R / B and the bytes per parameter on the wire. The batch
a run then needs is k x the volunteers of a stage.

`plan_budget` says the same of a plan's volunteers (`peer plan`): each with its own FLOP/s and its
links to its stage's servers (each server holds 1/S of the stage, pulled and pushed one after another).

Pure Python (the planner's floor): no torch, no network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.files import Cluster, ModelSpec, Plan

MODES = ("overlapped", "serial")


@dataclass(frozen=True)
class Volunteer:
    """A volunteer's processor and link: `tflops` peak, `mfu` the share of it a training pass
    sustains, `mbps` its link (each way), and the bytes per parameter it pulls and pushes."""

    tflops: float
    mbps: float
    mfu: float = 0.4
    down_bytes: int = 4
    up_bytes: int = 4

    def __post_init__(self):
        for name in ("tflops", "mbps", "mfu", "down_bytes", "up_bytes"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number, got {v}")
        if self.mfu > 1:
            raise ValueError(f"mfu is a share of the peak (at most 1), got {self.mfu}")

    @property
    def flops(self) -> float:
        return self.tflops * 1e12 * self.mfu

    @property
    def link_bytes(self) -> float:
        return self.mbps * 1e6 / 8


def stage_size(model: ModelSpec, stages: int, stage: int) -> tuple[float, float]:
    """(parameters, training FLOPs per token) of one stage of `model` cut into `stages` even pieces."""
    if not 0 <= stage < stages <= model.layers:
        raise ValueError(f"stage {stage} of {stages} stages of a {model.layers}-layer model")
    return layers_size(model, (stage + 1) * model.layers // stages - stage * model.layers // stages)


def layers_size(model: ModelSpec, layers: int) -> tuple[float, float]:
    """(parameters, training FLOPs per token) of `layers` blocks of `model`."""
    return layers * model.params_per_layer, layers * model.flops_per_token_per_layer


def seconds(model: ModelSpec, stages: int, stage: int, v: Volunteer, tokens: float) -> dict:
    """A version's compute, pull and push, in seconds, for `tokens` tokens of stage `stage`."""
    params, flops = stage_size(model, stages, stage)
    return {
        "compute": tokens * flops / v.flops,
        "pull": params * v.down_bytes / v.link_bytes,
        "push": params * v.up_bytes / v.link_bytes,
    }


def utilisation(model: ModelSpec, stages: int, stage: int, v: Volunteer, tokens: float, mode: str) -> float:
    """The share of a version's wall time the volunteer computes (see the module's docstring)."""
    t = seconds(model, stages, stage, v, tokens)
    if mode == "overlapped":
        return t["compute"] / max(t["compute"], t["pull"], t["push"])
    if mode == "serial":
        return t["compute"] / (t["pull"] + t["compute"] + t["push"])
    raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def tokens_for(model: ModelSpec, stages: int, v: Volunteer, target: float, mode: str) -> int:
    """The fewest tokens a version a volunteer of every stage must compute to be busy `target` of the
    time (the stage that needs most)."""
    if not 0 < target < 1:
        raise ValueError(f"a utilisation is in (0, 1), got {target}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    need = 0
    for stage in range(stages):
        t = seconds(model, stages, stage, v, 1.0)  # (compute of one token)
        link = max(t["pull"], t["push"]) if mode == "overlapped" else t["pull"] + t["push"]
        factor = target if mode == "overlapped" else target / (1 - target)
        need = max(need, math.ceil(factor * link / t["compute"]))
    return need


def plan_budget(
    cluster: Cluster,
    model: ModelSpec,
    plan: Plan,
    target: float = 0.5,
    down_bytes: int | None = None,
    up_bytes: int | None = None,
) -> list[dict | None]:
    """Per stage of `plan` (None for a stage without volunteers): `share`, the tokens a version each of
    its volunteers computes at the model's batch (an even share); `busy`, (lowest, highest) utilisation
    of its volunteers then, overlapped; `need`, the tokens a version the volunteer that needs most must
    compute to be busy `target`; `batch`, `need` x the stage's volunteers. The cluster's FLOP/s are
    what a device sustains, and a parameter takes the model file's bytes_per_value each way unless
    `down_bytes` / `up_bytes` say otherwise, as in the planner's cost (docs/cost-model.md)."""
    if not 0 < target < 1:
        raise ValueError(f"a utilisation is in (0, 1), got {target}")
    down_bytes = down_bytes or model.bytes_per_value
    up_bytes = up_bytes or model.bytes_per_value
    out: list[dict | None] = []
    for st in plan.stages:
        if not st.clients:
            out.append(None)
            continue
        params, flops = layers_size(model, st.layers[1] - st.layers[0])
        servers = list(st.frontal) + list(st.backward)
        slot = params / len(servers)
        share = model.batch_tokens / len(st.clients)
        busy, need = [], 0
        for c in st.clients:
            kind = cluster.unreliable_flops if cluster.kind(c) == "unreliable" else cluster.reliable_flops
            rate = float(kind[cluster.index(c)])
            pull = sum(slot * down_bytes / cluster.bandwidth(s, c) for s in servers)
            push = sum(slot * up_bytes / cluster.bandwidth(c, s) for s in servers)
            link = max(pull, push)
            compute = share * flops / rate
            busy.append(compute / max(compute, link))
            need = max(need, math.ceil(target * link * rate / flops))
        out.append({"share": share, "busy": (min(busy), max(busy)), "need": need, "batch": need * len(st.clients)})
    return out
