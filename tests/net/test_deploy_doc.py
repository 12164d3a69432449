"""docs/deploy.md is a test: its commands, exactly as written, run on three network namespaces (hosts
A, B and C at the page's addresses). The blocks run are those under a `<!-- deploy-test: host=...
[background] -->` comment, read from the page at every run, so that the page and the program cannot
drift apart. A line that sets INITIAL or RUN is where an operator pastes what a server printed: the
test pastes what this run's servers printed. STEPS, the run's length, is the walk's own: the page's
2000 steps last minutes for a person to follow its later sections, the walk's 24 take the same path
in seconds. Other assignments are the page's own.

The walk: the run key and the training flags; the first server alone past its first
reminder (REMIND_S here, a minute by default), saying that it waits; the three other servers one by one; the
dashboard's snapshot from host C once they serve (all four online, the run blocked on no compute:
it cannot have ended yet); two volunteers on links shaped to 50 and 20 Mbit/s (tc tbf), each given
ONE initial peer; the first server stopped and restarted with its own command (no --initial-peers:
it rejoins through the peers it kept) while a live dashboard on host C, started from the first
server's line alone, watches: it shows the run stopped for that server, then going on, and never
loses the run; the run finishing with every server and
volunteer exiting 0 by itself, both stages computed by volunteers, and the servers' parameters equal
to the single-process reference's; `peer export --checkpoint-dirs` and `peer generate` on the result.

Needs root and `ip netns` (skipped with the reason elsewhere); CI on this project's machine runs it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.lines import LineProcess
from tests.net import netns

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"deploy-doc test: {REASON}")

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "deploy.md"
# the peers' reminder of a wait comes every REMIND_S seconds here ($HIVEPIPE_REMIND_EVERY; a minute
# by default), so that the first server's wait past its first reminder takes ALONE_S, not a minute
REMIND_S = 10
ALONE_S = REMIND_S + 5.0
PASTED = ("INITIAL", "RUN")  # what an operator pastes from a server's output
WALK_STEPS = "24"  # STEPS in the walk (the page's run is long enough for a person)


@dataclass
class Step:
    hosts: list[str]
    background: bool
    lines: list[str]


def doc_steps(text: str) -> list[Step]:
    """The page's runnable blocks, in order; continuation lines joined."""
    steps = []
    pattern = re.compile(r"<!-- deploy-test: host=([A-Z,]+)( background)? -->\s*\n```bash\n(.*?)```", re.S)
    for m in pattern.finditer(text):
        body = m.group(3).replace("\\\n", " ")
        lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        steps.append(Step(m.group(1).split(","), bool(m.group(2)), lines))
    return steps


def test_the_page_has_the_walk():
    """The test below needs these blocks; a page that lost one fails here, not in the namespaces."""
    steps = doc_steps(DOC.read_text())
    text = [ln for s in steps for ln in s.lines]
    assert any(ln.startswith("peer keygen") for ln in text)
    assert sum(ln.startswith("peer serve") for s in steps if s.background for ln in s.lines) == 4
    assert any(ln.startswith("peer join") for s in steps if s.background for ln in s.lines)
    assert any("dashboard.py" in ln for ln in text)
    assert any(ln.startswith("peer export") for ln in text) and any(ln.startswith("peer generate") for ln in text)
    # the run's length is one line the walk can set (STEPS), and the page's is long enough for a person
    # to reach section 4 before it ends (about 4 steps a second, so a few minutes)
    page_steps = [int(ln.split("=", 1)[1]) for ln in text if ln.startswith("STEPS=")]
    assert len(page_steps) == 1 and page_steps[0] >= 1000, page_steps
    assert any(ln.startswith("TRAIN=") and "--steps $STEPS" in ln for ln in text)
    serves = [ln for s in steps for ln in s.lines if ln.startswith("peer serve")]
    assert "--initial-peers" not in serves[0] and all("--initial-peers" in ln for ln in serves[1:])


class Proc(LineProcess):
    """A background command of the page, its stdout read line by line (a line seen before counts)."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        super().__init__(argv, name=name, stderr=open(log, "a"), env=env, cwd=REPO)

    def wait_line(self, pattern: str, timeout: float) -> str:
        return super().wait_line(pattern, timeout, seen_too=True)


class Walk:
    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.bed = netns.Testbed(["A", "B", "C"], tag=f"hd{os.getpid() % 10000}")
        self.bed.shape("B", 50)  # volunteers at home
        self.bed.shape("C", 20)
        self.env: dict[str, dict[str, str]] = {}
        for host in self.bed.hosts:
            home = tmp_path / host
            home.mkdir()
            self.env[host] = {
                "HOME": str(home),
                "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "PYTHONUNBUFFERED": "1",
                "LANG": "C.UTF-8",
                "HIVEPIPE_REMIND_EVERY": str(REMIND_S),
            }
        self.pasted: dict[str, str] = {}
        self.procs: list[Proc] = []

    def argv(self, host: str, line: str) -> list[str]:
        return [*self.bed.prefix(host), "bash", "-c", line]

    def assign(self, host: str, line: str) -> bool:
        m = re.fullmatch(r"([A-Z_]+)=(.*)", line)
        if not m:
            return False
        name = m.group(1)
        if name in PASTED:
            self.env[host][name] = self.pasted[name]
        elif name == "STEPS":
            self.env[host][name] = WALK_STEPS
        else:
            value = subprocess.run(
                ["bash", "-c", f'{line}; printf %s "${name}"'], capture_output=True, text=True, env=self.env[host]
            )
            self.env[host][name] = value.stdout
        return True

    def run(self, host: str, line: str, timeout: float = 300) -> subprocess.CompletedProcess:
        out = subprocess.run(
            self.argv(host, line), capture_output=True, text=True, env=self.env[host], cwd=REPO, timeout=timeout
        )
        assert out.returncode == 0, (
            f"{host}$ {line}\nexit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}\n{self.diagnose(host, line)}"
        )
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        return out

    def diagnose(self, host: str, line: str) -> str:
        """What a failed command met: the tail of every background command's log, each host's TCP
        sockets, and a failed peer or dashboard command again with -vv (hivemind's debug log too)."""
        parts = []
        for p in self.procs:
            log = self.tmp / f"{p.name}.log"
            tail = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []
            alive = "running" if p.proc.poll() is None else f"exited {p.proc.returncode}"
            parts.append(f"--- {p.name} ({alive}): stdout {p.seen[-4:]}\n" + "\n".join(tail))
        for name in self.bed.hosts:
            ss = subprocess.run([*self.bed.prefix(name), "ss", "-tan"], capture_output=True, text=True)
            parts.append(f"--- sockets on {name}\n{ss.stdout[-3000:]}")
        if line.startswith("peer ") or "dashboard.py" in line:
            again = subprocess.run(
                self.argv(host, line + " -vv"),
                capture_output=True,
                text=True,
                env=self.env[host],
                cwd=REPO,
                timeout=120,
            )
            parts.append(f"--- {host}$ {line} -vv: exit {again.returncode}\n{again.stderr[-6000:]}")
        return "\n".join(parts)

    def start(self, host: str, line: str, name: str) -> Proc:
        p = Proc(name, self.argv(host, line), self.env[host], self.tmp / f"{name}.log")
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        self.bed.close()


def _version(ckpt: Path, device: str) -> int:
    try:
        return json.loads((ckpt / f"{device}.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return -1


def test_the_deploy_page_runs_as_written(tmp_path):
    steps = doc_steps(DOC.read_text())
    walk = Walk(tmp_path)
    servers: dict[str, Proc] = {}
    server_lines: dict[str, str] = {}
    volunteers: list[Proc] = []
    try:
        for step in steps:
            for host in step.hosts:
                for line in step.lines:
                    if walk.assign(host, line):
                        continue
                    if step.background and line.startswith("peer serve"):
                        device = "s{}{}0".format(
                            re.search(r"--stage (\d)", line).group(1), re.search(r"--role (\w)", line).group(1)
                        )
                        p = walk.start(host, line, device)
                        t_alone = time.monotonic()
                        servers[device], server_lines[device] = p, line
                        if "INITIAL" not in walk.pasted:  # the first server: its two lines are what everybody needs
                            # (the others start together, as an operator starts them: the dashboard's
                            # step below waits until every one serves)
                            first = p.wait_line(r"^initial_peers=", 120)
                            walk.pasted["INITIAL"] = first.split("=", 1)[1]
                            assert p.wait_line(r"^run=", 30) == "run=" + walk.pasted["RUN"]
                            # the walk's own watcher: a live dashboard on host C given this line alone,
                            # which must keep the run when this server is away (restart_first)
                            watcher = Watcher(walk)
                            p.wait_line(r"^s0f0: waiting: for the run's servers", 120)
                            time.sleep(max(0.0, ALONE_S - (time.monotonic() - t_alone)))
                            assert p.proc.poll() is None, "the first server did not outlive its wait"
                            p.wait_line(r"still for the run's servers", 30)
                    elif step.background:
                        p = walk.start(host, line, f"volunteer-{host}")
                        volunteers.append(p)
                        assert re.match(r"^v-\w+: starting: ", p.wait_line(r"starting", 20))
                        if len(volunteers) == 2:  # the walk's own action: a restart in the middle of the run
                            restart_first(walk, servers, server_lines, tmp_path, watcher)
                    elif line.startswith("peer export"):
                        finish(servers, volunteers)  # the run ends by itself
                        equals_the_reference(walk, tmp_path, volunteers)
                        walk.run(host, line)
                    else:
                        if "dashboard.py" in line:  # "once all four are up", as the page says
                            for p in servers.values():
                                p.wait_line(r": serving: ", 120)
                        out = walk.run(host, line)
                        if line.startswith("peer keygen"):
                            walk.pasted["RUN"] = re.search(r"^run=(\S+)$", out.stdout, re.M).group(1)
                        if line.startswith("peer generate"):
                            assert len(out.stdout.strip()) > 0
                        if "dashboard.py" in line:
                            servers_seen(json.loads(out.stdout), servers)
    finally:
        walk.close()


def servers_seen(snap: dict, servers: dict) -> None:
    """The dashboard, run once the servers are up and before any volunteer joins (the run cannot
    have ended): every server started so far online, and the run blocked on no compute."""
    seen = {e["device"]: e["state"] for st in snap["stages"] for role in ("frontal", "backward") for e in st[role]}
    assert seen == dict.fromkeys(servers, "online"), seen
    assert snap["health"]["status"] == "blocked", snap["health"]
    assert {b["stage"] for b in snap["health"]["blocking"] if "no compute" in b["reason"]} == {0, 1}, snap["health"]


def train_steps(walk: Walk) -> int:
    train = walk.env["A"]["TRAIN"].split()
    return int(train[train.index("--steps") + 1])


class Watcher:
    """`dashboard.py --serve 0` on host C, started from the first server's `initial_peers=` line alone
    (as section 3 of the page starts it), read at /api/state from inside host C."""

    def __init__(self, walk: Walk):
        line = f"python scripts/dashboard.py --run-id {walk.pasted['RUN']} --initial-peers $INITIAL --serve 0 --refresh 0.5"
        walk.env["C"]["INITIAL"] = walk.pasted["INITIAL"]
        self.walk, self.proc = walk, walk.start("C", line, "dashboard-live")
        self.url = self.proc.wait_line(r"^serving on http://127\.0\.0\.1:\d+$", 120).split()[-1]
        self.statuses: list[str] = []  # the run's status at each read

    def state(self) -> dict:
        read = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
        out = subprocess.run(
            [*self.walk.bed.prefix("C"), sys.executable, "-c", read, self.url + "/api/state"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        snap = json.loads(out.stdout)
        self.statuses.append(snap["health"]["status"])
        return snap

    def wait(self, what: str, predicate, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            snap = self.state()
            if predicate(snap):
                return snap
            assert time.monotonic() < deadline, f"the dashboard did not show {what}: {snap['health']}"
            time.sleep(0.5)


def s0f0_state(snap: dict) -> str | None:
    """s0f0's state as the dashboard shows it (None while it shows no stage: it has lost the run)."""
    frontal = snap["stages"][0]["frontal"] if snap["stages"] else []
    return next((e["state"] for e in frontal if e["device"] == "s0f0"), None)


def restart_first(walk: Walk, servers: dict, lines: dict, tmp_path: Path, watcher: Watcher) -> None:
    ckpt = tmp_path / "A" / "hp" / "ckpt"
    deadline = time.monotonic() + 240
    while _version(ckpt, "s0f0") < 1:
        assert time.monotonic() < deadline, "the run made no two steps with its volunteers"
        time.sleep(0.1)
    watcher.wait("s0f0 online", lambda snap: s0f0_state(snap) == "online")
    first = servers["s0f0"]
    t0 = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=10) == 0
    # the dashboard, which knew the run through s0f0 alone, sees it away and the run stopped for it
    watcher.wait(
        "s0f0 away and the run stopped for it",
        lambda snap: s0f0_state(snap) != "online" and snap["health"]["status"] in ("stopped", "blocked"),
    )
    # its DHT process and p2p daemon end with it: its process group empties (waited for, up to 30 s)
    deadline = time.monotonic() + 30
    while subprocess.run(["bash", "-c", f"kill -0 -{first.proc.pid} 2>/dev/null"]).returncode == 0:
        assert time.monotonic() < deadline, "a process of the stopped server is left"
        time.sleep(0.1)
    again = walk.start("A", lines["s0f0"], "s0f0-restarted")
    servers["s0f0"] = again
    again.wait_line(r"^initial_peers=" + re.escape(walk.pasted["INITIAL"].split()[0]), 120)
    again.wait_line(r"^s0f0: serving: ", 120)
    assert _version(ckpt, "s0f0") < train_steps(walk), "the run had ended before the restart"
    assert time.monotonic() - t0 < 180
    # ... and back, through the addresses of the other servers it had seen: it never lost the run
    watcher.wait("s0f0 back", lambda snap: s0f0_state(snap) == "online" or snap["health"]["status"] == "finished")
    assert "not_found" not in watcher.statuses, watcher.statuses


def finish(servers: dict, volunteers: list) -> None:
    for name, p in servers.items():
        p.wait_line(r"finished: run demo finished at step \d+ \(loss \d+\.\d+\)", 420)
        assert p.proc.wait(timeout=60) == 0, name
    for p in volunteers:
        p.wait_line(r"finished: run demo is over", 120)
        assert p.proc.wait(timeout=60) == 0, p.name


def equals_the_reference(walk: Walk, tmp_path: Path, volunteers: list) -> None:
    """Both stages had a volunteer's compute (the servers only serve), and the servers' parameters
    equal `peer reference`'s with the page's training flags."""
    from parameter_server.checkpoint import read_model
    from tests.swarm.harness import reference_state, rel_diff

    stages = set()
    for p in volunteers:
        m = re.search(r"(\d+) forward and (\d+) backward tasks done on stage\(s\) (\d+(?: -> \d+)*)", "\n".join(p.seen))
        assert m and int(m.group(1)) + int(m.group(2)) > 0, (p.name, p.seen[-5:])
        stages.update(int(k) for k in re.findall(r"\d+", m.group(3)))
    assert stages == {0, 1}
    train = walk.env["A"]["TRAIN"].split()
    flag = {k: train[i + 1] for i, k in enumerate(train) if k.startswith("--") and i + 1 < len(train)}
    steps = int(flag["--steps"])
    state, versions = read_model([str(tmp_path / "A" / "hp" / "ckpt")])
    assert set(versions.values()) == {steps}
    reference = reference_state(
        flag["--model"], steps, batch_size=int(flag["--batch-size"]), micro_batches=int(flag["--micro-batches"])
    )
    assert rel_diff(state, reference) < 1e-5
