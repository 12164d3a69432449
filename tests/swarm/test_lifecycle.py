"""An operator's run, as real processes on 127.0.0.1 (peer.host): a first server waits for its
partner saying so; a server under another run key, a server with other training flags and a volunteer
naming another run key each exit 2 with a line that names both sides; a volunteer that joined works
until the run's last step and then says the run is over and exits 0; a server finishes by itself
(`run R finished at step N (loss L)`, checkpoint written, exit 0) unless --hold; a volunteer joining
a finished run says so and exits 0; SIGTERM ends a holding server at once, and no process of its
session is left."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.cli import main
from tests.deploy_table import check_refusal
from tests.lines import LineProcess

STEPS = 3
REPO = Path(__file__).resolve().parents[2]


class Peer(LineProcess):
    """A `peer` command in its own session, its stdout read line by line."""

    def __init__(self, *argv: str, log=None):
        super().__init__(
            [sys.executable, "-m", "peer.cli", *argv],
            name=argv[0],
            stderr=open(log, "w") if log else subprocess.DEVNULL,
        )


def serve(key, role: str, tmp_path, *extra: str) -> list[str]:
    return [
        "serve",
        "--reliable",
        "--stages",
        "1",
        "--stage",
        "0",
        "--role",
        role,
        "--model",
        "tiny",
        "--steps",
        str(STEPS),
        "--batch-size",
        "8",
        "--micro-batches",
        "2",
        "--run-id",
        "life",
        "--run-key",
        str(key),
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--announce-period",
        "1",
        "--checkpoint-dir",
        str(tmp_path / f"ckpt-{role}"),
        # (the volunteer computes every task: with the servers computing too it could get none of the
        # 3 steps' work, and it says where its join went at its first task)
        "--no-compute",
        *extra,
    ]


def peer(*argv: str, verbose: bool = True) -> subprocess.CompletedProcess:
    """A `peer` command to its end (with -v unless `verbose` is false: the first line of stderr is then
    the refusal's); one that does not end within 180 s fails with what it printed."""
    command = [sys.executable, "-m", "peer.cli", *argv, *(["-v"] if verbose else [])]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        said = [
            (s or b"").decode(errors="replace") if isinstance(s, bytes) else (s or "") for s in (e.stdout, e.stderr)
        ]
        raise AssertionError(
            f"peer {' '.join(argv[:2])} did not end within 180 s; it said:\n{said[0][-2000:]}\n{said[1][-4000:]}"
        ) from None


@pytest.mark.stress
@pytest.mark.swarm
def test_an_operators_run_from_first_server_to_the_end(tmp_path, capsys):
    key_a, key_b = tmp_path / "keys" / "a.key", tmp_path / "keys" / "b.key"
    assert main(["keygen", "-o", str(key_a)]) == 0  # the folder is made
    assert main(["keygen", "-o", str(key_b)]) == 0
    fp_a, fp_b = re.findall(r"fingerprint=(\w+)", capsys.readouterr().out)
    peers: list[Peer] = []
    try:
        first = Peer(*serve(key_a, "frontal", tmp_path, "--hold"), log=tmp_path / "first.log")
        peers.append(first)
        initial = first.wait_line(r"^initial_peers=").split("=", 1)[1].split()
        assert first.wait_line(r"^run=") == f"run=life@{fp_a}"
        waits = first.wait_line(r"^s0f0: waiting: for the run's servers")  # its first wait line
        assert waits.startswith("s0f0: waiting: for the run's servers s0b0") and " s0f0 " not in waits, waits
        # the dashboard shows what each server says it does (once a record that carries the line has
        # been announced: asked again until it shows it)
        deadline, said = time.monotonic() + 120, {}
        while not (said.get("s0f0") or "").startswith("waiting: for the run's servers s0b0"):
            assert time.monotonic() < deadline, f"the dashboard did not show s0f0's line: {said}"
            dash = subprocess.run(
                [
                    sys.executable,
                    str(REPO / "scripts" / "dashboard.py"),
                    "--json",
                    "--run-id",
                    f"life@{fp_a}",
                    "--initial-peers",
                    *initial,
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            snap = json.loads(dash.stdout)
            said = {e["device"]: e.get("says") for st in snap["stages"] for e in st["frontal"] + st["backward"]}

        # misconfigurations: one line each, naming both sides, exit 2, as docs/deploy.md's table says
        # (the page's example run 'demo' is 'life' here, its fingerprints A and B these keys')
        example = {"demo": "life", "A": fp_a, "B": fp_b}
        other_key = peer(*serve(key_b, "backward", tmp_path, "--initial-peers", *initial), verbose=False)
        check_refusal("a server given another run key", other_key.returncode, other_key.stderr, example)
        # refused before it says where it listens: no initial_peers= or run= line for a run it is not in
        assert "initial_peers=" not in other_key.stdout and "run=" not in other_key.stdout, other_key.stdout
        other_flags = peer(
            *serve(key_a, "backward", tmp_path, "--initial-peers", *initial, "--steps", "5", "--lr-schedule", "cosine"),
            verbose=False,
        )
        check_refusal(
            "a server given other training flags",
            other_flags.returncode,
            other_flags.stderr,
            {"demo": "life", "2000": str(STEPS), "50": "5"},
        )
        assert "--lr-schedule constant (here: cosine)" in other_flags.stderr
        assert "initial_peers=" not in other_flags.stdout, other_flags.stdout
        wrong_fp = peer("join", "--run-id", f"life@{fp_b}", "--initial-peers", *initial, "--stage", "0", verbose=False)
        check_refusal("a volunteer given a wrong fingerprint", wrong_fp.returncode, wrong_fp.stderr, example)

        volunteer = Peer(
            "join",
            "--run-id",
            f"life@{fp_a}",
            "--initial-peers",
            *initial,
            "--stage",
            "0",
            "-v",
            log=tmp_path / "volunteer.log",
        )
        peers.append(volunteer)
        assert re.match(r"^v-\w+: starting: joining run life@", volunteer.wait_line(r"starting", timeout=10))
        volunteer.wait_line(r"waiting: for the servers of run life")
        second = Peer(*serve(key_a, "backward", tmp_path, "--initial-peers", *initial), log=tmp_path / "second.log")
        peers.append(second)
        volunteer.wait_line(r"serving: joined run life")

        # the end: said by each, exit 0 by itself (the holding server stays)
        assert re.search(
            rf"finished: run life finished at step {STEPS} \(loss \d+\.\d+\)", second.wait_line("finished")
        )
        assert second.proc.wait(timeout=60) == 0
        assert "finished: run life is over at step 3" in volunteer.wait_line("finished|leaving")
        assert volunteer.proc.wait(timeout=60) == 0
        # where its join went, step by step, said at its first task (-v); the servers' step took as
        # long as the second server's start
        joined = re.search(r"v-\w+: joined in ([\d.]+) s: (.*)", (tmp_path / "volunteer.log").read_text())
        assert joined, (tmp_path / "volunteer.log").read_text()[-3000:]
        steps = dict(re.findall(r"([a-zA-Z' -]+?) ([\d.]+) s(?:, |$)", joined.group(2)))
        assert list(steps) == [
            "DHT node",
            "run record",
            "servers' records",
            "stage choice",
            "compute measured",
            "registered",
            "warm-up",
            "first task",
        ], joined.group(0)
        # said so that the steps add up to the total to the hundredth (each is a difference of rounded times)
        assert sum(round(float(v) * 100) for v in steps.values()) == round(float(joined.group(1)) * 100)
        first.wait_line(r"finished: run life finished at step 3")
        first.wait_line(r"holding its final state")
        assert json.loads((tmp_path / "ckpt-backward" / "s0b0.json").read_text())["version"] == STEPS
        # the versions its memory lets go are kept beside the checkpoint for a ban's reach (none yet in 3 steps)
        assert (tmp_path / "ckpt-backward" / "s0b0.old-versions").is_dir()

        late = peer("join", "--run-id", f"life@{fp_a}", "--initial-peers", *initial, "--stage", "0")
        assert late.returncode == 0, late.stderr[-3000:]
        assert f"run life already finished at step {STEPS}" in late.stdout

        t0 = time.monotonic()
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=10) == 0
        deadline = time.monotonic() + 10
        while not first.gone() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.gone() and second.gone() and volunteer.gone(), time.monotonic() - t0
        for log in ("first.log", "second.log"):
            assert "Traceback" not in (tmp_path / log).read_text()
    finally:
        for p in peers:
            p.kill()


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ended(p: Peer, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None and p.gone():
            return True
        time.sleep(0.1)
    return False


A_PEER = "12D3KooWKweDwQYLfYdehecUQviKrEF294JbjV4AHx4Q7n8aLXeB"


@pytest.mark.swarm
def test_a_signal_ends_a_peer_in_any_state_and_leaves_no_process_or_port(tmp_path):
    """SIGTERM while a server waits for an initial peer that never answers (a blocking wait: it
    used to run to --timeout); SIGINT and SIGKILL while a first server waits for the others; SIGKILL
    while a volunteer waits for its run. Each within 10 s, with its DHT process and p2p daemon."""
    key = tmp_path / "run.key"
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{A_PEER}"
    peers = []
    try:
        log = tmp_path / "starting.log"
        starting = Peer(*serve(key, "backward", tmp_path, "--initial-peers", dead, "--timeout", "60"), log=log)
        peers.append(starting)
        starting.wait_line(r": waiting: for the initial peers to answer: .*trying again until --timeout 60 s", 60)
        starting.proc.send_signal(signal.SIGTERM)
        assert _ended(starting, 10) and starting.proc.returncode == 0, log.read_text()[-2000:]

        for sig in (signal.SIGINT, signal.SIGKILL):
            first = Peer(*serve(key, "frontal", tmp_path), log=tmp_path / f"first-{sig.name}.log")
            peers.append(first)
            initial = first.wait_line(r"^initial_peers=").split("=", 1)[1].split()
            port = int(re.search(r"/tcp/(\d+)/", initial[0]).group(1))
            first.wait_line(r"waiting: for the run's servers")
            os.kill(first.proc.pid, sig)  # the peer itself, not its group: its children must follow it
            assert _ended(first, 10), f"{sig.name}: a process of the server is left"
            assert first.proc.returncode == (0 if sig == signal.SIGINT else -signal.SIGKILL)
            assert _port_free(port), f"{sig.name}: port {port} still held"

        first = Peer(*serve(key, "frontal", tmp_path), log=tmp_path / "host.log")
        peers.append(first)
        initial = first.wait_line(r"^initial_peers=").split("=", 1)[1].split()
        volunteer = Peer("join", "--run-id", "no-such-run", "--initial-peers", *initial)
        peers.append(volunteer)
        volunteer.wait_line(r"waiting: for run 'no-such-run'")
        os.kill(volunteer.proc.pid, signal.SIGKILL)
        assert _ended(volunteer, 10), "a process of the volunteer is left"
    finally:
        for p in peers:
            p.kill()
