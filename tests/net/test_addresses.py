"""Addresses on one machine (no root needed): `peer serve` prints its initial_peers= line first,
warns once when a first server announces only private addresses, and refuses with exit code 2 (and
nothing written) an address that does not parse or cannot be bound, an initial peer without /p2p/,
initial peers that do not answer within --timeout, and an announced address nobody can dial back;
a volunteer waiting for a run that is not there exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from peer.cli import main
from tests.deploy_table import check_refusal

SERVE = ["serve", "--reliable", "--stage", "0", "--role", "frontal", "--model", "tiny", "--steps", "2"]


def serve(tmp_path) -> list[str]:
    """SERVE with the run key in the test's folder (made by the first server that reaches it)."""
    return SERVE + ["--run-key", str(tmp_path / "run.key")]


A_PEER = "12D3KooWKweDwQYLfYdehecUQviKrEF294JbjV4AHx4Q7n8aLXeB"


@pytest.mark.parametrize(
    "argv,words",
    [
        (SERVE + ["--host-maddrs", "not-an-address"], "--host-maddrs: 'not-an-address' is not a multiaddr"),
        (SERVE + ["--host-maddrs", "/ip4/127.0.0.1/udp/5"], "needs an IP (or DNS) address and a TCP port"),
        (SERVE + ["--announce-maddrs", "/ip4/203.0.113.7/tcp/0"], "needs an explicit port"),
        (SERVE + ["--initial-peers", "/ip4/127.0.0.1/tcp/5"], "lacks the peer id: add /p2p/<peer id>"),
        (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/5"], "lacks the peer id"),
        (
            ["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/5/p2p/{A_PEER}", "--timeout", "0"],
            "--timeout must be positive",
        ),
        (["join"], "--initial-peers is required"),
        (
            ["join", "--run-id", "demo@12345", "--initial-peers", f"/ip4/127.0.0.1/tcp/5/p2p/{A_PEER}"],
            "run fingerprint '12345': expected 16 hex digits",
        ),
        (["join", "--run-id", "de mo", "--initial-peers", f"/ip4/127.0.0.1/tcp/5/p2p/{A_PEER}"], "run id 'de mo'"),
        (SERVE + ["--run-id", "demo@00000000000000ff"], "not the 00000000000000ff that --run-id names"),
        (SERVE + ["--die-at-version", "0"], "--die-at-version must be a step in 1.."),
    ],
)
def test_bad_addresses_are_named(argv, words, capsys, tmp_path):
    if argv[0] == "serve":
        argv = argv + ["--run-key", str(tmp_path / "run.key")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and words in err.splitlines()[0], err  # the reason first, no usage dump before it
    if "lacks the peer id" in words:
        check_refusal("`--initial-peers` without `/p2p/`", code, err)


@pytest.mark.parametrize("command", [["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/5/p2p/{A_PEER}"], SERVE])
def test_an_identity_path_that_cannot_be_written_is_named_and_nothing_written(command, tmp_path, capsys):
    missing = tmp_path / "no-such-folder" / "id.key"
    extra = (
        ["--run-key", str(tmp_path / "run.key"), "--checkpoint-dir", str(tmp_path / "c")]
        if command[0] == "serve"
        else []
    )
    assert main([*command, *extra, "--identity-path", str(missing)]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert f"--identity-path {missing}: folder {missing.parent} does not exist" in first, first
    assert main([*command, *extra, "--identity-path", str(tmp_path)]) == 2
    assert "a folder, not an identity file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run key, checkpoint folder or identity


def test_a_new_run_key_in_a_missing_folder_is_named_and_nothing_written(tmp_path, capsys):
    missing = tmp_path / "no-such-folder" / "run.key"
    assert main(SERVE + ["--run-key", str(missing)]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert f"--run-key {missing}: folder {missing.parent} does not exist (a new run key" in first, first
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_supervise_without_a_checkpoint_is_named_and_nothing_written(tmp_path, capsys):
    assert main(serve(tmp_path) + ["--supervise"]) == 2
    assert "--supervise restarts a crashed server from its checkpoint: give --checkpoint-dir" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # not even the run key


def peer(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer.cli", *argv], capture_output=True, text=True, timeout=timeout)


def test_a_run_key_that_is_not_one_is_named(tmp_path, capsys):
    bad = tmp_path / "run.key"
    bad.write_text("not a key")
    assert main([*SERVE, "--run-key", str(bad)]) == 2
    assert f"--run-key: run key {bad}: not a PEM private key" in capsys.readouterr().err
    assert bad.read_text() == "not a key"


def test_an_address_that_cannot_be_bound_is_named_and_nothing_written(tmp_path):
    out = peer(*serve(tmp_path), "--host-maddrs", "/ip4/198.51.100.1/tcp/0", "--checkpoint-dir", str(tmp_path / "ckpt"))
    check_refusal("`--host-maddrs` not an address", out.returncode, out.stderr)
    assert "/ip4/198.51.100.1/tcp/0" in out.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "run.key").exists()  # nothing written


def test_initial_peers_that_do_not_answer_within_the_timeout(tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{A_PEER}"
    for argv in (
        ["join", "--initial-peers", dead, "--timeout", "3"],
        [*serve(tmp_path), "--initial-peers", dead, "--timeout", "3", "--checkpoint-dir", str(tmp_path / "c")],
    ):
        out = peer(*argv)
        check_refusal("initial peer mistyped or down", out.returncode, out.stderr, values={"120": "3"})
        assert dead in out.stderr
    assert not (tmp_path / "c").exists() and not (tmp_path / "run.key").exists()


def seen_within(stream, text: str, timeout: float) -> bool:
    """Whether a line containing `text` comes out of `stream` within `timeout` seconds."""
    found = threading.Event()

    def read():
        for line in stream:
            if text in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout)


def test_first_line_warning_and_a_refused_announce_address(tmp_path):
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "peer.cli",
            *serve(tmp_path),
            "--run-id",
            f"addr{os.getpid()}",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--no-compute",
        ],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "first.log", "w"),
        text=True,
        start_new_session=True,
    )
    try:
        line = first.stdout.readline().strip()
        assert line.startswith("initial_peers=/ip4/127.0.0.1/tcp/") and "/p2p/" in line, line
        initial = line.split("=", 1)[1].split()
        bogus = "/ip4/127.0.0.1/tcp/9"  # nobody listens on the discard port
        out = peer(
            "serve",
            "--reliable",
            "--stage",
            "1",
            "--role",
            "frontal",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--run-key",
            str(tmp_path / "run.key"),
            "--run-id",
            f"addr{os.getpid()}",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--announce-maddrs",
            bogus,
            "--initial-peers",
            *initial,
            "--checkpoint-dir",
            str(tmp_path / "c"),
        )
        check_refusal("server's port closed", out.returncode, out.stderr)
        assert f"could dial this server back at {bogus}" in out.stderr and "--announce-maddrs" in out.stderr
        # refused before it says where it can be reached: no initial_peers= line naming that address
        assert "initial_peers=" not in out.stdout, out.stdout
        assert not (tmp_path / "c").exists()
        # a volunteer whose run is not there waits, says so, and exits 0 on SIGTERM
        join = subprocess.Popen(
            [sys.executable, "-m", "peer.cli", "-v", "join", "--run-id", "no-such-run", "--initial-peers", *initial],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            assert seen_within(join.stdout, "waiting: for run 'no-such-run' to appear", 60)
            join.send_signal(signal.SIGTERM)
            assert join.wait(timeout=30) == 0
        finally:
            try:
                os.killpg(join.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=30)
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert code == 0
    log = (tmp_path / "first.log").read_text()
    warnings = [ln for ln in log.splitlines() if "announces only private or loopback addresses" in ln]
    assert len(warnings) == 1 and "/ip4/127.0.0.1/tcp/" in warnings[0]
