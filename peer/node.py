"""What every process of a run shares: its DHT node and P2P replica, links to servers (over P2P,
or in-process for a server's own worker through the very same checks), and the server directory
read from the DHT."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto.runtime_pb2 import ExpertRequest

from peer.protocol import methods, records
from peer.protocol.links import LinkEmulator
from peer.protocol.session import Sessions
from peer.protocol.session import handle_name as session_handler
from peer.protocol.wire import STALL_SECONDS, PayloadError, RemoteError, StreamCut, pack, payload_bytes, unpack

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

    from peer.protocol.records import Trust
    from peer.protocol.trust import SigningKey, validators
    from peer.protocol.wire import bound_messages

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


def die_with_parent(sig: int | None = None) -> bool:
    """Linux: the kernel sends this process `sig` (SIGKILL) when the thread that forked it ends
    (prctl PR_SET_PDEATHSIG): no poll, and it holds when the parent is SIGKILLed. False elsewhere."""
    import signal
    import sys

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
    from hivemind.p2p import PeerID
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


def visible_maddrs(dht: DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def is_loopback(maddr: str) -> bool:
    ip = _ip_of(maddr)
    return ip is not None and ip.is_loopback


def is_public(maddr: str) -> bool:
    ip = _ip_of(maddr)
    return ip is not None and ip.is_global


def _ip_of(maddr: str):
    import ipaddress

    parts = maddr.split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts:
            try:
                return ipaddress.ip_address(parts[parts.index(proto) + 1])
            except (ValueError, IndexError):
                return None
    return None


def announced_maddrs(dht: DHT) -> list[str]:
    """The multiaddrs (with /p2p/) other hosts should dial: what the node announces, without its
    loopback addresses when it has any other (a server listening on 0.0.0.0 also shows 127.0.0.1)."""
    maddrs = visible_maddrs(dht)
    outside = [m for m in maddrs if not is_loopback(m)]
    return outside or maddrs


def describe(error: BaseException) -> str:
    """The last line of an exception's message (the daemon's are long), or its type."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]


class DialError(ConnectionError):
    """The server could not be connected to at its announced addresses (or is in its backoff)."""


class LinkHealth:
    """Whether calls to one server get through, and the logging of it: one line when it starts
    failing, one a minute (with a count) while it goes on, one when it answers again; never a
    traceback. While it fails, dialling it again backs off (0.5 s doubling to `max_backoff`), but
    for addresses other than those of the last failed dial: a server that restarted announces new
    ones (a fresh port) once it serves, and is dialled there at once."""

    def __init__(self, name: str, clock=time.monotonic, period: float = 60.0, max_backoff: float = 5.0):
        self.name, self.clock, self.period, self.max_backoff = name, clock, period, max_backoff
        self.failing_since: float | None = None
        self.failures = 0  # consecutive
        self._unlogged = 0
        self._logged_at = 0.0
        self.next_try = 0.0
        self.failed_addresses: frozenset[str] | None = None  # where the last failed dial went

    def failed(self, error: BaseException | str, dial: bool = True, addresses=None) -> None:
        """A failed attempt; `dial` says the server could not even be connected to (only that
        backs off: a call cut short on a live connection is tried again at once); `addresses`:
        where it was dialled."""
        now = self.clock()
        self.failures += 1
        if dial and addresses:
            self.failed_addresses = frozenset(addresses)
        if self.failing_since is None:
            self.failing_since = now
        # one call cut short is common on a busy link: backoff and a log line start at the second
        # failure in a row
        if self.failures < 2:
            return
        if dial:
            self.next_try = now + min(0.5 * 2 ** (self.failures - 2), self.max_backoff)
        why = error if isinstance(error, str) else describe(error)
        if self.failures == 2:
            self._logged_at, self._unlogged = now, 0
            logger.warning("cannot reach %s: %s; retrying with backoff", self.name, why)
        elif now - self._logged_at >= self.period:
            logger.warning(
                "still cannot reach %s after %.0f s (%d more failed attempts): %s",
                self.name,
                now - self.failing_since,
                self._unlogged + 1,
                why,
            )
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1

    def succeeded(self) -> None:
        if self.failures >= 2:
            logger.warning("reached %s again after %.0f s", self.name, self.clock() - self.failing_since)
        self.failing_since, self.failures, self.next_try, self.failed_addresses = None, 0, 0.0, None

    def backing_off(self, addresses=None) -> float:
        """Seconds until the next dial may be tried (0 when it may now, or when `addresses` are not
        those where the last dial failed)."""
        if addresses and self.failed_addresses is not None and frozenset(addresses) != self.failed_addresses:
            return 0.0
        return max(self.next_try - self.clock(), 0.0)


class HaltNotice:
    """The log of a stopped run (a role lost its last server), in the manner of LinkHealth: one
    ERROR line when it stops, with the reason; one a minute while it stays stopped; one when it
    goes on. `update` takes the current reason (None: running). A reader of other peers' records
    passes `clear_after`: a DHT read can miss every record that says so, so the run counts as going
    on only once no read said it was stopped for that many seconds, or at once when the read shows
    progress (the servers' highest parameter version, passed as `progress`) beyond any read made
    before or while it was stopped: the records that carry a version also carry the stop, and a
    version reached before the stop that a lagging read had not shown yet is no progress."""

    def __init__(self, who: str, clock=time.monotonic, period: float = 60.0, clear_after: float = 0.0, on_change=None):
        self.who, self.clock, self.period, self.clear_after = who, clock, period, clear_after
        # instead of its own log lines: on_change(reason) when the run stops (or the reason changes),
        # on_change(None, seconds stopped) when it goes on (a peer's state line says it: peer.host)
        self.on_change = on_change
        self.reason: str | None = None
        self.since = self._logged_at = self._said_at = 0.0
        self._progress = -1  # the highest progress read so far

    def update(self, reason: str | None, progress: int | None = None) -> None:
        now = self.clock()
        if reason is None:
            moved = progress is not None and progress > self._progress
            if progress is not None:
                self._progress = max(self._progress, progress)
            if self.reason is not None and (moved or now - self._said_at >= self.clear_after):
                self.went_on()
            return
        self._said_at = now
        if progress is not None:
            self._progress = max(self._progress, progress)
        if self.on_change is not None:
            if self.reason is None:
                self.since = now
            if reason != self.reason:
                self.reason = reason
                self.on_change(reason)
            return
        if self.reason is None:
            self.reason, self.since, self._logged_at = reason, now, now
            logger.error("%s: %s", self.who, reason)
        elif reason != self.reason or now - self._logged_at >= self.period:
            self.reason, self._logged_at = reason, now
            logger.error("%s: still stopped after %.0f s: %s", self.who, now - self.since, reason)

    def went_on(self) -> None:
        """The run went on (a read showed it, or it reached its last step, which it cannot while
        stopped: a peer that learns the end while it still counts the run stopped says it went on)."""
        if self.reason is None:
            return
        now = self.clock()
        if self.on_change is not None:
            self.on_change(None, now - self.since)
        else:
            logger.warning("%s: the run goes on again after %.0f s stopped", self.who, now - self.since)
        self.reason = None


# peer id -> its health, shared by every link of this process to that peer
HEALTH: dict[str, LinkHealth] = {}


def health_of(peer_id: str, device: str) -> LinkHealth:
    if peer_id not in HEALTH:
        HEALTH[peer_id] = LinkHealth(f"{device} ({peer_id[-8:]})")
    return HEALTH[peer_id]


class P2PLink:
    """A server seen over hivemind P2P. Before its first call, and after any failed one, it
    connects to the server at the multiaddrs the server's record announces (`addresses()`): libp2p
    can reach a peer only at addresses it knows, and a volunteer knows only its initial peer's."""

    def __init__(
        self,
        p2p,
        peer_id: str,
        device: str,
        servicer_cls,
        links: LinkEmulator | None = None,
        addresses: Callable[[], list[str]] | None = None,
        backoff: bool = True,
        compress: str = "none",
    ):
        self.p2p = p2p
        self.compress = compress  # the run's --compress (peer/protocol/wire.py)
        self.peer_id = peer_id
        self.device = device
        self._session_handler = session_handler(servicer_cls)
        self.links = links or LinkEmulator()
        self.addresses = addresses
        self.health = health_of(peer_id, device)
        self.backoff = backoff  # False for a liveness probe: it must really try
        self._dialled = False

    async def dial(self) -> None:
        """Connect to the server at its announced addresses (a no-op for a peer already connected)."""
        maddrs = self.addresses() if self.addresses is not None else []
        wait = self.health.backing_off(maddrs) if self.backoff else 0.0
        if wait > 0:
            raise DialError(f"{self.device}: unreachable, next dial in {wait:.1f} s")
        if maddrs:
            from multiaddr import Multiaddr

            try:
                await asyncio.wait_for(
                    self.p2p._client.connect(
                        PeerID.from_base58(self.peer_id), [Multiaddr(m.split("/p2p/")[0]) for m in maddrs]
                    ),
                    15.0,
                )
            except Exception as e:
                self.health.failed(e, addresses=maddrs)
                raise DialError(f"{self.device}: cannot connect at {' '.join(maddrs)}: {e}") from None
        self._dialled = True

    def retry_in(self) -> float:
        """Seconds until this server may be dialled again (0 when now)."""
        return self.health.backing_off(self.addresses() if self.addresses is not None else None)

    async def call(self, method: str, meta: dict, tensors=(), timeout: float = 30.0):
        """One request; a connection that closes before answering is retried (but for `take`), then
        raised as ConnectionError. A refusal by the server (RemoteError) says nothing of the link."""
        attempts = 1 if method in methods.NOT_RETRIED else 3
        for attempt in range(attempts):
            try:
                if not self._dialled:
                    await self.dial()
                result = await self._call_once(method, meta, tensors, timeout)
            except RemoteError:
                self.health.succeeded()
                raise
            except P2PDaemonError as e:
                # the daemon could not open the stream: the peer is gone, or up but not serving yet
                # ("protocols not supported" while a restarted server loads its checkpoint). Counted as
                # a failed dial, so that callers back off instead of spinning on it.
                self.health.failed(e, dial=True, addresses=self.addresses() if self.addresses is not None else None)
                self._dialled = False
                raise DialError(f"{self.device}.{method}: {describe(e)}") from None
            except Exception as e:
                if not isinstance(e, DialError):  # (a failed dial is counted where it happens)
                    self.health.failed(e, dial=False)
                self._dialled = False
                if not isinstance(e, ConnectionError) or attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.1 * (attempt + 1))
            else:
                self.health.succeeded()
                return result

    async def _call_once(self, method: str, meta: dict, tensors, timeout: float):
        messages = pack(
            meta,
            list(tensors),
            ExpertRequest,
            compress=self.compress if method in methods.COMPRESSED_REQUESTS else "none",
        )
        size = payload_bytes(messages)
        await self.links.send(self.device, size)
        started = time.monotonic()

        async def roundtrip():
            sessions = Sessions.of(self.p2p)
            try:
                session = await sessions.get(self.peer_id, self._session_handler)
            except FileNotFoundError as e:  # (the local p2p daemon's control socket: this peer is closing)
                raise ConnectionError(f"{self.device}.{method}: this peer's p2p daemon is gone: {e}") from None
            try:
                # the answer's messages follow each other at once: one that stalls cuts the call
                return await unpack(session.call(method, messages), stall=STALL_SECONDS, accept=self.compress)
            except StreamCut as e:
                sessions.drop(self.peer_id, session)  # (a stalled answer stalls the session's others too)
                logger.debug("%s.%s: answer cut after %.1f s: %s", self.device, method, time.monotonic() - started, e)
                raise StreamCut(f"{self.device}.{method}: {e}", meta=e.meta) from None
            except PayloadError as e:
                if str(e) == "empty request":
                    sessions.drop(self.peer_id, session)
                    raise ConnectionError(f"{self.device}.{method}: the connection closed before an answer") from None
                raise

        try:  # the deadline covers the whole call: the request, the handler's work, every answer message
            meta_r, tensors_r = await asyncio.wait_for(roundtrip(), timeout)
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(f"{self.device}.{method}: no complete answer within {timeout:.0f} s") from None
        if "error" in meta_r:
            raise RemoteError.of(f"{self.device}.{method}", meta_r)
        return meta_r, tensors_r


class LocalLink:
    """The server in this very process: same handler, same checks, no network."""

    def __init__(self, server, sender: str):
        self.server = server
        self.peer_id = sender
        self.device = server.device_id
        self.sender = sender

    async def call(self, method: str, meta: dict, tensors=(), timeout: float = 30.0):
        meta_r, tensors_r = await self.server.handle(
            method, dict(meta), [t.detach().clone() for t in tensors], self.sender
        )
        if "error" in meta_r:
            raise RemoteError.of(f"{self.device}.{method}", meta_r)
        return meta_r, tensors_r


class Directory:
    """device id -> peer id of the run's servers, refreshed from the stage records."""

    def __init__(self, dht: DHT, run_id: str, num_stages: int):
        self.dht = dht
        self.run_id = run_id
        self.num_stages = num_stages
        self.servers: dict[str, str] = {}
        # every server ever seen (device -> peer id): one read of a key may miss a record that another
        # DHT node holds, so membership checks and calls use this, and losses are confirmed by a call
        self.known: dict[str, str] = {}
        self.versions: dict[str, int] = {}  # server device -> announced parameter version
        self.epochs: dict[str, int] = {}  # server device -> the layout epoch of that announcement
        self.records: dict[str, dict] = {}  # peer id -> record (servers and clients)
        self.addresses: dict[str, list[str]] = {}  # server peer id -> the multiaddrs it last announced
        # server device -> (the time its newest record was written, when (time.monotonic) this
        # process saw that record's time advance): a record lives records.record_ttl, longer than
        # its writer may be silent, so liveness is how long since a server last said something new
        self._heard: dict[str, tuple[float, float]] = {}
        # servers that announced the run finished (they leave once every server reached the last
        # step): their silence afterwards is not a loss
        self.finished: set[str] = set()

    async def refresh(self) -> dict[str, str]:
        servers, recs, versions, epochs = {}, {}, {}, {}
        for k, found in enumerate(await records.read_stages(self.dht, self.run_id, self.num_stages)):
            for peer, rec, problem in found:
                if rec is None:
                    logger.debug("ignoring a malformed record under stage %d: %s", k, problem)
                    continue
                recs[peer] = rec
                if rec["kind"] == "server":
                    self.addresses[peer] = [m for m in rec["maddrs"] if isinstance(m, str)]
                    self._note(rec)
                    if rec["state"] == "finished":
                        self.finished.add(rec["device"])
                if rec["kind"] == "server" and rec["state"] != "offline":
                    servers[rec["device"]] = peer
                    versions[rec["device"]] = rec["version"]
                    epochs[rec["device"]] = rec.get("epoch", 0)
        self.servers, self.records, self.versions, self.epochs = servers, recs, versions, epochs
        self.known.update(servers)
        return servers

    def _note(self, rec: dict) -> None:
        device, written = rec["device"], float(rec["time"])
        if rec["state"] == "offline":  # it said it left
            self._heard[device] = (written, float("-inf"))
            return
        last = self._heard.get(device)
        if last is None:  # first sight: as old as its own time says (a record outlives its writer)
            self._heard[device] = (written, time.monotonic() - max(0.0, time.time() - written))
        elif written > last[0]:  # something new: its writer was there a read ago
            self._heard[device] = (written, time.monotonic())

    def silent_for(self, device: str) -> float:
        """Seconds since server `device` last announced something new, as this directory's reads
        saw it (inf if never, or if it announced that it went offline)."""
        heard = self._heard.get(device)
        return float("inf") if heard is None else time.monotonic() - heard[1]

    def halted(self, period: float) -> str | None:
        """Why the run is stopped, as a live server of it announces (None while it runs): records
        fresher than records.stale_after(period) (a stopped server's record outlives it)."""
        return records.halted_reason(r for r in self.records.values() if records.is_fresh(r, period))

    def link(
        self,
        p2p,
        device: str,
        servicer_cls,
        links: LinkEmulator | None = None,
        peer_id: str | None = None,
        backoff: bool = True,
        compress: str = "none",
    ) -> "P2PLink":
        """A P2P link to server `device` (by default the peer id last seen for it) that dials the
        multiaddrs its record announces."""
        peer = peer_id or self.known[device]
        return P2PLink(
            p2p,
            peer,
            device,
            servicer_cls,
            links,
            addresses=lambda: self.addresses.get(peer, []),
            backoff=backoff,
            compress=compress,
        )

    async def wait_for(self, devices, timeout: float = 120.0) -> None:
        """Until every device in `devices` has been seen in a record. Seen once is enough: one read
        of the stage keys can miss a record another DHT node holds, and with many servers a read that
        misses none may take a long while; and devices already seen cost no read at all (a restarted
        server read the run's servers before it served, and a second read of a busy DHT can take seconds)."""
        deadline = time.monotonic() + timeout
        missing = [d for d in devices if d not in self.known]
        while missing:
            await self.refresh()
            missing = [d for d in missing if d not in self.known]
            if missing and time.monotonic() > deadline:
                raise TimeoutError(f"servers not found in the DHT: {missing}")
            if missing:
                await asyncio.sleep(0.3)


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
