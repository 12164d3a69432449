"""All servers and workers of a run in one event loop, wired by LocalLinks (the same handlers and
checks as over P2P, without the network). For fast logic tests; the end-to-end tests use real
processes and real hivemind P2P."""

from __future__ import annotations

import asyncio

from parameter_server.layout import RunLayout
from parameter_server.service import StageServer
from peer.model.config import get_preset
from peer.model.data import load_corpus
from peer.model.transformer import init_state
from peer.node import LocalLink
from peer.protocol.leases import LeaseTickets
from peer.protocol.records import RunConfig
from peer.volunteer.worker import StageWorker

# the servers of one swarm share the key of its lease tickets, as a run's servers derive it from the run key
TICKETS = LeaseTickets(b"in-process swarm lease key!")


def make_run(model="tiny", stages=2, frontal=1, backward=1, steps=3, seed=0, batch_size=16, micro_batches=4, lr=2e-3):
    cfg = get_preset(model)
    layout = RunLayout.even(stages, cfg.layers, frontal, backward)
    run = RunConfig("test", model, seed, steps, batch_size, micro_batches, lr, layout.to_dict(), announce_period=1.0)
    return cfg, layout, run


class InProcessSwarm:
    def __init__(self, cfg, layout, run, corpus=None, volunteers_per_stage=1, servers_compute=True):
        self.cfg, self.layout, self.run = cfg, layout, run
        self.corpus = corpus or load_corpus(None, seq_len=cfg.seq_len)
        self.servers: dict[str, StageServer] = {dev: self.new_server(dev) for st in layout.stages for dev in st.servers}
        directory = {d: f"peer-{d}" for d in self.servers}
        for s in self.servers.values():
            s.set_directory(directory)
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

    def versions(self) -> list[int]:
        return [s.version for s in self.servers.values()]

    async def lose(self, device: str) -> dict:
        """Server `device` is gone for good (every call to it fails, its own worker stops); the first
        remaining server coordinates the failover. Returns the new layout epoch's record."""
        server = self.servers.pop(device)

        async def gone(*args, **kwargs):
            raise ConnectionError(f"{device} is gone")

        server.handle = gone
        for worker, task in zip(self.workers, self.tasks):
            if worker.device_id == device:
                task.cancel()
        return await next(iter(self.servers.values())).fail_over([device])

    async def train(self, timeout: float = 120.0, at_version: dict | None = None) -> dict:
        """Run until every server has applied the last batch; `at_version` maps a version to a
        coroutine function run once the slowest server reaches it."""
        stop = asyncio.Event()
        at_version = dict(at_version or {})
        tasks = self.tasks = [asyncio.ensure_future(w.run_loop(stop)) for w in self.workers]

        async def maintain():
            while not stop.is_set():
                for s in self.servers.values():
                    s.maintenance()
                    s.maybe_start_batches()
                await asyncio.sleep(0.01)

        tasks.append(asyncio.ensure_future(maintain()))
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while min(self.versions()) < self.run.steps:
                versions = {d: s.version for d, s in self.servers.items()}
                for s in self.servers.values():
                    s.run_versions = versions
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
