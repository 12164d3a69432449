"""A run across hosts: three network namespaces on one bridge (tests/net/netns.py). The reliable
servers (`--no-compute`) listen on the first host's address; two volunteers on each of the other two
join with `--stage auto` through ONE initial peer, their links shaped by tbf; the dashboard reads
the run from the third host. The run's final parameters, read from the servers' checkpoint dirs,
equal the single-process reference. A server that announces an address nobody listens on is
refused by the reachability check with exit code 2.

Needs root and `ip netns` (skipped with the reason elsewhere); CI on this project's machine runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.net import netns

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cross-host test: {REASON}")

STEPS = 16  # long enough that a slow-linked volunteer sharing a stage with a fast one gets rows (at 8, 2 of 3 runs on an idle machine starved one, before and after signed records)
SERVERS = [("0", "frontal"), ("0", "backward"), ("1", "frontal"), ("1", "backward")]


class Hosts(netns.Processes):
    """The testbed and every process started in it; `close()` leaves nothing behind."""

    def __init__(self, tmp_path):
        super().__init__(str(tmp_path))
        self.bed = netns.Testbed(["srv", "vol1", "vol2"], tag=f"hx{os.getpid() % 10000}")

    def start(self, host: str, name: str, argv: list[str], stdout=None) -> subprocess.Popen:
        return super().start(name, argv, self.bed.prefix(host), stdout)

    def close(self) -> dict:
        try:
            return super().close()
        finally:
            self.bed.close()


def first_line(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The first stdout line of a process (its initial_peers= line)."""
    t0 = time.time()
    line = proc.stdout.readline()
    assert line, f"no output within {time.time() - t0:.0f} s (exit code {proc.poll()})"
    return line.strip()


REPO = Path(__file__).resolve().parents[2]


def serve_argv(stage: str, role: str, host_ip: str, run_id: str, ckpt, key, *extra: str) -> list[str]:
    return [
        "serve",
        "--reliable",
        "--hold",
        "--stage",
        stage,
        "--role",
        role,
        "--stages",
        "2",
        "--model",
        "tiny",
        "--steps",
        str(STEPS),
        "--run-id",
        run_id,
        "--no-compute",
        "--host-maddrs",
        f"/ip4/{host_ip}/tcp/0",
        "--checkpoint-dir",
        str(ckpt),
        "--identity-path",
        str(key),
        "--task-timeout",
        "20",
        "--run-key",
        str(Path(ckpt).parent / "run.key"),
        # every volunteer a share of every micro-batch (the default gives a whole batch to one client
        # of a stage, and a 20 Mbit/s volunteer of a short run under CI's load got none once)
        "--client-batch-tokens",
        "1",
        *extra,
    ]


def test_servers_on_one_host_volunteers_on_two_others(tmp_path):
    from parameter_server.checkpoint import read_model
    from tests.swarm.harness import reference_state, rel_diff

    run_id = f"xhost{os.getpid()}"
    hosts = Hosts(tmp_path)
    try:
        bed = hosts.bed
        bed.shape("vol1", 50)
        bed.shape("vol2", 20)
        srv_ip = bed.addrs["srv"]
        # the first server: its first stdout line is what everyone else passes to --initial-peers
        ckpt = tmp_path / "ckpt"
        first = hosts.start(
            "srv", "s0f", serve_argv(*SERVERS[0], srv_ip, run_id, ckpt, tmp_path / "s0f.key"), stdout=subprocess.PIPE
        )
        line = first_line(first)
        assert line.startswith("initial_peers=/ip4/" + srv_ip + "/tcp/"), line
        assert "127.0.0.1" not in line and "/p2p/" in line, line
        initial = line.split("=", 1)[1].split()
        run = first_line(first)  # the second: run=NAME@FINGERPRINT, what volunteers pass to --run-id
        assert run.startswith(f"run={run_id}@"), run
        run = run.split("=", 1)[1]
        # the volunteers first: they wait for every server of the run, so all of them are there when
        # the run starts (a late one could find the few tasks of a short run all taken)
        vols = []
        for host in ("vol1", "vol2"):
            for i in range(2):
                name = f"{host}-{i}"
                vols.append(name)
                hosts.start(
                    host,
                    name,
                    [
                        "join",
                        "--stage",
                        "auto",
                        "--run-id",
                        run,
                        "--initial-peers",
                        *initial,
                        "--device-id",
                        name,
                        "--probe-bytes",
                        str(1 << 18),
                        "--rebalance-period",
                        "5",
                    ],
                    stdout=open(tmp_path / f"{name}.out", "w"),
                )
        for stage, role in SERVERS[1:]:
            hosts.start(
                "srv",
                f"s{stage}{role[0]}",
                serve_argv(
                    stage, role, srv_ip, run_id, ckpt, tmp_path / f"s{stage}{role[0]}.key", "--initial-peers", *initial
                ),
            )
        # the run ends when every server's checkpoint says so
        deadline = time.time() + 480
        dashboard = None
        while True:
            done = []
            for stage, role in SERVERS:
                path = tmp_path / "ckpt" / f"s{stage}{role[0]}0.json"
                if path.exists():
                    try:
                        done.append(json.loads(path.read_text())["version"] >= STEPS)
                    except (json.JSONDecodeError, KeyError):
                        done.append(False)
            if dashboard is not None and len(done) == len(SERVERS) and all(done):
                break
            if dashboard is None and len(done) == len(SERVERS):  # the dashboard from the third host
                out = subprocess.run(
                    bed.prefix("vol2")
                    + [
                        sys.executable,
                        str(REPO / "scripts" / "dashboard.py"),
                        "--json",
                        "--run-id",
                        run,
                        "--initial-peers",
                        *initial,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert out.returncode == 0, out.stderr[-2000:]
                dashboard = json.loads(out.stdout)
            for name, p in hosts.procs:  # (a volunteer exits 0 by itself once the run is over)
                ok = (None, 0) if name.startswith("vol") else (None,)
                assert p.poll() in ok, f"{name} exited with {p.returncode}:\n{hosts.log(name)[-3000:]}"
            assert time.time() < deadline, "the run did not finish in 480 s:\n" + "\n".join(
                f"--- {n}\n{hosts.log(n)[-1500:]}" for n, _ in hosts.procs
            )
            time.sleep(1.0)
        # the dashboard saw the run's four servers and both stages from another host
        assert dashboard["health"]["status"] in ("ok", "finished", "blocked"), dashboard["health"]
        assert dashboard["config"]["steps"] == STEPS
        assert len(dashboard["stages"]) == 2
        assert sorted(e["device"] for s in dashboard["stages"] for e in s["frontal"] + s["backward"]) == sorted(
            f"s{s}{r[0]}0" for s, r in SERVERS
        )
        # a server announcing an address nobody listens on is refused, naming it
        bogus = f"/ip4/{srv_ip}/tcp/9"
        out = subprocess.run(
            bed.prefix("srv")
            + [
                sys.executable,
                "-m",
                "peer.cli",
                *serve_argv(
                    "0",
                    "frontal",
                    srv_ip,
                    run_id,
                    tmp_path / "bogus-ckpt",
                    tmp_path / "bogus.key",
                    "--initial-peers",
                    *initial,
                    "--announce-maddrs",
                    bogus,
                ),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
        assert bogus in out.stderr and "--announce-maddrs" in out.stderr, out.stderr[-2000:]
        assert not (tmp_path / "bogus-ckpt").exists()
    finally:
        codes = hosts.close()
    # every volunteer worked, exited 0 on SIGTERM, and both stages had compute
    stages_worked = set()
    for name in vols:
        text = (tmp_path / f"{name}.out").read_text()
        left = re.search(r"(\d+) forward and (\d+) backward tasks done on stage\(s\) (\d+(?: -> \d+)*)", text)
        assert left, f"{name} did not say what it did:\n{text}\n{hosts.log(name)[-2000:]}"
        assert int(left.group(1)) + int(left.group(2)) > 0, f"{name} did no task: {text}"
        assert codes[name] == 0, f"{name} exited with {codes[name]} (by itself at the end, or on SIGTERM)"
        stages_worked.update(int(k) for k in re.findall(r"\d+", left.group(3)))
    assert stages_worked == {0, 1}
    state, versions = read_model([str(tmp_path / "ckpt")])
    assert set(versions.values()) == {STEPS}
    reference = reference_state("tiny", STEPS)
    assert rel_diff(state, reference) < 1e-5
