"""What every process of a run shares: its DHT node (started on the run's identity, in a process that
dies with its starter) and the node's P2P replica. Links to servers are in peer/server_links.py, the
server directory read from the DHT in peer/directory.py, a node's addresses in peer/addresses.py and
the processes' lifetime in peer/lifetime.py."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from hivemind.dht import DHT
from hivemind.p2p import PeerID

from peer.addresses import announced_maddrs
from peer.lifetime import die_with_parent, p2pd_dies_with_its_parent

logger = logging.getLogger("hivepipe.node")


LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"


class NetworkStartError(RuntimeError):
    """The DHT node could not start: an address that cannot be bound, initial peers that do not answer."""


IDENTITY_DIR_PREFIX = "hivepipe-id-"
# how long one DHT call waits for its peer: a request is a few kB, which crosses the slowest link
# supported (300 ms, 10 Mbit/s) in well under a second; hivemind's default is 3 s
DHT_CALL_TIMEOUT = 5.0
NOBODY_ANSWERED = "none of the initial peers answered"  # (a NetworkStartError's reason, which the dashboard explains)


def _sweep_identity_dirs(tmp: str) -> None:
    """Remove the fresh-identity folders of processes that are gone: one killed while its DHT started
    (churn does that) never reached its own clean-up. A folder is named after its process's pid."""
    import shutil

    for name in os.listdir(tmp):
        if not name.startswith(IDENTITY_DIR_PREFIX):
            continue
        pid = name[len(IDENTITY_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: is it alive (nothing is sent)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def _claim_new_identity(path: str) -> bool:
    """Write a new libp2p identity at `path` unless a file is there by then; whether this call wrote
    it. Only then may the start skip hivemind's check that no live peer holds the identity, which
    starts a second p2p daemon and bootstraps it into the swarm (~0.4 CPU-s and 0.35 s a start, 8
    of them in a swarm of 8 servers; a restarted server's identity, already on disk, is still
    checked). Generated beside `path` and hard-linked into place, which fails if `path` exists, so
    two processes given the same new path cannot both take it for theirs."""
    from hivemind.p2p import P2P

    tmp = f"{path}.{os.getpid()}.new"
    P2P.generate_identity(tmp)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def start_dht(
    initial_peers=(),
    *,
    run_id: str,
    run_fp: str | None,
    run_key=None,
    identity_path: str | None = None,
    client_mode: bool = False,
    host_maddrs=(LOOPBACK_MADDR,),
    announce_maddrs=None,
    timeout: float | None = None,
    on_wait=None,
) -> DHT:
    """A DHT node with its p2p daemon, holding the record validators of run `run_id` (whose run key
    has fingerprint `run_fp`; None: learnt from the only config record that verifies) and what it
    signs its records with: its libp2p identity (from `identity_path`, else a fresh one) and, on a
    server, the run key (a trust.SigningKey). A server listens on `host_maddrs` and announces
    `announce_maddrs` (default: what it listens on); a client (volunteer, dashboard) dials out only.
    `timeout` bounds the wait for the initial peers; `on_wait(why)` is told once when they do not answer
    yet (a peer's state line: it says `waiting: ...` on stdout; default a warning in the log).
    Raises NetworkStartError saying what failed."""
    import tempfile

    from hivemind.p2p import P2P

    from core.protocol.record_store import Trust
    from core.protocol.trust import SigningKey
    from core.protocol.validator import validators
    from core.protocol.wire import bound_messages

    bound_messages()  # no incoming message read whole past its bound, in this peer and its DHT process

    fresh, made = None, False
    if not identity_path:  # a fresh identity of our own, so that this process can sign as its peer id
        _sweep_identity_dirs(tempfile.gettempdir())
        fresh = tempfile.mkdtemp(prefix=f"{IDENTITY_DIR_PREFIX}{os.getpid()}-")
        identity_path = os.path.join(fresh, "identity.key")
        P2P.generate_identity(identity_path)
        made = True
    elif not os.path.exists(identity_path):
        made = _claim_new_identity(identity_path)
    try:
        identity = SigningKey.from_identity(identity_path)
    except Exception as e:
        raise NetworkStartError(f"identity {identity_path}: not a libp2p RSA identity ({type(e).__name__})") from None
    kwargs = dict(
        initial_peers=list(initial_peers) or None,
        start=True,
        client_mode=client_mode,
        await_ready=True,
        record_validators=validators(run_id, run_fp),
    )
    if made:  # just made here: nobody else can hold it
        kwargs["check_if_identity_free"] = False
    kwargs["host_maddrs"] = [LOOPBACK_MADDR] if client_mode else list(host_maddrs)
    if announce_maddrs and not client_mode:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    kwargs["identity_path"] = identity_path
    # one DHT call to a peer (a ping, a find, a store) waits at most DHT_CALL_TIMEOUT: the wait for
    # the initial peers is `timeout` (the loop in _start), never every later call's, or a frozen or
    # vanished peer holds each read and store that reaches it that long (at 30 s, announcements expire
    # before they are stored, and a failover takes about 45 s instead of 6)
    kwargs["wait_timeout"] = DHT_CALL_TIMEOUT
    if timeout is not None and initial_peers:
        kwargs["bootstrap_timeout"] = min(timeout, 30.0)
        kwargs["wait_timeout"] = min(max(timeout, 1.0), DHT_CALL_TIMEOUT)
    # initial peers that do not answer yet (a server restarting) are tried again until `timeout`
    deadline = time.monotonic() + (timeout or 0.0)
    try:
        return _start(
            kwargs,
            deadline,
            timeout,
            initial_peers,
            Trust(run_id=run_id, run_fp=run_fp, identity=identity, run_key=run_key),
            on_wait,
        )
    finally:
        if fresh:  # the daemon has read it (or never will)
            import shutil

            shutil.rmtree(fresh, ignore_errors=True)


class RequestPipe:
    """The DHT process's end of its request pipe, as hivemind's DHT reads it (poll, recv, fileno),
    except that a request that cannot be unpickled because its sender died while handing over a
    file descriptor inside it is refused as a ConnectionError, which the DHT process logs and
    skips, instead of an EOFError, which ends the DHT process. Every request carries its future's
    pipe to the caller, handed over by the caller's multiprocessing resource sharer; a supervised
    server process SIGKILLed just after a call left the node of its supervisor with EOFError in that
    hand-over and killed it (a soak, 20 minutes in). The pipe's own end of file still ends it."""

    def __init__(self, conn):
        self._conn = conn

    def recv(self):
        from multiprocessing.reduction import ForkingPickler

        message = self._conn.recv_bytes()
        try:
            return ForkingPickler.loads(message)
        except EOFError as e:
            raise ConnectionError(f"a DHT request whose sender died while handing it over: {e!r}") from None

    def __getattr__(self, name):
        return getattr(self._conn, name)


class RunDHT(DHT):
    """hivemind's DHT, reading its requests through RequestPipe, whose process (and its p2p daemon)
    dies with the process that started it: a SIGKILLed peer leaves no DHT process or daemon holding
    its port (the parent-death signal: only when started from the main thread, since the kernel
    signals when the forking thread ends)."""

    def start(self) -> None:
        import threading

        self._parent_pid = os.getpid()
        self._from_main_thread = threading.current_thread() is threading.main_thread()
        p2pd_dies_with_its_parent()
        super().start()

    def run(self) -> None:
        if getattr(self, "_from_main_thread", False):
            die_with_parent()
            if os.getppid() != self._parent_pid:  # the parent died before the signal was armed
                os._exit(0)
        self._inner_pipe = RequestPipe(self._inner_pipe)
        super().run()


def _start(kwargs: dict, deadline: float, timeout, initial_peers, trust, on_wait=None) -> DHT:
    tries = 0
    while True:
        tries += 1
        try:
            dht = RunDHT(**kwargs)
            dht.hivepipe_trust = trust
            return dht
        except Exception as e:
            problem = _daemon_problem(e)
            if "initial peers" in problem and time.monotonic() + 2.0 < deadline:
                why = f"{problem}; trying again until --timeout {timeout:.0f} s"
                if tries > 1:
                    logger.debug(why)
                elif on_wait is not None:
                    on_wait(why)
                else:
                    logger.warning(why)
                time.sleep(2.0)
                continue
            where = " ".join(initial_peers) if initial_peers else "none"
            if problem == NOBODY_ANSWERED:
                # what it can mean: this peer cannot tell a run that ended from an address that is wrong
                within = f" within {timeout:.0f} s" if timeout else ""
                raise NetworkStartError(
                    f"{problem}{within} ({where}): the run may be over (its servers leave at "
                    "its last step unless started with --hold), or the addresses are wrong or not reachable "
                    "from here; use the initial_peers= line of a server that is running"
                ) from None
            listening = "" if kwargs["client_mode"] else f"listening on {' '.join(kwargs['host_maddrs'])}; "
            raise NetworkStartError(f"{problem} ({listening}initial peers: {where})") from None


async def close_replica(p2p, timeout: float = 5.0) -> None:
    """Close a P2P replica of a DHT node (`dht.replicate_p2p()`): its connection to the daemon, and
    its unix socket, which hivemind makes in /tmp and removes only when the replica is shut down or
    collected (the processes freeze their start-up objects out of the collector's sight: every
    `peer swarm` left its four servers' sockets behind). The daemon is the DHT process's."""
    if p2p is None:
        return
    try:
        await asyncio.wait_for(p2p.shutdown(), timeout)
    except Exception as e:
        logger.debug("closing the P2P replica: %r", e)


def stop_dht(dht: DHT, timeout: float = 5.0) -> None:
    """Shut the DHT node's process down, and SIGKILL it if it is still there after `timeout`: a DHT
    process forked from inside a running event loop inherits that loop's SIGTERM handler, so
    hivemind's fallback (terminate) does not stop it, and the interpreter's exit would wait for it
    forever (a launcher whose servers crashed would hang so)."""
    import signal

    try:
        dht.shutdown_timeout = min(getattr(dht, "shutdown_timeout", timeout), timeout)
        dht.shutdown()
    except Exception as e:  # a broken pipe to a dead process: nothing left to ask
        logger.debug("DHT shutdown: %r", e)
    if dht.pid is not None and dht.is_alive():
        logger.debug("the DHT process %d did not stop; killing it", dht.pid)
        try:
            os.kill(dht.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        dht.join(timeout)


@dataclass
class HeldNode:
    """A DHT node held by a supervisor for the server processes it forks, one after the other: the
    handle, the unix socket where each of them takes the node's streams, and what does not change
    while the node lives (asked once, not by every restart: each ask is a round trip through the DHT
    process, slow under load)."""

    dht: DHT
    socket_path: str
    daemon: object  # the p2p daemon's control multiaddr
    maddrs: list[str]  # announced_maddrs(dht)

    @classmethod
    def of(cls, dht: DHT, socket_path: str) -> "HeldNode":
        return cls(dht, socket_path, dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr), announced_maddrs(dht))

    async def replicate(self):
        """A P2P replica of the node's daemon that takes its streams at `socket_path`. The daemon
        keeps a dead replica's stream handlers (only its unary ones go with its connection) and
        refuses to register them again ("already set"); a restarted replica listening at the same
        path is where they already lead, so it takes them over without a word. A replica at a fresh
        path (hivemind's `replicate_p2p`) could not serve them again."""
        from hivemind.p2p import P2P
        from hivemind.p2p.p2p_daemon_bindings import p2pclient
        from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
        from hivemind.utils.multiaddr import Multiaddr  # (the `multiaddr` package drops a unix path's leading /)

        class Replica(P2P):
            async def add_binary_stream_handler(self, name, handler, balanced: bool = False) -> None:
                try:
                    await super().add_binary_stream_handler(name, handler, balanced)
                except ControlFailure as e:  # registered by our predecessor at this very socket
                    if "already set" not in str(e):
                        raise
                    logger.debug("stream handler %s: taken over from the previous server process", name)

        replica = Replica()
        replica._child, replica._alive = None, True  # the daemon is the DHT process's, not ours to stop
        replica._daemon_listen_maddr = self.daemon
        replica._client_listen_maddr = Multiaddr(f"/unix{self.socket_path}")
        replica._client = await p2pclient.Client.create(self.daemon, replica._client_listen_maddr)
        await replica._ping_daemon()
        return replica


async def _leave_with(parent_pid: int, _dht, node) -> None:
    """Run inside a DHT process held by a supervisor: when the supervisor is gone (SIGKILLed alone,
    so nobody stopped us), stop the p2p daemon and leave, instead of serving its identity forever."""
    import signal

    async def watch():
        while os.getppid() == parent_pid:
            await asyncio.sleep(1.0)
        child = getattr(node.p2p, "_child", None)
        if child is not None and child.returncode is None:
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(3)

    _WATCHERS.add(asyncio.get_event_loop().create_task(watch()))


_WATCHERS: set = set()  # (a task nobody holds may be collected before it ends)


async def reach_peers(_dht, node, peers: list[tuple[str, list[str]]], timeout: float = 5.0) -> int:
    """(Run in the DHT process: dht.run_coroutine.) Connect the node's p2p daemon to each (peer id,
    multiaddrs) and ping it into the node's routing table: a client-mode node knows only its initial
    peers' addresses (libp2p dials a peer only at addresses it knows), so once those are gone it reaches
    nobody, although the run's records named every server's. How many answered."""
    from hivemind.utils.multiaddr import Multiaddr

    reached = 0
    for peer_id, maddrs in peers:
        try:
            pid = PeerID.from_base58(peer_id)
            await asyncio.wait_for(
                node.p2p._client.connect(pid, [Multiaddr(m.split("/p2p/")[0]) for m in maddrs]), timeout
            )
            if await asyncio.wait_for(node.protocol.call_ping(pid), timeout) is not None:
                reached += 1
        except Exception as e:  # (gone, or not there yet: the next read tries again)
            logger.debug("reaching %s at %s: %r", peer_id[-8:], maddrs, e)
    return reached


def dht_leaves_with(dht: DHT, parent_pid: int) -> None:
    """Make `dht`'s process (and its p2p daemon) end when process `parent_pid` does."""
    import functools

    dht.run_coroutine(functools.partial(_leave_with, parent_pid))


def _daemon_problem(e: Exception) -> str:
    import re

    text = str(e).strip() or type(e).__name__
    if "none of the initial_peers responded" in text or "failed to connect to bootstrap peers" in text:
        return NOBODY_ANSWERED
    text = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", text.splitlines()[-1])
    if "failed to listen" in text or "cannot assign requested address" in text or "address already in use" in text:
        return f"cannot listen on the given address: {text[:300]}"
    return text[:400]
