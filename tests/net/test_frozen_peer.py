"""A frozen DHT peer (SIGSTOP of its DHT process and p2p daemon: a suspended laptop, a paused VM)
hides no one else's records: announcements made while it is frozen are stored and read. With
3-second records and 30-second DHT calls, every store that reached the frozen peer outlived its
record, and readers found no record of the stage at all (a failover took 45 s, not 9). Real DHT
processes on 127.0.0.1, real SIGSTOP."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import psutil

from core.protocol import record_store, records
from peer.addresses import visible_maddrs
from peer.node import start_dht, stop_dht

PERIOD = 1.0  # the announce period the records are made for


def announce(dht, device: str) -> float:
    written = time.time()
    rec = records.record_to_dict(
        records.ClientRecord(device=device, stage=0, state="online", compute=1.0, time=written)
    )
    asyncio.run(record_store.publish(dht, rec, ttl=records.record_ttl(PERIOD), stage=0))
    return written


def group(dht) -> list[psutil.Process]:
    proc = psutil.Process(dht.pid)
    return [proc] + proc.children(recursive=True)


def test_records_announced_while_a_peer_is_frozen_are_stored_and_read():
    """Five DHT nodes each announce a record every PERIOD, as servers and volunteers do; one is
    frozen; every other node's records written after the freeze are read (within 30 s)."""
    run = f"frozen-peer-{os.getpid()}"
    nodes = [start_dht([], run_id=run, run_fp=None)]
    frozen, stop = [], threading.Event()
    written: dict[str, list[float]] = {}

    def announcer(i: int, dht) -> None:
        while not stop.is_set():
            try:
                written.setdefault(f"n{i}", []).append(announce(dht, f"n{i}"))
            except Exception:  # (a store that failed: the next one tries again)
                pass
            stop.wait(PERIOD)

    threads = []
    try:
        for _ in range(4):
            nodes.append(start_dht(visible_maddrs(nodes[0]), run_id=run, run_fp=None, timeout=60.0))  # as peer serve
        names = {str(n.peer_id): f"n{i}" for i, n in enumerate(nodes)}
        threads = [threading.Thread(target=announcer, args=(i, n), daemon=True) for i, n in enumerate(nodes)]
        for t in threads:
            t.start()
        time.sleep(3 * PERIOD)
        frozen = group(nodes[1])
        for p in frozen:
            p.send_signal(signal.SIGSTOP)
        frozen_at = time.time()
        deadline, seen = time.monotonic() + 30.0, {}
        live = [f"n{i}" for i in range(len(nodes)) if i != 1]
        while time.monotonic() < deadline:
            for peer, rec, _ in asyncio.run(record_store.read_stage(nodes[0], run, 0, "clients")):
                if rec is not None:
                    seen[names.get(peer, peer)] = max(seen.get(names.get(peer, peer), 0.0), rec["time"])
            if all(seen.get(d, 0.0) > frozen_at for d in live):
                break
            time.sleep(0.5)
        assert all(seen.get(d, 0.0) > frozen_at for d in live), (
            {d: round(t - frozen_at, 1) for d, t in seen.items()},
            {d: [round(t - frozen_at, 1) for t in ts[-3:]] for d, ts in written.items()},
        )
    finally:
        stop.set()
        for p in frozen:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        for t in threads:
            t.join(15.0)
        for n in nodes:
            stop_dht(n)
