#!/usr/bin/env python3
"""Operations per second of taskpool.TaskPool on one core, for a pool of N tasks.

    python scripts/bench_taskpool.py [--tasks N] [--clients C] [--no-gc]

Rows (each on a fresh pool of N tasks unless said otherwise):

* add: N ``add`` calls (the Task objects are built beforehand; their cost is its own row);
* take+complete: N pairs, clients taking in turn with one lease each (the hot path);
* take, many leases: N ``take`` calls spread over C clients holding N/C leases each;
* expire: one ``expire`` call that re-queues those N leases, counted per lease;
* client_left: after leasing everything again, C ``client_left`` calls, per lease re-queued.

ops/s is per CPU second of this process (one core), so it holds on a busy machine; the
wall seconds are shown too.  The target is 200,000 take+complete pairs per second; the exit status is 1 below it
with ``--check``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file from a checkout: import this tree's taskpool
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taskpool import BACKWARD, FORWARD, Task, TaskPool  # noqa: E402

PAIRS_TARGET = 200_000


def make_tasks(n: int) -> list[Task]:
    """n tasks in 64 micro-batches per batch, every fourth one a backward task."""
    return [Task(f"t{i}", BACKWARD if i % 4 == 0 else FORWARD, i >> 6, i & 63, 0, (0, 8)) for i in range(n)]


def timed(fn) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of fn().  The pool is single-threaded, so CPU time is
    its time on one core even when other processes share the machine."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def filled_pool(tasks: list[Task], max_leases: int = 1) -> TaskPool:
    pool = TaskPool(clock=time.monotonic, max_leases_per_client=max_leases)
    for task in tasks:
        pool.add(task)
    return pool


def lease_all(pool: TaskPool, clients: list[str], n: int) -> None:
    take = pool.take
    per_client = -(-n // len(clients))
    for client in clients:
        for _ in range(per_client):
            if take(client) is None:
                return


def run(n: int, n_clients: int) -> list[tuple[str, int, tuple[float, float]]]:
    rows = []
    tasks: list[Task] = []
    rows.append(("Task() build", n, timed(lambda: tasks.extend(make_tasks(n)))))

    pool = TaskPool(clock=time.monotonic)

    def add_all() -> None:
        add = pool.add
        for task in tasks:
            add(task)

    rows.append(("add", n, timed(add_all)))

    clients = [f"client{i}" for i in range(n_clients)]

    def pairs() -> None:
        take, complete = pool.take, pool.complete
        for i in range(n):
            client = clients[i % n_clients]
            complete(take(client).task.task_id, client)

    rows.append(("take+complete pairs", n, timed(pairs)))
    assert len(pool) == 0 and pool.stats()["done"] == n
    del pool

    max_leases = -(-n // n_clients)
    pool = filled_pool(tasks, max_leases)
    rows.append(("take, many leases", n, timed(lambda: lease_all(pool, clients, n))))
    assert pool.stats()["leased"] == n
    expired: list[Task] = []
    rows.append(("expire", n, timed(lambda: expired.extend(pool.expire(time.monotonic() + 1e9)))))
    assert len(expired) == n and pool.stats()["queued"] == n

    lease_all(pool, clients, n)
    requeued = 0

    def leave_all() -> None:
        nonlocal requeued
        for client in clients:
            requeued += len(pool.client_left(client))

    seconds = timed(leave_all)
    assert requeued == n
    rows.append(("client_left", n, seconds))
    rows.append((f"  (per client, {max_leases} leases each)", n_clients, seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000, help="pool size (default 10^6)")
    parser.add_argument("--clients", type=int, default=100, help="clients (default 100)")
    parser.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    parser.add_argument("--check", action="store_true", help=f"exit 1 below {PAIRS_TARGET:,} take+complete pairs/s")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.clients < 1:
        parser.error("--tasks and --clients must be >= 1")
    if args.no_gc:
        gc.disable()

    rows = run(args.tasks, args.clients)

    print(
        f"taskpool benchmark: {args.tasks:,} tasks, {args.clients} clients, "
        f"Python {sys.version.split()[0]}, gc {'off' if args.no_gc else 'on'}"
    )
    print(f"{'operation':<36}{'count':>10}{'cpu s':>9}{'wall s':>9}{'ops/s (cpu)':>14}")
    for name, count, (cpu, wall) in rows:
        print(f"{name:<36}{count:>10,}{cpu:>9.3f}{wall:>9.3f}{count / cpu:>14,.0f}")
    pairs = next(count / cpu for name, count, (cpu, _) in rows if name == "take+complete pairs")
    verdict = "ok" if pairs >= PAIRS_TARGET else "BELOW TARGET"
    print(f"take+complete: {pairs:,.0f} pairs/s (target {PAIRS_TARGET:,}): {verdict}")
    return 1 if args.check and pairs < PAIRS_TARGET else 0


if __name__ == "__main__":
    sys.exit(main())
