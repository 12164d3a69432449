"""A run's servers and volunteers as the very objects that `peer serve` and `peer join` run
(peer.host.ServerHost, peer.host.VolunteerSession), all in the test's event loop. Each has its own
real DHT node and p2p daemon on 127.0.0.1 and talks real hivemind P2P: nothing of the network is
stood in for. What only a process has (signals, exit codes of a command, a SIGKILL of the whole
process, a frozen process) is tested with processes (test_lifecycle.py, test_faults.py); the run's
life (finding the run, waiting, serving, failover, restart from a checkpoint, the end) is tested
here, without an interpreter and a torch import per peer.

A crash here SIGKILLs the peer's DHT process (its p2p daemon dies with it): from that moment the
others can neither reach it nor read anything new from it, as when its host dies. Its objects are then
dropped without a word (no "offline" record): its tasks are cancelled, and its checkpoint writer and
request log closed, so that a restart reads files no other writer holds."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time
from pathlib import Path

from peer import join
from peer.cli import build_parser
from peer.errors import NetworkError, UsageError
from peer.host.options import ServerOptions
from peer.host.server import ServerHost
from peer.host.state import StateLine
from peer.host.volunteer import VolunteerSession
from peer.runtime import check_common

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# two stages of the tiny model, one server of each role a stage, or two
TWO_STAGES = ["--stages", "2", "--frontal-per-stage", "1", "--backward-per-stage", "1"]
FOUR_A_STAGE = ["--stages", "2", "--frontal-per-stage", "2", "--backward-per-stage", "2"]


def device(stage: int, role: str, index: int = 0) -> list[str]:
    """`peer serve`'s flags for one server of the layout."""
    return ["--stage", str(stage), "--role", role, "--index", str(index)]


def servers_of(per_role: int) -> list[list[str]]:
    """Every server of a two-stage layout with `per_role` servers of each role a stage, stage by stage."""
    return [device(k, r, i) for k in (0, 1) for r in ("frontal", "backward") for i in range(per_role)]


def play(scenario, timeout: float):
    """Run `scenario()` (a coroutine function) in a fresh event loop, for at most `timeout` seconds."""
    return asyncio.run(asyncio.wait_for(scenario(), timeout))


def awaiting(task: asyncio.Task) -> list[str]:
    """Where a task waits: each coroutine of its await chain, as function:line."""
    out, coro = [], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            out.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out


class Said(io.StringIO):
    """What a peer's state line printed."""

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


class HostRun:
    """One run of the tiny model: `layout_flags` as `peer serve` takes them (every server gets them),
    `train_flags` the training flags every server shares."""

    def __init__(self, tmp_path: Path, run_id: str, steps: int, layout_flags=(), train_flags=(), announce_period=1.0):
        self.dir, self.run_id, self.steps = Path(tmp_path), run_id, steps
        self.key = self.dir / "run.key"
        self.layout_flags, self.train_flags = list(layout_flags), list(train_flags)
        self.announce_period = announce_period
        self.servers: dict[str, ServerHost] = {}
        self.volunteers: dict[str, VolunteerSession] = {}
        self.said: dict[str, Said] = {}
        self.stops: dict[str, asyncio.Event] = {}
        self.runs: dict[str, asyncio.Task] = {}
        self.codes: dict[str, int | BaseException] = {}
        self.errors: dict[str, str] = {}  # the one-line error a peer's command would end with
        self.crashed: list[object] = []  # the peers crashed, whose objects were dropped
        self.initial: list[str] = []  # the first server's multiaddrs: every later peer joins through them
        self.run_fp: str | None = None
        self._corpus = None

    # ---- the commands, as an operator types them --------------------------------------------------

    def serve_argv(self, device_flags: list[str], initial_peers: list[str] | None = None) -> list[str]:
        peers = self.initial if initial_peers is None else initial_peers
        return [
            "serve",
            "--reliable",
            *device_flags,
            *self.layout_flags,
            "--model",
            "tiny",
            "--steps",
            str(self.steps),
            "--announce-period",
            str(self.announce_period),
            *self.train_flags,
            "--run-id",
            self.run_id,
            "--run-key",
            str(self.key),
            "--host-maddrs",
            LOOPBACK,
            "--no-reachability-check",
            "--checkpoint-dir",
            str(self.dir / "checkpoints"),
            *(["--initial-peers", *peers] if peers else []),
        ]

    def parse(self, argv: list[str]):
        args = build_parser().parse_args(argv)
        check_common(args)
        return args

    # ---- servers ----------------------------------------------------------------------------------

    def start_server(self, device_flags: list[str], initial_peers: list[str] | None = None) -> ServerHost:
        """`peer serve ... device_flags` (through the first server's addresses, or `initial_peers`),
        running in this loop; its name is its device id."""
        from peer import serve_flags

        args = self.parse(self.serve_argv(device_flags, initial_peers))
        cfg, layout, device, run_cfg = serve_flags.resolve(args)
        if args.identity_path is None:  # (a restart comes back under the same peer id, as with --supervise)
            args.identity_path = str(self.dir / "identities" / f"{device}.key")
            os.makedirs(os.path.dirname(args.identity_path), exist_ok=True)
        self.run_fp = args.run_fp
        said = self.said[device] = Said()
        host = ServerHost(
            ServerOptions.from_args(args), cfg, layout, device, run_cfg, corpus=self.corpus(cfg), out=said
        )
        self._launch(device, host, host.run)
        self.servers[device] = host
        return host

    def corpus(self, cfg):
        if self._corpus is None:
            from core.model.data import load_corpus

            self._corpus = load_corpus(None, seq_len=cfg.seq_len)
        return self._corpus

    async def first_server(self, device_flags: list[str], timeout: float = 60.0) -> ServerHost:
        """The run's first server: the others join through its addresses, with the run key it wrote
        once it made the run (as an operator copies that file to the other servers' hosts)."""
        host = self.start_server(device_flags, initial_peers=[])
        await self.wait(lambda: host.maddrs and self.key.exists(), timeout, f"{host.device} to make the run")
        self.initial = list(host.maddrs)
        return host

    async def start_servers(self, all_flags: list[list[str]]) -> ServerHost:
        """The first of `all_flags` as the run's first server, then the others through it; the first."""
        first = await self.first_server(all_flags[0])
        for flags in all_flags[1:]:
            self.start_server(flags)
        return first

    def _launch(self, name: str, peer, run) -> None:
        stop = self.stops[name] = asyncio.Event()

        async def life():
            try:
                self.codes[name] = await run(stop)
            except (UsageError, NetworkError) as e:  # what the command says, exit 2 (peer.cli.main)
                self.errors[name] = str(e)
                self.codes[name] = 2
            except BaseException as e:  # (a crash cancels it: recorded, not raised)
                self.codes[name] = e

        self.runs[name] = asyncio.ensure_future(life())

    # ---- volunteers -------------------------------------------------------------------------------

    def join(self, name: str, stage: str = "auto", *extra: str) -> VolunteerSession:
        """`peer join --stage STAGE --device-id NAME` through the first server's addresses."""
        argv = ["join", "--stage", stage, "--device-id", name, "--run-id", f"{self.run_id}@{self.run_fp}"]
        args = build_parser().parse_args([*argv, "--initial-peers", *self.initial, *extra])
        join.check(args)  # (as `peer join` checks them: --cheat parsed, for one)
        said = self.said[name] = Said()
        session = VolunteerSession(args, name, StateLine(name, out=said))
        self._launch(name, session, session.run)
        self.volunteers[name] = session
        return session

    # ---- faults -----------------------------------------------------------------------------------

    async def crash(self, name: str) -> None:
        """Peer `name`'s host dies: its DHT process is SIGKILLed (its p2p daemon with it), and its
        objects are dropped without a word. A restart under the same name is a new peer."""
        peer = self.servers.pop(name, None) or self.volunteers.pop(name)
        os.kill(peer.dht.pid, signal.SIGKILL)
        peer.stopping = True  # (so that its run's way out announces nothing: there is no one left to)
        run = self.runs.pop(name)
        self.stops.pop(name)
        self.codes.pop(name, None)
        tasks = list(getattr(peer, "tasks", []))
        for t in [*tasks, run]:
            t.cancel()
        await asyncio.gather(run, *tasks, return_exceptions=True)
        if getattr(peer, "writer", None) is not None:
            peer.writer.close()  # (what it had queued reaches the disk: no second writer of the same files)
        log = getattr(getattr(peer, "server", None), "log", None)
        if log is not None:
            log.f.close()
        peer.dht.join(10)
        self.crashed.append(peer)

    def restart(self, device_flags: list[str], initial_peers: list[str] | None = None) -> ServerHost:
        """The server of `device_flags` started again with its own command: same identity, same
        checkpoint folder, no --initial-peers unless given (it finds the run through the peers it
        kept)."""
        return self.start_server(device_flags, initial_peers=initial_peers or [])

    # ---- waiting and the end ----------------------------------------------------------------------

    async def wait(self, predicate, timeout: float, what: str, poll: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            for name, task in self.runs.items():
                if task.done() and isinstance(self.codes.get(name), Exception):
                    raise AssertionError(f"{name} failed while waiting for {what}") from self.codes[name]
            if time.monotonic() > deadline:
                states = "; ".join(f"{n}: {said.lines()[-1:]}" for n, said in self.said.items())
                running = {
                    n: [f"{f.f_code.co_name}:{f.f_lineno}" for f in t.get_stack()]
                    for n, t in self.runs.items()
                    if not t.done()
                }
                raise TimeoutError(f"{what}: not within {timeout} s (last lines: {states}; still in: {running})")
            await asyncio.sleep(poll)

    async def wait_version(self, device: str, version: int, timeout: float = 120.0) -> None:
        host = self.servers[device]
        await self.wait(
            lambda: host.server is not None and host.server.version >= version,
            timeout,
            f"{device} to reach version {version}",
        )

    async def ended(self, names=None, timeout: float = 180.0) -> dict[str, int]:
        """Wait until the runs of `names` (default: every peer's) have returned by themselves; their
        return codes."""
        names = list(self.runs) if names is None else list(names)
        await self.wait(lambda: all(self.runs[n].done() for n in names), timeout, f"{' '.join(names)} to end")
        return {n: self.codes[n] for n in names}

    def state(self) -> dict:
        """The run's parameters at its last step, from the live servers (not one refused, whose run
        returned another code than 0: a failed-over server that came back, say)."""
        out = {}
        for name, host in self.servers.items():
            if host.server is not None and self.codes.get(name, 0) == 0:
                for shard in host.server.hosted.values():
                    out.update(shard.params_at(self.steps))
        return out

    async def close(self) -> None:
        """Stop whatever still runs (as SIGTERM would), and wait for it."""
        import gc

        for name, stop in self.stops.items():
            stop.set()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        gc.unfreeze()  # (each server froze what it had built: the test process gets it back)
