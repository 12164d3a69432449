"""A command started in its own session whose stdout a test reads line by line (on a thread, so a
wait can time out): the operator's-run tests (tests/swarm/test_lifecycle.py) and the deploy page's
walk (tests/net/test_deploy_doc.py) wait on what a peer says."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time


class LineProcess:
    def __init__(self, argv: list[str], *, name: str = "", stderr=subprocess.DEVNULL, env=None, cwd=None):
        self.name = name or argv[-1]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []  # the lines read so far, in order
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def drain(self) -> None:
        """Move the lines that arrived into `seen` without waiting."""
        while not self.lines.empty():
            self.seen.append(self.lines.get())

    def wait_line(self, pattern: str, timeout: float = 120.0, *, seen_too: bool = False) -> str:
        """The next line that matches `pattern` (with `seen_too`, also one read before); an
        AssertionError with the last lines when none comes within `timeout` or the process ends."""
        if seen_too:
            for line in self.seen:
                if re.search(pattern, line):
                    return line
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"{self.name}: no line matching {pattern!r} in {timeout:.0f} s; saw {self.seen[-15:]}")

    def gone(self) -> bool:
        """No process of its session is left (its DHT process and p2p daemon included)."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return True
        return False

    def kill(self) -> None:
        """SIGKILL to its whole session, then reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
