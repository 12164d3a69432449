"""What a server remembers of what its volunteers sent (parameter_server/arrivals.py) as a part on its
own: probation then the sample, a contribution shared by k servers, the batches a ban must reach and
their forgetting, an outsized push, the oldest unsettled work, and a banned peer refused by code."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from core.protocol.refusals import Refusal
from core.protocol.wire import PayloadError
from parameter_server.arrivals import NORM_FACTOR, Arrivals


class NoDrift:
    def __init__(self, suspects=()):
        self.suspected = set(suspects)

    def suspicious(self, peer):
        return peer in self.suspected

    def suspects(self):
        return set(self.suspected)

    def forget(self, peer):
        self.suspected.discard(peer)


def make(rate=0.0, probation=2, drift=None):
    state = {"kept": 0, "replaying": False}
    clients, banned, counts = {}, {}, {"passed": 0}
    arrivals = Arrivals(
        verify_rate=rate,
        probation=probation,
        rng=random.Random(0),
        drift=drift or NoDrift(),
        counts=counts,
        banned=banned,
        clients=clients,
        is_server=lambda peer: peer.startswith("server"),
        replaying=lambda: state["replaying"],
        kept_from=lambda: state["kept"],
    )
    return arrivals, state, clients, banned, counts


def test_probation_checks_every_contribution_then_the_sample_decides():
    arrivals, _, clients, _, counts = make(rate=0.0, probation=2)
    clients["v"] = SimpleNamespace()
    assert arrivals.note_contribution("v", 0) and arrivals.note_contribution("v", 1)
    arrivals.passed("v", [1e-7])
    assert arrivals.note_contribution("v", 2)  # one check passed of two
    arrivals.passed("v", [3e-7])
    assert not arrivals.note_contribution("v", 3)  # rate 0 past probation
    assert arrivals.cleared == {"v"} and counts["passed"] == 2 and arrivals.honest_distance() == 3e-7


def test_a_drifting_volunteer_stays_checked_and_unsettled_after_probation():
    drift = NoDrift({"liar"})
    arrivals, _, clients, _, _ = make(rate=0.0, probation=1, drift=drift)
    clients["liar"] = SimpleNamespace()
    arrivals.note_contribution("liar", 4)
    arrivals.passed("liar", [0.0])
    assert "liar" not in arrivals.cleared and arrivals.note_contribution("liar", 5)
    assert arrivals.unsettled_first() == 4
    drift.suspected.clear()
    arrivals.passed("liar", [0.0])
    assert "liar" in arrivals.cleared and arrivals.unsettled_first() is None


@pytest.mark.parametrize("k", [1, 2, 4])
def test_work_that_k_servers_receive_is_checked_by_one_of_them_at_the_rate(k):
    arrivals, _, clients, _, _ = make(rate=0.1, probation=0)
    clients["v"] = SimpleNamespace()
    share = sum(any(arrivals.note_contribution("v", 2, shared_by=k) for _ in range(k)) for _ in range(4000)) / 4000
    assert 0.08 < share < 0.12


def test_a_servers_work_and_a_replay_are_not_remembered():
    arrivals, state, _, _, _ = make(probation=5)
    assert not arrivals.note_contribution("server-s0f0", 1)
    state["replaying"] = True
    assert not arrivals.note_contribution("v", 1)
    assert arrivals.contributed == {}


def test_batches_out_of_reach_are_dropped_and_departed_volunteers_forgotten():
    arrivals, state, clients, banned, _ = make(probation=1)
    clients["stays"] = clients["goes"] = SimpleNamespace()
    for t in range(6):
        arrivals.note_work("stays", t)
        arrivals.note_work("goes", t)
    arrivals.passed("goes", [2e-7])
    state["kept"] = 4
    arrivals.note_work("stays", 6)
    assert arrivals.contributed["stays"] == {4, 5, 6} and arrivals.first_contributed["stays"] == 0
    del clients["goes"]
    arrivals.forget_departed()
    assert "goes" in arrivals.contributed  # its batches 4 and 5 are still within reach
    state["kept"] = 7
    arrivals.forget_departed()
    assert "goes" not in arrivals.contributed and "goes" not in arrivals.checks_passed
    assert arrivals.departed_distance == 2e-7 and "stays" in arrivals.contributed


def test_an_outsized_push_is_flagged_once_the_slot_has_a_history():
    arrivals, _, _, _, counts = make()
    one = [torch.ones(4)]
    assert not any(arrivals.unusual_norm(0, one, rows=2) for _ in range(8))
    assert not arrivals.unusual_norm(0, [torch.ones(4) * NORM_FACTOR * 0.99], rows=2)
    assert arrivals.unusual_norm(0, [torch.ones(4) * NORM_FACTOR * 1.5], rows=2)
    assert not arrivals.unusual_norm(1, [torch.ones(4) * 1e6], rows=2)  # another slot: no history yet
    assert counts["unusual_norms"] == 1


def test_a_banned_peer_is_refused_by_its_code():
    arrivals, _, _, banned, _ = make()
    arrivals.refuse_banned("v")
    banned["v"] = "re-run 0.5 off"
    with pytest.raises(PayloadError) as e:
        arrivals.refuse_banned("v")
    assert e.value.refusal == Refusal.BANNED
