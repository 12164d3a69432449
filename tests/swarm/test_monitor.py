"""The launcher's Monitor: the final statuses and the model assembled from the slots' hosts."""

import asyncio

import pytest
import torch

from core.layout import RunLayout
from core.protocol.params import NotReady
from peer.launcher.monitor import Monitor
from peer.server_links import DialError


class Trailing:
    """A host whose slot reaches `version` only after `behind` more asks (as a slot adopted at a
    failover can trail its host's own shard); it answers `retry` until then, as the server does."""

    def __init__(self, device: str, behind: int):
        self.device, self.behind, self.asked = device, behind, 0

    async def call(self, method, meta, tensors=(), timeout=30.0):
        assert method == "get_params"
        self.asked += 1
        if self.asked <= self.behind:
            return {"retry": True, "version": meta["version"] - 1}, []
        return {"version": meta["version"], "names": [f"{self.device}.{meta['slot']}"]}, [torch.tensor([meta["slot"]])]


def test_assemble_waits_for_a_slot_that_trails_and_names_one_that_never_comes():
    layout = RunLayout.even(2, 4, 1, 1)
    monitor = Monitor(None, None, "run", layout, tokens_per_batch=1)
    links = {
        d: Trailing(d, behind=3 if d == layout.stages[1].hosts[0] else 0) for st in layout.stages for d in st.hosts
    }
    monitor._link = lambda d: links[d]
    state = asyncio.run(monitor.assemble(5, patience=10.0, poll=0.01))
    assert sorted(state) == sorted(f"{d}.{slot}" for st in layout.stages for slot, d in enumerate(st.hosts))
    assert links[layout.stages[1].hosts[0]].asked == 4  # three `retry` answers, then the slot
    never = layout.stages[0].hosts[0]
    links[never] = Trailing(never, behind=10**9)
    with pytest.raises(NotReady, match=f"{never} holds slot 0 at version 4, not 5"):
        asyncio.run(monitor.assemble(5, patience=0.05, poll=0.01))


class Away:
    """A server in its dial backoff for `away` more calls (just brought back: the launcher's DHT node
    failed to reach it while it was down, and libp2p refuses to dial it again for some seconds)."""

    def __init__(self, device: str, away: int):
        self.device, self.away, self.calls = device, away, 0

    def retry_in(self) -> float:
        return 0.01

    async def call(self, method, meta, tensors=(), timeout=30.0):
        self.calls += 1
        if self.calls <= self.away:
            raise DialError(f"{self.device}: unreachable, next dial in 0.3 s")
        return {"device": self.device, "method": method}, []


def test_statuses_wait_out_a_server_in_its_dial_backoff_and_name_one_that_stays_away():
    layout = RunLayout.even(2, 4, 1, 1)
    monitor = Monitor(None, None, "run", layout, tokens_per_batch=1)
    back = layout.stages[1].backward[0]
    links = {d: Away(d, away=4 if d == back else 0) for d in monitor.all_devices()}
    monitor._link = lambda d: links[d]
    statuses = asyncio.run(monitor.statuses(patience=10.0))
    assert statuses[back] == {"device": back, "method": "status"} and links[back].calls == 5
    links[back] = Away(back, away=10**9)
    with pytest.raises(DialError, match=f"{back}: unreachable"):
        asyncio.run(monitor.statuses(patience=0.05))


def test_the_final_statuses_are_read_once_every_slot_has_the_last_version():
    """The summary counts each stage's applied micro-batches from the servers' statuses. A slot
    adopted at a failover can trail its host's own shard by a step or two; statuses read before the
    model was assembled counted its last batch as not applied (in CI: 52 of 56). `final`,
    asked before the run has reached the last version at all (real servers, in one loop), answers
    once every slot has it: every micro-batch counted, the last version's model."""
    from peer.server_links import LocalLink
    from tests.swarm.harness import rel_diff
    from tests.swarm.inprocess import InProcessSwarm, make_run

    steps = 3
    cfg, layout, run = make_run(steps=steps, frontal=2, backward=1)
    swarm = InProcessSwarm(cfg, layout, run)
    monitor = Monitor(None, None, run.run_id, layout, tokens_per_batch=1)
    monitor._link = lambda d: LocalLink(swarm.servers[d], "launcher")

    async def scenario():
        final = asyncio.ensure_future(monitor.final(steps))
        await asyncio.sleep(0)
        trained = await swarm.train(timeout=120)
        return trained, await final

    trained, (statuses, state) = asyncio.run(scenario())
    assert {st.index: statuses[st.servers[0]]["microbatches_applied"] for st in layout.stages} == {
        st.index: steps * run.micro_batches for st in layout.stages
    }
    assert rel_diff(state, trained) == 0
