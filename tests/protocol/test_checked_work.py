"""The pieces of checked work that need no network: a shard's rollback to a kept version (parameters
and AdamW state), the request log's drop of undone batches, the distance a re-run is judged by, and
the test tool that lies (`peer join --cheat`)."""

from __future__ import annotations

import pytest
import torch

from core.protocol.wire import PayloadError
from parameter_server import blob


def _shard(keep: int = 4):
    from parameter_server.shard import ShardState

    return ShardState(
        {"w": torch.zeros(3), "b": torch.ones(2)},
        lr=1e-1,
        rows_per_micro=1,
        micro_batches=1,
        steps=8,
        keep_versions=keep,
    )


def _grads(t: int):
    return [torch.tensor([1.0, -2.0]) * (t + 1), torch.tensor([0.5, 1.0, -1.5]) / (t + 1)]  # names: b, w


def _run(shard, batches, scale=1.0):
    for t in batches:
        assert shard.credit(batch=t, pieces=[(f"B{t}.0.0.0-1", 0, (0, 1))], grads=[g * scale for g in _grads(t)]) == (
            "credited",
            [],
        )
        shard.step()


def test_a_rollback_restores_parameters_and_adamw_state_exactly():
    """Batches 2 and 3 applied with a liar's gradient, rolled back to version 2 and applied again
    honestly: the shard equals one that only ever saw honest gradients, AdamW moments included."""
    clean, dirty = _shard(), _shard()
    _run(clean, range(5))
    _run(dirty, range(2))
    _run(dirty, range(2, 4), scale=1e4)
    assert dirty.rollback(2, epoch=1) is True
    assert dirty.version == 2 and dirty.microbatches_applied == 2 and sorted(dirty.losses) == [0, 1]
    assert sorted(dirty.snapshots) == [1, 2]  # the undone versions are forgotten (the window keeps 4)
    _run(dirty, range(2, 5))
    for n in clean.names:
        assert torch.equal(clean.params[n], dirty.params[n]), n
        a, b = clean.optimizer.state[clean.params[n]], dirty.optimizer.state[dirty.params[n]]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        assert float(a["step"]) == float(b["step"])


def test_a_rollback_is_applied_once_per_epoch_and_refused_beyond_the_kept_versions():
    shard = _shard(keep=3)
    _run(shard, range(5))
    before = {n: p.detach().clone() for n, p in shard.params.items()}
    with pytest.raises(PayloadError, match="no longer kept"):
        shard.rollback(1, epoch=1)
    assert shard.version == 5 and all(torch.equal(before[n], shard.params[n]) for n in before)
    assert shard.rollback(3, epoch=1) is True and shard.version == 3
    _run(shard, [3])
    assert shard.rollback(3, epoch=1) is False and shard.version == 4  # a replayed log does not undo twice
    assert shard.rollback(4, epoch=2) is False  # nothing after version 4 to undo


def test_a_rollback_to_version_zero_clears_adamw_and_survives_a_checkpoint():
    from parameter_server.shard import ShardState

    shard = _shard()
    _run(shard, range(2))
    state = shard.state_dict()
    copy = _shard()
    copy.load_state_dict(state)
    assert copy.rollback(0, epoch=1) and copy.version == 0
    assert not copy.optimizer.state and torch.equal(copy.params["b"], torch.ones(2))
    assert isinstance(copy, ShardState) and copy.rollback_epoch == 1


def test_the_request_log_drops_the_undone_batches(tmp_path):
    from parameter_server.requestlog import RequestLog, read_log

    log = RequestLog(str(tmp_path / "r.log"))
    for b in (1, 2, 3, 4, 9):
        log.append({"method": "push_grads", "batch": b}, [torch.ones(1)])
    log.drop_batches(3, 9)
    assert [r["batch"] for r, _ in read_log(log.path)] == [1, 2, 9]
    log.append({"method": "x", "batch": 3})
    assert [r["batch"] for r, _ in read_log(log.path)] == [1, 2, 9, 3]


def test_distance_is_relative_and_names_every_lie():
    from parameter_server.verify import TOLERANCE, distance
    from peer.volunteer.cheat import Cheat

    g = torch.linspace(-1, 1, 1000)
    assert distance(g, g) == 0.0
    assert distance(g * (1 + 1e-6), g) < 1e-5
    for kind in ("scale", "signflip", "noise", "zeros"):
        assert distance(Cheat.parse(kind).tensor(g), g) > 10 * TOLERANCE, kind
    assert distance(torch.zeros(4), torch.zeros(4)) == 0.0  # an all-zero result that is right


def test_the_cheat_argument_is_parsed_or_named_wrong():
    from peer.volunteer.cheat import Cheat

    assert Cheat.parse("noise@12") == Cheat("noise", 12)
    c = Cheat.parse("scale@3")
    assert not c.active(2) and c.active(3) and c.active(4) and c.loss(2.0) == 2e4
    patient = Cheat.parse("signflip@12/20")
    assert patient == Cheat("signflip", 12, every=20)
    assert [n for n in range(60) if patient.active(n)] == [12, 32, 52]
    for bad, words in (
        ("lazy", "kind must be one of"),
        ("zeros@x", "AFTER"),
        ("zeros@-1", "AFTER"),
        ("zeros@3/0", "EVERY"),
        ("zeros/", "EVERY"),
        ("zeros@3/x", "EVERY"),
    ):
        with pytest.raises(ValueError, match=words):
            Cheat.parse(bad)


def test_peer_join_refuses_a_bad_cheat_before_it_joins():
    from peer.cli import build_parser
    from peer.errors import UsageError
    from peer.join import run

    args = build_parser().parse_args(
        [
            "join",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/1/p2p/QmP5pMMGzUaivesT5jgPHfCw3kTYvobEovLGprfmYjSKWy",
            "--run-id",
            "r",
            "--cheat",
            "lazy",
        ]
    )
    with pytest.raises(UsageError, match="--cheat 'lazy'"):
        run(args)


def test_a_checkpoint_holds_the_current_state_once_and_a_shard_loaded_from_it_steps_on_identically(tmp_path):
    """The current parameters and AdamW state are the current version's kept snapshot and moments:
    the checkpoint file naming the versions carries no tensor, the version's own file carries them,
    and a shard loaded from it takes the next steps bit for bit like the one that wrote it. A state
    written before (parameters and optimizer inline) still loads; one lacking its version refuses."""
    import copy
    from types import SimpleNamespace

    from parameter_server.checkpoint import _history_in, checkpoint_state, write_checkpoint

    shard = _shard(keep=3)
    _run(shard, range(3))
    server = SimpleNamespace(slot=0, hosted={0: shard}, version=shard.version, device_id="s0f0", stage=0, epoch=0)
    write_checkpoint(str(tmp_path), "s0f0", *checkpoint_state(server))
    saved = blob.load(str(tmp_path / "s0f0.shard.pt"))["slots"][0]
    assert not any(isinstance(t, torch.Tensor) for t in _leaves(saved))
    older = copy.deepcopy(shard.state_dict()) | {
        "params": {n: p.detach().clone() for n, p in shard.params.items()},
        "optimizer": copy.deepcopy(shard.optimizer.state_dict()),
    }
    loaded, inline = _shard(keep=3), _shard(keep=3)
    loaded.load_state_dict(_history_in(str(tmp_path), saved))
    inline.load_state_dict(older)
    _run(shard, range(3, 6))
    for copy_ in (loaded, inline):
        _run(copy_, range(3, 6))
        for n in shard.names:
            assert torch.equal(copy_.params[n], shard.params[n]), n
            a, b = copy_.optimizer.state[copy_.params[n]], shard.optimizer.state[shard.params[n]]
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
            assert float(a["step"]) == float(b["step"]) == 6.0
    broken = shard.state_dict()
    del broken["snapshots"][shard.version]
    fresh = _shard(keep=3)
    with pytest.raises(ValueError, match="lacks that version"):
        fresh.load_state_dict(broken)
    assert fresh.version == 0 and torch.equal(fresh.params["w"], torch.zeros(3))


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def test_a_checkpoint_writes_each_kept_version_once_and_reads_back_the_whole_history(tmp_path):
    """The kept versions (what rollbacks and replicas need) live in files of their own, written once
    each: a step adds one file and the oldest goes; a rollback's re-made versions get new files; the
    history read back equals the shard's, AdamW moments included."""
    import os
    from types import SimpleNamespace

    from parameter_server.checkpoint import _history_in, checkpoint_state, write_checkpoint, write_replica

    shard = _shard(keep=3)
    server = SimpleNamespace(slot=0, hosted={0: shard}, version=0, device_id="s0f0", stage=0, epoch=0)

    def write() -> dict[str, float]:
        server.version = shard.version
        write_checkpoint(str(tmp_path), "s0f0", *checkpoint_state(server))
        return {f: os.stat(tmp_path / f).st_mtime_ns for f in os.listdir(tmp_path) if ".history." in f}

    _run(shard, range(3))
    files = write()
    assert len(files) == 3  # versions 1, 2, 3
    _run(shard, [3])
    again = write()
    assert len(again) == 3 and len(set(again) - set(files)) == 1  # one new version file, the oldest gone
    assert all(again[f] == files[f] for f in set(again) & set(files))  # the others were not rewritten
    assert shard.rollback(2, epoch=1)
    _run(shard, [2, 3])
    redone = write()
    assert len(redone) == 3 and len(set(redone) - set(again)) == 2  # versions 3 and 4 were made anew
    saved = blob.load(str(tmp_path / "s0f0.shard.pt"))["slots"][0]
    assert "snapshots" not in saved
    copy = _shard(keep=3)
    copy.load_state_dict(_history_in(str(tmp_path), saved))
    assert sorted(copy.snapshots) == sorted(shard.snapshots) == [2, 3, 4]
    for v in shard.snapshots:
        assert all(torch.equal(copy.snapshots[v][n], shard.snapshots[v][n]) for n in shard.names)
        for n in shard.names:
            assert copy.moments[v][n][0] == shard.moments[v][n][0]
            assert torch.equal(copy.moments[v][n][1], shard.moments[v][n][1])
    write_replica(str(tmp_path), "s0b0", 1, shard.state_dict())  # a replica's history beside it, apart
    assert len([f for f in os.listdir(tmp_path) if f.startswith("s0b0.replica1.history.")]) == 3
    assert len([f for f in os.listdir(tmp_path) if f.startswith("s0f0.history.")]) == 3


@pytest.mark.parametrize(
    "first,kept_from,versions,memory_from,want",
    [
        (0, 0, [3, 3, 2, 3], None, 0),  # nothing has left the window: back to the liar's first batch
        (1, 0, [0, 2, 1, 2], None, 0),  # a server still at version 0 applied nothing of it: no further than 0
        (2, 4, [9, 10, 9, 10], None, 5),  # its first work left the window: from where a re-run can start (4 kept)
        (6, 4, [9, 10, 9, 10], None, 6),  # all of it within the window
        # below memory (from 23), on disk only every 8th version with the one before it (old_versions.STRIDE):
        (25, 7, [30, 30], 23, 25),  # batch 25 re-runs on 24, in memory
        (12, 7, [30, 30], 23, 8),  # the grid's version at or before it: 8 (7 and 8 on disk)
        (4, 0, [16, 16], 10, 0),  # the same, to the run's start
        (9, 8, [30, 30], 23, 16),  # 8 is kept but not 7, which its re-run needs: the grid's next, 16
    ],
)
def test_a_bans_rollback_target(first, kept_from, versions, memory_from, want):
    from parameter_server.bans import rollback_target

    assert rollback_target(first, kept_from, versions, memory_from) == want
