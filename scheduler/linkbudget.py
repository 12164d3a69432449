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
links to its stage's servers (each server holds 1/S of the stage, pulled and pushed one after another),
and the activations its tokens move to and from those servers.

`choose_layout` (`peer simulate --choose-layout`) chooses the number of stages and the batch for a fleet
described by ranges: activations between stages, a stage's memory and the servers' links counted; a
stage whose activations take longer on the link than their tokens' compute can never keep its
volunteers busy, which is what limits the number of stages on home links.

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
    compute to be busy `target` (None when its activations alone keep it below); `batch`, `need` x the
    stage's volunteers. The cluster's FLOP/s are what a device sustains, and a parameter takes the model
    file's bytes_per_value each way unless `down_bytes` / `up_bytes` say otherwise, as in the planner's
    cost (docs/cost-model.md). A volunteer's link also carries its tokens' activations: a stage's inputs
    from its frontal servers and output gradients from its backward servers down, its outputs to the
    backward and input gradients to the frontal servers up (the model file's bytes a value)."""
    if not 0 < target < 1:
        raise ValueError(f"a utilisation is in (0, 1), got {target}")
    down_bytes = down_bytes or model.bytes_per_value
    up_bytes = up_bytes or model.bytes_per_value
    out: list[dict | None] = []
    last = len(plan.stages) - 1
    for k, st in enumerate(plan.stages):
        if not st.clients:
            out.append(None)
            continue
        params, flops = layers_size(model, st.layers[1] - st.layers[0])
        servers = list(st.frontal) + list(st.backward)
        slot = params / len(servers)
        share = model.batch_tokens / len(st.clients)
        busy, need = [], 0.0
        for c in st.clients:
            kind = cluster.unreliable_flops if cluster.kind(c) == "unreliable" else cluster.reliable_flops
            rate = float(kind[cluster.index(c)])
            pull = sum(slot * down_bytes / cluster.bandwidth(s, c) for s in servers)
            push = sum(slot * up_bytes / cluster.bandwidth(c, s) for s in servers)
            # seconds a token's activations take each way: from and to one of each role's servers
            act_down = _act(model, k > 0, st.frontal, c, cluster.bandwidth, "in") + _act(
                model, k < last, st.backward, c, cluster.bandwidth, "in"
            )
            act_up = _act(model, k < last, st.backward, c, cluster.bandwidth, "out") + _act(
                model, k > 0, st.frontal, c, cluster.bandwidth, "out"
            )
            compute = flops / rate  # a token's
            busy.append(share * compute / max(share * compute, pull + share * act_down, push + share * act_up))
            for fixed, per_token in ((pull, act_down), (push, act_up)):
                room = compute - target * per_token
                need = max(need, math.ceil(target * fixed / room) if room > 0 else math.inf)
        n = None if math.isinf(need) else int(need)
        out.append(
            {
                "share": share,
                "busy": (min(busy), max(busy)),
                "need": n,
                "batch": None if n is None else n * len(st.clients),
            }
        )
    return out


def _act(model: ModelSpec, crosses: bool, servers, client: str, bandwidth, way: str) -> float:
    """Seconds a token's activations (or their gradients) take between `client` and a server of
    `servers` (their mean), `way` "in" to the client or "out" of it; 0 where no stage boundary is."""
    if not crosses:
        return 0.0
    pairs = [(s, client) if way == "in" else (client, s) for s in servers]
    return sum(model.act_bytes_per_token / bandwidth(a, b) for a, b in pairs) / len(pairs)


@dataclass(frozen=True)
class Fleet:
    """Volunteers of a swarm: `count` of them, each with a processor of `tflops` (lo, hi) peak and a
    link of `mbps` (lo, hi) each way, sustaining `mfu` of the peak, with `memory_gb` for a stage."""

    count: int
    tflops: tuple[float, float]
    mbps: tuple[float, float]
    mfu: float = 0.4
    memory_gb: float = math.inf

    def __post_init__(self):
        if self.count < 1:
            raise ValueError(f"a fleet has at least one volunteer, got {self.count}")
        for name in ("tflops", "mbps"):
            lo, hi = getattr(self, name)
            if not (0 < lo <= hi and math.isfinite(hi)):
                raise ValueError(f"{name} must be positive numbers lo <= hi, got {lo}-{hi}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu is a share of the peak in (0, 1], got {self.mfu}")
        if not self.memory_gb > 0:
            raise ValueError(f"memory_gb must be positive, got {self.memory_gb}")


@dataclass(frozen=True)
class Wire:
    """Bytes a value on the wire: parameters pulled (`down`), gradients pushed (`up`), activations and
    their gradients between stages (`act`)."""

    down: float = 4
    up: float = 4
    act: float = 4


def layout_for_links(
    model: ModelSpec,
    fleet: Fleet,
    stages: int,
    target: float = 0.5,
    wire: Wire = Wire(),
    server_mbps: float = 1000.0,
) -> dict:
    """The batch that keeps every volunteer of `fleet` busy at least `target` of the time with `model`
    cut into `stages` even pieces, overlapped (module docstring), now counting the activations too.

    Volunteers are given to stages in proportion to their layers and rows in proportion to their
    FLOP/s (the frontal server's cut), so every volunteer computes a version for the same C seconds.
    A volunteer of stage s with k tokens moves P_s x bytes of parameters and k x a_s of activations
    each way (a_s: the hidden size x `wire.act` for each neighbouring stage), so the fastest processor
    on the slowest link needs most: C >= target x (P_s x bytes + k_hi x a_s) / B_lo with k_hi = C x
    R_hi / F_s. A stage whose activations alone keep that volunteer below `target` makes the layout
    infeasible, as does a stage that does not fit `fleet.memory_gb` (its parameters twice, held and
    fetched ahead, and an fp32 gradient sum).

    Returns `stages`, `reason` (None when feasible) and, when feasible: `batch` (tokens a version),
    `tokens` (lo, mean, hi tokens a volunteer computes a version), `version_s` (a version's wall
    time, set by the slowest link), `busy` (every volunteer's share of it computing),
    `tokens_per_s`, `memory_gb` (a volunteer's, the largest stage), `servers` (per stage: how many
    servers of `server_mbps` the parameter and activation traffic through them needs, frontal and
    backward, an even number of at least 2)."""
    if not 0 < target < 1:
        raise ValueError(f"a utilisation is in (0, 1), got {target}")
    if not 1 <= stages <= min(model.layers, fleet.count):
        raise ValueError(f"{stages} stages of a {model.layers}-layer model on {fleet.count} volunteers")
    if not (server_mbps > 0 and math.isfinite(server_mbps)):
        raise ValueError(f"server_mbps must be a positive number, got {server_mbps}")
    lo_link = fleet.mbps[0] * 1e6 / 8
    r_lo, r_hi = (x * 1e12 * fleet.mfu for x in fleet.tflops)
    r_mean = (r_lo + r_hi) / 2
    per_stage = []
    for s in range(stages):
        n = (s + 1) * model.layers // stages - s * model.layers // stages
        params, flops = layers_size(model, n)
        neighbours = (s > 0) + (s < stages - 1)
        per_stage.append({"layers": n, "params": params, "flops": flops, "act": neighbours * model.hidden * wire.act})
    out: dict = {"stages": stages, "reason": None}
    biggest = max(per_stage, key=lambda st: st["params"])
    memory = biggest["params"] * (2 * wire.down + 4) / 1e9
    out["memory_gb"] = memory
    if memory > fleet.memory_gb:
        out["reason"] = (
            f"a stage of {biggest['layers']} layers needs {memory:.3g} GB (its parameters held and fetched "
            f"ahead, and an fp32 gradient sum), more than a volunteer's {fleet.memory_gb:g} GB"
        )
        return out
    need = 0.0  # C: the seconds a volunteer computes a version
    for st in per_stage:
        act_share = target * r_hi * st["act"] / (st["flops"] * lo_link)
        if act_share >= 1:
            out["reason"] = (
                f"activations alone ({st['act']:,.0f} bytes a token each way) keep a volunteer of "
                f"{fleet.tflops[1]:g} TFLOP/s on {fleet.mbps[0]:g} Mbit/s below {target:.0%}: at most "
                f"{target / act_share:.0%} with a stage of {st['layers']} layers"
            )
            return out
        need = max(need, target * st["params"] * max(wire.down, wire.up) / lo_link / (1 - act_share))
    version_s = 0.0
    for st in per_stage:
        k_hi = need * r_hi / st["flops"]
        link = (st["params"] * max(wire.down, wire.up) + k_hi * st["act"]) / lo_link
        version_s = max(version_s, need, link)
    total_flops = sum(st["flops"] for st in per_stage)
    batch = need * fleet.count * r_mean / total_flops
    servers = []
    for st in per_stage:
        volunteers = fleet.count * st["layers"] / model.layers
        relayed = 2 * batch * st["act"]  # handed to its volunteers, and relayed on to the next stage
        busiest = max(volunteers * st["params"] * wire.down, volunteers * st["params"] * wire.up) + relayed
        n = max(2, math.ceil(busiest / (version_s * server_mbps * 1e6 / 8)))
        servers.append(n + n % 2)
    mean_tokens = batch * stages / fleet.count
    out.update(
        batch=batch,
        tokens=(
            min(need * r_lo / st["flops"] for st in per_stage),
            mean_tokens,
            max(need * r_hi / st["flops"] for st in per_stage),
        ),
        version_s=version_s,
        busy=need / version_s,
        tokens_per_s=batch / version_s,
        servers=servers,
    )
    return out


def choose_layout(
    model: ModelSpec,
    fleet: Fleet,
    target: float = 0.5,
    wire: Wire = Wire(),
    server_mbps: float = 1000.0,
) -> tuple[list[dict], dict | None]:
    """`layout_for_links` for every number of stages the model and the fleet allow, and the one
    chosen: the smallest batch that keeps every volunteer busy `target` (a version is one optimizer
    step, so a smaller batch is more steps for the same tokens), fewer servers on a tie; None when
    no number of stages can."""
    rows = [
        layout_for_links(model, fleet, s, target, wire, server_mbps)
        for s in range(1, min(model.layers, fleet.count) + 1)
    ]
    feasible = [r for r in rows if r["reason"] is None]
    best = min(feasible, key=lambda r: (r["batch"], sum(r["servers"])), default=None)
    return rows, best
