"""A server's layout epochs (parameter_server/failover.py) as a part on its own, with fake shards and
parts: a record that does not fit the run is refused and changes nothing; a newer epoch takes a lost
server's slot over from its replica, moves the placement, resets the data path and tells the parts;
an older one is ignored; a rollback the shards no longer keep is refused before anything changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core.layout import RunLayout
from core.protocol.wire import PayloadError
from parameter_server.failover import Failover, Placement

LAYOUT = RunLayout.even(2, 4, 2, 1)  # stage 0: s0f0, s0f1 (frontal), s0b0; slots 0, 1, 2


class Shard:
    def __init__(self, version, keeps_from=0):
        self.version, self.keeps_from, self.rollback_epoch, self.batches = version, keeps_from, 0, {1: "rows"}

    def keeps(self, v):
        return v >= self.keeps_from

    def rollback(self, v, epoch):
        self.version, self.rollback_epoch = v, epoch
        return True


def make():
    seen = {"reset": 0, "forgot": 0, "banned": [], "epochs": [], "adopted": []}
    placement = Placement(LAYOUT, 0, None, LAYOUT.stages[0], 0)
    hosted, replicas = {0: Shard(6)}, {1: Shard(5), 2: Shard(6)}
    epochs = Failover(
        device_id="s0f0",
        peer_id="peer-s0f0",
        stage=0,
        role="frontal",
        steps=20,
        layers=4,
        placement=placement,
        hosted=hosted,
        replicas=replicas,
        clipping=SimpleNamespace(forget_sums_from=lambda v, e: None),
        evaluation=SimpleNamespace(forget_evals_from=lambda v: None),
        bans=SimpleNamespace(ban_here=lambda peer, why: seen["banned"].append(peer)),
        pins=SimpleNamespace(release=lambda: None),
        directory=SimpleNamespace(new_epoch=lambda: None, is_server=lambda p: p == "peer-s0b0"),
        copies=SimpleNamespace(new_epoch=lambda: None, replicate_hosted=lambda: None),
        report=None,
        old_versions=lambda: None,
        connector=lambda: None,
        replaying=lambda: False,
        log=lambda: None,
        reset_datapath=lambda: seen.__setitem__("reset", seen["reset"] + 1),
        forget_checks=lambda: seen.__setitem__("forgot", seen["forgot"] + 1),
        wake_waiters=lambda: None,
        start_batches=lambda: None,
    )
    epochs.on_epoch.append(seen["epochs"].append)
    epochs.on_adopt.append(seen["adopted"].append)
    return epochs, placement, hosted, replicas, seen


def record(epoch=1, lost="s0f1", **more):
    return {"epoch": epoch, "layout": LAYOUT.without({lost: "s0f0"}).to_dict(), "from_batch": 4, **more}


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"from_batch": 20}, "from_batch 20 outside"),
        ({"banned": [7]}, "'banned' must list peer ids"),
        ({"rollback_to": 5}, "rollback_to 5 outside"),
        ({"layout": RunLayout.even(2, 4, 1, 1).to_dict()}, "keep the stages"),
    ],
)
def test_a_record_that_does_not_fit_the_run_is_refused_and_changes_nothing(bad, words):
    epochs, placement, hosted, _, seen = make()
    with pytest.raises(PayloadError, match=words):
        epochs.adopt(record(**bad))
    assert placement.epoch == 0 and set(hosted) == {0} and seen["reset"] == 0


def test_a_newer_epoch_takes_the_lost_slot_over_from_its_replica():
    epochs, placement, hosted, replicas, seen = make()
    assert epochs.adopt(record(banned=["peer-liar"]))
    assert set(hosted) == {0, 1} and 1 not in replicas and hosted[0].batches == {}
    assert (placement.epoch, placement.reflow_from, placement.st.hosts) == (1, 4, ("s0f0", "s0f0", "s0b0"))
    assert seen["reset"] == 1 and seen["banned"] == ["peer-liar"] and len(seen["epochs"]) == len(seen["adopted"]) == 1
    assert not epochs.adopt(record())  # not newer: ignored


def test_a_rollback_the_shards_no_longer_keep_is_refused_before_anything_changes():
    epochs, placement, hosted, replicas, seen = make()
    hosted[0].keeps_from = 3
    with pytest.raises(PayloadError, match="no longer keeps version 2"):
        epochs.adopt(record(rollback_to=2))
    assert set(hosted) == {0} and 1 in replicas and placement.epoch == 0
    assert epochs.adopt(record(rollback_to=3)) and hosted[0].version == 3 and seen["forgot"] == 1
