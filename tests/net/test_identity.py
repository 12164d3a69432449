"""A server's identity file: one that `start_dht` writes itself is nobody else's, so the start skips
hivemind's check that no live peer holds it (a second p2p daemon bootstrapped into the swarm, for
each of a swarm's servers); one already on disk is checked (real DHT nodes and p2p daemons on
127.0.0.1). hivemind's check is best effort; a server whose identity a live server of its run holds is
refused by the run's own records (peer.host.twin; tested in tests/swarm/test_hosts.py)."""

from __future__ import annotations

import os

import pytest
from hivemind.p2p import P2P

from peer.addresses import visible_maddrs
from peer.node import NetworkStartError, _claim_new_identity, start_dht, stop_dht


def test_a_new_identity_path_is_claimed_by_one_caller_only(tmp_path):
    path = str(tmp_path / "s0f0.key")
    assert _claim_new_identity(path)
    written = open(path, "rb").read()
    assert not _claim_new_identity(path)  # there by now: someone else's, left as it is
    assert open(path, "rb").read() == written
    assert sorted(os.listdir(tmp_path)) == ["s0f0.key"]  # no temporary file left beside it


@pytest.mark.stress
def test_an_identity_made_at_start_is_not_checked_and_one_on_disk_is(tmp_path, monkeypatch):
    checked = tmp_path / "checked"
    original = P2P.is_identity_taken.__func__

    async def recorded(cls, identity_path, **kwargs):  # runs in the DHT's forked process: a file says so
        with open(checked, "a") as f:
            f.write(os.path.basename(identity_path) + "\n")
        return await original(cls, identity_path, **kwargs)

    monkeypatch.setattr(P2P, "is_identity_taken", classmethod(recorded))
    boot = start_dht(run_id="identity", run_fp=None)
    key = str(tmp_path / "server.key")
    try:
        peers = visible_maddrs(boot)
        first = start_dht(peers, run_id="identity", run_fp=None, identity_path=key)
        try:
            assert os.path.exists(key) and not checked.exists()  # written by this start: not checked
            # hivemind's check runs for an identity on disk; it finds the holder through the libp2p
            # DHT of the initial peers, best effort (under load it can miss a live holder): the
            # guarantee that a live server's identity is refused rests on the run's own records
            # (peer.host.twin, tests/swarm/test_hosts.py), so here only that the check ran is asserted
            try:
                stop_dht(start_dht(peers, run_id="identity", run_fp=None, identity_path=key))
            except NetworkStartError as e:
                assert "already taken" in str(e), e
            assert checked.read_text().split() == ["server.key"]
        finally:
            stop_dht(first)
        again = start_dht(peers, run_id="identity", run_fp=None, identity_path=key)  # its holder gone: free
        stop_dht(again)
        assert checked.read_text().split() == ["server.key"] * 2
    finally:
        stop_dht(boot)
