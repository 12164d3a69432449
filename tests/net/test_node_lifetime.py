"""A DHT node held by a supervisor (peer.node.dht_leaves_with): when the process that holds it is
SIGKILLed alone, nobody stops the node, so the node stops itself and its p2p daemon (real
processes, real SIGKILL)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

HOLDER = textwrap.dedent("""
    import os, signal
    from peer.node import dht_leaves_with, start_dht

    dht = start_dht(run_id="lifetime", run_fp=None)
    dht_leaves_with(dht, os.getpid())
    print(dht.pid, flush=True)
    signal.pause()  # until the test kills it
""")


def descendants(pid: int) -> list[int]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != b"Z":
                table[int(name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in table.items() if pp == p]
        out += kids
        frontier += kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def survivors(pids: list[int], seconds: float = 20.0) -> list[int]:
    """Those of `pids` still alive once all have exited or `seconds` have passed: waits on each one's
    exit itself (a pidfd becomes readable when its process ends), not on a clock."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass  # (gone already)
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left, deadline = set(fds), time.monotonic() + seconds
        while left and (remaining := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(remaining * 1000):
                left.discard(fd)
                poller.unregister(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return [p for p in pids if alive(p)]


def test_a_held_dht_node_leaves_with_its_holder():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        dht_pid = int(holder.stdout.readline())
        node = descendants(holder.pid)
        assert dht_pid in node and len(node) >= 2, node  # the DHT process and its p2p daemon
        os.kill(holder.pid, signal.SIGKILL)  # the holder alone, as an OOM kill would
        holder.wait()
        assert not survivors(node), "the DHT process or its p2p daemon outlived their holder"
    finally:
        try:
            os.killpg(holder.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _hand_over_from_the_dead():
    raise EOFError  # what multiprocessing's resource sharer raises when the sender died mid-hand-over


class DiesInFlight:
    """A request argument that unpickles as a dead caller's future pipe does in the DHT process."""

    def __reduce__(self):
        return _hand_over_from_the_dead, ()


def test_a_request_whose_sender_died_while_handing_it_over_does_not_end_the_dht_process():
    """Every DHT request carries its caller's pipe, which the DHT process fetches from the caller;
    a supervised server process SIGKILLed just after a call made that fetch fail with EOFError and
    killed its supervisor's DHT node with it (a soak). hivemind's own DHT dies of it; ours
    skips that request and goes on answering."""
    from hivemind.dht import DHT

    from peer.node import RunDHT, stop_dht

    for cls, survives in ((DHT, False), (RunDHT, True)):
        dht = cls(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], wait_timeout=0.5)
        try:
            dht._outer_pipe.send(("_get", [], dict(key="k", latest=True, future=DiesInFlight())))
            if not survives:  # (the request ends hivemind's DHT process: wait for that exit)
                survivors([dht.pid], 10.0)
            assert dht.is_alive() == survives, cls
            if survives:  # and still answers (bounded: a dead DHT process never resolves a future)
                assert dht.store("k", "v", expiration_time=time.time() + 60, return_future=True).result(timeout=10)
                assert dht.get("k", return_future=True).result(timeout=10).value == "v"
        finally:
            stop_dht(dht)


def test_a_closed_replica_leaves_no_socket_behind():
    """`peer serve`, `peer join` and `peer swarm` close their P2P replica on the way out
    (peer.node.close_replica): hivemind removes the replica's /tmp socket only then, or when the
    object is collected, which a process that froze its start-up objects never does (each
    `peer swarm` left its four servers' sockets in /tmp)."""
    import asyncio

    from peer.node import close_replica, start_dht, stop_dht

    dht = start_dht(run_id="sockets", run_fp=None)

    async def replica_socket() -> tuple[bool, bool]:
        p2p = await dht.replicate_p2p()

        async def handler(*_):
            pass

        await p2p.add_binary_stream_handler("sockets.test", handler)  # the replica listens from here on
        path = p2p._client_listen_maddr["unix"]
        there = os.path.exists(path)
        await close_replica(p2p)
        return there, os.path.exists(path)

    try:
        assert asyncio.run(replica_socket()) == (True, False)
    finally:
        stop_dht(dht)


def test_a_call_once_the_local_p2p_daemon_is_gone_is_a_lost_connection():
    """A server that closes (its DHT and p2p daemon stopped) while a task of its own still calls
    another server (a pin, a replica copy): the call fails as a lost connection, which every caller
    handles, not as the daemon's missing control socket (a FileNotFoundError escaped a pin's task at
    the end of a run: "Task exception was never retrieved")."""
    import asyncio

    import pytest

    from peer.node import start_dht, stop_dht
    from peer.server_links import P2PLink

    dht = start_dht(run_id="gone", run_fp=None)

    async def call_after_stop() -> None:
        p2p = await dht.replicate_p2p()
        link = P2PLink(p2p, dht.peer_id.to_base58(), "s9")  # (no addresses: nothing to dial)
        stop_dht(dht)  # the daemon and its control socket go
        with pytest.raises(ConnectionError):
            await link.call("ping", {"device": "x"}, timeout=10)

    try:
        asyncio.run(call_after_stop())
    finally:
        stop_dht(dht)
