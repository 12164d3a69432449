"""A process killed while its DHT started leaves its fresh-identity folder behind (churn SIGKILLs
volunteers at any moment); the next start removes the folders of processes that are gone, and only
those."""

from __future__ import annotations

import os
import subprocess
import sys

from peer.node import IDENTITY_DIR_PREFIX, _sweep_identity_dirs


def test_folders_of_dead_processes_are_swept_and_the_others_kept(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead": f"{IDENTITY_DIR_PREFIX}{gone.pid}-abc",
            "alive": f"{IDENTITY_DIR_PREFIX}{alive.pid}-def",
            "me": f"{IDENTITY_DIR_PREFIX}{os.getpid()}-ghi",
            "other": "hivepipe-swarm-xyz",
            "no pid": f"{IDENTITY_DIR_PREFIX}zz9x-1",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "identity.key").write_bytes(b"k")
        _sweep_identity_dirs(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")
    finally:
        alive.kill()
        alive.wait()
