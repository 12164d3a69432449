"""A server's ping, status and announcement (parameter_server/status.py) as a part on its own, with
fake shards and parts: what the status says, the last 16 versions' times kept, and the volunteers an
announcement counts (each once, servers apart, leavers as left)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from parameter_server.place import ServerPlace
from parameter_server.status import Status


class Links:
    def __init__(self):
        self.sent = []

    async def send(self, device, nbytes):
        self.sent.append((device, nbytes))


def make():
    shard = SimpleNamespace(
        version=5,
        losses={3: 1.5, 4: 1.25},
        duplicates=1,
        microbatches_applied=20,
        memory_from=lambda: 2,
        kept_from=lambda: 0,
    )
    clients = {}
    pool = SimpleNamespace(stats=lambda: {"duplicates": 2, "requeued": 3, "queued": 0})
    status = Status(
        place=ServerPlace("s0f0", 0, "frontal", 0, False),
        links=Links(),
        clients=clients,
        shard=shard,
        stage_layers=lambda: (0, 2),
        pool=lambda: pool,
        hosted=lambda: {0: shard},
        replicas=lambda: {1: SimpleNamespace(version=4)},
        version=lambda: 5,
        epoch=lambda: 1,
        halted=lambda: None,
        evaluation=SimpleNamespace(eval_losses={4: 2.0}),
        clipping=SimpleNamespace(grad_norms={3: 0.5}),
        deltas=SimpleNamespace(sent=7, declined=1),
        arrivals=SimpleNamespace(honest_distance=lambda: 3e-7),
        bans=SimpleNamespace(banned={"liar": "re-run off"}),
        counters={"payload_errors": 4, "relay_duplicates": 1, "output_duplicates": 0},
        check_counts={"checked": 9},
        tasks_by_device={"v0": 11},
    )
    return status, clients


def test_the_status_says_the_servers_state_and_its_parts():
    status, clients = make()
    clients["peer-v0"] = SimpleNamespace(device="v0", compute=2.0, tasks_done=11)
    s = status.status()
    assert (s["device"], s["stage"], s["role"], s["version"], s["epoch"]) == ("s0f0", 0, "frontal", 5, 1)
    assert s["hosted"] == {"0": 5} and s["replicas"] == {"1": 4} and s["kept_from"] == {"0": 2}
    assert s["duplicates"] == 1 + 2 + 1 and s["requeued"] == 3 and s["param_deltas"] == {"sent": 7, "declined": 1}
    assert s["losses"] == {"3": 1.5, "4": 1.25} and s["eval_losses"] == {"4": 2.0} and s["grad_norms"] == {"3": 0.5}
    assert s["checks"] == {"checked": 9, "max_honest_distance": 3e-7} and s["banned"] == {"liar": "re-run off"}
    assert s["clients"] == {"peer-v0": {"device": "v0", "compute": 2.0, "tasks_done": 11}}
    assert status.status(recent=1)["losses"] == {"4": 1.25}


def test_a_ping_answers_its_size_and_goes_back_over_an_unregistered_probers_link():
    status, clients = make()
    answer = asyncio.run(status.on_ping({"device": "v9"}, [torch.zeros(4)], "peer-v9"))
    assert answer == {"ok": True, "received": 16, "stage": 0} and status.links.sent == [("v9", 64)]
    clients["peer-v9"] = SimpleNamespace()
    asyncio.run(status.on_ping({"device": "v9"}, [], "peer-v9"))
    assert status.links.sent == [("v9", 64)]  # registered: its own link already counts its calls


def test_the_last_16_versions_times_are_kept(monkeypatch):
    status, _ = make()
    for v in range(40):
        status.note_step(v)
    assert sorted(status.step_times) == list(range(24, 40))


def test_an_announcement_counts_each_volunteer_once_and_servers_apart():
    status, clients = make()
    clients.update({p: SimpleNamespace(device=p, compute=1.5, tasks_done=0) for p in ("peer-a", "peer-b", "peer-s1f0")})
    stats = status.announcement("online", [], 1.0, servers={"peer-s1f0"}).stats
    assert (stats["clients_joined"], stats["clients_left"], stats["volunteers"]) == (2, 0, 2)
    assert stats["volunteer_compute"] == 3.0 and stats["ban_reach"] == 5 and stats["banned"] == 1
    del clients["peer-a"]
    record = status.announcement("online", ["/ip4/127.0.0.1/tcp/1"], 1.0, servers={"peer-s1f0"}, says="x" * 999)
    assert (record.stats["clients_joined"], record.stats["clients_left"]) == (2, 1)
    assert record.layers == [0, 2] and len(record.says) < 999 and record.device == "s0f0"
