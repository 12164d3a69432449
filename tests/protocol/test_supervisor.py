"""peer/supervisor.py: a crashed child is forked again, a finished or misconfigured one is not, the
restarts are bounded, and SIGTERM reaches the child (real forks, real signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from peer.supervisor import RestartBudget, describe, supervise


def counting_child(tmp_path, outcomes):
    """A child that appends its pid to a file, then ends as `outcomes[n]` says for its n-th run
    (an int: exit with it; 'kill': SIGKILL itself)."""
    runs = tmp_path / "runs"

    def child(supervisor_pid: int, run: int) -> int:
        assert os.getppid() == supervisor_pid and os.getpgrp() == os.getpid()  # its own process group
        with open(runs, "a") as f:
            f.write(f"{os.getpid()}\n")
        n = len(runs.read_text().split()) - 1
        assert run == n
        outcome = outcomes[min(n, len(outcomes) - 1)]
        if outcome == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return outcome

    return child, runs


def test_a_killed_child_is_forked_again_until_it_finishes(tmp_path):
    child, runs = counting_child(tmp_path, ["kill", "kill", 0])
    assert supervise(child, name="t", max_restarts=5) == 0
    pids = runs.read_text().split()
    assert len(pids) == 3 and len(set(pids)) == 3


def test_an_error_exit_is_restarted_but_a_usage_error_is_not(tmp_path):
    child, runs = counting_child(tmp_path, [1, 2])
    assert supervise(child, name="t") == 2
    assert len(runs.read_text().split()) == 2


def test_restarts_are_bounded(tmp_path):
    child, runs = counting_child(tmp_path, ["kill"])
    assert supervise(child, name="t", max_restarts=2) == 128 + signal.SIGKILL
    assert len(runs.read_text().split()) == 3  # the first run and two restarts


def test_a_child_whose_needs_are_gone_is_stopped(tmp_path):
    """`needs` (for a server: its supervisor's DHT process) checked while the child runs: once it
    reports something gone, the child is killed and the supervisor returns 1, without a restart."""
    runs = tmp_path / "runs"
    gone = tmp_path / "gone"

    def child(*_):
        with open(runs, "a") as f:
            f.write(f"{os.getpid()}\n")
        gone.write_text("x")
        time.sleep(60)
        return 0

    t0 = time.monotonic()
    assert (
        supervise(child, name="t", poll_s=0.02, needs=lambda: "its DHT process is gone" if gone.exists() else None) == 1
    )
    assert time.monotonic() - t0 < 30  # not the child's 60 s
    pids = runs.read_text().split()
    assert len(pids) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(int(pids[0]), 0)


def test_an_exception_in_the_child_is_a_crash(tmp_path):
    marker = tmp_path / "raised"

    def child(*_):
        if not marker.exists():
            marker.write_text("x")
            raise RuntimeError("boom")
        return 0

    assert supervise(child, name="t") == 0


def test_restart_budget_counts_within_the_window():
    now = [0.0]
    budget = RestartBudget(2, 60.0, clock=lambda: now[0])
    assert budget.allow()
    now[0] = 30.0
    assert budget.allow() and not budget.allow()
    now[0] = 59.0
    assert not budget.allow()
    now[0] = 60.0  # the first restart left the window, the second not yet
    assert budget.allow() and not budget.allow()
    with pytest.raises(ValueError, match="window"):
        RestartBudget(1, 0)


def test_describe_reads_wait_statuses():
    assert describe(9) == ("was killed by SIGKILL", 128 + 9, True)
    assert describe(1 << 8) == ("exited with code 1", 1, True)
    assert describe(2 << 8) == ("exited with code 2", 2, False)
    assert describe(0) == ("exited with code 0", 0, False)


SCRIPT = textwrap.dedent("""
    import os, sys, time
    from peer.supervisor import supervise

    def child(*_):
        print(os.getpid(), flush=True)
        time.sleep(60)
        return 0

    sys.exit(supervise(child, name="t"))
""")


def test_sigterm_reaches_the_child_which_is_not_restarted(tmp_path):
    """A supervisor in a process of its own: SIGTERM to it ends the child (default action: it dies
    of SIGTERM), and the supervisor exits with that status instead of forking again."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        child = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"child {child} outlived its supervisor")
        assert proc.stdout.read() == ""  # no second child
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_supervisor_whose_parent_dies_ends_its_child(tmp_path):
    """The supervisor watches the pid it was given (the launcher's): when that one is gone, it
    SIGKILLs its child's group and exits."""
    script = SCRIPT.replace('supervise(child, name="t")', 'supervise(child, name="t", parent_pid=int(sys.argv[1]))')
    middle = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", {script!r}, str(__import__("os").getpid())], stdout=subprocess.PIPE,
                             text=True)
        print(p.pid, p.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        supervisor, child = map(int, middle.stdout.readline().split())
        middle.kill()
        middle.wait()
        deadline = time.time() + 15
        alive = {supervisor, child}
        while alive and time.time() < deadline:
            for pid in list(alive):
                try:
                    os.kill(pid, 0)
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            alive.discard(pid)
                except (ProcessLookupError, FileNotFoundError):
                    alive.discard(pid)
            time.sleep(0.05)
        assert not alive, f"{alive} outlived the supervisor's parent"
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
