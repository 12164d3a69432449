"""A live swarm of real processes on 127.0.0.1 driven from a test: the same launcher code as
`peer swarm` (its Swarm and Monitor), with the test holding the bootstrap DHT so that it can watch
records, call servers over P2P, kill volunteers and start new ones."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time

from safetensors.torch import load_file

from core.protocol import record_store
from peer.addresses import visible_maddrs
from peer.cli import build_parser
from peer.launcher.monitor import Monitor
from peer.launcher.processes import Swarm, kill_group
from peer.node import start_dht, stop_dht
from peer.server_links import P2PLink
from peer.swarm_flags import validate


def rel_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), f"parameter names differ: {set(a) ^ set(b)}"
    num = sum(float(((a[k].float() - b[k].float()) ** 2).sum()) for k in b)
    den = sum(float((b[k].float() ** 2).sum()) for k in b)
    return (num / den) ** 0.5


def reference_state(
    model: str,
    steps: int,
    seed: int = 0,
    batch_size: int = 16,
    micro_batches: int = 4,
    lr: float = 2e-3,
    recipe=None,
    precision: str = "fp32",
):
    """`peer reference --delay 1`'s parameters after `steps` (with a core.protocol.recipe.Recipe, or the
    default one at `lr`): computed once per test run and arguments, each caller given its own copy."""
    state = _reference_state(model, steps, seed, batch_size, micro_batches, lr, recipe, precision)
    return {k: v.clone() for k, v in state.items()}


@functools.lru_cache(maxsize=None)
def _reference_state(
    model: str, steps: int, seed: int, batch_size: int, micro_batches: int, lr: float, recipe, precision: str
):
    from core.model.config import get_preset
    from core.model.data import load_corpus
    from peer.reference import train_reference

    cfg = get_preset(model)
    state, _ = train_reference(
        cfg,
        load_corpus(None, seq_len=cfg.seq_len),
        steps=steps,
        seed=seed,
        batch_size=batch_size,
        micro_batches=micro_batches,
        delay=1,
        lr=lr if recipe is None else recipe.lr,
        recipe=recipe,
        precision=precision,
        progress=False,
    )
    return state


def reference_run(steps: int, recipe=None, eval_every: int = 0, model: str = "tiny") -> tuple[dict, dict]:
    """`peer reference --delay 1` of the swarm tests' settings (seed 0, batch 16 in 4 micro-batches,
    the default corpus), with a core.protocol.recipe.Recipe (None: the default at lr 2e-3) and
    --eval-every: (final state, summary)."""
    from core.model.config import get_preset
    from core.model.data import load_corpus
    from peer.reference import train_reference

    cfg = get_preset(model)
    return train_reference(
        cfg,
        load_corpus(None, seq_len=cfg.seq_len),
        steps=steps,
        seed=0,
        batch_size=16,
        micro_batches=4,
        delay=1,
        lr=2e-3 if recipe is None else recipe.lr,
        recipe=recipe,
        eval_every=eval_every,
        progress=False,
    )


REFRESH = 0.5  # s between the harness's reads of the records while it waits


class LiveSwarm:
    def __init__(self, work_dir: str, argv: list[str]):
        self.args = build_parser().parse_args(
            ["swarm", "--work-dir", str(work_dir), "--no-progress", *servers_compute(argv)]
        )
        # HIVEPIPE_TEST_VERBOSE=1 (info) or 2 (debug) makes every process of the swarm log more
        self.args.verbose = int(os.environ.get("HIVEPIPE_TEST_VERBOSE", "0"))
        self.cfg, self.layout, frontal, backward = validate(self.args)
        self.work_dir = str(work_dir)
        os.makedirs(self.work_dir, exist_ok=True)
        self.dht = start_dht([], run_id=self.args.run_id, run_fp=Swarm.run_key(self.work_dir).fingerprint)
        self.swarm = Swarm(self.args, self.layout, frontal, backward, visible_maddrs(self.dht), self.work_dir)
        self.monitor: Monitor | None = None

    async def start(self, volunteers: bool = True) -> None:
        from peer.reachability import DialBackService

        self.p2p = await self.dht.replicate_p2p()
        await DialBackService().add_p2p_handlers(self.p2p)
        self.swarm.start_servers()
        if volunteers:
            self.swarm.start_volunteers()
        self.monitor = Monitor(
            self.dht, self.p2p, self.args.run_id, self.layout, self.args.batch_size * self.cfg.seq_len
        )

    async def wait(self, predicate, timeout: float, what: str, poll: float = 0.1):
        """Until `predicate()` holds, asked every `poll` s; the records it may look at are read every
        REFRESH s (they change once per announce period, and a read every 0.1 s cost a quarter of the
        2 cores: each read visits every DHT node of the swarm)."""
        deadline, refreshed = time.monotonic() + timeout, float("-inf")
        while True:
            self.swarm.check_alive()
            if time.monotonic() - refreshed >= REFRESH:
                refreshed = time.monotonic()
                await self.monitor.refresh()
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}; servers: {await self.diagnose()}")
            await asyncio.sleep(poll)

    async def diagnose(self) -> dict:
        out = {}
        for dev in self.monitor.all_devices():
            try:
                st = await self.status(dev)
                out[dev] = {
                    "version": st["version"],
                    "pool": {k: st["pool"][k] for k in ("queued", "leased", "done", "requeued")},
                    "clients": {c["device"]: c["tasks_done"] for c in st["clients"].values()},
                }
            except Exception as e:
                out[dev] = repr(e)
        return out

    async def wait_version(self, version: int, timeout: float = 240.0) -> None:
        await self.wait(lambda: self.monitor.min_version() >= version, timeout, f"version {version}")

    async def wait_server(self, device: str, predicate, what: str, near=None, timeout: float = 240.0) -> dict:
        """Wait until `predicate(status)` holds for `device`'s own status over P2P (on one link),
        asked every 0.25 s, or every 20 ms once `near(status)` holds; the status. The DHT records
        that `wait` reads lag: they are announced every --announce-period, and while a peer of the
        DHT is frozen a read can wait on it for seconds or miss records."""
        deadline, link = time.monotonic() + timeout, None
        while True:
            self.swarm.check_alive()
            close = False
            try:
                link = link or self.link(device)
                meta, _ = await link.call("status", {}, timeout=30)
                if predicate(meta):
                    return meta
                close = near is not None and near(meta)
            except (KeyError, ConnectionError, asyncio.TimeoutError):  # not in the records yet, not up, busy
                link = None
                await self.monitor.refresh()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"timed out after {timeout} s waiting for {device}: {what}; servers: {await self.diagnose()}"
                )
            await asyncio.sleep(0.02 if close else 0.25)

    async def wait_server_version(self, device: str, version: int, timeout: float = 240.0) -> None:
        """Until `device` itself holds `version`, so that a fault injected right after lands at that
        version (a loss meant for step 2 landed at the run's end on a faster machine when the test
        waited on the records)."""
        await self.wait_server(
            device,
            lambda st: st["version"] >= version,
            f"version {version}",
            near=lambda st: st["version"] >= version - 1,
            timeout=timeout,
        )

    async def clients(self, stage: int) -> dict[str, str]:
        """device id -> peer id of the volunteers announced under a stage."""
        found = await record_store.read_stage(self.dht, self.args.run_id, stage, "clients")
        return {rec["device"]: peer for peer, rec, _ in found if rec is not None}

    def link(self, device: str) -> P2PLink:
        return self.monitor._link(device)

    async def status(self, device: str) -> dict:
        meta, _ = await self.link(device).call("status", {}, timeout=30)
        return meta

    async def finish(self, steps: int, timeout: float = 300.0):
        """Wait for the last step; the servers' statuses and the assembled model."""
        await self.wait_version(steps, timeout=timeout)
        return await self.monitor.final(steps)

    def run(self, scenario):
        """Run an async scenario against this swarm, then stop every process of it."""
        try:
            return asyncio.run(scenario())
        finally:
            self.close()

    def kill(self, name: str) -> None:
        proc, _ = self.swarm.volunteers.pop(name)
        kill_group(proc, signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        try:
            self.swarm.close()
        finally:
            stop_dht(self.dht)


def servers_compute(argv) -> list[str]:
    """`argv` with `--servers-compute yes` unless it says: these swarms were written for servers
    whose own workers compute (a stage trains with its volunteers killed, a failover test needs no
    volunteer), where `peer swarm` by default leaves the compute to its volunteers (tested in
    tests/swarm/test_cli.py)."""
    argv = list(argv)
    return argv if "--servers-compute" in argv else ["--servers-compute", "yes", *argv]


def swarm_cli(tmp_path, run_id: str, *args: str, timeout: float = 600) -> tuple[dict, dict, str]:
    """Run `peer swarm ARGS` as a process (work dir, summary and checkpoint under tmp_path); check it
    exits 0 and leaves no process behind; return (summary, final parameters, its stdout)."""
    # its own process group: on a timeout the launcher, its DHT process and every server and
    # volunteer it started are killed, not the launcher alone
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "swarm",
            *servers_compute(args),
            "--run-id",
            run_id,
            "--no-progress",
            "--work-dir",
            str(tmp_path / "work"),
            "--summary-json",
            str(tmp_path / "s.json"),
            "--checkpoint-out",
            str(tmp_path / "ckpt"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, signal.SIGKILL)  # (its servers and volunteers follow it: --parent-pid)
        proc.communicate()
        raise
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stderr[-3000:]
    assert no_children_left(run_id) == []
    summary = json.loads((tmp_path / "s.json").read_text())
    from peer.swarm import summary_line

    assert out.stdout.strip().splitlines()[-1] == summary_line(summary)  # the summary ends in one plain line
    return summary, load_file(str(tmp_path / "ckpt" / "model.safetensors")), out.stdout


def no_children_left(work_dir: str) -> list[int]:
    """Pids of processes whose command line mentions this work dir (should be none after close)."""
    left = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if str(work_dir) in cmd:
                left.append(int(pid))
    return left
