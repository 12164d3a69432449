"""The run's servers as a server knows them (parameter_server/directory.py), as a part on its own:
a server once read stays known, versions only from this layout epoch's announcements, a peer is a
server only while its device is in the layout, and the run's lowest version."""

from __future__ import annotations

from types import SimpleNamespace

from parameter_server.directory import Directory


def make():
    state = {
        "layout": SimpleNamespace(
            stages=[SimpleNamespace(servers=["s0f0", "s0b0"]), SimpleNamespace(servers=["s1f0"])]
        ),
        "epoch": 0,
        "replaying": False,
    }
    directory = Directory(
        device_id="s0f0",
        peer_id="peer-s0f0",
        layout=lambda: state["layout"],
        epoch=lambda: state["epoch"],
        version=lambda: 7,
        replaying=lambda: state["replaying"],
    )
    return directory, state


def test_a_server_once_read_stays_known_and_versions_come_from_this_epoch_only():
    directory, state = make()
    directory.update({"s0b0": "peer-s0b0", "s1f0": "peer-s1f0"}, {"s0b0": 6, "s1f0": 9}, {"s0b0": 0, "s1f0": 1})
    directory.update({"s0b0": "peer-s0b0"})  # a read that missed s1f0's record
    assert directory.peer_of("s1f0") == "peer-s1f0" and directory.device_of("peer-s1f0") == "s1f0"
    assert directory.run_versions == {"s0b0": 6} and directory.run_min_version() == 0  # s1f0 unknown here: 0
    directory.update({}, {"s1f0": 8}, {"s1f0": 0})
    assert directory.run_min_version() == 6
    state["epoch"] = 1
    directory.new_epoch()
    assert directory.run_versions == {} and directory.run_min_version() == 0


def test_a_peer_is_a_server_while_its_device_is_in_the_layout():
    directory, state = make()
    directory.update({"s0b0": "peer-s0b0", "s9f9": "peer-s9f9"})
    assert directory.is_server("peer-s0f0") and directory.is_server("peer-s0b0")
    assert not directory.is_server("peer-s9f9") and not directory.is_server("peer-volunteer")
    state["layout"] = SimpleNamespace(stages=[SimpleNamespace(servers=["s0f0"]), SimpleNamespace(servers=["s1f0"])])
    assert not directory.is_server("peer-s0b0")  # failed over: no longer one of the run's servers
    state["replaying"] = True
    assert directory.is_server("peer-volunteer")  # a replay trusts what it replays
