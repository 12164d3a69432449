"""How a frontal server cuts a micro-batch's rows among its clients: here, below the servers, so
that the step model (scheduler/stepsim.py) plays the very rules the servers run
(parameter_server/frontal.py imports them through core.layout)."""

from __future__ import annotations


def split_by_weights(lo: int, hi: int, weights: list[float]) -> list[tuple[int, int, int]]:
    """Rows [lo, hi) cut into len(weights) contiguous pieces proportional to the weights (largest
    remainder rounding), as (weight index, lo, hi); empty pieces are dropped, so fewer pieces come
    back when rows are scarcer than weights."""
    n = hi - lo
    if n <= 0:
        return []
    w = [max(float(x), 0.0) for x in weights] or [1.0]
    total = sum(w)
    if total <= 0:
        w, total = [1.0] * len(w), float(len(w))
    exact = [n * x / total for x in w]
    counts = [int(e) for e in exact]
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    pieces, at = [], lo
    for i, c in enumerate(counts):
        if c > 0:
            pieces.append((i, at, at + c))
            at += c
    return pieces


def clients_per_batch(micro_batches: int, rows: int, min_client_rows: int) -> int:
    """How many clients a batch's `micro_batches` x `rows` rows at one frontal server are held to:
    as many as give each at least `min_client_rows` (`peer serve --client-batch-tokens`), one at least."""
    return max(1, micro_batches * rows // min_client_rows)


# how much faster (by the compute it registered) another free client must be for a new batch to go
# to it rather than to a free worker of a stage server. A volunteer moves 4x the parameter bytes (it
# pulls both of a two-server stage's shards and pushes both, where a server's worker reads its
# server's shard and replica and pushes half), over a link the frontal server does not measure: at
# 2,048 tokens a batch moves a byte per ~1,500 FLOPs, so on a 10-200 Mbit/s home link a device faster
# than 2-40 GFLOP/s spends longer moving the stage's parameters than computing. 2 is a judgment, not
# a fit: it keeps a much faster volunteer (a GPU beside CPU-only servers) computing, at the price of
# its transfers, and leaves equal devices (this machine's) to the servers' workers.
LOCAL_EDGE = 2.0


def in_flight(members: dict[int, list[str]], version: int, batch: int) -> set:
    """The members of the batches before `batch` not applied yet at `version` (busy computing them)."""
    return {p for b, ms in members.items() if version <= b < batch for p in ms}


def local_first(clients: list[tuple[str, float]], local: set, busy: set) -> set:
    """The clients a new batch's members are chosen from first: the stage servers' own workers
    (`local`) that are not members of an earlier batch still in flight (`busy`: `in_flight`), unless a free other
    client is more than LOCAL_EDGE times as fast as one (`clients`: (name, speed), a device's
    compute: not its measured throughput, which follows the work it was given). Delay scheduling's locality rule
    (Zaharia et al., 2010), in bytes: a batch that such a worker computes moves a quarter of the
    stage's parameter bytes a volunteer's would (no pull, half the push)."""
    free = [(p, w) for p, w in clients if p not in busy]
    fastest_other = max((w for p, w in free if p not in local), default=0.0)
    return {p for p, w in free if p in local and w * LOCAL_EDGE >= fastest_other}


def cut_rows(
    lo: int,
    hi: int,
    clients: list[tuple[str, float]],
    credit: dict[str, float],
    min_task_rows: int,
    members: list[str] | None = None,
    per_batch: int = 0,
    first: set = frozenset(),
) -> list[tuple[str | None, int, int]]:
    """A micro-batch's rows [lo, hi) cut into forward tasks, as (preferred client, lo, hi).
    `clients` are (name, weight) in a fixed order. Every client gets a piece when the rows allow
    each one at least `min_task_rows`; else only the ones owed the most rows get one: each client
    accrues its weight's share of every micro-batch's rows in `credit` (updated in place; clients no
    longer listed are dropped from it) and pays for the rows it gets, so that over a batch every
    client still gets rows in proportion to its weight, in fewer, larger tasks (a 1-row task costs
    as many calls as a 4-row one). No clients: one piece for anyone (None).

    `members` (the batch's list, filled in place at its first micro-batch) and `per_batch` > 0 hold
    a batch's micro-batches to the `per_batch` clients owed the most rows when it began (any still
    listed; new ones once none is): a client that computes part of a batch pulls the stage's
    parameters of its version and pushes a gradient sum as large, whatever its share, so a batch
    goes to fewer clients in larger shares and the others take the next batches (the credit keeps
    their shares in proportion over batches). Members are chosen among the clients in `first`
    (`local_first`) before the others, each group by the rows it is owed."""
    rows = hi - lo
    k = max(1, rows // min_task_rows)
    restrict = members is not None and 0 < per_batch < len(clients)
    if len(clients) <= k and not restrict:
        weights = [w for _, w in clients] or [1.0]
        return [(clients[i][0] if clients else None, a, b) for i, a, b in split_by_weights(lo, hi, weights)]
    names = {p for p, _ in clients}
    for p in [p for p in credit if p not in names]:
        del credit[p]
    total = sum(max(w, 0.0) for _, w in clients) or float(len(clients))
    for p, w in clients:
        credit[p] = credit.get(p, 0.0) + rows * max(w, 0.0) / total

    def most_owed(pool):
        return sorted(pool, key=lambda c: (-credit[c[0]], c[0]))

    if restrict:
        if not names.intersection(members):
            ranked = most_owed(clients)
            ranked = [c for c in ranked if c[0] in first] + [c for c in ranked if c[0] not in first]
            members[:] = [p for p, _ in ranked[:per_batch]]
        clients = [c for c in clients if c[0] in members]
    chosen = most_owed(clients)[:k]
    pieces = []
    for i, a, b in split_by_weights(lo, hi, [w for _, w in chosen]):
        credit[chosen[i][0]] -= b - a
        pieces.append((chosen[i][0], a, b))
    return pieces


def note_cut(cuts: dict[int, tuple[int, set]], batch: int, clients: set) -> None:
    """Record that a micro-batch of `batch` was cut for `clients`: `cuts[batch]` is (micro-batches of
    it cut, the clients that got a piece of every one)."""
    cut, every = cuts.get(batch, (0, None))
    cuts[batch] = (cut + 1, set(clients) if every is None else every & clients)


def owed_more(cuts: dict[int, tuple[int, set]], batch: int, client: str, micro_batches: int) -> bool:
    """Whether more of the batch's micro-batches are still to be cut and `client` got a piece of every
    one cut so far (so it is likely to get the next ones: the batch's member)."""
    cut, every = cuts.get(batch, (0, set()))
    return cut < micro_batches and client in every
