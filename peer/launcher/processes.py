"""The processes of a local swarm: one place that starts, watches and kills them, shared by
`peer swarm`, the tests and the benchmarks. Every child runs in its own process group (SIGKILL
takes its DHT process and p2p daemon down too, as a real machine's crash would) and is gone after
`close()`. Must not read the DHT (monitor.py does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from peer.launcher.forker import Forker
from peer.supervisor import group_members as _group_members
from peer.supervisor import proc_table as _proc_table

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"  # a local swarm never listens beyond this machine


class Swarm:
    """The child processes of a local swarm; every one of them is gone after `close()`."""

    def __init__(self, args, layout, frontal: int, backward: int, maddrs: list[str], work_dir: str):
        self.args, self.layout, self.frontal, self.backward = args, layout, frontal, backward
        self.maddrs = maddrs
        self.work_dir = work_dir
        self.servers: dict[str, subprocess.Popen] = {}
        self.lost: list[str] = []  # servers SIGKILLed for good
        # server -> the step right after which it kills itself (--lose-server: peer serve --die-at-version)
        self.dying: dict[str, int] = {device: step for step, device in getattr(args, "losses", None) or []}
        self.server_argv: dict[str, list[str]] = {}
        os.makedirs(os.path.join(work_dir, "identities"), exist_ok=True)
        self.volunteers: dict[str, tuple[subprocess.Popen, str]] = {}  # name -> (process, stage argument)
        self.killed = 0
        self._count = 0
        self.run_key_path = os.path.join(work_dir, "run.key")
        self.run_fp = self.run_key(work_dir).fingerprint
        # the forker (peer/launcher/forker.py), started now so that its imports overlap the
        # launcher's; Linux only (on macOS a fork of a process that imported torch is not safe).
        # Its output is forker.out: the work dir's *.log are the swarm's peers, one each
        fork = sys.platform.startswith("linux") and getattr(args, "fork_processes", False)
        self.forker = Forker(os.path.join(work_dir, "forker.out")) if fork else None

    @staticmethod
    def run_key(work_dir: str):
        """The run key of the swarm in `work_dir` (made there on first use; its servers share it)."""
        from core.protocol.trust import SigningKey

        os.makedirs(work_dir, exist_ok=True)
        return SigningKey.load_or_create(os.path.join(work_dir, "run.key"))[0]

    def spawn(self, name: str, argv: list[str]):
        path = os.path.join(self.work_dir, f"{name}.log")
        # `peer swarm -vv` (debug) makes every process log at debug too, not only at info
        argv = (["-" + "v" * self.args.verbose] if self.args.verbose else []) + argv
        if self.forker is not None:  # forked from the imported state: same process, no imports
            return self.forker.spawn(argv, path)
        # its own process group: SIGKILL reaches its DHT process and p2p daemon too, as a real
        # machine's crash would take them down
        with open(path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "peer.cli", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def common(self) -> list[str]:
        a = self.args
        # the process that starts them: a forked child watches the forker, which leaves with this one
        parent = self.forker.proc.pid if self.forker is not None else os.getpid()
        out = ["--run-id", f"{a.run_id}@{self.run_fp}", "--initial-peers", *self.maddrs, "--parent-pid", str(parent)]
        if a.link_profile:
            out += ["--link-profile", a.link_profile, "--link-scale", str(a.link_scale)]
        return out

    def start_servers(self) -> None:
        a = self.args
        for st in self.layout.stages:
            for role, names in (("frontal", st.frontal), ("backward", st.backward)):
                for i, name in enumerate(names):
                    where = (
                        ["--plan", a.plan, "--device-id", name]
                        if a.plan
                        else [
                            "--stage",
                            str(st.index),
                            "--role",
                            role,
                            "--index",
                            str(i),
                            "--stages",
                            str(a.stages),
                            "--frontal-per-stage",
                            str(self.frontal),
                            "--backward-per-stage",
                            str(self.backward),
                        ]
                    )
                    # every process of a local swarm is on this host's loopback: nobody to ask to dial back
                    argv = [
                        "serve",
                        "--reliable",
                        "--hold",  # it stays until this launcher has read its final state
                        *where,
                        "--host-maddrs",
                        LOOPBACK_MADDR,
                        "--no-reachability-check",
                        "--model",
                        a.model,
                        "--seed",
                        str(a.seed),
                        "--steps",
                        str(a.steps),
                        "--batch-size",
                        str(a.batch_size),
                        "--micro-batches",
                        str(a.micro_batches),
                        "--lr",
                        str(a.lr),
                        "--announce-period",
                        str(a.announce_period),
                        "--task-timeout",
                        str(a.task_timeout),
                        "--client-timeout",
                        str(a.client_timeout),
                        "--failover-after",
                        str(a.failover_after),
                        "--checkpoint-dir",
                        os.path.join(self.work_dir, "checkpoints"),
                        "--identity-path",
                        os.path.join(self.work_dir, "identities", f"{name}.key"),
                        "--run-key",
                        self.run_key_path,
                    ] + self.common()
                    if a.data:
                        argv += ["--data", a.data]
                    if a.init_from:
                        argv += ["--init-from", a.init_from]
                    if a.seq_len is not None:
                        argv += ["--seq-len", str(a.seq_len)]
                    if a.servers_compute == "no":
                        argv.append("--no-compute")
                    if a.no_requeue:
                        argv.append("--no-requeue")
                    if getattr(a, "no_local_first", False):
                        argv.append("--no-local-first")
                    if a.compress != "none":
                        argv += ["--compress", a.compress]
                    if getattr(a, "recipe", None) is not None:  # (validate() read it from the flags)
                        argv += a.recipe.flags()
                    if getattr(a, "precision", "fp32") != "fp32":
                        argv += ["--precision", a.precision]
                    if getattr(a, "eval_every", 0):
                        argv += ["--eval-every", str(a.eval_every)]
                    last = self.layout.stages[-1]
                    if name == last.frontal[0]:  # (it holds the labels: the loss is known there)
                        argv += ["--log-dir", os.path.join(self.work_dir, "logs")]
                    if getattr(a, "supervise_servers", False):
                        argv.append("--supervise")
                    if a.verify_rate is not None:
                        argv += ["--verify-rate", str(a.verify_rate)]
                    if a.probation is not None:
                        argv += ["--probation", str(a.probation)]
                    if getattr(a, "ban_reach", None) is not None:
                        argv += ["--ban-reach", str(a.ban_reach)]
                    for flag in ("task_tokens", "client_batch_tokens"):
                        if getattr(a, flag, None) is not None:
                            argv += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
                    if name in self.dying:  # (--lose-server: the server kills itself right after that step)
                        argv += ["--die-at-version", str(self.dying[name])]
                    self.server_argv[name] = argv
                    self.servers[name] = self.spawn(name, argv)

    def start_volunteer(self, stage_arg: str, name: str | None = None, extra: list[str] = ()) -> str:
        if name is None:
            name = f"v{self._count}"
            self._count += 1
        argv = ["join", "--stage", stage_arg, "--device-id", name] + self.common() + list(extra)
        if self.args.volunteer_slowdown:
            argv += ["--slowdown", str(self.args.volunteer_slowdown)]
        if getattr(self.args, "no_param_deltas", False):
            argv.append("--no-param-deltas")
        if getattr(self.args, "device", "cpu") != "cpu":
            argv += ["--device", self.args.device]
        self.volunteers[name] = (self.spawn(name, argv), stage_arg)
        return name

    def start_volunteers(self) -> None:
        a = self.args
        if a.plan:  # each client of the plan, on its stage, under its device id
            for st in self.layout.stages:
                for name in st.clients:
                    self.start_volunteer(str(st.index), name=name)
            return
        for i in range(a.volunteers):
            stage = str(i % a.stages) if a.volunteer_stage == "spread" else a.volunteer_stage
            self.start_volunteer(stage)
        for i, cheat in enumerate(a.cheater):  # test tool: liars the servers must catch
            stage = str(i % a.stages) if a.volunteer_stage == "spread" else a.volunteer_stage
            self.start_volunteer(stage, name=f"cheat{i}", extra=["--cheat", cheat, "--rebalance-period", "0"])

    def kill_volunteer(self, name: str) -> None:
        proc, stage = self.volunteers.pop(name)
        if proc.poll() is None:
            kill_group(proc, signal.SIGKILL)
            proc.wait()
            self.killed += 1
        # a new volunteer takes the departed one's place in the cluster (and so its emulated links),
        # with a fresh process and peer id
        self.start_volunteer(stage, name=name)

    def restart_server(self, name: str) -> None:
        """SIGKILL a server (its whole process group) and start it again with the same identity and
        checkpoint dir: it resumes from its shard checkpoint and request log. A supervised server
        (`--supervise-servers`): SIGKILL its server process, whose supervisor forks it again."""
        proc = self.servers[name]
        if "--supervise" in self.server_argv[name]:
            kill_worker(proc)
            return
        kill_group(proc, signal.SIGKILL)
        proc.wait()
        self.servers[name] = self.spawn(name, self.server_argv[name])

    def lose_server(self, name: str) -> None:
        """SIGKILL a server (its whole process group) for good: the others fail it over."""
        proc = self.servers.pop(name)
        kill_group(proc, signal.SIGKILL)
        proc.wait()
        self.lost.append(name)

    def collect_losses(self) -> list[tuple[str, int]]:
        """(server, step) of the servers started to die at a step (--lose-server) that have died since
        the last call: moved to `lost`."""
        gone = [(n, step) for n, step in self.dying.items() if n in self.servers and self.servers[n].poll() is not None]
        for name, _ in gone:
            proc = self.servers.pop(name)
            kill_group(proc, signal.SIGKILL)  # (whatever of its group is left)
            self.lost.append(name)
        return gone

    def bring_back(self, name: str) -> None:
        """Start a server lost with lose_server again, with its identity and checkpoint dir."""
        self.lost.remove(name)
        self.servers[name] = self.spawn(name, self.server_argv[name])

    def check_alive(self) -> None:
        for name, proc in self.servers.items():
            if proc.poll() is not None:
                tail = open(os.path.join(self.work_dir, f"{name}.log"), "rb").read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"server {name} exited with code {proc.returncode}:\n{tail}")

    def close(self) -> None:
        procs = list(self.servers.values()) + [p for p, _ in self.volunteers.values()]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            kill_group(p, signal.SIGKILL)  # whatever is left of it: its DHT process, its p2p daemon
            p.wait()
        if self.forker is not None:
            self.forker.close()


def kill_group(proc: subprocess.Popen, sig: int, wait: float = 5.0) -> None:
    """Send `sig` to the process group that `proc` leads (it, its DHT process, its p2p daemon) and,
    for SIGKILL, to the groups of its descendants that lead their own (a supervised server's server
    process); for SIGKILL, wait up to `wait` seconds until every member is gone, so that nothing of
    it outlives the call (a killed process with much memory takes a moment to exit)."""
    groups = [proc.pid] + (child_groups(proc.pid) if sig == signal.SIGKILL else [])
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if sig != signal.SIGKILL:
        return
    deadline = time.time() + wait
    while time.time() < deadline:
        if proc.poll() is None:
            time.sleep(0.02)
            continue
        if not any(_group_members(pgid) for pgid in groups):
            return
        time.sleep(0.02)


def kill_worker(proc: subprocess.Popen, wait: float = 5.0) -> int | None:
    """SIGKILL the server process of a supervised server (`peer serve --supervise`: `proc`'s child
    in a group of its own, with its DHT process and p2p daemon), as a crash would; its supervisor
    forks a new one. Returns the killed pid (None if there was none)."""
    workers = child_groups(proc.pid)
    for pgid in workers:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.time() + wait
    while time.time() < deadline and any(_group_members(pgid) for pgid in workers):
        time.sleep(0.02)
    return workers[0] if workers else None


def child_groups(pid: int) -> list[int]:
    """Process groups led by children of `pid` (a supervised server's server process leads its own)."""
    return sorted(n for n, (ppid, pgrp) in _proc_table().items() if ppid == pid and pgrp == n)
