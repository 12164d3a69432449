"""peer/launcher/forker.py: a process forked from the preloaded zygote is what `python -m peer.cli
ARGV` would be (its command line, its own session and process group, its output in its log, stdin
from /dev/null, its exit status reported), and the zygote leaves with the launcher. `peer swarm`
uses it on Linux (the default; --no-fork-processes: a new interpreter each), and so does every swarm
test but the CLI one in test_e2e.py."""

import json
import os
import signal

import pytest

from peer.launcher.forker import Forker
from scheduler import scenarios


@pytest.fixture
def forker(tmp_path):
    f = Forker(str(tmp_path / "forker.log"))
    yield f
    f.close()
    assert f.proc.returncode == 0, (tmp_path / "forker.log").read_text()


def plan_files(tmp_path):
    cluster, model = tmp_path / "cluster.json", tmp_path / "model.json"
    cluster.write_text(json.dumps(scenarios.random_cluster(4, 5, 3)))
    model.write_text(json.dumps(scenarios.small_model(4)))
    return str(cluster), str(model)


def test_a_forked_child_is_a_process_of_its_own_and_its_exit_is_reported(tmp_path, forker):
    cluster, model = plan_files(tmp_path)
    log = tmp_path / "plan.log"
    # the planner searches for --time-limit seconds: long enough to look at the process
    proc = forker.spawn(["plan", cluster, model, "--time-limit", "60"], str(log))
    assert proc.poll() is None
    cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode().replace("\0", " ")
    assert f"-m peer.cli plan {cluster} {model} --time-limit 60" in cmdline, cmdline
    assert os.getsid(proc.pid) == proc.pid and os.getpgid(proc.pid) == proc.pid
    assert os.readlink(f"/proc/{proc.pid}/fd/0") == os.devnull
    assert os.path.samefile(f"/proc/{proc.pid}/fd/1", log) and os.path.samefile(f"/proc/{proc.pid}/fd/2", log)
    assert open(f"/proc/{proc.pid}/stat").read().split(")")[1].split()[1] == str(forker.proc.pid)  # its parent
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL

    bad = forker.spawn(["plan", "--score", str(tmp_path / "missing.json"), cluster, model], str(tmp_path / "bad.log"))
    assert bad.wait(timeout=60) == 2
    assert "missing.json" in (tmp_path / "bad.log").read_text()

    ok = forker.spawn(
        ["plan", cluster, model, "--time-limit", "0.2", "-o", str(tmp_path / "plan.json")], str(tmp_path / "ok.log")
    )
    assert ok.wait(timeout=60) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["predicted_seconds_per_batch"] > 0


def test_the_forker_leaves_with_its_launcher_and_a_dead_one_is_a_clear_error(tmp_path):
    f = Forker(str(tmp_path / "forker.log"))
    child = f.spawn(["plan", "--help"], str(tmp_path / "help.log"))
    assert child.wait(timeout=60) == 0 and "usage: peer plan" in (tmp_path / "help.log").read_text()
    f.close()  # closes its socket, as the launcher's death does
    assert f.proc.returncode == 0

    dead = Forker(str(tmp_path / "dead.log"))
    dead.proc.kill()
    dead.proc.wait()
    with pytest.raises(RuntimeError, match="forker"):
        dead.spawn(["plan", "--help"], str(tmp_path / "late.log"))
    dead.close()
