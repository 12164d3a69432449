"""`peer swarm`: a whole swarm on this machine, as separate processes on 127.0.0.1: a bootstrap DHT
(this process), the reliable servers, the volunteers, optional churn (SIGKILL and replacement). At
the end it writes the summary JSON and the full model assembled from the servers' shards."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from peer.errors import UsageError
from peer.reference import DEFAULTS as TRAIN_DEFAULTS

logger = logging.getLogger("hivepipe.swarm")

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"  # a local swarm never listens beyond this machine


def add_arguments(p) -> None:
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--servers-per-stage", type=int, default=2, help="frontal + backward servers per stage (>= 2)")
    p.add_argument("--volunteers", type=int, default=4)
    p.add_argument("--volunteer-stage", default="spread", help="'spread' (round robin), 'auto' or a stage index")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=TRAIN_DEFAULTS["model"])
    p.add_argument("--data", default=None)
    p.add_argument("--batch-size", type=int, default=TRAIN_DEFAULTS["batch_size"])
    p.add_argument("--micro-batches", type=int, default=TRAIN_DEFAULTS["micro_batches"])
    p.add_argument("--lr", type=float, default=TRAIN_DEFAULTS["lr"])
    p.add_argument("--churn", type=float, default=0.0, help="fraction of volunteers SIGKILLed (and replaced) each step")
    p.add_argument("--no-requeue", action="store_true", help="drop a departed volunteer's work (SWARM-like baseline)")
    p.add_argument("--servers-compute", choices=["yes", "no"], default="yes", help="servers run a local worker too")
    p.add_argument("--volunteer-slowdown", type=float, default=None,
                   help="stretch the volunteers' compute by this factor (emulates slower devices)")
    p.add_argument("--cluster", default=None, metavar="CLUSTER.json",
                   help="with --plan: the cluster the plan was made for; also the link profile")
    p.add_argument("--plan", default=None, metavar="PLAN.json",
                   help="lay the swarm out as this plan says: each process takes a device's identity")
    p.add_argument("--link-profile", default=None, metavar="CLUSTER.json")
    p.add_argument("--link-scale", type=float, default=1.0)
    p.add_argument("--run-id", default="swarm")
    p.add_argument("--announce-period", type=float, default=1.0)
    p.add_argument("--task-timeout", type=float, default=30.0)
    p.add_argument("--client-timeout", type=float, default=4.0)
    p.add_argument("--failover-after", type=float, default=10.0,
                   help="seconds a server may be silent in the DHT before the others fail it over (0: never)")
    p.add_argument("--lose-server", action="append", default=[], metavar="DEVICE@STEP",
                   help="SIGKILL server DEVICE for good once the run reaches STEP (failover; repeatable)")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--checkpoint-out", default=None, help="write model.safetensors here")
    p.add_argument("--work-dir", default=None, help="logs and server checkpoints (default: a temporary folder)")
    p.add_argument("--hold", action="store_true", help="keep the swarm up after the last step until Ctrl-C")
    p.add_argument("--no-progress", action="store_true")


def validate(args):
    from parameter_server.layout import RunLayout
    from peer.model.config import check_micro_batches, get_preset

    try:
        cfg = get_preset(args.model)
        check_micro_batches(args.batch_size, args.micro_batches)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.servers_per_stage < 2:
        raise UsageError("--servers-per-stage must be >= 2 (one frontal and one backward server)")
    if args.volunteers < 0 or args.steps < 1:
        raise UsageError("--volunteers must be >= 0 and --steps >= 1")
    if args.volunteer_slowdown is not None and args.volunteer_slowdown < 1:
        raise UsageError("--volunteer-slowdown must be >= 1")
    if not 0 <= args.churn <= 1:
        raise UsageError(f"--churn is a fraction in [0, 1], got {args.churn}")
    frontal = (args.servers_per_stage + 1) // 2
    backward = args.servers_per_stage // 2
    if bool(args.plan) != bool(args.cluster):
        raise UsageError("--plan and --cluster go together")
    try:
        if args.plan:
            with open(args.plan) as f:
                layout = RunLayout.from_dict(json.load(f), cfg.layers)
            args.link_profile = args.link_profile or args.cluster
            args.stages = layout.num_stages
            args.volunteers = sum(len(st.clients) for st in layout.stages)
        else:
            layout = RunLayout.even(args.stages, cfg.layers, frontal, backward)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--plan {args.plan}: {e}") from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    frontal = max(len(st.frontal) for st in layout.stages)
    backward = max(len(st.backward) for st in layout.stages)
    if args.link_profile:
        from scheduler import PlanInputError, load_cluster

        try:
            cluster = load_cluster(args.link_profile)
        except (OSError, PlanInputError) as e:
            raise UsageError(f"{args.link_profile}: {e}") from None
        known = set(cluster.reliable_ids)
        missing = [d for st in layout.stages for d in st.servers if d not in known]
        if args.plan and missing:
            raise UsageError(f"the plan's servers {missing} are not reliable devices of {args.link_profile}")
    if max(frontal, backward) > args.batch_size // args.micro_batches:
        raise UsageError("more servers of one role than rows in a micro-batch")
    if args.volunteer_stage not in ("spread", "auto"):
        try:
            if not 0 <= int(args.volunteer_stage) < args.stages:
                raise ValueError
        except ValueError:
            raise UsageError(f"--volunteer-stage must be spread, auto or 0..{args.stages - 1}") from None
    if args.data is not None:
        from peer.model.data import load_corpus

        try:
            load_corpus(args.data, seq_len=cfg.seq_len)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.failover_after < 0:
        raise UsageError(f"--failover-after must be >= 0 seconds, got {args.failover_after}")
    args.losses = parse_lose_server(args.lose_server, layout, args.steps)
    if args.losses and args.failover_after <= 0:
        raise UsageError("--lose-server needs --failover-after > 0: without failover the run would stop")
    if args.summary_json and os.path.dirname(os.path.abspath(args.summary_json)):
        os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
    return cfg, layout, frontal, backward


def parse_lose_server(values: list[str], layout, steps: int) -> list[tuple[int, str]]:
    """--lose-server DEVICE@STEP values -> sorted (step, device); UsageError naming what is wrong."""
    out = []
    for v in values:
        device, _, at = v.partition("@")
        try:
            step = int(at)
        except ValueError:
            raise UsageError(f"--lose-server {v!r}: expected DEVICE@STEP") from None
        try:
            stage, role, _ = layout.locate(device)
        except ValueError:
            raise UsageError(f"--lose-server {v!r}: {device!r} is not a server of the layout") from None
        if not 1 <= step < steps:
            raise UsageError(f"--lose-server {v!r}: STEP must be in 1..{steps - 1}")
        st = layout.stages[stage]
        if len(st.frontal if role == "frontal" else st.backward) < 2:
            raise UsageError(f"--lose-server {v!r}: stage {stage} has no other {role} server to fail over to")
        out.append((step, device))
    if len({d for _, d in out}) != len(out):
        raise UsageError("--lose-server names a server twice")
    return sorted(out)


class Swarm:
    """The child processes of a local swarm; every one of them is gone after `close()`."""

    def __init__(self, args, layout, frontal: int, backward: int, maddrs: list[str], work_dir: str):
        self.args, self.layout, self.frontal, self.backward = args, layout, frontal, backward
        self.maddrs = maddrs
        self.work_dir = work_dir
        self.servers: dict[str, subprocess.Popen] = {}
        self.lost: list[str] = []  # servers SIGKILLed for good
        self.server_argv: dict[str, list[str]] = {}
        os.makedirs(os.path.join(work_dir, "identities"), exist_ok=True)
        self.volunteers: dict[str, tuple[subprocess.Popen, str]] = {}  # name -> (process, stage argument)
        self.killed = 0
        self._count = 0

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.work_dir, f"{name}.log"), "ab")
        cmd = [sys.executable, "-m", "peer.cli"] + (["-v"] if self.args.verbose else []) + argv
        # its own process group: SIGKILL reaches its DHT process and p2p daemon too, as a real
        # machine's crash would take them down
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def common(self) -> list[str]:
        a = self.args
        out = ["--run-id", a.run_id, "--initial-peers", *self.maddrs, "--parent-pid", str(os.getpid())]
        if a.link_profile:
            out += ["--link-profile", a.link_profile, "--link-scale", str(a.link_scale)]
        return out

    def start_servers(self) -> None:
        a = self.args
        for st in self.layout.stages:
            for role, names in (("frontal", st.frontal), ("backward", st.backward)):
                for i, name in enumerate(names):
                    where = (["--plan", a.plan, "--device-id", name] if a.plan else
                             ["--stage", str(st.index), "--role", role, "--index", str(i), "--stages", str(a.stages),
                              "--frontal-per-stage", str(self.frontal), "--backward-per-stage", str(self.backward)])
                    argv = ["serve", "--reliable", *where, "--host-maddrs", LOOPBACK_MADDR, "--model", a.model, "--seed", str(a.seed),
                            "--steps", str(a.steps), "--batch-size", str(a.batch_size),
                            "--micro-batches", str(a.micro_batches), "--lr", str(a.lr),
                            "--announce-period", str(a.announce_period), "--task-timeout", str(a.task_timeout),
                            "--client-timeout", str(a.client_timeout), "--failover-after", str(a.failover_after),
                            "--checkpoint-dir", os.path.join(self.work_dir, "checkpoints"),
                            "--identity-path", os.path.join(self.work_dir, "identities", f"{name}.key")] + self.common()
                    if a.data:
                        argv += ["--data", a.data]
                    if a.servers_compute == "no":
                        argv.append("--no-compute")
                    if a.no_requeue:
                        argv.append("--no-requeue")
                    self.server_argv[name] = argv
                    self.servers[name] = self._spawn(name, argv)

    def start_volunteer(self, stage_arg: str, name: str | None = None, extra: list[str] = ()) -> str:
        if name is None:
            name = f"v{self._count}"
            self._count += 1
        argv = ["join", "--stage", stage_arg, "--device-id", name] + self.common() + list(extra)
        if self.args.volunteer_slowdown:
            argv += ["--slowdown", str(self.args.volunteer_slowdown)]
        self.volunteers[name] = (self._spawn(name, argv), stage_arg)
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
        checkpoint dir: it resumes from its shard checkpoint and request log."""
        proc = self.servers[name]
        kill_group(proc, signal.SIGKILL)
        proc.wait()
        self.servers[name] = self._spawn(name, self.server_argv[name])

    def lose_server(self, name: str) -> None:
        """SIGKILL a server (its whole process group) for good: the others fail it over."""
        proc = self.servers.pop(name)
        kill_group(proc, signal.SIGKILL)
        proc.wait()
        self.lost.append(name)

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


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(args) -> int:
    cfg, layout, frontal, backward = validate(args)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="hivepipe-swarm-")
    os.makedirs(work_dir, exist_ok=True)
    from peer.runtime import run_until_signalled

    return run_until_signalled(lambda stop: swarm_main(args, cfg, layout, frontal, backward, work_dir, stop))


async def swarm_main(args, cfg, layout, frontal, backward, work_dir, stop: asyncio.Event) -> int:
    from tqdm import tqdm

    from peer.node import start_dht, visible_maddrs
    from peer.reachability import DialBackService

    t_launch = time.time()
    dht = start_dht([])  # every process of a local swarm listens on loopback only
    maddrs = visible_maddrs(dht)
    print(f"initial_peers={maddrs[0]}", flush=True)
    swarm = Swarm(args, layout, frontal, backward, maddrs, work_dir)
    rng = random.Random(args.seed)
    try:
        p2p = await dht.replicate_p2p()
        await DialBackService().add_p2p_handlers(p2p)  # the first server's reachability check asks us
        swarm.start_servers()
        swarm.start_volunteers()
        monitor = Monitor(dht, p2p, args.run_id, layout, args.batch_size * cfg.seq_len)
        bar = tqdm(total=args.steps, desc="swarm", unit="step", disable=args.no_progress, file=sys.stderr)
        t_start = None
        step_times: list[float] = []
        last_version, last_change = 0, time.time()
        pending_kills: list[tuple[float, str]] = []

        def kill_due(until: float) -> None:
            """SIGKILL (and replace) every volunteer whose kill time is `until` or earlier."""
            for when, name in [pk for pk in pending_kills if pk[0] <= until]:
                pending_kills.remove((when, name))
                if name in swarm.volunteers:
                    swarm.kill_volunteer(name)

        while not stop.is_set():
            swarm.check_alive()
            await monitor.refresh()
            version = monitor.min_version()
            if t_start is None and monitor.all_online():
                t_start = time.time()
                last_change = t_start
            if version > last_version:
                now = time.time()
                step_times.append((now - last_change) / (version - last_version))
                last_version, last_change = version, now
                bar.update(version - bar.n)
                loss = monitor.loss(version - 1)
                if loss is not None:
                    elapsed = max(now - (t_start or now), 1e-6)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{version * args.batch_size * cfg.seq_len / elapsed:.0f}")
                if args.churn > 0 and version < args.steps:
                    # a kill meant for the step that just ended happens now, at its boundary: every step
                    # loses its share of volunteers however fast it ran
                    kill_due(math.inf)
                    expected = sum(step_times[-3:]) / len(step_times[-3:])
                    names = sorted(swarm.volunteers)
                    # churn x volunteers on average: the fraction's remainder is a coin toss, so 40% and
                    # 60% of 4 volunteers are 1.6 and 2.4 kills per step, not both 2
                    share = args.churn * len(names)
                    n_kill = min(len(names), int(share) + (rng.random() < share - int(share)))
                    for name in rng.sample(names, n_kill):
                        pending_kills.append((now + rng.uniform(0, expected), name))
            if version >= args.steps:
                break
            for at, name in [x for x in args.losses if x[0] <= version and x[1] in swarm.servers]:
                logger.warning("losing server %s for good at version %d", name, version)
                swarm.lose_server(name)
            kill_due(time.time())
            await asyncio.sleep(0.2)
        bar.close()
        if stop.is_set() and last_version < args.steps:
            print("interrupted: stopping the swarm", file=sys.stderr)
            return 130
        wall = time.time() - (t_start or t_launch)
        statuses = await monitor.statuses()
        state = await monitor.assemble(args.steps)
        summary = monitor.summary(args, cfg, statuses, swarm.killed, wall)
        summary["startup_seconds"] = (t_start or t_launch) - t_launch
        if args.checkpoint_out:
            from safetensors.torch import save_file

            os.makedirs(args.checkpoint_out, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(args.checkpoint_out, "model.safetensors"))
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=2)
        print(json.dumps(summary), flush=True)
        if args.hold:
            print("holding the swarm up; Ctrl-C to stop", file=sys.stderr, flush=True)
            await stop.wait()
        return 0
    finally:
        swarm.close()
        dht.shutdown()


class Monitor:
    """The launcher's view of the run: DHT records for progress, P2P calls for the final state."""

    def __init__(self, dht, p2p, run_id: str, layout, tokens_per_batch: int):
        self.dht, self.p2p, self.run_id, self.layout = dht, p2p, run_id, layout
        self.num_layers = layout.stages[-1].layers[1]
        self.epoch = 0
        self.tokens_per_batch = tokens_per_batch
        self.servers: dict[str, tuple[str, dict]] = {}  # device -> (peer id, record)
        self.server_ids = set(self.all_devices())  # of every epoch (a failover only removes servers)

    async def refresh(self) -> None:
        from parameter_server.layout import RunLayout
        from peer.protocol import records

        try:  # after a failover the servers announce the layout of the new epoch
            config = await records.get(self.dht, records.config_key(self.run_id))
            if isinstance(config, dict) and config.get("epoch", 0) > self.epoch:
                self.layout = RunLayout.from_dict(config["layout"], self.num_layers)
                self.epoch = config["epoch"]
        except Exception as e:
            logger.debug("read config failed: %r", e)
        for k in range(self.layout.num_stages):
            try:
                found = await records.read_stage(self.dht, self.run_id, k)
            except Exception as e:
                logger.debug("read_stage failed: %r", e)
                continue
            for peer, rec, _ in found:
                if rec is not None and rec["kind"] == "server":
                    self.servers[rec["device"]] = (peer, rec)

    def all_devices(self) -> list[str]:
        return [d for st in self.layout.stages for d in st.servers]

    def all_online(self) -> bool:
        return all(d in self.servers and self.servers[d][1]["state"] == "online" for d in self.all_devices())

    def min_version(self) -> int:
        if not all(d in self.servers for d in self.all_devices()):
            return 0
        return min(self.servers[d][1]["version"] for d in self.all_devices())

    def loss(self, t: int) -> float | None:
        last = self.layout.stages[-1]
        for d in last.servers:
            rec = self.servers.get(d, (None, {}))[1]
            if str(t) in rec.get("losses", {}):
                return rec["losses"][str(t)] / self.tokens_per_batch
        return None

    def _link(self, device: str):
        from parameter_server.server import StageServer
        from peer.node import P2PLink

        peer, rec = self.servers[device]
        return P2PLink(self.p2p, peer, device, StageServer, addresses=lambda: rec.get("maddrs", []))

    async def statuses(self) -> dict[str, dict]:
        out = {}
        for d in self.all_devices():
            meta, _ = await self._link(d).call("status", {}, timeout=30)
            out[d] = meta
        return out

    async def assemble(self, version: int) -> dict:
        """The full model at `version`, from every shard slot's host."""
        state = {}
        for st in self.layout.stages:
            for slot, d in enumerate(st.hosts):
                meta, tensors = await self._link(d).call("get_params", {"version": version, "slot": slot}, timeout=120)
                state.update(zip(meta["names"], tensors))
        return state

    def summary(self, args, cfg, statuses: dict, killed: int, wall: float) -> dict:
        last = self.layout.stages[-1]
        loss_sums = statuses[last.servers[0]]["losses"]
        losses = {int(k): v / self.tokens_per_batch for k, v in loss_sums.items()}
        applied = sum(statuses[st.servers[0]]["microbatches_applied"] for st in self.layout.stages)
        return {
            "steps": args.steps,
            "first_loss": losses[min(losses)],
            "last_loss": losses[max(losses)],
            "microbatches_expected": args.steps * args.micro_batches * self.layout.num_stages,
            "microbatches_applied": applied,
            "duplicates_dropped": sum(s["duplicates"] for s in statuses.values()),
            "requeued": sum(s["requeued"] for s in statuses.values()),
            "volunteers_killed": killed,
            "layout_epoch": self.epoch,
            "layout": self.layout.to_dict(),
            # the volunteers (not servers) registered with each stage's servers when the run ended
            "volunteers_by_stage": {str(st.index): sorted({c["device"] for d in st.servers
                                                           for c in statuses[d].get("clients", {}).values()}
                                                          - self.server_ids)
                                    for st in self.layout.stages},
            "wall_seconds": round(wall, 3),
            "tokens_per_second": round(args.steps * args.batch_size * cfg.seq_len / max(wall, 1e-9), 1),
            "bytes_on_wire": sum(sum(s.get("traffic", {}).values()) for s in statuses.values()),
            "traffic": dict(sum((collections.Counter(s.get("traffic", {})) for s in statuses.values()), collections.Counter())),
        }
