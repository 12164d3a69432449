"""The pool's heaps: which queued task a client gets next and which lease runs out first, each
operation O(log n).

* ``by_key``: priority key (taskpool/entry.py) -> the Entry of a queued or leased task;
* ``open``: keys of the open tasks; ``pref[c]``: keys of the tasks that prefer client ``c``;
  ``pending``: ``(end of grace, key)`` of the preferred tasks;
* ``deadlines``: ``(deadline, key)`` of the leases; ``oldest``: ``(added at, key)`` of the queued
  tasks (for the age statistic).

Deletion is lazy: an item is live iff its entry is still in ``by_key`` in the state the heap is for
(and, for a deadline, the lease has that deadline); other items are stale and are dropped when they
reach the top, or all at once by a compaction when they outnumber the live ones (amortized O(1)). A
task may have two identical live items in one heap (it left and came back before the first one
reached the top): the first one popped changes its state and makes the other stale.

The pool's hot paths (TaskPool.take, complete, expire) read these lists directly.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from .entry import LEASED, OPEN, PREF, Entry

# A group of heaps is compacted when it holds more than SLACK x live + min_stale items.
SLACK = 4
MIN_STALE = 4096


class Queues:
    __slots__ = ("by_key", "open", "pref", "pending", "oldest", "pref_items", "deadlines", "min_stale")

    def __init__(self, min_stale: int = MIN_STALE) -> None:
        self.by_key: dict[int, Entry] = {}
        self.open: list[int] = []
        self.pref: dict[str, list[int]] = {}
        self.pending: list[tuple[float, int]] = []
        self.oldest: list[tuple[float, int]] = []
        self.pref_items = 0  # items in all the pref heaps together
        self.deadlines: list[tuple[float, int]] = []
        self.min_stale = min_stale

    def enqueue(self, entry: Entry, now: float, queued: int) -> None:
        """Queue a task (new, or back from a lease): preferred while in grace, else open. `queued`:
        how many tasks are queued, this one included (what the live items number)."""
        entry.lease = None
        key = entry.key
        heappush(self.oldest, (entry.added_at, key))
        preferred = entry.task.preferred_client
        if preferred is not None and now < entry.open_at:
            entry.state = PREF
            heappush(self.pref.setdefault(preferred, []), key)
            heappush(self.pending, (entry.open_at, key))
            self.pref_items += 1
        else:
            entry.state = OPEN
            heappush(self.open, key)
        if len(self.open) + len(self.oldest) + len(self.pending) + self.pref_items > SLACK * queued + self.min_stale:
            self.compact_queues()

    def push_open(self, entry: Entry) -> None:
        entry.state = OPEN
        heappush(self.open, entry.key)

    def promote(self, now: float) -> None:
        """Preferred tasks whose grace period is over become open to every client."""
        pending = self.pending
        by_key = self.by_key
        while pending and pending[0][0] <= now:
            entry = by_key.get(heappop(pending)[1])
            if entry is not None and entry.state == PREF:
                self.push_open(entry)

    def pop_best(self, client: str, now: float, grace: float, standing) -> Entry | None:
        """Take out of the queues the best task `client` may have now (its own preferred tasks
        included), or None. A task whose lease this client let run out goes to others first
        (`shun`); a newly open task goes first to the clients that have delivered
        (taskpool/standing.py `waits`); its own preferred tasks it may take at once."""
        pending = self.pending
        if pending and pending[0][0] <= now:
            self.promote(now)
        by_key = self.by_key
        heap = self.open
        while heap:
            entry = by_key.get(heap[0])
            if entry is not None and entry.state == OPEN:
                break
            heappop(heap)
        else:
            entry = None
        if entry is not None and (
            (entry.shun == client and now < entry.shun_until)
            or (now < entry.open_at + grace and standing.waits(client))
        ):
            entry = None
        if self.pref:
            pref = self.pref.get(client)
            while pref:
                pentry = by_key.get(pref[0])
                if pentry is not None and pentry.state == PREF:
                    if entry is None or pentry.key < entry.key:
                        entry, heap = pentry, pref
                        self.pref_items -= 1
                    break
                heappop(pref)
                self.pref_items -= 1
        if entry is not None:
            heappop(heap)
        return entry

    def open_preferred(self, client: str) -> list[Entry]:
        """The tasks waiting for `client` (gone) become open to everyone; returns them."""
        keys = self.pref.pop(client, None)
        if not keys:
            return []
        self.pref_items -= len(keys)
        opened = []
        for key in keys:
            entry = self.by_key.get(key)
            if entry is not None and entry.state == PREF:
                self.push_open(entry)
                opened.append(entry)
        return opened

    def push_deadline(self, deadline: float, key: int, leased: int) -> None:
        """A lease's deadline; `leased`: how many leases there are (what the live items number)."""
        deadlines = self.deadlines
        heappush(deadlines, (deadline, key))
        if len(deadlines) > SLACK * leased + self.min_stale:
            self.compact_deadlines()

    def live_deadline(self, item: tuple[float, int]) -> bool:
        entry = self.by_key.get(item[1])
        return entry is not None and entry.state == LEASED and entry.lease.deadline == item[0]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a current lease, or None."""
        deadlines = self.deadlines
        while deadlines and not self.live_deadline(deadlines[0]):
            heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def oldest_added(self) -> float | None:
        """When the oldest queued task was added, or None when nothing is queued."""
        oldest = self.oldest
        by_key = self.by_key
        while oldest:
            entry = by_key.get(oldest[0][1])
            if entry is not None and entry.state <= PREF:
                return oldest[0][0]
            heappop(oldest)
        return None

    def items(self) -> dict[str, int]:
        """Items in the heaps, live and stale: what compaction keeps within SLACK x live + min_stale."""
        return {
            "deadlines": len(self.deadlines),
            "queues": len(self.open) + len(self.oldest) + len(self.pending) + self.pref_items,
        }

    # Compactions: drop the stale items and re-heapify. Each runs when stale items are at least 3/4 of
    # its heaps, so its cost, paid once per item dropped, is amortized O(1) per operation.

    def compact_deadlines(self) -> None:
        get = self.by_key.get
        heap = self.deadlines
        heap[:] = [
            item
            for item in heap
            if (e := get(item[1])) is not None and e.state == LEASED and e.lease.deadline == item[0]
        ]
        heapify(heap)

    def compact_queues(self) -> None:
        get = self.by_key.get

        def keep(heap: list, state: int) -> None:
            heap[:] = [key for key in heap if (e := get(key)) is not None and e.state == state]
            heapify(heap)

        def keep_timed(heap: list, lo: int, hi: int) -> None:
            heap[:] = [item for item in heap if (e := get(item[1])) is not None and lo <= e.state <= hi]
            heapify(heap)

        keep(self.open, OPEN)
        keep_timed(self.pending, PREF, PREF)
        keep_timed(self.oldest, OPEN, PREF)
        self.pref_items = 0
        for client in list(self.pref):
            heap = self.pref[client]
            keep(heap, PREF)
            if heap:
                self.pref_items += len(heap)
            else:
                del self.pref[client]
