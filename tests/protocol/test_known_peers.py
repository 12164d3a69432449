"""A server's kept peers (peer/host/known_peers.py): the run's other servers' multiaddrs in its
checkpoint folder, read back by a restart without --initial-peers."""

from __future__ import annotations

import logging
import os

from peer.host.known_peers import KnownPeers

A = "/ip4/127.0.0.1/tcp/4001/p2p/QmA"
B = "/ip4/127.0.0.1/tcp/4002/p2p/QmB"


def test_what_is_remembered_is_read_back_by_the_next_start(tmp_path):
    kept = KnownPeers(str(tmp_path), "s0f0")
    assert kept.read() == []  # nothing kept yet
    kept.remember([B, A, "/ip4/127.0.0.1/tcp/4003"])  # (an address without a peer id cannot be dialled)
    assert KnownPeers(str(tmp_path), "s0f0").read() == [A, B]
    assert KnownPeers(str(tmp_path), "s0b0").read() == []  # each server its own file
    assert sorted(os.listdir(tmp_path)) == ["s0f0.peers"]  # (written whole: no .tmp left)


def test_an_unchanged_list_is_not_written_again_and_an_empty_one_never(tmp_path):
    kept = KnownPeers(str(tmp_path), "s0f0")
    kept.remember([A])
    path = tmp_path / "s0f0.peers"
    path.write_text(B + "\n")  # (changed behind its back: an unchanged list is not rewritten over it)
    kept.remember([A])
    assert path.read_text() == B + "\n"
    kept.remember([])
    assert path.read_text() == B + "\n"


def test_without_a_folder_nothing_is_kept():
    kept = KnownPeers(None, "s0f0")
    kept.remember([A])
    assert kept.path is None and kept.read() == []


def test_an_unwritable_folder_is_said_not_raised(tmp_path, caplog):
    kept = KnownPeers(str(tmp_path / "missing"), "s0f0")
    with caplog.at_level(logging.INFO, logger="hivepipe.serve"):
        kept.remember([A])
    assert kept.read() == [] and "cannot keep the run's peers" in caplog.text
