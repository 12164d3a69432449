"""`peer swarm` and `peer serve` refuse bad failover arguments with a message that names them,
before any process starts."""

from __future__ import annotations

import re

import pytest

from peer.cli import build_parser
from peer.errors import UsageError
from peer.swarm_flags import validate


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--lose-server", "s0f0"], "expected DEVICE@STEP"),
        (["--lose-server", "s9f0@2"], "not a server of the layout"),
        (["--lose-server", "s0f0@0"], "STEP must be in 1..5"),
        (["--lose-server", "s0f0@2"], "no other frontal server"),  # 2 servers per stage: one of each role
        (["--servers-per-stage", "4", "--lose-server", "s0f0@2", "--lose-server", "s0f0@3"], "names a server twice"),
        (["--servers-per-stage", "4", "--lose-server", "s0f0@2", "--failover-after", "0"], "needs --failover-after"),
        (["--servers-per-stage", "4", "--lose-server", "s0f0@2", "--supervise-servers"], "would fork the lost"),
        (["--failover-after", "-1"], "--failover-after must be >= 0"),
        (["--task-tokens", "0"], "--task-tokens must be >= 1, got 0"),
        (["--client-batch-tokens", "-3"], "--client-batch-tokens must be >= 1, got -3"),
    ],
)
def test_bad_failover_arguments_are_named(argv, words):
    args = build_parser().parse_args(["swarm", "--model", "tiny", "--steps", "6", *argv])
    with pytest.raises(UsageError, match=words):
        validate(args)


def test_good_failover_arguments_are_sorted_by_step():
    args = build_parser().parse_args(
        [
            "swarm",
            "--model",
            "tiny",
            "--steps",
            "6",
            "--servers-per-stage",
            "4",
            "--lose-server",
            "s1b1@4",
            "--lose-server",
            "s0f0@2",
        ]
    )
    validate(args)
    assert args.losses == [(2, "s0f0"), (4, "s1b1")]


@pytest.mark.parametrize("script", ["bench_fidelity.py", "bench_churn.py"])
def test_a_benchmark_whose_out_folder_is_a_file_is_refused_before_it_runs(script, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    target = tmp_path / "bench.md"
    target.write_text("kept\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / script), "--out", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--out {target} is a file" in out.stderr
    assert target.read_text() == "kept\n"


@pytest.mark.parametrize("flag,expected", [((), False), (("--no-local-first",), True)])
def test_no_local_first_reaches_every_server_the_swarm_starts(flag, expected, tmp_path):
    """`peer swarm --no-local-first` starts every `peer serve` with it (each server's frontal cut then
    chooses a batch's clients by the rows they are owed only: tests/swarm/test_inprocess_assignment.py)."""
    from core.layout import RunLayout
    from core.model.config import get_preset
    from peer.launcher.processes import Swarm

    args = build_parser().parse_args(["swarm", "--model", "tiny", "--steps", "6", "--no-fork-processes", *flag])
    validate(args)
    layout = RunLayout.even(args.stages, get_preset("tiny").layers, 1, 1)
    swarm = Swarm(args, layout, 1, 1, ["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"], str(tmp_path))
    swarm.spawn = lambda name, argv: argv
    swarm.start_servers()
    assert len(swarm.servers) == 2 * args.stages
    for argv in swarm.servers.values():
        served = build_parser().parse_args(argv)
        assert served.no_local_first is expected, argv


def test_the_swarm_passes_its_checked_work_and_compression_flags_to_its_peers(tmp_path):
    """`peer swarm --cheater K --compress C --probation P --verify-rate R --ban-reach B --volunteer-slowdown
    S` reaches the commands it starts: every server serves with C, P, R and B, each honest volunteer is
    slowed by S, and liar i joins stage i mod 2 with `--cheat K` (what those flags do on a live run:
    tests/swarm/test_hosts_trust.py)."""
    from core.layout import RunLayout
    from core.model.config import get_preset
    from peer.launcher.processes import Swarm

    argv = ["swarm", "--model", "tiny", "--steps", "6", "--no-fork-processes", "--volunteers", "2"]
    argv += ["--compress", "8bit", "--probation", "1", "--verify-rate", "0.5", "--volunteer-slowdown", "8"]
    argv += ["--ban-reach", "3"]
    args = build_parser().parse_args([*argv, "--cheater", "scale", "--cheater", "zeros@6"])
    validate(args)
    layout = RunLayout.even(args.stages, get_preset("tiny").layers, 1, 1)
    swarm = Swarm(args, layout, 1, 1, ["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"], str(tmp_path))
    swarm.spawn = lambda name, argv: argv
    swarm.start_servers()
    swarm.start_volunteers()
    for argv in swarm.servers.values():
        served = build_parser().parse_args(argv)
        assert (served.compress, served.probation, served.verify_rate, served.ban_reach) == ("8bit", 1, 0.5, 3), argv
    joined = {name: build_parser().parse_args(argv) for name, (argv, _) in swarm.volunteers.items()}
    assert sorted(joined) == ["cheat0", "cheat1", "v0", "v1"]
    assert [(joined[n].stage, joined[n].slowdown) for n in ("v0", "v1")] == [("0", 8.0), ("1", 8.0)]
    assert [(joined[n].stage, str(joined[n].cheat)) for n in ("cheat0", "cheat1")] == [("0", "scale"), ("1", "zeros@6")]


def test_the_summary_line_says_steps_loss_speed_batches_and_who_computed():
    from peer.swarm import summary_line

    line = summary_line(
        {
            "steps": 8,
            "first_loss": 5.5392,
            "last_loss": 4.3055,
            "tokens_per_second": 1656.7,
            "microbatches_applied": 64,
            "microbatches_expected": 64,
            "tasks_by_worker": {"v1": 62, "v0": 55, "s0f0": 3},
            "servers": ["s0b0", "s0f0"],
        }
    )
    assert line == (
        "8 steps, loss 5.539 -> 4.306, 1,657 tokens/s, micro-batches 64/64, "
        "tasks computed: volunteers 98% (v0 55, v1 62), servers 2% (s0f0 3)"
    )


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--volunteers", "1"], "--volunteers 1 for 2 stages with servers that do not compute"),
        (["--volunteer-stage", "1"], "--volunteer-stage 1 puts every volunteer on one stage"),
    ],
)
def test_a_swarm_where_a_stage_has_no_one_to_compute_is_refused(argv, words):
    args = build_parser().parse_args(["swarm", "--model", "tiny", "--steps", "6", *argv])
    with pytest.raises(UsageError, match=words):
        validate(args)
    validate(build_parser().parse_args(["swarm", "--model", "tiny", *argv, "--servers-compute", "yes"]))


def test_volunteers_on_cuda_need_a_cuda_device():
    import torch

    args = build_parser().parse_args(["swarm", "--model", "tiny", "--device", "cuda"])
    if torch.cuda.is_available():
        validate(args)
        return
    with pytest.raises(UsageError, match="--device cuda: torch sees no CUDA device"):
        validate(args)


@pytest.mark.stress
def test_peer_swarm_without_a_work_dir_leaves_no_folder_behind_and_a_server_it_loses_is_failed_over(tmp_path):
    """`peer swarm` without --work-dir removes its temporary folder; `--lose-server` (here a backward
    server of the only stage, right after step 1: it kills itself there, however fast the 3 steps go
    by the launcher's reads) is failed over by the others and the run applies every micro-batch (the
    failover's guarantees are tested in tests/swarm/test_hosts.py)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "swarm",
            "--model",
            "tiny",
            "--steps",
            "3",
            "--stages",
            "1",
            "--servers-per-stage",
            "4",
            "--volunteers",
            "1",
            "--lose-server",
            "s0b1@1",
            "--failover-after",
            "3",
            "--announce-period",
            "1",
            "--no-progress",
            "--summary-json",
            str(tmp_path / "summary.json"),
            "--run-id",
            f"tmpdir-{os.getpid()}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    *first, last = out.stdout.strip().splitlines()
    assert not [line for line in first if line.startswith("{")], first  # the figures go to --summary-json
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layout_epoch"] == 1, summary
    # by default the volunteers compute: the servers' own workers take no task
    assert re.match(r"3 steps, loss .*, micro-batches 12/12, tasks computed: volunteers 100% \(v0 \d+\)$", last), last
    assert not list(tmp_path.glob("hivepipe-swarm-*")), list(tmp_path.iterdir())
