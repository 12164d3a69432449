"""The what-if model at scale (scheduler/scale.py) and `peer simulate`: churn costs what the formula
says and no more, a server's resources grow with its stage's volunteers until one of them is the
step, the servers a stage needs follow, and the command refuses bad input by name."""

import dataclasses
import json
import subprocess
import sys

import pytest

from scheduler.files import load_model
from scheduler.scale import Swarm, churn_factor, predict
from scheduler.step_io import Calibration

MODEL = load_model(
    {"layers": 4, "hidden": 128, "bytes_per_value": 4, "batch_tokens": 8192, "micro_batches": 4}
)  # the `small` preset's shape
CAL = Calibration(
    call_seconds=0.5e-3,
    byte_seconds=4e-9,
    ref_flops=5e10,
    forward_row=[0.003, 0.003],
    fb_row=[0.008, 0.008],
    backward_row=[0.005, 0.0],
    slice_build=[0.0, 0.0],
    apply_seconds=1e-3,
)


def test_churn_costs_the_rejoin_and_half_a_task_and_no_requeue_waits_what_the_pipeline_cannot_hide():
    assert churn_factor(0.0, 2.0, 10.0) == 1.0
    # s = (s0 + c R) / (1 - c / 2T): 2 s steps, half the volunteers lost, 4 s to rejoin, 4 tasks a step
    assert churn_factor(0.5, 2.0, 4.0, tasks=4) == pytest.approx(2.0 / ((2.0 + 2.0) / (1 - 0.5 / 8)))
    pool = churn_factor(0.5, 2.0, 4.0, requeue=True, task_timeout=20.0)
    waited = churn_factor(0.5, 2.0, 4.0, requeue=False, task_timeout=20.0)
    assert 0 < waited < pool < 1
    assert churn_factor(0.1, 2.0, 4.0) > churn_factor(0.5, 2.0, 4.0)  # more churn, less left
    # a lease shorter than two (stretched) steps is waited out while the pipeline works on: no cost
    assert churn_factor(0.5, 10.0, 4.0, requeue=False, task_timeout=5.0) == churn_factor(0.5, 10.0, 4.0)
    with pytest.raises(ValueError, match="churn is a fraction"):
        churn_factor(1.0, 2.0, 4.0)


def test_a_small_swarm_is_the_step_model_and_a_large_one_is_held_by_a_server_resource():
    small = predict(Swarm(volunteers=16), MODEL, 128, CAL)
    assert small.bottleneck == "volunteers" and small.step_s == pytest.approx(small.group_step_s)
    assert small.servers_per_stage_needed == 2
    big = predict(Swarm(volunteers=10_000), MODEL, 128, CAL)
    # the group plays the same protocol: the same step when the servers keep up
    assert big.group_step_s == pytest.approx(small.group_step_s)
    assert big.bottleneck.startswith("a server's") and big.step_s > big.group_step_s
    assert big.servers_per_stage_needed > 2
    # every server resource grows with the stage's volunteers
    for name, seconds in big.resource_s.items():
        assert seconds > small.resource_s[name], name
    # the servers it says are needed bring the step back to the group's
    more = predict(Swarm(volunteers=10_000, servers_per_stage=big.servers_per_stage_needed + 1), MODEL, 128, CAL)
    assert max(more.resource_s.values()) <= big.group_step_s * 1.05
    # throughput still grows with volunteers, and below linear once a server is the step
    assert big.tokens_per_second > small.tokens_per_second
    assert big.tokens_per_second < small.tokens_per_second * 10_000 / 16


def test_a_volunteers_busy_share_is_its_compute_over_the_run_and_grows_with_its_tokens_a_version():
    """Utilisation: the seconds a volunteer's passes last over the run. Each volunteer fetches and
    pushes its stage's parameters once a version whatever its share of the batch, so on a home link
    a larger batch keeps it busier and a slower link idles it more; never more than all of its time."""
    home = dict(volunteers=4, volunteer_tflops=(0.01, 0.01), volunteer_mbps=(20.0, 20.0))
    shares = [
        predict(Swarm(**home, batch_rows=b), MODEL, 128, CAL, group=2).volunteer_utilisation for b in (8, 64, 512)
    ]
    assert 0 < shares[0] < shares[1] < shares[2] <= 1, shares
    fast = predict(Swarm(**{**home, "volunteer_mbps": (1000.0, 1000.0)}, batch_rows=8), MODEL, 128, CAL, group=2)
    assert fast.volunteer_utilisation > shares[0]
    # the trace it comes from: each volunteer's compute is the cost of the rows it ran, so the
    # volunteers' compute together is at least every row's forward and backward once per stage
    from scheduler.files import load_cluster, load_plan
    from scheduler.scale import group_cluster, group_plan, workload
    from scheduler.stepsim import simulate

    s = Swarm(**home, batch_rows=64)
    cluster = load_cluster(group_cluster(s, 2))
    trace = simulate(
        cluster,
        load_plan(group_plan(s, MODEL, 2), cluster),
        workload(MODEL, 128, 2, 64, 4, 4, s),
        CAL,
        servers_compute=False,
    )
    rows_run = 4 * 64  # steps x rows a step, through each stage
    # stage 0: a forward pass, then a backward pass from kept activations (or a recompute, more);
    # the last stage: forward, loss and backward in one task; the devices run at 1e10 FLOP/s
    per_row = CAL.forward_row[0] + CAL.backward_row[0] + CAL.fb_row[1]
    least = rows_run * per_row * CAL.ref_flops / 1e10
    assert sum(trace.compute_seconds[d] for d in trace.volunteers) >= least * (1 - 1e-9)
    assert set(trace.volunteers) == set(trace.compute_seconds) and len(trace.volunteers) == 4
    assert trace.utilisation() == pytest.approx(sum(trace.compute_seconds.values()) / 4 / trace.version_times[-1])


def test_a_slow_uplink_is_named_first_and_the_dht_holder_load_grows_with_the_volunteers_not_their_square():
    slow = predict(Swarm(volunteers=2_000, server_mbps=50.0, server_tflops=1e3), MODEL, 128, CAL)
    assert slow.bottleneck in ("a server's uplink", "a server's downlink")
    a = predict(Swarm(volunteers=1_000), MODEL, 128, CAL).dht_mbps_per_holder
    b = predict(Swarm(volunteers=2_000), MODEL, 128, CAL).dht_mbps_per_holder
    assert b / a == pytest.approx(2.0, rel=0.02)


def test_the_dht_holders_load_by_hand_and_its_constants_are_the_products():
    """10,000 volunteers on 2 stages of 2 servers, announcing every 5 s: the servers' key of a stage
    is read by every peer (servers each period, volunteers once a minute calm and once a minute to
    re-choose), the volunteers' key takes a store from each volunteer every 5 periods and one
    dashboard's reads. The constants are those of the volunteer (run_watch) and the records."""
    from core.protocol.records import VOLUNTEER_PERIODS
    from peer.host.run_watch import CALM_READ_PERIOD_S
    from scheduler.scale import CALM_READ_S, dht_holder_bps
    from scheduler.scale import VOLUNTEER_PERIODS as MODELLED

    assert (CALM_READ_S, MODELLED) == (CALM_READ_PERIOD_S, VOLUNTEER_PERIODS)
    s = Swarm(volunteers=10_000)
    reads = 4 / 5.0 + 10_000 / 60.0 + 10_000 / 60.0
    servers_key = 2 * 1900.0 / 5.0 + reads * 2 * 1900.0 / 5
    volunteers_key = 5_000 * 800.0 / 25.0 + 5_000 * 800.0 / 5.0 / 5
    assert dht_holder_bps(s, 5_000, 2) == pytest.approx(max(servers_key, volunteers_key, reads * 1000.0 / 5))
    # a volunteer's link of 50 Mbit/s: the holders' load is under 10% of it
    assert dht_holder_bps(s, 5_000, 2) * 8 / 50e6 < 0.10


def test_churn_lowers_the_prediction_by_its_factor():
    calm = predict(Swarm(volunteers=64), MODEL, 128, CAL)
    churned = predict(Swarm(volunteers=64, churn=0.5, rejoin_s=5.0), MODEL, 128, CAL)
    assert churned.calm_tokens_per_second == pytest.approx(calm.tokens_per_second)
    want = churn_factor(0.5, calm.step_s, 5.0, tasks=4)
    assert churned.tokens_per_second == pytest.approx(calm.tokens_per_second * want)


def peer(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "simulate", *argv], capture_output=True, text=True, timeout=120
    )


def test_peer_simulate_prints_tokens_the_limit_and_the_servers_needed():
    out = peer("--volunteers", "100,1000,10000", "--json")
    assert out.returncode == 0, out.stderr
    preds = json.loads(out.stdout)
    assert [p["volunteers"] for p in preds] == [100, 1000, 10000]
    assert preds[0]["tokens_per_second"] < preds[1]["tokens_per_second"] <= preds[2]["tokens_per_second"] * 1.001
    assert [p["servers_per_stage_needed"] for p in preds] == sorted(p["servers_per_stage_needed"] for p in preds)
    table = peer("--volunteers", "1000")
    assert table.returncode == 0 and "servers/stage needed" in table.stdout and "1,000" in table.stdout


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--volunteers", "ten"], "--volunteers is a comma-separated list"),
        (["--volunteers", "1"], "at least --stages"),
        (["--churn", "1.5"], "--churn is a fraction"),
        (["--volunteer-mbps", "100-20"], "--volunteer-mbps must be positive numbers LO-HI"),
        (["--server-mbps", "0"], "--server-mbps must be a positive number"),
        (["--servers-per-stage", "3"], "--servers-per-stage an even number"),
        (["--model", "huge"], "--model 'huge' is not a preset"),
        (["--calibration", "/nonexistent.json"], "--calibration /nonexistent.json"),
        (["--check", "/nonexistent.json"], "--check /nonexistent.json"),
    ],
)
def test_peer_simulate_names_what_is_wrong(argv, words):
    out = peer(*argv)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_peer_simulate_checks_against_bench_scale_points(tmp_path):
    """--check reads bench_scale's results file and prints the model beside each measured point."""
    calm = predict(Swarm(volunteers=4, volunteer_tflops=(0.002, 0.002)), MODEL, 128, CAL)
    results = {
        "setup": {
            "volunteer_tflops": 0.002,
            "volunteer_mbps": [20.0, 100.0],
            "volunteer_delay_ms": [20.0, 80.0],
            "server_mbps": 1000.0,
            "server_delay_ms": 0.5,
            "task_timeout": 20.0,
            "client_batch_tokens": 1024,
            "compute_factor": 1.0,
        },
        "results": [
            {"volunteers": 4, "kind": "calm", "mode": "pool", "churn": 0.0, "tokens_per_second": 1000.0},
            {
                "volunteers": 4,
                "kind": "churn",
                "mode": "no-requeue",
                "churn": 0.5,
                "tokens_per_second": 100.0,
                "rejoin_seconds": 5.0,
            },
        ],
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(dataclasses.asdict(CAL)))
    out = peer("--check", str(path), "--calibration", str(cal))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("largest difference: ")
    assert lines[1].split()[:4] == ["4", "calm", "pool", "1,000"]
    assert calm.tokens_per_second > 0
