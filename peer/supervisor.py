"""Keep a server alive on its host: run it in a forked child and fork it again when it crashes.

A committed host's server that dies (SIGKILL from the OOM killer, a segfault in a kernel, an
unhandled error) should be back in seconds, from its checkpoint, under the same identity. A service
manager can restart it too, but the new process imports torch and hivemind again before it does
anything: 3-5 s on an idle machine, 26 s measured on this 2-core machine under a soak's load, and
the server's stage waits for it all that time (a batch needs every shard of its stage). The
supervisor imports everything once and forks: a restarted child resumes at once, on the same DHT node.

The child runs in its own process group, so a crash of the child takes what it started down and
leaves the supervisor; the child watches the supervisor and leaves with it. `peer serve` starts the
host's DHT node (its process and p2p daemon) in the supervisor before the first fork: the node
outlives a crashed server process, and `needs` stops the child when the node is gone. The supervisor restarts a child that died of a signal or exited with an error code other than
the ones that mean "do not try again" (0: done, 2: a usage or network error that would repeat, 3:
its parent is gone, 130: interrupted); at most `max_restarts` times within `window_s` seconds (then
it gives up with the child's status, as systemd's StartLimitBurst does). SIGTERM/SIGINT to the
supervisor are passed to the child, which then is not restarted.

The supervisor starts no event loop and no thread of its own (fork copies only the calling thread;
hivemind's future reader, started with the DHT node, idles in a pipe read): it polls its child and
its own parent instead. A forked child runs multiprocessing's after-fork hooks, as a process that
multiprocessing forks does.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections import deque
from typing import Callable

logger = logging.getLogger("hivepipe.supervisor")

# exit codes after which a restart would not help (see the module's docstring)
FINAL_CODES = frozenset({0, 2, 3, 130})


class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds (time injected for tests)."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        if limit < 0 or window_s <= 0:
            raise ValueError(f"restart budget: limit {limit} must be >= 0 and window {window_s} > 0")
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.times: deque[float] = deque()

    def allow(self) -> bool:
        now = self.clock()
        while self.times and now - self.times[0] >= self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


def describe(status: int) -> tuple[str, int, bool]:
    """(what happened, the exit code to hand on, whether a restart may help) for a waitpid status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by {signal.Signals(sig).name}", 128 + sig, True
    code = os.WEXITSTATUS(status)
    return f"exited with code {code}", code, code not in FINAL_CODES


def after_fork_in_child() -> None:
    """In a child forked from a process that imported hivemind (a supervisor, the swarm's zygote):
    redo what a fresh interpreter has of its own. Multiprocessing's after-fork hooks (its fd sharer,
    which passes pipes to the DHT process, and other per-process state were the parent's), and
    hivemind's process-wide multiprocessing locks, which it makes in class attributes when it is
    imported: in a fork each is one semaphore shared with the parent and its other children, and a
    child SIGKILLed while it held one hung all the others (found by the churn test with forked
    volunteers: replacements stuck in their DHT process's MPFuture update lock)."""
    import multiprocessing
    import multiprocessing.util

    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    multiprocessing.util._run_after_forkers()
    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _fork(child_main: Callable[[int, int], int], run: int) -> int:
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the supervisor's stack
        code = 1
        try:
            os.setpgid(0, 0)
            after_fork_in_child()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            code = int(child_main(supervisor, run) or 0)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - the child's crash is reported and ends it
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    try:
        os.setpgid(pid, pid)  # both sides set it: whichever runs first, a killpg after this finds the group
    except (ProcessLookupError, PermissionError):
        pass  # the child already did (and exec'd nothing), or is already gone
    return pid


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, pgrp) of process `pid` from /proc, or None if it is gone, a zombie, or /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    if len(fields) < 3 or fields[0] == b"Z":  # fields: state, ppid, pgrp, ...
        return None
    return int(fields[1]), int(fields[2])


def proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgrp) of every live (not zombie) process, from /proc (empty where it is missing)."""
    if not os.path.isdir("/proc"):
        return {}
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := proc_stat(int(name))) is not None:
            table[int(name)] = stat
    return table


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of group `pgid`; where /proc is missing, whether
    signal 0 reaches the group."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    return [pid for pid, (_, pgrp) in proc_table().items() if pgrp == pgid]


def _end_group(pgid: int, wait_s: float = 5.0) -> None:
    """SIGKILL what is left of a process group and wait until it is gone, so that a restarted child
    does not meet what its predecessor started."""
    _kill_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and group_members(pgid):
        time.sleep(0.02)


def supervise(
    child_main: Callable[[int, int], int],
    *,
    name: str,
    parent_pid: int | None = None,
    max_restarts: int = 5,
    window_s: float = 600.0,
    poll_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    needs: Callable[[], str | None] | None = None,
) -> int:
    """Run `child_main(supervisor_pid, run) -> exit code` in a forked child until it ends for good
    (`run`: 0 for the first start, n for the n-th restart); return its exit code (128 + signal for
    a child killed by a signal). `needs()`: what the child cannot do without is gone (a message; the
    supervisor's DHT process died), checked every poll: the child is killed and 1 returned."""
    budget = RestartBudget(max_restarts, window_s, clock)
    stopping: list[int] = []
    child: list[int] = []

    def forward(signum, _frame):
        stopping.append(signum)
        if child:  # to the child alone, as a launcher does: it ends its work and announces "offline"
            try:
                os.kill(child[0], signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    runs = 0
    try:
        while True:
            started = clock()
            child[:] = [_fork(child_main, runs)]
            runs += 1
            status = None
            while status is None:
                pid, st = os.waitpid(child[0], os.WNOHANG)
                if pid:
                    status = st
                    break
                if parent_pid and os.getppid() != parent_pid:  # whoever started us is gone: so are we
                    _kill_group(child[0], signal.SIGKILL)
                    os.waitpid(child[0], 0)
                    return 3
                missing = needs() if needs is not None else None
                if missing:
                    logger.error("%s: %s; stopping its server process", name, missing)
                    _kill_group(child[0], signal.SIGKILL)
                    os.waitpid(child[0], 0)
                    return 1
                time.sleep(poll_s)
            _end_group(child[0])  # what is left of its group
            what, code, may_restart = describe(status)
            if stopping or not may_restart:
                logger.info("%s: its server process %s", name, what)
                return code
            if not budget.allow():
                logger.error(
                    "%s: its server process %s; %d restarts within %.0f s already, giving up",
                    name,
                    what,
                    max_restarts,
                    window_s,
                )
                return code
            logger.warning(
                "%s: its server process (pid %d) %s after %.0f s; restarting it (restart %d of at most %d "
                "within %.0f s)",
                name,
                child[0],
                what,
                clock() - started,
                len(budget.times),
                max_restarts,
                window_s,
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
