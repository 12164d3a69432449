"""One server's shard of a stage's fp32 master parameters and its AdamW state, with the ledger of
which gradient contributions have been credited.

Exactly-once: a client accumulates the gradients of several tasks of one batch and pushes the sum
with the ids of the tasks it covers (each id names its batch, micro-batch and rows). Each server
credits a push all or nothing and a task at most once: a push whose tasks are all credited already
is a duplicate (dropped, counted), one with only some of them credited is a conflict (nothing
credited; the sender re-runs the rest as single-task pushes). It steps batch t once the credited
rows of every micro-batch of t tile the whole micro-batch. Since a task's gradient is a pure
function of (parameters version, rows), whichever client's copy arrives first is the right one, and
no cross-server agreement is needed.

Delayed parameter update: batch t is computed on version v(t) = max(t - 1, 0) (the updates of
batches 0..t-2), and update t is applied when version == t, producing version t + 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from core.model.optim import make_optimizer, set_lr
from core.protocol import param_delta
from core.protocol.fields import all_finite
from core.protocol.recipe import Recipe
from core.protocol.wire import PayloadError
from parameter_server.shard_copies import ShardCopies, new_token


@dataclass
class BatchCredit:
    rows_per_micro: int
    micro_batches: int
    task_ids: set = field(default_factory=set)
    intervals: dict = field(default_factory=dict)  # micro -> list[(lo, hi)]
    rows_done: dict = field(default_factory=dict)  # micro -> int
    loss_sum: float = 0.0
    grads: dict | None = None
    senders: list = field(default_factory=list)  # who pushed each credited sum, in the order summed
    sumsq: float | None = None  # the sum of squares of the complete sum (float64), once asked for
    scale: float = 1.0  # what the step multiplied the sum by (gradient clipping; 1: not clipped)

    def complete(self) -> bool:
        return len(self.rows_done) == self.micro_batches and all(
            v == self.rows_per_micro for v in self.rows_done.values()
        )


# a pin (a volunteer still on probation, pins.py) keeps up to this many times keep_versions more
# versions: each costs 3 x the shard's parameters in memory (snapshot and AdamW's two moments)
PIN_EXTRA = 2
LOSS_HISTORY = 4096  # batches whose loss a shard keeps (status, dashboard, replicas, checkpoints)


class ShardState(ShardCopies):
    def __init__(
        self,
        params: dict[str, torch.Tensor],
        *,
        lr: float | None = None,
        recipe: Recipe | None = None,
        rows_per_micro: int,
        micro_batches: int,
        steps: int,
        keep_versions: int = 2,
    ):
        self.names = sorted(params)
        self.params = {n: torch.nn.Parameter(params[n].detach().clone().float()) for n in self.names}
        if (lr is None) == (recipe is None):
            raise ValueError("a shard takes a learning rate or a recipe (one of them)")
        # the run's schedule and AdamW settings: update t (version t -> t + 1) at recipe.lr_at(t)
        self.recipe = recipe if recipe is not None else Recipe(lr=lr)
        self.optimizer = make_optimizer([self.params[n] for n in self.names], self.recipe)
        self.rows_per_micro = rows_per_micro
        self.micro_batches = micro_batches
        self.steps = steps
        self.version = 0
        self.keep_versions = keep_versions
        # the oldest version a ban may still have to roll back to (its server's pin: pins.py), kept
        # beyond keep_versions, up to PIN_EXTRA x keep_versions more; None: no pin
        self.pinned_from: int | None = None
        self.old = None  # the versions memory let go that a ban may still reach, on disk (old_versions.py)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}
        # AdamW's state at each kept version (step count, exp_avg, exp_avg_sq per parameter): with the
        # parameter snapshot, what a rollback to that version restores
        self.moments: dict[int, dict[str, tuple]] = {0: self._moments()}
        # a name for each kept version's contents, new whenever a version is made (a rollback re-makes
        # later versions with other contents): a checkpoint writes each version's file once, by it
        self.tokens: dict[int, str] = {0: new_token()}
        # ((version, its token), the squared norm of AdamW's first moment there): momentum_cosine reads
        # it for every push, and the moment changes only when a version is made
        self._moment_sq: tuple[tuple[int, str | None] | None, float] = (None, 0.0)
        self.rollback_epoch = 0  # the last layout epoch whose rollback this shard applied
        self.batches: dict[int, BatchCredit] = {}
        self.losses: dict[int, float] = {}
        # batch -> the run's sum of squares of batch's gradient over every shard of every stage, for
        # the batches whose step was clipped by it (--clip-grad-norm): what a server that lost its
        # peers' sums asks the slot's host (or its replica) for (parameter_server/clipping.py)
        self.totals: dict[int, float] = {}
        self.duplicates = 0
        self.microbatches_applied = 0
        # the credit that made each of the last two versions (version -> its summed gradient and who
        # pushed it): a replica is kept by sending it the step (one tensor a parameter) instead of the
        # state (three), or only the step's digest when its own server's worker pushed the whole sum
        self.applied: dict[int, BatchCredit] = {}
        # on a replica: (version, the sender's token of that version) of the state it mirrors; a step is
        # applied on that state only (a sender that rolled back re-makes versions with other contents)
        self.mirror: tuple[int, str] | None = None
        self._digests: dict[tuple[int, str], str] = {}  # (version, token) -> digest(version)

    def digest(self, version: int) -> str | None:
        """SHA-256 of kept version `version`'s parameters (each one's name, dtype, shape and bytes, in
        `names` order), or None when it is not kept; computed once per version's contents (its token).
        What a server's own worker compares with the slot's host before it reads a version from the
        replica its server keeps: a replica steps on its own, and on another kind of device its bits
        may differ."""
        snap, token = self.snapshots.get(version), self.tokens.get(version)
        if snap is None or token is None:
            return None
        if (version, token) not in self._digests:
            self._digests = {k: d for k, d in self._digests.items() if self.tokens.get(k[0]) == k[1]}
            self._digests[(version, token)] = param_delta.digest(self.names, [snap[n] for n in self.names])
        return self._digests[(version, token)]

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def _moments(self) -> dict[str, tuple]:
        out = {}
        for n, p in self.params.items():
            st = self.optimizer.state.get(p, {})
            out[n] = (
                float(st["step"]) if "step" in st else 0.0,
                st["exp_avg"].clone() if "exp_avg" in st else None,
                st["exp_avg_sq"].clone() if "exp_avg_sq" in st else None,
            )
        return out

    def _keep(self, version: int) -> None:
        """Record version's parameters and AdamW state; forget versions beyond the kept window."""
        self.snapshots[version] = self._snapshot()
        self.moments[version] = self._moments()
        self.tokens[version] = new_token()
        if self.old is not None:  # what memory lets go now stays within a ban's reach, on disk
            dropped = [v for v in self.snapshots if self._forgotten(v, version) and v in self.moments]
            self.old.spill(dropped, self.snapshots, self.moments, after=version - self.reach())
        for store in (self.snapshots, self.moments, self.tokens):
            for v in [v for v in store if self._forgotten(v, version)]:
                del store[v]

    def _forgotten(self, v: int, version: int) -> bool:
        """Whether kept version `v` is dropped once `version` is made: beyond keep_versions and not
        pinned, or beyond the pin's bound (PIN_EXTRA x keep_versions more)."""
        if v > version - self.keep_versions:
            return False
        pinned = self.pinned_from is not None and v >= self.pinned_from
        return not pinned or v <= version - (1 + PIN_EXTRA) * self.keep_versions

    def reach(self) -> int:
        """How many versions back a rollback can go here at most: those memory keeps, and those on disk."""
        return self.keep_versions + (self.old.depth if self.old is not None else 0)

    def keeps(self, version: int) -> bool:
        """Whether a rollback to `version` is possible here (in memory, or on disk)."""
        kept = version in self.snapshots and version in self.moments
        return kept or (self.old is not None and self.old.has(version))

    def memory_from(self) -> int:
        """The oldest version kept in memory (parameters and AdamW state): what can be served and re-run on."""
        return min(v for v in self.snapshots if v in self.moments)

    def kept_from(self) -> int:
        """The oldest version a rollback can go back to here (parameters and AdamW state both kept)."""
        return min([self.memory_from()] + (self.old.versions() if self.old is not None else []))

    def _restore(self, version: int) -> None:
        """Parameters and AdamW state as they were right after `version` was made: its kept snapshot
        and moments, copied (the kept ones never change)."""
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.snapshots[version][n])
                step, avg, avg_sq = self.moments[version][n]
                if avg is None:
                    self.optimizer.state.pop(p, None)
                else:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(step),
                        "exp_avg": avg.clone(),
                        "exp_avg_sq": avg_sq.clone(),
                    }

    def rollback(self, version: int, epoch: int) -> bool:
        """Go back to the state right after version `version` was reached (parameters and AdamW state
        from the kept history, in memory or on disk), forgetting every later version, credit and loss:
        the update of a batch that carried a cheater's work is undone and credited again. Once per layout
        epoch (a replayed request log does not roll back twice). False when nothing changes (at or below
        `version` already, or this epoch's rollback applied); PayloadError when it is no longer kept."""
        if epoch <= self.rollback_epoch or self.version <= version:
            self.rollback_epoch = max(self.rollback_epoch, epoch)
            return False
        if not self.keeps(version):
            raise PayloadError(f"version {version} is no longer kept (kept from {self.kept_from()})")
        # from disk: `version` and the versions below it memory would hold (batch `version` re-runs on version - 1)
        wanted = [v for v in range(version - self.keep_versions + 1, version + 1) if v not in self.moments]
        back = self.old.read(wanted) if self.old is not None else {}
        if version not in self.moments and version not in back:  # (read before anything changes)
            raise PayloadError(f"version {version} could not be read back from disk")
        for v, (snap, moments) in back.items():
            self.snapshots[v], self.moments[v], self.tokens[v] = snap, moments, new_token()
        self._restore(version)
        if self.old is not None:
            self.old.forget(lambda v: v < version)  # (the later ones are undone; it is in memory again)
        for store in (self.snapshots, self.moments, self.tokens):
            for v in [v for v in store if v > version]:
                del store[v]
        self.microbatches_applied -= (self.version - version) * self.micro_batches
        self.losses = {t: v for t, v in self.losses.items() if t < version}
        self.totals = {t: v for t, v in self.totals.items() if t < version}
        self.version = version
        self.batches = {}
        self.applied = {}
        self.mirror = None
        self.rollback_epoch = epoch
        return True

    def params_at(self, version: int) -> dict[str, torch.Tensor] | None:
        return self.snapshots.get(version)

    def credit(
        self,
        *,
        batch: int,
        pieces: list[tuple[str, int, tuple[int, int]]],
        grads: list[torch.Tensor],
        loss_sum: float | None = None,
        sender: str | None = None,
        authorize: Callable[[], None] | None = None,
    ) -> tuple[str, list[str]]:
        """Add one client's gradient shard accumulated over the tasks `pieces` = [(task id, micro,
        (lo, hi)), ...] of batch `batch`, all or nothing. Returns ("credited", []); ("duplicate", ids)
        when every task is already credited (a re-push); or ("conflict", ids) when only some are: the
        sum cannot be split, so nothing is credited and `ids` names the tasks already credited here
        (the sender re-runs the others alone). Raises PayloadError, changing nothing, for anything
        that does not fit; `authorize`, called once the payload is found well-formed, raises it too
        (the sender holds no lease of a task)."""
        if not 0 <= batch < self.steps:
            raise PayloadError(f"batch {batch} outside the run's 0..{self.steps - 1}")
        if not pieces:
            raise PayloadError("a gradient push must name at least one task")
        if len(pieces) > self.micro_batches * self.rows_per_micro:
            raise PayloadError(
                f"{len(pieces)} tasks in one push: a batch has at most {self.micro_batches * self.rows_per_micro} rows"
            )
        mine: dict[int, list[tuple[int, int]]] = {}
        for task_id, micro, (lo, hi) in pieces:
            if not 0 <= micro < self.micro_batches:
                raise PayloadError(f"task {task_id}: micro-batch {micro} outside 0..{self.micro_batches - 1}")
            if not 0 <= lo < hi <= self.rows_per_micro:
                raise PayloadError(
                    f"task {task_id}: rows [{lo}, {hi}) outside the micro-batch's {self.rows_per_micro} rows"
                )
            for a, b in mine.get(micro, []):
                if a < hi and lo < b:
                    raise PayloadError(
                        f"task {task_id}: rows [{lo}, {hi}) of micro-batch {micro} overlap rows "
                        f"[{a}, {b}) of another task of the same push"
                    )
            mine.setdefault(micro, []).append((lo, hi))
        # a malformed payload is an error even for a batch already applied: the sender must learn it
        if len(grads) != len(self.names):
            raise PayloadError(f"expected {len(self.names)} gradient tensors for this shard, got {len(grads)}")
        for name, g in zip(self.names, grads):
            p = self.params[name]
            if tuple(g.shape) != tuple(p.shape):
                raise PayloadError(f"gradient {name}: expected shape {tuple(p.shape)}, got {tuple(g.shape)}")
            if g.dtype != torch.float32:
                raise PayloadError(f"gradient {name}: expected dtype torch.float32, got {g.dtype}")
            if not all_finite(g):
                raise PayloadError(f"gradient {name}: contains NaN or infinite values")
        if loss_sum is not None and not (loss_sum == loss_sum and abs(loss_sum) != float("inf")):
            raise PayloadError("loss_sum must be finite")
        if authorize is not None:
            authorize()
        ids = [task_id for task_id, _, _ in pieces]
        if batch < self.version:
            # its update is already applied: every row of it was credited
            self.duplicates += 1
            return "duplicate", ids
        if batch > self.version + 1:
            raise PayloadError(f"batch {batch} is ahead of the parameters (version {self.version})")
        bc = self.batches.get(batch) or BatchCredit(self.rows_per_micro, self.micro_batches)
        already = []
        for task_id, micro, (lo, hi) in pieces:
            if task_id in bc.task_ids:
                already.append(task_id)
                continue
            for a, b in bc.intervals.get(micro, []):
                if a < hi and lo < b:
                    if (a, b) == (lo, hi):  # same rows under another task id: the same work done twice
                        already.append(task_id)
                        break
                    raise PayloadError(
                        f"task {task_id}: rows [{lo}, {hi}) of micro-batch {micro} overlap credited rows [{a}, {b})"
                    )
        if already:
            if len(already) == len(pieces):
                self.duplicates += 1
                return "duplicate", already
            return "conflict", already
        # accepted: mutate
        self.batches[batch] = bc
        for task_id, micro, (lo, hi) in pieces:
            bc.task_ids.add(task_id)
            bc.intervals.setdefault(micro, []).append((lo, hi))
            bc.rows_done[micro] = bc.rows_done.get(micro, 0) + (hi - lo)
        if loss_sum is not None:
            bc.loss_sum += float(loss_sum)
        if bc.grads is None:
            bc.grads = {n: g.clone() for n, g in zip(self.names, grads)}
        else:
            for n, g in zip(self.names, grads):
                bc.grads[n].add_(g)
        bc.senders.append(sender)
        return "credited", []

    def ready_to_step(self) -> bool:
        bc = self.batches.get(self.version)
        return self.version < self.steps and bc is not None and bc.complete()

    def _trim_losses(self) -> None:
        """Keep the last LOSS_HISTORY batches' losses: the history travels in every replica export
        and checkpoint, so kept whole it would grow each of them by a line per step for as long as a run
        lasts (megabytes of metadata within days)."""
        if len(self.losses) > LOSS_HISTORY:
            for t in sorted(self.losses)[: len(self.losses) - LOSS_HISTORY]:
                del self.losses[t]
        if len(self.totals) > LOSS_HISTORY:
            for t in sorted(self.totals)[: len(self.totals) - LOSS_HISTORY]:
                del self.totals[t]

    def batch_sumsq(self) -> float:
        """The sum of squares (float64) of the complete gradient sum of batch `version` here."""
        bc = self.batches[self.version]
        if bc.sumsq is None:
            bc.sumsq = float(sum(bc.grads[n].double().square().sum() for n in self.names))
        return bc.sumsq

    def step(self, scale: float = 1.0, total: float | None = None) -> int:
        """Apply the update of batch `version`, its summed gradient multiplied by `scale` (gradient
        clipping: the run's sum of squares for the batch was `total`); returns the new version."""
        t = self.version
        bc = self.batches.pop(t)
        bc.scale = scale
        for n, p in self.params.items():
            p.grad = bc.grads[n] if scale == 1.0 else bc.grads[n] * scale
        self._optimizer_step(t)
        self.version = t + 1
        self.losses[t] = bc.loss_sum
        if total is not None:
            self.totals[t] = total
        self._trim_losses()
        self.microbatches_applied += self.micro_batches
        self._keep(self.version)
        self.applied = {v: c for v, c in self.applied.items() if v >= t}
        self.applied[self.version] = bc
        return self.version

    def _optimizer_step(self, update: int) -> None:
        """AdamW's step of update `update` (from version `update`) on the gradients set as .grad, at the
        schedule's learning rate for that update."""
        set_lr(self.optimizer, self.recipe.lr_at(update, self.steps))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def momentum_cosine(self, grads: list[torch.Tensor]) -> float | None:
        """The cosine between a gradient push (tensors in `names` order) and AdamW's first moment here:
        how far the push agrees with the direction the slot's recent batches took. None before the
        first step (no moment yet) or for a zero push."""
        dot = push = 0.0
        moments = []
        for name, g in zip(self.names, grads):
            state = self.optimizer.state.get(self.params[name])
            if not state or "exp_avg" not in state:
                return None
            m, g = state["exp_avg"].reshape(-1), g.reshape(-1)  # (dot products: no copy of either)
            dot, push = dot + float(g @ m), push + float(g @ g)
            moments.append(m)
        key = (self.version, self.tokens.get(self.version))
        if key[1] is None or self._moment_sq[0] != key:
            self._moment_sq = (key, sum(float(m @ m) for m in moments))
        moment = self._moment_sq[1]
        return dot / (push * moment) ** 0.5 if push > 0 and moment > 0 else None

    def pushed_by(self, version: int) -> tuple:
        """Who pushed the gradient sums that made kept version `version`, in the order summed (empty
        when that step is not kept)."""
        bc = self.applied.get(version)
        return tuple(bc.senders) if bc is not None else ()
