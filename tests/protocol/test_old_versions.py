"""A ban's reach on disk (parameter_server/old_versions.py): the versions a shard's memory lets go,
kept in files up to a depth, read back by a rollback exactly; what is beyond it refused."""

from __future__ import annotations

import os

import pytest
import torch

from core.protocol.wire import PayloadError
from parameter_server.old_versions import OldVersions, disk_bytes, reach_depth
from tests.protocol.test_checked_work import _run, _shard


def _same(a, b) -> None:
    for n in a.names:
        assert torch.equal(a.params[n], b.params[n]), n
        sa, sb = a.optimizer.state[a.params[n]], b.optimizer.state[b.params[n]]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"])


def test_a_rollback_beyond_memory_reads_the_version_back_from_disk_exactly(tmp_path):
    """Memory keeps 2 versions, the disk 5 more of the grid (every 8th and the one before it): at
    version 12 a ban rolls back to 8 (from its file, with 7, which batch 8's re-run computes on), and
    the shard run again honestly equals one that never saw the lies, AdamW moments included."""
    clean, dirty = _shard(keep=2), _shard(keep=2)
    clean.steps = dirty.steps = 16
    old = OldVersions(str(tmp_path / "old"), depth=5)
    dirty.old = old.slot(0)
    _run(clean, range(14))
    _run(dirty, range(8))
    _run(dirty, range(8, 12), scale=1e4)  # lies from batch 8 on, caught at version 12
    assert sorted(dirty.snapshots) == [11, 12] and dirty.old.versions() == [7, 8]  # (of 6..10: the grid's)
    assert dirty.reach() == 7 and dirty.kept_from() == 7 and dirty.keeps(8) and not dirty.keeps(9)
    # what can be served (and a failover's re-run start from: a server's status) is memory's alone
    assert dirty.memory_from() == 11 and dirty.params_at(10) is None
    assert dirty.rollback(8, epoch=1) is True and dirty.version == 8
    # the later ones are undone; 8 is in memory again, with 7 (batch 8 re-runs on 7)
    assert dirty.old.versions() == [7] and sorted(dirty.snapshots) == [7, 8] and dirty.params_at(7) is not None
    _run(dirty, range(8, 14))
    _same(clean, dirty)
    assert dirty.old.versions() == [8]  # at version 14: 8..12 within reach, 8 the grid's
    old.close()
    assert [name.split(".")[1] for name in os.listdir(tmp_path / "old")] == ["v8"]


def test_beyond_the_reach_a_rollback_is_refused_and_changes_nothing(tmp_path):
    shard = _shard(keep=2)
    shard.steps = 16
    old = OldVersions(None, depth=3)  # a temporary folder, gone at close
    shard.old = old.slot(0)
    _run(shard, range(10))
    before = {n: p.detach().clone() for n, p in shard.params.items()}
    assert shard.kept_from() == 7 and shard.old.versions() == [7, 8]  # 6..8 within reach; memory keeps 9, 10
    for version, why in ((6, "no longer kept \\(kept from 7\\)"), (5, "no longer kept")):
        with pytest.raises(PayloadError, match=f"version {version} is {why}"):
            shard.rollback(version, epoch=1)
    assert shard.version == 10 and all(torch.equal(before[n], shard.params[n]) for n in before)
    folder = old.directory
    old.close()
    assert not os.path.exists(folder)


def test_a_folder_an_earlier_process_left_is_emptied_and_the_depth_follows_the_disk_bound(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "s0.v3.1.pt").write_bytes(b"left by a process before a restart")
    old = OldVersions(str(folder), depth=4)
    assert os.listdir(folder) == [] and old.slot(0).versions() == []
    old.close()
    with pytest.raises(ValueError, match="at least 1 version"):
        OldVersions(None, depth=0)
    mb = 2**20
    assert reach_depth(64, 20.0, 1 * mb) == 64  # 3 MiB a file: 16 files (2 every 8 versions) fit in 20 GB
    assert reach_depth(64, 0.25, 16 * mb) == 16  # 48 MiB a file: 5 fit in 0.25 GB, 2 of every 8 versions
    for versions, gb, size in ((64, 0.25, 16 * mb), (64, 1.0, 7 * mb), (30, 20.0, mb)):
        assert disk_bytes(reach_depth(versions, gb, size), size) <= gb * 2**30
    assert reach_depth(64, 0.01, 16 * mb) == 0 and reach_depth(0, 20.0, mb) == 0
    assert disk_bytes(64, mb) == 16 * 3 * mb and disk_bytes(20, 16 * mb) == 6 * 3 * 16 * mb  # (the grid's files)


def test_a_temporary_folder_left_by_a_killed_server_is_removed_by_the_next(tmp_path, monkeypatch):
    import subprocess
    import sys

    from parameter_server.old_versions import TEMP_PREFIX

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (read TMPDIR again)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{TEMP_PREFIX}{gone.stdout.strip()}-abc"  # a server SIGKILLed: its pid is gone
    live = tmp_path / f"{TEMP_PREFIX}{os.getpid()}-def"  # a live server's (this process)
    for folder in (dead, live):
        folder.mkdir()
        (folder / "s0.v1.1.pt").write_bytes(b"x")
    old = OldVersions(None, depth=2)
    assert old.directory.startswith(str(tmp_path / f"{TEMP_PREFIX}{os.getpid()}-"))
    assert not dead.exists() and live.exists()
    old.close()
    assert not os.path.exists(old.directory) and live.exists()


def test_a_version_the_disk_did_not_take_is_not_kept_and_a_rollback_to_it_changes_nothing(
    tmp_path, monkeypatch, caplog
):
    from parameter_server import blob

    shard = _shard(keep=2)
    shard.steps = 16
    old = OldVersions(str(tmp_path / "old"), depth=3)
    shard.old = old.slot(0)
    _run(shard, range(9))  # 7 on disk (of 5..7 within reach, the grid's), 8 and 9 in memory

    def full(obj, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blob, "save", full)
    _run(shard, range(9, 11))  # 8 and 9 are let go; 8's write fails
    before = {n: p.detach().clone() for n, p in shard.params.items()}
    assert shard.old.read([8]) == {}  # (waits for the write) nothing read: it failed
    assert shard.old.versions() == [7] and not shard.keeps(8) and shard.kept_from() == 7
    assert "version 8 not kept on disk for bans" in caplog.text
    with pytest.raises(PayloadError, match="version 8 is no longer kept"):
        shard.rollback(8, epoch=1)
    # a version whose file is gone after the check said kept: refused once read, before anything changes
    shard.old.files[8] = (str(tmp_path / "old" / "gone.pt"), shard.old.files[7][1])
    with pytest.raises(PayloadError, match="version 8 could not be read back from disk"):
        shard.rollback(8, epoch=1)
    assert shard.version == 11 and all(torch.equal(before[n], shard.params[n]) for n in before)
    old.close()
