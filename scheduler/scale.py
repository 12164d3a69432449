"""What-if at scale: a swarm of thousands of volunteers, from the step model of a group of them and
the load they put on the run's servers and DHT (`peer simulate`).

The step model (scheduler/stepsim.py, checked by scripts/bench_fidelity.py) plays the protocol call
by call; it does not share a server's link or processor between callers, and its event loop grows
with the square of the workers. At scale the run is data-parallel: a batch is cut into pieces of at
least `--client-batch-tokens` per volunteer, so N volunteers need a batch of N such pieces, and every
group of volunteers runs the same protocol against the same servers. So:

1. the step model plays a **group** of `group` volunteers per stage (drawn from the cluster's
   distributions, the batch cut to give each its piece): the step time when the servers are not
   the limit, and the calls and bytes a volunteer costs per step;
2. the **servers' resources** for all N: each server holds 1/S of its stage's parameters, every
   volunteer of the stage fetches its slot once a version and pushes the slot's gradient once a
   step, and the activations and their gradients of every row pass a stage's servers both ways.
   A server's uplink and downlink (`server_mbps`) and its processor (the calibration's cost per
   call and per byte, the re-runs of checked work on the server's own FLOP/s, its step of the
   shard) each take a time per step; the step takes the longest of these and the group's step;
3. the **DHT** (`dht_holder_bps`): a stage has two keys. Its servers' key holds one record per
   server, stored every announce period; every server reads every stage's servers' key (and the
   run's config) each announce period, and every volunteer once a `calm_read_s` while it works and
   its servers answer (peer/host/run_watch.py) and once a `rebalance_s` to re-choose its stage
   (`--stage auto`; it reads the servers' counts of their volunteers). Its volunteers' key holds one
   record per volunteer, stored every VOLUNTEER_PERIODS announce periods and read by dashboards
   only. The nodes that hold a key (`dht_replicas` of them, volunteers' machines like any other)
   each take every store under it and a share of the reads: what they serve grows with the
   volunteers, not with their square;
4. **churn** (a fraction of the volunteers lost and replaced each step): `churn_factor`.

The first resource to saturate is the one whose time per step passes the group's step first as N
grows; the servers a stage needs to go on scaling are S x (its time / the group's step).

Pure Python (the planner's floor): no torch, no network.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from scheduler.files import ModelSpec, load_cluster, load_plan
from scheduler.step_io import Calibration, Workload
from scheduler.stepsim import simulate

# how often a working volunteer whose servers answer reads the run's records (peer/host/run_watch.py's
# CALM_READ_PERIOD_S), and how many announce periods apart a volunteer stores its own record
# (core/protocol/records.py's VOLUNTEER_PERIODS); tests/scheduler/test_scale.py checks both equal
CALM_READ_S = 60.0
VOLUNTEER_PERIODS = 5


def dht_holder_bps(s: "Swarm", per_stage: int, servers_per_stage: int) -> float:
    """Bytes a second that each node holding one of a stage's keys takes in and serves, for the
    busier of the stage's two keys (point 3 of the module's doc): every store reaches each holder,
    reads are shared among the `dht_replicas` holders."""
    servers, volunteers = servers_per_stage * s.stages, per_stage * s.stages
    reads = servers / s.announce_period + volunteers / s.calm_read_s  # of every stage's servers' key
    if s.rebalance_s > 0:
        reads += volunteers / s.rebalance_s
    servers_key = (
        servers_per_stage * s.server_record_bytes / s.announce_period
        + reads * servers_per_stage * s.server_record_bytes / s.dht_replicas
    )
    volunteers_key = (
        per_stage * s.client_record_bytes / (VOLUNTEER_PERIODS * s.announce_period)
        + s.dashboards * per_stage * s.client_record_bytes / s.announce_period / s.dht_replicas
    )
    config_key = reads * s.config_bytes / s.dht_replicas  # (the config is read with the servers' keys)
    return max(servers_key, volunteers_key, config_key)


def churn_factor(
    churn: float, step_s: float, rejoin_s: float, requeue: bool = True, task_timeout: float = 30.0, tasks: int = 4
) -> float:
    """Calm seconds per step / seconds per step when a fraction `churn` of the volunteers is killed
    (at a random moment of each step) and replaced, the replacement taking `rejoin_s` to join.

    With the task pool a killed volunteer's leases go back at once: the run loses the volunteer's
    time until its replacement joins and, on average, half a task of work (a volunteer runs `tasks`
    tasks a step). The volunteers' capacity per step is then short by churn x (rejoin + step /
    (2 tasks)) / step, and the step stretches until the work fits: s = (s0 + c R) / (1 - c / 2T).
    With `--no-requeue` a lost lease is waited out: its batch cannot end before the lease runs out
    (`task_timeout`), while the pipeline (the first stage cuts up to two batches ahead) goes on with
    the next batches, so a step waits what is left of a lease beyond two steps, at any real churn
    (a step that loses no task is rare) once a step."""
    if not 0 <= churn < 1:
        raise ValueError(f"churn is a fraction in [0, 1), got {churn}")
    if churn == 0:
        return 1.0
    stretched = (step_s + churn * rejoin_s) / (1 - churn / (2 * tasks))
    if not requeue:
        stretched += max(0.0, task_timeout - 2 * stretched)
    return step_s / stretched


@dataclass
class Swarm:
    """A swarm to predict: `volunteers` split evenly over the stages; devices drawn uniformly from the
    given ranges (seeded)."""

    volunteers: int
    stages: int = 2
    servers_per_stage: int = 2
    volunteer_tflops: tuple = (0.005, 0.02)
    volunteer_mbps: tuple = (20.0, 100.0)
    volunteer_delay_ms: tuple = (20.0, 80.0)
    server_tflops: float = 10.0  # a server's processor, for the re-runs of checked work (peer simulate's default)
    server_mbps: float = 1000.0  # each server's uplink and downlink
    server_delay_ms: float = 0.5  # between the servers (one data centre)
    client_batch_tokens: int = 1024  # the piece of a batch each volunteer computes a step
    task_tokens: int = 512  # the fewest tokens a forward task carries (peer serve --task-tokens)
    batch_rows: int | None = None  # a fixed batch (a measured run's); else a piece for every volunteer
    churn: float = 0.0
    rejoin_s: float = 10.0
    requeue: bool = True
    task_timeout: float = 30.0
    verify_rate: float = 0.05
    announce_period: float = 5.0
    # signed records as stored (envelope, signatures; measured): a server's (with its last losses and
    # step times), a volunteer's, and the run's config
    server_record_bytes: float = 1900.0
    client_record_bytes: float = 800.0
    config_bytes: float = 1000.0
    dht_replicas: int = 5
    calm_read_s: float = CALM_READ_S
    rebalance_s: float = 60.0  # peer join --rebalance-period (0: volunteers never re-choose)
    dashboards: int = 1  # dashboards reading the run every announce period
    seed: int = 0


@dataclass
class Prediction:
    volunteers: int
    batch_tokens: int
    group_step_s: float  # the step model's step of a group, servers not the limit
    resource_s: dict  # seconds per step each server resource needs
    step_s: float
    tokens_per_second: float
    calm_tokens_per_second: float
    bottleneck: str  # 'volunteers' when no server resource is the limit
    servers_per_stage_needed: int
    dht_mbps_per_holder: float  # what each node holding one of a stage's keys takes in and serves
    dht_share: float  # of a median volunteer's bandwidth
    volunteer_utilisation: float = 0.0  # a volunteer's mean share of the time spent computing (the group's)


def group_cluster(s: Swarm, per_stage: int) -> dict:
    """The cluster file of one group: the stages' servers in one data centre and `per_stage`
    volunteers a stage, drawn from the swarm's ranges."""
    servers = [f"s{k}{r}{i}" for k in range(s.stages) for r in "fb" for i in range(1)]
    rng = random.Random(s.seed)
    n = per_stage * s.stages
    vols = [
        (rng.uniform(*s.volunteer_tflops), rng.uniform(*s.volunteer_delay_ms), rng.uniform(*s.volunteer_mbps))
        for _ in range(n)
    ]
    return {
        "reliable": [{"id": d, "tflops": s.server_tflops} for d in servers],
        "unreliable": [{"id": f"v{u}", "tflops": f} for u, (f, _, _) in enumerate(vols)],
        "delay_ms": {
            "reliable": [[0.0 if a == b else s.server_delay_ms for b in servers] for a in servers],
            "unreliable": [[round(d, 1)] * len(servers) for _, d, _ in vols],
        },
        "bandwidth_mbps": {
            "reliable": [[0.0 if a == b else s.server_mbps for b in servers] for a in servers],
            "unreliable": [[round(b, 1)] * len(servers) for _, _, b in vols],
        },
    }


def segment_layers(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of `parts` even, contiguous pieces of range(n) (the layout's own rule)."""
    return i * n // parts, (i + 1) * n // parts


def group_plan(s: Swarm, model: ModelSpec, per_stage: int) -> dict:
    return {
        "stages": [
            {
                "frontal": [f"s{k}f0"],
                "backward": [f"s{k}b0"],
                "clients": [f"v{u}" for u in range(per_stage * s.stages) if u % s.stages == k],
                "layers": list(segment_layers(model.layers, s.stages, k)),
            }
            for k in range(s.stages)
        ],
        "idle": [],
    }


def workload(model: ModelSpec, seq_len: int, stages: int, batch_rows: int, micro_batches: int, steps: int, s: Swarm):
    """The step model's workload for a batch of `batch_rows` sequences (fp32 on the wire)."""
    params = [
        (hi - lo) * model.params_per_layer * 4
        for lo, hi in (segment_layers(model.layers, stages, k) for k in range(stages))
    ]
    params[0] += 256 * model.hidden * 4  # the embedding (vocabulary of the byte-level presets)
    params[-1] += 256 * model.hidden * 4  # the head
    act = seq_len * model.hidden * 4
    labels = seq_len * 8
    return Workload(
        steps=steps,
        micro_batches=micro_batches,
        rows=max(1, batch_rows // micro_batches),
        min_task_rows=max(1, -(-s.task_tokens // seq_len)),
        min_client_rows=max(1, -(-s.client_batch_tokens // seq_len)),
        input_bytes=[2 * labels] + [act + labels] * (stages - 1),
        act_bytes=act,
        label_bytes=labels,
        param_bytes=params,
    )


def predict(
    s: Swarm, model: ModelSpec, seq_len: int, cal: Calibration, group: int = 8, steps: int = 8, warmup: int = 3
) -> Prediction:
    """The swarm's steady tokens/s, its limiting resource, and the servers a stage needs."""
    per_stage = max(1, s.volunteers // s.stages)
    rows_each = max(1, -(-s.client_batch_tokens // seq_len))
    micro = 4
    # a fixed batch (a measured run's) is played whole; a batch that grows with the volunteers, by a group
    g = per_stage if s.batch_rows else min(per_stage, group)
    cluster = load_cluster(group_cluster(s, g))
    plan = load_plan(group_plan(s, model, g), cluster)
    group_rows = s.batch_rows or g * rows_each  # the group's batch: a piece for each of its volunteers
    gw = workload(model, seq_len, s.stages, group_rows, micro, steps, s)
    trace = simulate(cluster, plan, gw, cal, servers_compute=False)
    group_step = trace.seconds_per_step(warmup)
    calls_per_volunteer = trace.calls / max(steps, 1) / (g * s.stages)

    batch_rows = s.batch_rows or per_stage * rows_each
    tokens = batch_rows * seq_len
    S = s.servers_per_stage
    stage_params = max(gw.param_bytes)
    slot = stage_params / S
    rows_stage = batch_rows  # every row of the batch passes each stage
    act = gw.act_bytes
    # per server per step: each volunteer of the stage fetches the slot and pushes its gradient;
    # the activations (in from the volunteers, relayed, out to the volunteers) and their gradients
    # split over the stage's servers, each way
    out_bytes = per_stage * slot + 2 * rows_stage * act / S
    in_bytes = per_stage * slot + 2 * rows_stage * act / S
    link = s.server_mbps * 1e6 / 8
    stage_flops = tokens * model.flops_per_token_per_layer * model.layers / s.stages
    resource = {
        "a server's uplink": out_bytes / link,
        "a server's downlink": in_bytes / link,
        "a server's processor": (
            per_stage * calls_per_volunteer / S * cal.call_seconds
            + (in_bytes + out_bytes) * cal.byte_seconds
            + s.verify_rate * stage_flops / S / (s.server_tflops * 1e12)
            + cal.apply_seconds
        ),
    }
    step = max([group_step] + list(resource.values()))
    worst = max(resource, key=resource.get)
    bottleneck = worst if resource[worst] > group_step else "volunteers"
    needed = S if resource[worst] <= group_step else math.ceil(S * resource[worst] / group_step)
    dht_bps = dht_holder_bps(s, per_stage, S)
    median_vol = (s.volunteer_mbps[0] + s.volunteer_mbps[1]) / 2 * 1e6 / 8
    calm = tokens / step
    factor = churn_factor(s.churn, step, s.rejoin_s, s.requeue, s.task_timeout, micro) if s.churn else 1.0
    return Prediction(
        volunteers=s.volunteers,
        batch_tokens=tokens,
        group_step_s=group_step,
        resource_s=resource,
        step_s=step / factor,
        tokens_per_second=calm * factor,
        calm_tokens_per_second=calm,
        bottleneck=bottleneck,
        servers_per_stage_needed=needed,
        dht_mbps_per_holder=dht_bps * 8 / 1e6,
        dht_share=dht_bps / median_vol,
        # the group's volunteers, stretched when a server resource, not they, sets the step
        volunteer_utilisation=trace.utilisation() * min(1.0, group_step / step) * factor,
    )


def predict_measured(
    base: Swarm, setup: dict, point: dict, model: ModelSpec, seq_len: int, cal: Calibration
) -> Prediction:
    """The prediction for one point scripts/bench_scale.py measured (`setup`: its results file's,
    `point`: one of its results), the rest of the swarm as in `base`: the run's devices, links, batch
    and lease, its churn and measured re-join time, and the slowdown its volunteers measured of
    themselves against the calibration (they share two cores)."""
    s = dataclasses.replace(
        base,
        volunteers=point["volunteers"],
        volunteer_tflops=(setup["volunteer_tflops"],) * 2,
        volunteer_mbps=tuple(setup["volunteer_mbps"]),
        volunteer_delay_ms=tuple(setup["volunteer_delay_ms"]),
        server_mbps=setup["server_mbps"],
        server_delay_ms=setup["server_delay_ms"],
        client_batch_tokens=setup["client_batch_tokens"],
        batch_rows=setup.get("batch_rows"),
        task_timeout=setup["task_timeout"],
        churn=point["churn"],
        rejoin_s=point.get("rejoin_seconds") or base.rejoin_s,
        requeue=point["mode"] == "pool",
    )
    cal = dataclasses.replace(cal, compute_factor=setup.get("compute_factor", 1.0))
    return predict(s, model, seq_len, cal, group=max(s.volunteers // s.stages, 1))
