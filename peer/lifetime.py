"""A peer's processes end with the process that started them: the kernel's parent-death signal for
forked children and every p2p daemon, and a watch on a parent given by pid (peers and dashboards
started by a launcher or a test)."""

from __future__ import annotations

import logging
import os
import sys
import time

logger = logging.getLogger("hivepipe.node")


def die_with_parent(sig: int | None = None) -> bool:
    """Linux: the kernel sends this process `sig` (SIGKILL) when the thread that forked it ends
    (prctl PR_SET_PDEATHSIG): no poll, and it holds when the parent is SIGKILLed. False elsewhere."""
    import signal

    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig or signal.SIGKILL), 0, 0, 0) == 0


def p2pd_dies_with_its_parent() -> None:
    """Make every p2p daemon this process (or a fork of it: a hivemind DHT process) starts die with
    the process that started it: hivemind starts the daemon through
    asyncio.subprocess.create_subprocess_exec, which gets a preexec_fn that sets the parent-death
    signal in the daemon before it runs."""
    import asyncio.subprocess as aio_subprocess

    start = aio_subprocess.create_subprocess_exec
    if getattr(start, "hivepipe_dies_with_parent", False):
        return

    async def create_subprocess_exec(program, *args, **kwargs):
        if os.path.basename(str(program)).startswith("p2pd") and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = die_with_parent
        return await start(program, *args, **kwargs)

    create_subprocess_exec.hivepipe_dies_with_parent = True
    aio_subprocess.create_subprocess_exec = create_subprocess_exec


def watch_parent(parent_pid: int | None) -> None:
    """Exit when the process that started us is gone (so a killed launcher leaves no orphans)."""
    if not parent_pid:
        return
    import threading

    def loop():
        import signal

        while True:
            if os.getppid() != parent_pid:
                if os.getpgrp() == os.getpid():  # our own group (as a launcher starts us): our DHT
                    os.killpg(os.getpid(), signal.SIGKILL)  # process and p2p daemon go with us
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=loop, daemon=True).start()
