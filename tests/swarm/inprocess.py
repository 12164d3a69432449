"""All servers and workers of a run in one event loop, wired by LocalLinks (the same handlers and
checks as over P2P, without the network). For fast logic tests of the servers and workers; a run's
life as a server process lives it (peer.host.ServerHost: finding the run, waiting, the end, restarts)
is tested in tests/swarm/hosts.py, on real DHT nodes. The servers' periodic work and the detection of
a lost server here are the very parts a server process runs (peer.host.Maintenance and
peer.host.FailureDetector), fed by what this swarm knows: which peers are connected, which servers
are gone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from core.layout import RunLayout
from core.model.config import get_preset
from core.model.data import load_corpus
from core.model.transformer import init_state
from core.protocol.leases import LeaseTickets
from core.protocol.records import RunConfig
from parameter_server.service import StageServer
from peer.host.failures import FailureDetector
from peer.host.maintenance import Maintenance
from peer.server_links import LocalLink
from peer.volunteer.worker import StageWorker

# the servers of one swarm share the key of its lease tickets, as a run's servers derive it from the run key
TICKETS = LeaseTickets(b"in-process swarm lease key!")


def make_run(
    model="tiny",
    stages=2,
    frontal=1,
    backward=1,
    steps=3,
    seed=0,
    batch_size=16,
    micro_batches=4,
    lr=2e-3,
    recipe=None,
    precision="fp32",
    eval_every=0,
):
    """(cfg, layout, run config) of a run; `recipe`: a core.protocol.recipe.Recipe (its lr is the run's)."""
    cfg = get_preset(model)
    layout = RunLayout.even(stages, cfg.layers, frontal, backward)
    if recipe is not None:
        lr = recipe.lr
    run = RunConfig(
        "test",
        model,
        seed,
        steps,
        batch_size,
        micro_batches,
        lr,
        layout.to_dict(),
        announce_period=1.0,
        recipe=None if recipe is None else recipe.record(),
        precision=precision,
        eval_every=eval_every,
    )
    return cfg, layout, run


class InProcessSwarm:
    def __init__(
        self, cfg, layout, run, corpus=None, volunteers_per_stage=1, servers_compute=True, server_options=None
    ):
        self.cfg, self.layout, self.run = cfg, layout, run
        self.server_options = dict(server_options or {})  # more of StageServer's arguments, for every server
        self.corpus = corpus or load_corpus(None, seq_len=cfg.seq_len)
        self.servers: dict[str, StageServer] = {dev: self.new_server(dev) for st in layout.stages for dev in st.servers}
        directory = {d: f"peer-{d}" for d in self.servers}
        for s in self.servers.values():
            s.directory.update(directory)
        self.workers: list[StageWorker] = []
        for st in layout.stages:
            names = (list(st.servers) if servers_compute else []) + [
                f"u{st.index}{i}" for i in range(volunteers_per_stage)
            ]
            for name in names:
                peer = f"peer-{name}"
                links = {d: LocalLink(self.servers[d], peer) for d in st.servers}
                self.workers.append(
                    StageWorker(
                        run=run,
                        layout=layout,
                        cfg=cfg,
                        stage=st.index,
                        device_id=name,
                        links=links,
                        compute=1.0,
                        poll=0.005,
                    )
                )

    def new_server(self, dev: str) -> StageServer:
        """Server `dev` of the first layout, fresh (its calls to other servers go to this swarm's)."""
        st = self.layout.stages[self.layout.locate(dev)[0]]
        return StageServer(
            run=self.run,
            layout=self.layout,
            cfg=self.cfg,
            device_id=dev,
            peer_id=f"peer-{dev}",
            stage_params=init_state(self.cfg, *st.layers, self.run.seed),
            corpus=self.corpus,
            connector=lambda d: LocalLink(self.servers[d], f"peer-{dev}"),
            lease_tickets=TICKETS,
        )

    def connected(self) -> set[str]:
        """The peers a server's node would list as connected: the live servers and running workers."""
        live = {f"peer-{d}" for d in self.servers}
        tasks = getattr(self, "tasks", [])
        return live | {f"peer-{w.device_id}" for w, t in zip(self.workers, tasks) if not t.done()}

    def versions(self) -> list[int]:
        return [s.version for s in self.servers.values()]

    async def lose(self, device: str, failover_after: float = 3.0) -> dict:
        """Server `device` is gone for good (every call to it fails, its own worker stops). Each
        remaining server's FailureDetector looks, then looks again `failover_after` seconds later (a
        clock of this swarm's): the server is silent and deaf to a ping, so the first remaining server
        fails it over. Returns the new layout epoch's record."""
        server = self.servers.pop(device)

        async def gone(*args, **kwargs):
            raise ConnectionError(f"{device} is gone")

        server.surface.handle = gone
        for worker, task in zip(self.workers, self.tasks):
            if worker.device_id == device:
                task.cancel()
        now = [0.0]
        swarm = self

        class Seen:  # what a server's directory says: a gone server is silent for ever
            finished: set = set()

            def silent_for(self, d: str) -> float:
                return 0.0 if d in swarm.servers else float("inf")

        async def answers(d: str) -> bool:
            return d in self.servers

        detectors = [
            FailureDetector(s, Seen(), d, self.run.announce_period, failover_after, answers, clock=lambda: now[0])
            for d, s in self.servers.items()
        ]
        for det in detectors:
            await det.check()
        now[0] += failover_after + 0.1
        for det in detectors:
            await det.check()
        records = [det.record for det in detectors if det.record is not None]
        assert len(records) == 1, f"{len(records)} servers failed {device} over"
        return records[0]

    async def train(self, timeout: float = 120.0, at_version: dict | None = None) -> dict:
        """Run until every server has applied the last batch; `at_version` maps a version to a
        coroutine function run once the slowest server reaches it."""
        stop = asyncio.Event()
        at_version = dict(at_version or {})
        tasks = self.tasks = [asyncio.ensure_future(w.run_loop(stop)) for w in self.workers]

        swarm = self

        class Connections:  # what a server's p2p daemon lists as connected
            async def list_peers(self):
                return [SimpleNamespace(peer_id=p) for p in swarm.connected()]

        async def maintain():  # each server's Maintenance, every 10 ms (a server process: every 0.2 s)
            parts = {}
            while not stop.is_set():
                for d, s in list(self.servers.items()):
                    if d not in parts or parts[d].server is not s:
                        parts[d] = Maintenance(s, Connections(), d, period=0.01)
                    await parts[d].once()
                await asyncio.sleep(0.01)

        tasks.append(asyncio.ensure_future(maintain()))
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while min(self.versions()) < self.run.steps:
                versions = {d: s.version for d, s in self.servers.items()}
                for s in self.servers.values():
                    s.directory.run_versions = versions
                for v in [v for v in at_version if min(self.versions()) >= v]:
                    await at_version.pop(v)()
                if loop.time() > deadline:
                    raise TimeoutError(f"versions {self.versions()} after {timeout} s")
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception():
                        raise t.exception()
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        state = {}
        for s in self.servers.values():
            for shard in s.hosted.values():
                state.update(shard.params_at(self.run.steps))
        return state


def one_worker_on_a_clock():
    """One stage's frontal server on an injected clock (`now[0]`), one volunteer and its link."""
    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    now = [100.0]
    fs.clock = lambda: now[0]
    fs.reset_datapath()  # its pool on the injected clock
    (a,) = swarm.workers
    return fs, a, a.links[fs.device_id], now
