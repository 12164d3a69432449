"""A ban's reach on disk (parameter_server/old_versions.py): the versions a shard's memory lets go,
kept in files up to a depth, read back by a rollback exactly; what is beyond it refused."""

from __future__ import annotations

import os

import pytest
import torch

from core.protocol.wire import PayloadError
from parameter_server.old_versions import OldVersions, reach_depth
from tests.protocol.test_checked_work import _run, _shard


def _same(a, b) -> None:
    for n in a.names:
        assert torch.equal(a.params[n], b.params[n]), n
        sa, sb = a.optimizer.state[a.params[n]], b.optimizer.state[b.params[n]]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"])


def test_a_rollback_beyond_memory_reads_the_version_back_from_disk_exactly(tmp_path):
    """Memory keeps 2 versions, the disk 5 more: at version 12 a ban rolls back to 7 (from its file, with
    6, which batch 7's re-run computes on), and the shard run again honestly equals one that never saw
    the lies, AdamW moments included."""
    clean, dirty = _shard(keep=2), _shard(keep=2)
    clean.steps = dirty.steps = 16
    old = OldVersions(str(tmp_path / "old"), depth=5)
    dirty.old = old.slot(0)
    _run(clean, range(14))
    _run(dirty, range(7))
    _run(dirty, range(7, 12), scale=1e4)  # lies from batch 7 on, caught at version 12
    assert sorted(dirty.snapshots) == [11, 12] and dirty.old.versions() == [6, 7, 8, 9, 10]
    assert dirty.reach() == 7 and dirty.kept_from() == 6 and dirty.keeps(6) and not dirty.keeps(5)
    assert dirty.rollback(7, epoch=1) is True and dirty.version == 7
    # the later ones are undone; 7 is in memory again, with 6 (memory keeps two: batch 7 re-runs on 6)
    assert dirty.old.versions() == [6] and sorted(dirty.snapshots) == [6, 7] and dirty.params_at(6) is not None
    _run(dirty, range(7, 14))
    _same(clean, dirty)
    old.close()
    assert dirty.old.versions() == [8, 9, 10, 11, 12]  # at version 14: memory keeps 13 and 14
    assert sorted(int(name.split(".")[1][1:]) for name in os.listdir(tmp_path / "old")) == [8, 9, 10, 11, 12]


def test_beyond_the_reach_a_rollback_is_refused_and_changes_nothing(tmp_path):
    shard = _shard(keep=2)
    shard.steps = 16
    old = OldVersions(None, depth=3)  # a temporary folder, gone at close
    shard.old = old.slot(0)
    _run(shard, range(10))
    before = {n: p.detach().clone() for n, p in shard.params.items()}
    assert shard.kept_from() == 6
    with pytest.raises(PayloadError, match="version 5 is no longer kept \\(kept from 6\\)"):
        shard.rollback(5, epoch=1)
    assert shard.version == 10 and all(torch.equal(before[n], shard.params[n]) for n in before)
    assert shard.old.versions() == [6, 7, 8]  # memory keeps 9 and 10
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
    assert reach_depth(64, 20.0, 1 * mb) == 64  # 3 MiB a version: 64 fit in 20 GB
    assert reach_depth(64, 1.0, 16 * mb) == 21  # 48 MiB a version: 21 fit in 1 GB
    assert reach_depth(64, 0.01, 16 * mb) == 0 and reach_depth(0, 20.0, mb) == 0


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
    _run(shard, range(4))  # versions 0-2 on disk, 3 and 4 in memory

    def full(obj, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blob, "save", full)
    _run(shard, range(4, 6))  # 3 and 4 are let go, their writes fail; 0 and 1 fall out of reach
    before = {n: p.detach().clone() for n, p in shard.params.items()}
    pending = shard.old.read([4])  # (waits for the writes) nothing read: the write failed
    assert pending == {} and shard.old.versions() == [2] and not shard.keeps(4) and shard.kept_from() == 2
    assert "version 4 not kept on disk for bans" in caplog.text
    with pytest.raises(PayloadError, match="version 4 is no longer kept"):
        shard.rollback(4, epoch=1)
    # a version whose write fails after the check said kept: refused once read, before anything changes
    shard.old.files[3] = (str(tmp_path / "old" / "gone.pt"), shard.old.files[2][1])
    with pytest.raises(PayloadError, match="version 3 could not be read back from disk"):
        shard.rollback(3, epoch=1)
    assert shard.version == 6 and all(torch.equal(before[n], shard.params[n]) for n in before)
    old.close()
