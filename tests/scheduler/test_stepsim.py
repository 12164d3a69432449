"""The model of a step (scheduler/stepsim.py) on cases worked out by hand, and the properties that
make it a model of the protocol rather than a fit: time scales with compute when links are free,
links and call costs only ever add time, and what it cannot model it refuses."""

import dataclasses

import pytest

from scheduler import load_cluster, load_plan
from scheduler.step_io import Calibration, Workload
from scheduler.stepsim import simulate


def cluster(delay_ms=0.0, mbps=1e9, volunteers=2, tflops=1e-3):
    ids = ["fs0", "bs0", "fs1", "bs1"]
    return load_cluster(
        {
            "reliable": [{"id": i, "tflops": 1.0} for i in ids],
            "unreliable": [{"id": f"v{u}", "tflops": tflops} for u in range(volunteers)],
            "delay_ms": {
                "reliable": [[0.0 if a == b else delay_ms for b in ids] for a in ids],
                "unreliable": [[delay_ms] * 4 for _ in range(volunteers)],
            },
            "bandwidth_mbps": {
                "reliable": [[0.0 if a == b else mbps for b in ids] for a in ids],
                "unreliable": [[mbps] * 4 for _ in range(volunteers)],
            },
        }
    )


CAL = Calibration(
    call_seconds=0.0,
    byte_seconds=0.0,
    ref_flops=1e9,
    forward_row=[0.01, 0.01],
    fb_row=[0.03, 0.03],
    backward_row=[0.02, 0.02],
    apply_seconds=0.0,
)
WORK = Workload(
    steps=8,
    micro_batches=4,
    rows=4,
    min_task_rows=4,
    input_bytes=[1000, 5000],
    act_bytes=4000,
    label_bytes=1000,
    param_bytes=[1e6, 1e6],
    preference_grace=0.0,
)


def two_stage_plan(c, clients=("v0", "v1")):
    return load_plan(
        {
            "stages": [
                {"frontal": ["fs0"], "backward": ["bs0"], "clients": [clients[0]], "layers": [0, 1]},
                {"frontal": ["fs1"], "backward": ["bs1"], "clients": [clients[1]], "layers": [1, 2]},
            ]
        },
        c,
    )


def test_one_client_per_stage_with_free_links_is_its_compute():
    """Servers that do not compute, free links and calls: stage 0's one worker runs 4 forward and 4
    backward tasks a step, stage 1's 4 forward+loss+backward tasks, each at 1 GFLOP/s against the
    reference's 1 GFLOP/s: (4 x 4 x (0.01 + 0.02)) = 0.48 s at stage 0 and 4 x 4 x 0.03 = 0.48 s at
    stage 1; the two pipelined batches keep both busy, so a step is 0.48 s (the first is longer: the
    pipeline fills; the last shorter: nothing follows it)."""
    c = cluster()
    trace = simulate(c, two_stage_plan(c), WORK, CAL, servers_compute=False)
    assert trace.median_step() == pytest.approx(0.48, rel=1e-6)
    assert trace.version_times[0] == pytest.approx(0.64, rel=1e-6)
    assert trace.recomputed == 0  # each backward task went to the worker that kept its forward pass


def test_time_scales_with_compute_when_links_are_free():
    c = cluster()
    plan = two_stage_plan(c)
    slow = simulate(c, plan, WORK, CAL, servers_compute=False)
    fast_cal = dataclasses.replace(CAL, ref_flops=CAL.ref_flops / 2)  # every pass half as long
    fast = simulate(c, plan, WORK, fast_cal, servers_compute=False)
    assert fast.seconds_per_step() == pytest.approx(slow.seconds_per_step() / 2, rel=1e-6)


def test_links_and_calls_add_time_to_a_worker_bound_pipeline():
    """(Not a law of the protocol in general: with fast servers computing, a slow link can keep a
    slow volunteer from grabbing an open task first, and the step gets shorter.)"""
    free = cluster()
    base = simulate(free, two_stage_plan(free), WORK, CAL, servers_compute=False).seconds_per_step()
    slow_links = cluster(delay_ms=20.0, mbps=50.0)
    with_links = simulate(slow_links, two_stage_plan(slow_links), WORK, CAL, servers_compute=False).seconds_per_step()
    with_calls = simulate(
        slow_links,
        two_stage_plan(slow_links),
        WORK,
        dataclasses.replace(CAL, call_seconds=2e-3, byte_seconds=5e-9),
        servers_compute=False,
    ).seconds_per_step()
    assert base < with_links < with_calls
    # per step each stage-1 task waits at least for its take's answer, its input gradient's round
    # trip and a relay: 4 tasks x 3 x 20 ms on the critical path at the very least
    assert with_links - base > 4 * 3 * 0.020


def test_a_slow_volunteer_gets_rows_by_its_compute_not_an_equal_share():
    """Weights are the workers' compute: with the servers computing at 1000x a volunteer, the
    volunteer is owed a sliver of each micro-batch and, one task a micro-batch, almost never gets one
    (while its preference holds: here for good)."""
    c = cluster(tflops=1e-3)
    held = dataclasses.replace(WORK, preference_grace=1e9)
    trace = simulate(c, two_stage_plan(c), held, dataclasses.replace(CAL, ref_flops=1e12))
    alone = simulate(c, two_stage_plan(c), held, dataclasses.replace(CAL, ref_flops=1e12), servers_compute=False)
    assert trace.seconds_per_step() < alone.seconds_per_step() / 100


def test_a_stage_with_more_than_one_frontal_or_backward_server_is_refused():
    c = cluster()
    plan = load_plan(
        {
            "stages": [{"frontal": ["fs0", "fs1"], "backward": ["bs0"], "clients": ["v0"], "layers": [0, 2]}],
            "idle": ["v1"],
        },
        None,
    )
    with pytest.raises(ValueError, match="stage 0: the step simulation models one frontal and one backward server"):
        simulate(c, plan, WORK, CAL)


def test_three_stages_relay_both_ways_and_no_step_beats_the_busiest_worker():
    """A middle stage gets its inputs relayed from stage 0's backward server and its output
    gradients from stage 2's frontal server; each of the three workers computes 0.48 s a step
    (stage 0: forward + backward, stage 1 the same, stage 2: forward+loss+backward), so no step is
    shorter, and the run finishes."""
    ids = ["fs0", "bs0", "fs1", "bs1", "fs2", "bs2"]
    c = load_cluster(
        {
            "reliable": [{"id": i, "tflops": 1.0} for i in ids],
            "unreliable": [{"id": f"v{u}", "tflops": 1e-3} for u in range(3)],
            "delay_ms": {
                "reliable": [[0.0 if a == b else 5.0 for b in ids] for a in ids],
                "unreliable": [[5.0] * 6 for _ in range(3)],
            },
            "bandwidth_mbps": {
                "reliable": [[0.0 if a == b else 1000.0 for b in ids] for a in ids],
                "unreliable": [[1000.0] * 6 for _ in range(3)],
            },
        }
    )
    plan = load_plan(
        {
            "stages": [
                {"frontal": [f"fs{k}"], "backward": [f"bs{k}"], "clients": [f"v{k}"], "layers": [k, k + 1]}
                for k in range(3)
            ]
        },
        c,
    )
    cal = dataclasses.replace(CAL, forward_row=[0.01] * 3, fb_row=[0.03] * 3, backward_row=[0.02] * 3)
    work = dataclasses.replace(WORK, input_bytes=[1000, 5000, 5000], param_bytes=[1e6] * 3)
    trace = simulate(c, plan, work, cal, servers_compute=False)
    assert len(trace.version_times) == work.steps
    assert trace.seconds_per_step() >= 0.48
    # a step: 4 forward + 4 backward tasks at stages 0 and 1, 4 forward+loss+backward at stage 2
    assert trace.recomputed == 0 and trace.tasks >= 20 * (work.steps - 1)


def test_a_version_fetched_ahead_takes_its_pull_off_the_steps_critical_path(monkeypatch):
    """The worker's rule (scheduler/prefetch.py) played by the model: at 40 Mbit/s a shard (0.5 MB)
    takes 0.1 s to pull; fetched while the worker computes on the version before, a step is 0.1 s
    shorter than when each version is pulled as a task needs it (the rule turned off)."""
    import scheduler.stepsim as stepsim

    c = cluster(mbps=40)
    ahead = simulate(c, two_stage_plan(c), WORK, CAL, servers_compute=False)
    monkeypatch.setattr(stepsim, "version_to_fetch", lambda worked, v, held, fetching: (None, worked))
    on_demand = simulate(c, two_stage_plan(c), WORK, CAL, servers_compute=False)
    assert on_demand.median_step() - ahead.median_step() == pytest.approx(0.1, rel=0.02)
