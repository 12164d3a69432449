"""A small testbed of hosts on one machine: network namespaces joined by veth pairs to one bridge,
each host's link optionally rate-shaped by `tc tbf` in both directions. Used by the deploy walk
(tests/net/test_deploy_doc.py) and scripts/bench_netns.py. Needs root, `ip netns` and `tc`; `require()` says why not.

Addresses come from 198.18.0.0/15, the range set aside for benchmarks (RFC 2544), so the testbed
never collides with a real network. Everything it creates carries a per-testbed prefix and is
removed by `close()`, also after a partial `__init__`."""

from __future__ import annotations

import os
import shutil
import subprocess


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2)"
    probe = f"hpprobe{os.getpid() % 10000}"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


class Testbed:
    """`hosts` named hosts on one bridge; host i gets 198.18.<subnet>.<i+1>/24."""

    def __init__(self, hosts: list[str], *, tag: str | None = None, subnet: int = 0):
        self.tag = tag or f"hp{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.hosts: dict[str, str] = {}  # host name -> namespace
        self.addrs: dict[str, str] = {}  # host name -> IPv4 address
        self._veths: dict[str, str] = {}  # host name -> the bridge side of its veth
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(hosts):
                ns, outer, inner = f"{self.tag}{name}", f"{self.tag}{i}o", f"{self.tag}{i}i"
                _sh("ip", "netns", "add", ns)
                self.hosts[name] = ns
                _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
                self._veths[name] = outer
                _sh("ip", "link", "set", inner, "netns", ns)
                _sh("ip", "link", "set", outer, "master", self.bridge)
                _sh("ip", "link", "set", outer, "up")
                addr = f"198.18.{subnet}.{i + 1}"
                self.addrs[name] = addr
                _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", inner)
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def shape(self, host: str, mbit: float, burst_kb: int = 64, latency_ms: int = 50) -> None:
        """Limit the host's link to `mbit` Mbit/s each way (tbf on both ends of its veth)."""
        rate = f"{mbit:g}mbit"
        ns = self.hosts[host]
        inner = self._veths[host][:-1] + "i"
        for prefix in (["ip", "netns", "exec", ns], []):
            dev = inner if prefix else self._veths[host]
            _sh(
                *prefix,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                f"{burst_kb}kb",
                "latency",
                f"{latency_ms}ms",
            )

    def counters(self, host: str) -> dict[str, int]:
        """Bytes the kernel counted on the host's link since it was made: {"sent": ..., "received": ...}
        (read on the bridge side of its veth, whose receive is the host's send)."""
        stats = f"/sys/class/net/{self._veths[host]}/statistics"
        with open(f"{stats}/rx_bytes") as rx, open(f"{stats}/tx_bytes") as tx:
            return {"sent": int(rx.read()), "received": int(tx.read())}

    def prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command inside the host's namespace."""
        return ["ip", "netns", "exec", self.hosts[host]]

    def close(self) -> None:
        for ns in self.hosts.values():
            _sh("ip", "netns", "del", ns, check=False)
        for outer in self._veths.values():
            _sh("ip", "link", "del", outer, check=False)
        _sh("ip", "link", "del", self.bridge, check=False)
        self.hosts.clear()
        self._veths.clear()

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Processes:
    """`peer` processes started in the testbed's hosts (or on this machine), each in its own process
    group, logging to WORK/NAME.log; `close()` leaves none behind."""

    def __init__(self, work):
        self.work = work
        os.makedirs(work, exist_ok=True)
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], prefix=(), stdout=None) -> subprocess.Popen:
        """`python -m peer.cli ARGV` under `prefix` (Testbed.prefix(host), or nothing); stdout to the
        log unless given (subprocess.PIPE to read it, as text)."""
        import sys

        log = open(os.path.join(self.work, f"{name}.log"), "ab")
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "peer.cli", *argv],
            stdout=stdout or log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=stdout is not None,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        self.procs.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        with open(os.path.join(self.work, f"{name}.log"), errors="replace") as f:
            return f.read()

    def close(self, grace: float = 15.0) -> dict[str, int | None]:
        """SIGTERM to each process, as an operator's `kill` would; SIGKILL to whatever of its group is
        left after `grace` seconds. Returns {name: exit code, None if it had to be killed}."""
        import signal
        import time

        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + grace
        codes = {}
        for name, p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            codes[name] = p.poll()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        return codes
