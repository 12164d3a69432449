"""Versions a ban may still roll back to, kept on disk once a shard's memory lets them go.

A shard keeps its last few versions in memory (parameters and AdamW state of each: 3 + 2 x stages
of them, more while a pin asks: shard.py, pins.py). A liar past its probation that lies on a few of
its tasks meets the sample only: at a sample rate r, a lie on a fraction f of its contributions is
seen after about 1 / (f x r) of them, and by then its first lies are older than memory keeps. What a
ban cannot reach stays applied. So each version memory lets go is written to a file of its own here,
up to `depth` versions back (those of STRIDE's grid: below), and a rollback to one of them reads it
back: the run then goes back to the liar's first work within that reach (or the grid's version at or
before it) and runs again from there, exactly as from a kept version.

The files are written by one thread (in the order they were asked for, deletions among them), so a
step only hands the version over; a rollback waits for the file it reads. Each version costs three
times its shard's parameters on disk. A restarted server begins with none (its reach on disk grows
again a version a step): what is kept here is a ban's reach, not a checkpoint."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

from parameter_server import blob

logger = logging.getLogger("hivepipe.server")

DEFAULT_BAN_REACH = 64  # versions back a ban reaches on disk beyond those in memory (`--ban-reach`)
# on disk, of every STRIDE versions: the one a multiple of STRIDE and the one before it (a rollback to V
# re-runs batch V on version V - 1), a quarter of the writes of keeping every version; a ban rolls back
# to the multiple at or below the liar's first batch (at most STRIDE - 1 versions more re-done)
STRIDE = 8
DEFAULT_BAN_REACH_GB = 20.0  # at most this much disk for them, per server (`--ban-reach-gb`)
TEMP_PREFIX = "hivepipe-old-versions-"  # a server's temporary folder (without --checkpoint-dir): + its pid


class OldVersions:
    """A server's versions on disk for bans: one folder, one writer thread, a store per shard slot."""

    def __init__(self, directory: str | None, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a ban's reach on disk is at least 1 version, got {depth}")
        self.depth = depth
        self.own = directory is None  # a temporary folder, removed at close
        if directory is None:
            _remove_orphans()
            directory = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
        self.directory = directory
        if not self.own:  # what an earlier process left is not this one's (a restart begins with none)
            shutil.rmtree(self.directory, ignore_errors=True)
            os.makedirs(self.directory)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="old-versions")
        self.slots: dict[int, SlotVersions] = {}

    def slot(self, slot: int) -> "SlotVersions":
        if slot not in self.slots:
            self.slots[slot] = SlotVersions(self, slot)
        return self.slots[slot]

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        if self.own:
            shutil.rmtree(self.directory, ignore_errors=True)


class SlotVersions:
    """One shard slot's versions on disk: version -> its file, written (or being written) by the
    server's writer thread."""

    def __init__(self, owner: OldVersions, slot: int) -> None:
        self.owner, self.slot = owner, slot
        self.files: dict[int, tuple[str, Future]] = {}
        self.count = 0  # files written in all (a version re-made after a rollback is a new file)
        self.failed: set[str] = set()  # files whose write failed (a full disk): not kept (set by the thread)

    @property
    def depth(self) -> int:
        return self.owner.depth

    def versions(self) -> list[int]:
        return sorted(v for v, (path, _) in self.files.items() if path not in self.failed)

    def has(self, version: int) -> bool:
        return version in self.files and self.files[version][0] not in self.failed

    def put(self, version: int, snapshot: dict, moments: dict) -> None:
        """Keep `version` (its parameter snapshot and AdamW moments, never changed in place: the
        thread writes them as they are) unless it is kept already."""
        if version in self.files:
            return
        self.count += 1
        path = os.path.join(self.owner.directory, f"s{self.slot}.v{version}.{self.count}.pt")
        saved = {"snapshot": snapshot, "moments": moments}
        written = self.owner.writer.submit(blob.save, saved, path)
        written.add_done_callback(lambda done: self._written(done, path, version))
        self.files[version] = (path, written)

    def _written(self, done: Future, path: str, version: int) -> None:
        if done.exception() is not None:  # (on the writer thread: a ban then reaches less far, and says so)
            self.failed.add(path)
            logger.warning("slot %d: version %d not kept on disk for bans: %r", self.slot, version, done.exception())

    def spill(self, versions, snapshots: dict, moments: dict, after: int) -> None:
        """Keep those of `versions` (let go by memory now) newer than `after` and on the grid (on_grid),
        and forget every older one."""
        for v in versions:
            if v > after and on_grid(v):
                self.put(v, snapshots[v], moments[v])
        self.forget(lambda v: v > after)

    def read(self, versions) -> dict[int, tuple[dict, dict]]:
        """version -> (snapshot, moments) of those of `versions` kept here, read back once their files
        are written (those whose write or read failed are left out)."""
        out = {}
        for v in versions:
            if v in self.files and self.files[v][1].exception() is None:
                try:
                    saved = blob.load(self.files[v][0])
                except Exception as e:  # (a file gone or torn under it: that version is not kept after all)
                    logger.warning("slot %d: version %d could not be read back: %r", self.slot, v, e)
                    continue
                out[v] = saved["snapshot"], saved["moments"]
        return out

    def forget(self, keep) -> None:
        """Delete the versions for which `keep(version)` is false (after their writes: same thread)."""
        for v in [v for v in self.files if not keep(v)]:
            path, _ = self.files.pop(v)
            self.owner.writer.submit(_remove, path)


def on_grid(version: int) -> bool:
    """Whether `version` is kept on disk: a multiple of STRIDE, or the one before it."""
    return version % STRIDE in (0, STRIDE - 1)


def _remove_orphans() -> None:
    """Remove the temporary folders of servers that are gone (a SIGKILL leaves its folder behind)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(TEMP_PREFIX) :].split("-", 1)[0]
        if name.startswith(TEMP_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def reach_depth(versions: int, max_gb: float, shard_bytes: int) -> int:
    """How many versions back a server's disk reaches for bans: `versions` (`--ban-reach`), fewer where
    the files would pass `max_gb` (`--ban-reach-gb`): three copies of its shards' parameters each, two
    files every STRIDE versions; 0: none."""
    if versions <= 0 or shard_bytes <= 0:
        return max(0, versions)
    files = int(max_gb * 2**30 // (3 * shard_bytes))
    return max(0, min(versions, files // 2 * STRIDE))  # (so that disk_bytes stays under max_gb)


def disk_bytes(depth: int, shard_bytes: int) -> int:
    """The most a reach of `depth` versions holds on disk: two files every STRIDE versions (on_grid),
    three copies of the shards' parameters each."""
    return 2 * -(-depth // STRIDE) * 3 * shard_bytes
