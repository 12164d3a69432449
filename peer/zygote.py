"""The forker's zygote (peer/launcher/forker.py is the launcher's side, and says why): imports
what `peer serve` and `peer join` import, then forks a process per request of the launcher, which
runs `peer.cli.main(ARGV)` as `python -m peer.cli ARGV` would. `python -m peer.zygote FD`: FD is
its end of a socket pair with the launcher (a request and an answer per line, JSON)."""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys

# what `peer serve` and `peer join` import (and peer.serve.preload_server_modules: the server's
# own, which the supervisor imports before it forks, and torch._dynamo through the first optimizer)
PRELOAD = (
    "peer.cli",
    "peer.serve",
    "peer.join",
    "peer.volunteer.stage_choice",
    "peer.volunteer.cheat",
    "core.protocol.trust",
    "hivemind.dht",
    "hivemind.p2p",
)


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass  # the launcher is gone; the loop sees the closed socket next


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _serve(sock: socket.socket) -> dict | None:
    """The zygote's loop. Returns only in a forked child (its request), or None when the launcher
    has closed the socket."""
    buf = b""
    while True:
        readable = select.select([sock], [], [], 0.2)[0]
        _reap(sock)
        if not readable:
            continue
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                sock.close()
                os.close(ready_r)
                return request | {"ready_fd": ready_w}
            os.close(ready_w)
            # the pid goes to the launcher once the child leads its own process group under its own
            # command line: a killpg right after the spawn (churn) must reach it, not miss it
            select.select([ready_r], [], [], 30.0)
            os.close(ready_r)
            _send(sock, {"pid": pid})


def _become(request: dict) -> list[str]:
    """In the forked child: a process of its own, as `python -m peer.cli ARGV` would be."""
    import numpy as np
    import setproctitle
    import torch

    from peer.supervisor import after_fork_in_child

    os.setsid()
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    after_fork_in_child()  # its own multiprocessing state and hivemind locks, as a fresh interpreter
    np.random.seed()
    torch.seed()
    argv = [str(a) for a in request["argv"]]
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "peer.cli", *argv]))
    os.write(request["ready_fd"], b".")
    os.close(request["ready_fd"])
    import peer.cli

    sys.argv = [peer.cli.__file__, *argv]
    return argv


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        importlib.import_module(name)
    import peer.cli
    import peer.serve

    peer.cli.build_parser()  # every command's module
    peer.serve.preload_server_modules()
    request = _serve(sock)
    if request is None:
        return 0
    argv = _become(request)
    return peer.cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
