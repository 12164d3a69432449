"""Where a volunteer should compute: the stage whose predicted step time (the cost model of
docs/cost-model.md, `plan_cost`) improves most when it joins, given the compute every stage
has now. Pure arithmetic on what a volunteer can know: the run's layout, the compute the DHT
records announce for each server and volunteer, and its own measured compute and links.

What it assumes where it cannot know: the servers of a run sit at one site (links between them
`server_delay` / `server_bandwidth`), and every other volunteer has the same links to a stage's
servers as this one measured. A stage with no compute at all stalls the run, so it ranks before any
time: a placement that leaves fewer stages without compute always wins.

It does not talk to anyone and does not decide when to look again (peer/join.py does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from scheduler.cost import plan_cost
from scheduler.files import Cluster, ModelSpec, Plan, Stage

TIE = 0.10  # stages whose predicted times are within 10% of the best are decided by the links
MOVE = 0.20  # a volunteer moves when another stage shortens the predicted step by at least 20%


@dataclass
class StageNow:
    """One stage as the DHT shows it now: its servers (device id, FLOP/s of its worker; 0 without
    one), and the FLOP/s of every volunteer computing on it (not counting the one deciding)."""

    frontal: list
    backward: list
    layers: tuple
    server_flops: dict = field(default_factory=dict)  # device id -> FLOP/s
    volunteer_flops: list = field(default_factory=list)


@dataclass
class Decision:
    stage: int
    predicted: list  # per stage: (stages left without compute, predicted seconds per batch) with us there
    stay: tuple | None = None  # the same for staying where we are (None for a new volunteer)
    link_scores: list = field(default_factory=list)  # mean delay + bytes/bandwidth to each stage's servers
    reason: str = ""

    @property
    def moves(self) -> bool:
        return self.stay is not None and self.reason.startswith("move")


def link_score(delays, bandwidths, nbytes: float) -> float:
    """mean over a stage's servers of (delay + nbytes / bandwidth), seconds."""
    return sum(d + (nbytes / b if b > 0 else math.inf) for d, b in zip(delays, bandwidths)) / max(len(delays), 1)


def predict(
    stages: list[StageNow],
    model: ModelSpec,
    own_flops: float,
    delays,
    bandwidths,
    where: int | None,
    server_delay: float = 1e-3,
    server_bandwidth: float = 1.25e9,
) -> tuple[int, float]:
    """(stages without compute, seconds per batch by plan_cost) with this volunteer on stage `where`
    (None: not computing). Other volunteers get this volunteer's links to their stage's servers."""
    empty = sum(
        1
        for k, st in enumerate(stages)
        if sum(st.server_flops.values()) + sum(st.volunteer_flops) + (own_flops if k == where else 0) <= 0
    )
    if empty:
        return empty, math.inf
    servers = [d for st in stages for d in list(st.frontal) + list(st.backward)]
    index = {d: i for i, d in enumerate(servers)}
    flops = {d: float(st.server_flops.get(d, 0.0)) for st in stages for d in list(st.frontal) + list(st.backward)}
    vols, vol_stage = [], []
    for k, st in enumerate(stages):
        for f in st.volunteer_flops:
            vols.append(float(f))
            vol_stage.append(k)
    if where is not None:
        vols.append(float(own_flops))
        vol_stage.append(where)
    r, u = len(servers), len(vols)
    delay_rr = np.full((r, r), server_delay)
    bw_rr = np.full((r, r), server_bandwidth)
    np.fill_diagonal(delay_rr, 0.0)
    # a volunteer's links to servers of other stages never enter the cost; give them its own anyway
    delay_ur = np.zeros((u, r))
    bw_ur = np.ones((u, r))
    for k, st in enumerate(stages):
        for j, d in enumerate(list(st.frontal) + list(st.backward)):
            delay_ur[:, index[d]] = delays[k][j]
            bw_ur[:, index[d]] = bandwidths[k][j]
    ids = [f"v{i}" for i in range(u)]
    cluster = Cluster(
        reliable_ids=servers,
        unreliable_ids=ids,
        reliable_flops=np.array([flops[d] for d in servers]),
        unreliable_flops=np.array(vols, dtype=float),
        reliable_memory=[None] * r,
        unreliable_memory=[None] * u,
        delay_rr=delay_rr,
        bw_rr=bw_rr,
        delay_ur=delay_ur,
        bw_ur=bw_ur,
    )
    plan = Plan(
        stages=[
            Stage(
                frontal=list(st.frontal),
                backward=list(st.backward),
                clients=[ids[i] for i in range(u) if vol_stage[i] == k],
                layers=tuple(st.layers),
            )
            for k, st in enumerate(stages)
        ]
    )
    cost = plan_cost(cluster, model, plan)
    if not cost.valid:
        raise ValueError(f"the run's layout cannot be scored: {cost.reason}")
    return 0, cost.total


def better(a: tuple[int, float], b: tuple[int, float], by: float) -> bool:
    """Is placement score `a` better than `b` by the fraction `by` (fewer empty stages always is)?"""
    if a[0] != b[0]:
        return a[0] < b[0]
    return a[1] < math.inf and (b[1] == math.inf or a[1] <= (1 - by) * b[1])


def choose(
    stages: list[StageNow],
    model: ModelSpec,
    own_flops: float,
    delays,
    bandwidths,
    nbytes: float,
    current: int | None = None,
    tie: float = TIE,
    move: float = MOVE,
) -> Decision:
    """The stage to compute on. A new volunteer (`current` None) takes the best predicted stage,
    the measured links deciding between stages within `tie` of the best. A volunteer on stage
    `current` (its own compute not in `stages`) moves only to a stage that is better than staying
    by `move` (hysteresis), else stays."""
    if len(stages) != len(delays) or len(delays) != len(bandwidths):
        raise ValueError("choose: one StageNow and one list of delays and bandwidths per stage are needed")
    predicted = [predict(stages, model, own_flops, delays, bandwidths, k) for k in range(len(stages))]
    links = [link_score(d, b, nbytes) for d, b in zip(delays, bandwidths)]
    fewest = min(p[0] for p in predicted)
    best_time = min(p[1] for p in predicted if p[0] == fewest)
    close = [
        k for k, p in enumerate(predicted) if p[0] == fewest and (p[1] == best_time or p[1] <= (1 + tie) * best_time)
    ]
    pick = min(close, key=lambda k: (links[k], k))
    if current is None:
        why = (
            f"predicted {best_time:.3g} s/batch"
            if math.isfinite(best_time)
            else f"{fewest} stage(s) still without compute"
        )
        return Decision(
            pick,
            predicted,
            None,
            links,
            f"join: {why}; {len(close)} stage(s) within {tie:.0%}, the closest by links chosen",
        )
    stay = predicted[current]
    if pick != current and better(predicted[pick], stay, move):
        return Decision(
            pick,
            predicted,
            stay,
            links,
            f"move: stage {pick} predicts {_fmt(predicted[pick])} against {_fmt(stay)} here",
        )
    return Decision(
        current,
        predicted,
        stay,
        links,
        f"stay: best elsewhere {_fmt(predicted[pick])} (stage {pick}) is not {move:.0%} better than {_fmt(stay)}",
    )


def _fmt(score: tuple[int, float]) -> str:
    return f"{score[1]:.3g} s/batch" if score[0] == 0 else f"{score[0]} stage(s) without compute"
