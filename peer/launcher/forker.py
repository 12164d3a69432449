"""The launcher's side of the forker (the zygote itself is peer/zygote.py, the top of the house:
it runs `peer.cli`). Start a local swarm's processes by forking them from one process that has imported torch,
hivemind and the peer's modules once (a zygote, as multiprocessing's forkserver and Android's
zygote do), instead of starting a fresh interpreter for each.

Why: a fresh `python -m peer.cli serve` spends about 2.3 s of CPU importing torch and hivemind and
1.2 s more importing torch._dynamo (the optimizer's first call does), before it does anything. A
swarm of 8 servers and 2 volunteers spent ~35 CPU-s on imports alone, 17 s of wall time on this
2-core machine, every time a swarm starts (and every restart of a killed process). A forked child
starts from the imported state at once.

A forked child is what `python -m peer.cli ARGV` would be: its own session and process group (a
SIGKILL of the group takes its DHT process and p2p daemon down, as a machine's crash would), its
output in its log file, stdin from /dev/null, the default signal handlers, fresh random seeds
(Python's `random` reseeds itself at fork; numpy's and torch's default generators are reseeded
here), multiprocessing's after-fork hooks run, and its command line (`ps`, /proc/PID/cmdline)
rewritten to `python -m peer.cli ARGV` (setproctitle), so that tools that find a process by its
command line find it. It leaves through the interpreter's normal exit (atexit handlers, non-daemon
threads joined), not through os._exit: the fork returns out of the zygote's loop and runs
`peer.cli.main` at the top of the stack.

The zygote is the launcher's child; it starts no thread and no event loop (fork copies the calling
thread only), reaps its children and reports each exit status to the launcher over a socket, and
leaves when the launcher closes that socket or dies. The children are not its to watch after that:
each watches the launcher itself (--parent-pid).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time


class ForkedProcess:
    """A process forked by the zygote, with what the launcher uses of subprocess.Popen: pid, poll(),
    wait(), returncode (negative: the signal that ended it), send_signal(), kill()."""

    def __init__(self, forker: "Forker", pid: int, args: list[str]):
        self.forker, self.pid, self.args = forker, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.forker.check(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.forker.pump(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forker:
    """The launcher's side: starts the zygote (`log` gets its own output: an import error there is
    the reason no process starts) and asks it for processes."""

    def __init__(self, log: str, timeout: float = 120.0):
        self.timeout = timeout
        self.log = log
        ours, theirs = socket.socketpair()
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "peer.zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        theirs.close()
        self.sock = ours
        self.sock.setblocking(False)
        self.buf = b""
        # the live children by pid: an exit status goes to the process it belongs to (pids are
        # reused, 32768 of them here, so a status must not outlive its process)
        self.live: dict[int, ForkedProcess] = {}

    def spawn(self, argv: list[str], log: str) -> ForkedProcess:
        """Fork `python -m peer.cli ARGV` with its output appended to `log`."""
        try:
            self.sock.setblocking(True)
            self.sock.sendall(json.dumps({"argv": list(argv), "log": log}).encode() + b"\n")
            self.sock.setblocking(False)
        except OSError as e:
            raise RuntimeError(f"the process forker is gone ({e}): see {self.log}") from e
        deadline = time.monotonic() + self.timeout
        while True:
            for msg in self._messages():
                if "pid" in msg:
                    proc = ForkedProcess(self, msg["pid"], [sys.executable, "-m", "peer.cli", *argv])
                    self.live[proc.pid] = proc
                    return proc
            if time.monotonic() > deadline:
                raise RuntimeError(f"the process forker did not answer within {self.timeout} s: see {self.log}")
            if not self._wait_readable(0.5) and self.proc.poll() is not None:
                raise RuntimeError(f"the process forker exited with code {self.proc.returncode}: see {self.log}")

    def pump(self, wait: float = 0.0) -> None:
        """Take in the exit statuses the zygote has sent (waiting up to `wait` s for one)."""
        if wait > 0:
            self._wait_readable(wait)
        for _ in self._messages():
            pass

    def check(self, proc: ForkedProcess) -> None:
        """Take in the statuses sent so far; `proc.returncode` is set once it has exited."""
        self.pump()
        if proc.returncode is None and self.proc.poll() is not None and not _alive(proc.pid):
            proc.returncode = -signal.SIGKILL  # the zygote died: nobody reports it
            self.live.pop(proc.pid, None)

    def _wait_readable(self, timeout: float) -> bool:
        try:
            return bool(select.select([self.sock], [], [], timeout)[0])
        except (OSError, ValueError):
            return False

    def _messages(self):
        """Every whole message received so far; exit statuses are recorded here."""
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                break
            self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg and msg["exit"] in self.live:
                self.live.pop(msg["exit"]).returncode = msg["code"]
            yield msg

    def close(self) -> None:
        """Stop the zygote (its children are the launcher's to stop first)."""
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _alive(pid: int) -> bool:
    from peer.supervisor import proc_stat

    return proc_stat(pid) is not None
