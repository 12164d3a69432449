"""Global gradient-norm clipping (--clip-grad-norm X): the step of batch t on every shard of every
stage multiplies the shard's summed gradient by min(1, X / (norm + 1e-6)), where norm is the L2 norm
of batch t's whole gradient, over every parameter of the model, as torch.nn.utils.clip_grad_norm_
over the whole model does in `peer reference`.

The round: when a hosted slot's batch t is complete, its host sums the squares of the slot's gradient
(float64) and sends that sum to every other server of the run (`grad_norm`, a server-only method),
whose answer carries what the receiver knows of batch t in turn. A shard steps batch t once it knows
the sum of every slot of every stage, added in one order (stage, slot) so that every server gets the
same total to the bit. The delayed update gives the round its slack: batch t's update is needed only
by the tasks of batch t + 2, so a stage that waits for the first stage's last backward of batch t
waits while batch t + 1 is computed.

What is lost on the way is asked for again: a shard that waits longer than PULL_AFTER asks the host
of each slot it lacks, every PULL_PERIOD, until it knows them. A slot stepped already keeps the total
its step used (ShardState.totals, sent with its replica and written in its checkpoint), which answers
for it after a failover or a restart. A sum belongs to the layout epoch it was made in: a ban's
rollback to version r makes every sum of a batch >= r from an earlier epoch stale (the banned work
was in it), and those are dropped and refused."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Awaitable, Callable

from core.protocol.fields import field as mfield
from core.protocol.recipe import clip_scale
from core.protocol.values import finite_number
from core.protocol.wire import PayloadError, RemoteError

logger = logging.getLogger("hivepipe.server")

PULL_AFTER = 1.0  # seconds a shard ready to step waits for the other slots' sums before it asks for them
PULL_PERIOD = 1.0  # seconds between two such asks while sums are still missing
NORMS_KEPT = 64  # batches whose gradient norm a server keeps for its status


class Clipping:
    """A server's part of the global gradient-norm round, given what it reads of its server: its
    `device_id`, `stage` and the run's `steps`; `layout()`, `epoch()` and `replaying()` as they are
    now; `hosted()` and `replicas()` (slot -> ShardState); `outbox` for its background asks; `call`
    (device, method, meta) -> (answer, tensors), a call to another server; and `on_news()`, called
    when what it learnt may let a step go (the server's maybe_step). `clip` None: no clipping, and
    nothing is sent."""

    def __init__(
        self,
        clip: float | None,
        *,
        device_id: str,
        stage: int,
        steps: int,
        layout: Callable[[], object],
        epoch: Callable[[], int],
        replaying: Callable[[], bool],
        hosted: Callable[[], dict],
        replicas: Callable[[], dict],
        outbox,
        call: Callable[[str, str, dict], Awaitable[tuple[dict, list]]],
        on_news: Callable[[], None],
    ) -> None:
        self.clip = clip
        self.device_id, self.stage, self.steps = device_id, stage, steps
        self.layout, self.epoch, self.replaying, self.hosted, self.replicas = layout, epoch, replaying, hosted, replicas
        self.outbox, self.call, self.on_news = outbox, call, on_news
        # batch -> (stage, slot) -> (the layout epoch the sum was made in, the slot's sum of squares)
        self.slot_sums: dict[int, dict[tuple[int, int], tuple[int, float]]] = {}
        # batch -> (epoch, the run's total) heard from a server whose shard stepped it (ShardState.totals)
        self.heard_totals: dict[int, tuple[int, float]] = {}
        self.sums_sent: set[tuple[int, int, int]] = set()  # (epoch, batch, slot) sent to the others
        self.sum_rollbacks: list[tuple[int, int]] = []  # (epoch, version) of each rollback adopted
        self.sums_pulling: set[int] = set()  # batches whose missing sums are being asked for
        self.grad_norms: dict[int, float] = {}  # batch -> the norm its step saw (before clipping)

    def all_slots(self) -> list[tuple[int, int]]:
        return [(st.index, k) for st in self.layout().stages for k in range(len(st.hosts))]

    def _stale(self, batch: int, epoch: int) -> bool:
        """A sum of `batch` made in `epoch` predates a rollback that undid that batch."""
        return any(e > epoch and batch >= v for e, v in self.sum_rollbacks)

    def _note_sum(self, batch: int, key: tuple[int, int], epoch: int, value: float) -> None:
        if self._stale(batch, epoch):
            return
        sums = self.slot_sums.setdefault(batch, {})
        if key not in sums or sums[key][0] <= epoch:
            sums[key] = (epoch, value)

    def _note_total(self, batch: int, epoch: int, total: float) -> None:
        if not self._stale(batch, epoch) and self.heard_totals.get(batch, (-1, 0.0))[0] <= epoch:
            self.heard_totals[batch] = (epoch, total)

    def forget_sums_from(self, version: int, epoch: int) -> None:
        """A ban's rollback to `version` at layout epoch `epoch` (Failover.adopt): the sums of the
        batches it undid are stale."""
        self.sum_rollbacks.append((epoch, version))
        for batch in [t for t in self.slot_sums if t >= version]:
            self.slot_sums[batch] = {k: v for k, v in self.slot_sums[batch].items() if v[0] >= epoch}
        for batch in [t for t, (e, _) in self.heard_totals.items() if t >= version and e < epoch]:
            del self.heard_totals[batch]

    def run_total(self, batch: int) -> float | None:
        """The run's sum of squares of batch `batch`'s gradient, once known here; None before."""
        for shard in [*self.hosted().values(), *self.replicas().values()]:
            if batch in shard.totals:
                return shard.totals[batch]
        if batch in self.heard_totals:
            return self.heard_totals[batch][1]
        sums = self.slot_sums.get(batch, {})
        keys = self.all_slots()
        if any(k not in sums for k in keys):
            return None
        return math.fsum(sums[k][1] for k in keys)  # (fsum: exact, whatever the order)

    def announce_sums(self) -> None:
        """Each hosted slot whose batch is complete: its sum of squares noted here and sent to every
        other server, once per layout epoch, as soon as the batch is complete (whatever else holds its
        step here: the other stages' steps wait on it)."""
        if self.clip is None:
            return
        for slot, shard in self.hosted().items():
            if shard.ready_to_step():
                self._announce(slot, shard)

    def _announce(self, slot: int, shard) -> None:
        """The sum of `shard`'s complete batch noted here and, once per layout epoch, sent to the others."""
        t = shard.version
        self._note_sum(t, (self.stage, slot), self.epoch(), shard.batch_sumsq())
        if not self.replaying() and (self.epoch(), t, slot) not in self.sums_sent:
            self.sums_sent.add((self.epoch(), t, slot))
            self.outbox.spawn(self._send_sums(t, slot, shard.batch_sumsq()))

    def clip_hold(self, slot: int, shard) -> bool:
        """True while the step of `shard` (slot `slot`, ready to step) waits for the run's total of its
        batch; asks for what is missing after PULL_AFTER. Its own sum is announced here too: a shard
        that just stepped can be ready for its next batch at once (credited while it waited), which
        `announce_sums`, run before the steps, did not see (it then went out only at the next event,
        and the other servers waited for a pull)."""
        if self.clip is None:
            return False
        t = shard.version
        if self.run_total(t) is not None:
            return False
        self._announce(slot, shard)
        if self.run_total(t) is not None:
            return False
        if self.replaying():
            return True
        if t not in self.sums_pulling:
            self.sums_pulling.add(t)
            self.outbox.spawn(self._pull_sums(t))
        return True

    def clip_step(self, slot: int, shard) -> tuple[float, float | None]:
        """(scale, total) for the step of `shard`'s batch: (1.0, None) without clipping."""
        if self.clip is None:
            return 1.0, None
        t = shard.version
        total = self.run_total(t)
        norm = math.sqrt(total)
        self.grad_norms[t] = norm
        for old in sorted(self.grad_norms)[:-NORMS_KEPT]:
            del self.grad_norms[old]
        self._forget_sums_before(t - 2 * len(self.layout().stages) - 4)
        return clip_scale(self.clip, total), total

    def _forget_sums_before(self, batch: int) -> None:
        for store in (self.slot_sums, self.heard_totals):
            for t in [t for t in store if t < batch]:
                del store[t]
        self.sums_sent = {k for k in self.sums_sent if k[1] >= batch}

    def _sums_known(self, batch: int) -> dict:
        sums = [[s, k, v] for (s, k), (_, v) in sorted(self.slot_sums.get(batch, {}).items())]
        return {"batch": batch, "epoch": self.epoch(), "sums": sums, "total": self.run_total(batch)}

    def _merge(self, answer: dict) -> None:
        """Take what another server's `grad_norm` answer says it knows (a malformed answer is ignored)."""
        try:
            batch, epoch, sums, total = self._read_sums(answer)
        except PayloadError as e:
            logger.debug("%s: a grad_norm answer ignored: %s", self.device_id, e)
            return
        for stage, slot, value in sums:
            self._note_sum(batch, (stage, slot), epoch, value)
        if total is not None:
            self._note_total(batch, epoch, total)

    async def _send_sums(self, batch: int, slot: int, value: float) -> None:
        meta = {"batch": batch, "epoch": self.epoch(), "sums": [[self.stage, slot, value]], "total": None}
        others = [d for st in self.layout().stages for d in st.servers if d != self.device_id]
        answers = await asyncio.gather(*(self._ask_sums(d, meta) for d in others))
        for answer in answers:
            if answer is not None:
                self._merge(answer)
        self.on_news()

    async def _ask_sums(self, device: str, meta: dict) -> dict | None:
        try:
            answer, _ = await self.call(device, "grad_norm", meta)
            return answer
        except (ConnectionError, RemoteError, PayloadError, asyncio.TimeoutError) as e:
            logger.debug("%s: grad_norm to %s: %r", self.device_id, device, e)
            return None

    def _waiting_on(self, batch: int) -> bool:
        return (
            any(sh.version == batch and sh.ready_to_step() for sh in self.hosted().values())
            and self.run_total(batch) is None
        )

    async def _pull_sums(self, batch: int) -> None:
        """Ask the host of each slot whose sum of `batch` is missing, every PULL_PERIOD after
        PULL_AFTER, while a hosted shard waits on that batch."""
        try:
            await asyncio.sleep(PULL_AFTER)
            while self._waiting_on(batch):
                have = self.slot_sums.get(batch, {})
                hosts = {
                    self.layout().stages[s].hosts[k]
                    for s, k in self.all_slots()
                    if (s, k) not in have and self.layout().stages[s].hosts[k] != self.device_id
                }
                meta = {"batch": batch, "epoch": self.epoch(), "sums": [], "total": None}
                for answer in await asyncio.gather(*(self._ask_sums(d, meta) for d in sorted(hosts))):
                    if answer is not None:
                        self._merge(answer)
                self.on_news()
                if self._waiting_on(batch):
                    logger.info(
                        "%s: batch %d waits for the gradient sums of slots %s",
                        self.device_id,
                        batch,
                        [k for k in self.all_slots() if k not in self.slot_sums.get(batch, {})],
                    )
                    await asyncio.sleep(PULL_PERIOD)
        finally:
            self.sums_pulling.discard(batch)

    def _read_sums(self, meta: dict) -> tuple[int, int, list[tuple[int, int, float]], float | None]:
        batch, epoch = mfield(meta, "batch", int), mfield(meta, "epoch", int)
        if not 0 <= batch < self.steps:
            raise PayloadError(f"field 'batch' must be in 0..{self.steps - 1}, got {batch}")
        if epoch < 0:
            raise PayloadError(f"field 'epoch' must be >= 0, got {epoch}")
        raw = mfield(meta, "sums", list)
        slots = set(self.all_slots())
        if len(raw) > len(slots):
            raise PayloadError(f"field 'sums' holds {len(raw)} sums: the run has {len(slots)} slots")
        sums = []
        for item in raw:
            if (
                not isinstance(item, (list, tuple))
                or len(item) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in item[:2])
                or not _sum_value(item[2])
            ):
                raise PayloadError(f"a sum must be [stage, slot, sum of squares >= 0], got {item!r}")
            if (item[0], item[1]) not in slots:
                raise PayloadError(f"no slot {item[1]} of stage {item[0]} in this run")
            sums.append((item[0], item[1], float(item[2])))
        total = meta.get("total")
        if total is not None and not _sum_value(total):
            raise PayloadError(f"field 'total' must be a sum of squares >= 0 or none, got {total!r}")
        return batch, epoch, sums, None if total is None else float(total)

    async def on_grad_norm(self, meta, tensors, sender):
        """Another server's sums of squares of batch `batch` (its slots', made in layout epoch `epoch`);
        answered with what this server knows of that batch."""
        batch, epoch, sums, total = self._read_sums(meta)
        if tensors:
            raise PayloadError("grad_norm carries no tensors")
        for stage, slot, value in sums:
            self._note_sum(batch, (stage, slot), epoch, value)
        if total is not None:
            self._note_total(batch, epoch, total)
        self.on_news()
        return self._sums_known(batch)


def _sum_value(x) -> bool:
    return finite_number(x) and x >= 0
