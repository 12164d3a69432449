"""A shard's copies: its state as a replica carries it to another server of the stage (the whole state,
or the step that made a version from the one before), taken in by the replica, and as a checkpoint or
replica file holds it (a part of parameter_server.shard.ShardState, whose state these read and set)."""

from __future__ import annotations

import uuid

import torch

from core.protocol.fields import all_finite
from core.protocol.values import finite_number
from core.protocol.wire import PayloadError


def new_token() -> str:
    """A version's lineage token: two shards at the same version with the same token hold the same state."""
    return uuid.uuid4().hex[:16]


class ShardCopies:
    """Export, take in and save a shard's state (ShardState's)."""

    def export(self, version: int | None = None) -> tuple[dict, list[torch.Tensor]]:
        """(meta, tensors): the version, counters and AdamW step count, and per parameter (in `names`
        order) its value, exp_avg and exp_avg_sq: enough for another server to take this shard over.
        `version` (default: the current one) is any version still kept: a replica must receive every
        version in order, since a takeover re-runs the batch computed on the version before its own."""
        v = self.version if version is None else version
        if v not in self.snapshots or v not in self.moments:
            raise PayloadError(f"version {v} is no longer kept (kept: {sorted(self.snapshots)})")
        tensors, steps = [], []
        for n in self.names:
            step, avg, avg_sq = self.moments[v][n]
            value = self.snapshots[v][n]
            steps.append(step)
            tensors += [
                value.clone(),
                torch.zeros_like(value) if avg is None else avg.clone(),
                torch.zeros_like(value) if avg_sq is None else avg_sq.clone(),
            ]
        meta = {
            "version": v,
            "names": self.names,
            "adam_steps": steps,
            "token": self.tokens[v],
            "losses": {str(k): x for k, x in self.losses.items() if k < v},
            "totals": {str(k): x for k, x in self.totals.items() if k < v},
            "microbatches_applied": self.microbatches_applied - (self.version - v) * self.micro_batches,
            "duplicates": self.duplicates,
        }
        return meta, tensors

    def export_step(self, version: int) -> tuple[dict, list[torch.Tensor]] | None:
        """(meta, tensors) of the step that made `version` from the version before it: the summed
        gradient (one tensor a parameter, in `names` order) and the tokens of both versions, for a
        replica that mirrors the version before (`absorb_step`); None when this shard no longer
        holds that gradient or either version."""
        if version not in self.applied or version - 1 not in self.tokens or version not in self.tokens:
            return None
        meta = {
            "form": "step",
            "version": version,
            "names": self.names,
            "base_token": self.tokens[version - 1],
            "token": self.tokens[version],
            "loss": self.losses.get(version - 1),
            "scale": self.applied[version].scale,
            "total": self.totals.get(version - 1),
            "microbatches_applied": self.microbatches_applied - (self.version - version) * self.micro_batches,
            "duplicates": self.duplicates,
        }
        return meta, [self.applied[version].grads[n] for n in self.names]

    def absorb_step(self, meta: dict, tensors: list[torch.Tensor]) -> bool:
        """Take the step `export_step` sent: the same AdamW step on the same state gives the sender's
        state, bit for bit on the same kind of device. False when this replica mirrors that version
        already (the same step again: a call repeated after its answer was lost). PayloadError,
        changing nothing, when it does not fit this shard or this replica does not mirror the
        sender's version before it (the sender then sends the whole state)."""
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= self.steps:
            raise PayloadError(f"replica step version must be an int in 1..{self.steps}, got {version!r}")
        if meta.get("names") != self.names:
            raise PayloadError("replica step names another shard's parameters")
        loss, applied, duplicates = meta.get("loss"), meta.get("microbatches_applied"), meta.get("duplicates")
        scale, total = meta.get("scale", 1.0), meta.get("total")
        if (
            not finite_number(scale)
            or not 0 < scale <= 1
            or not (total is None or (finite_number(total) and total >= 0))
        ):
            raise PayloadError("replica step needs a 'scale' in (0, 1] and a 'total' >= 0 or none")
        if (
            not isinstance(meta.get("token"), str)
            or not (loss is None or isinstance(loss, (int, float)))
            or not isinstance(applied, int)
            or not isinstance(duplicates, int)
        ):
            raise PayloadError(
                "replica step needs a 'token' string, a numeric 'loss' and integer "
                "'microbatches_applied' and 'duplicates'"
            )
        self._check_tensors(tensors, 1)
        if self.mirror == (version, meta["token"]):
            return False
        if self.mirror != (version - 1, meta.get("base_token")) or self.version != version - 1:
            raise PayloadError(
                f"this replica does not mirror the sender's version {version - 1} (it is at version "
                f"{self.version}): send the whole state"
            )
        with torch.no_grad():
            for n, g in zip(self.names, tensors):
                self.params[n].grad = g.clone() if scale == 1.0 else g * scale
        self._optimizer_step(version - 1)
        self.version = version
        if loss is not None:
            self.losses[version - 1] = float(loss)
        if total is not None:
            self.totals[version - 1] = float(total)
        self._trim_losses()
        self.microbatches_applied, self.duplicates = applied, duplicates
        self._keep(version)
        self.batches = {}
        self.mirror = (version, meta["token"])
        return True

    def _check_tensors(self, tensors: list[torch.Tensor], per_name: int) -> None:
        """`per_name` float32, finite tensors of each parameter's shape, in `names` order."""
        if len(tensors) != per_name * len(self.names):
            raise PayloadError(f"a replica carries {per_name * len(self.names)} tensors, got {len(tensors)}")
        for i, n in enumerate(self.names):
            for t in tensors[per_name * i : per_name * (i + 1)]:
                if tuple(t.shape) != tuple(self.params[n].shape) or t.dtype != torch.float32:
                    raise PayloadError(
                        f"replica of {n}: expected float32 {tuple(self.params[n].shape)}, got "
                        f"{t.dtype} {tuple(t.shape)}"
                    )
                if not all_finite(t):
                    raise PayloadError(f"replica of {n}: contains NaN or infinite values")

    def absorb(self, meta: dict, tensors: list[torch.Tensor]) -> bool:
        """Become the exported state `meta, tensors` of the same shard if it is newer than this one,
        or the same version from a lineage this replica does not mirror yet (a fresh replica's version
        0 is its own init: it must mirror the sender's before it takes steps). False: older, or the
        version it mirrors already; nothing changes. PayloadError, changing nothing, if it does not
        fit this shard."""
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= self.steps:
            raise PayloadError(f"replica version must be an int in 0..{self.steps}, got {version!r}")
        if meta.get("names") != self.names:
            raise PayloadError("replica names another shard's parameters")
        steps = meta.get("adam_steps")
        if (
            not isinstance(steps, list)
            or len(steps) != len(self.names)
            or not all(isinstance(x, (int, float)) and 0 <= x <= self.steps for x in steps)
        ):
            raise PayloadError("replica 'adam_steps' must list one step count per parameter")
        self._check_tensors(tensors, 3)
        token = meta.get("token")
        if version < self.version or (version == self.version and (self.mirror == (version, token) or token is None)):
            return False
        with torch.no_grad():
            for i, n in enumerate(self.names):
                p = self.params[n]
                p.copy_(tensors[3 * i])
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(steps[i])),
                    "exp_avg": tensors[3 * i + 1].clone(),
                    "exp_avg_sq": tensors[3 * i + 2].clone(),
                }
        self.version = version
        self.losses = {int(k): float(v) for k, v in meta.get("losses", {}).items()}
        self.totals = {int(k): float(v) for k, v in meta.get("totals", {}).items()}
        self._trim_losses()
        self.microbatches_applied = int(meta.get("microbatches_applied", 0))
        self.duplicates = int(meta.get("duplicates", 0))
        self._keep(version)
        self.batches = {}
        self.mirror = (version, token) if isinstance(token, str) else None
        return True

    # checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint or replica file holds. The current parameters and AdamW state are not in
        it apart: they are the current version's kept snapshot and moments (every version made is kept
        at once), which it holds already; the kept versions' tensors are never changed in place, so the
        maps are copied, not the tensors (a thread may write this while the next step runs)."""
        return {
            "version": self.version,
            "snapshots": dict(self.snapshots),
            "moments": dict(self.moments),
            "tokens": dict(self.tokens),
            "rollback_epoch": self.rollback_epoch,
            "losses": dict(self.losses),
            "totals": dict(self.totals),
            "microbatches_applied": self.microbatches_applied,
            "duplicates": self.duplicates,
        }

    def load_state_dict(self, state: dict) -> None:
        version = int(state["version"])
        snapshots = {int(v): s for v, s in state["snapshots"].items()}
        # (a state written before rollbacks existed has no AdamW history: it cannot roll back)
        moments = {int(v): m for v, m in state.get("moments", {}).items()}
        if "params" not in state and (version not in snapshots or version not in moments):
            raise ValueError(
                f"shard state at version {version} lacks that version's parameters or AdamW state "
                f"(kept: {sorted(snapshots)})"
            )
        self.version, self.snapshots, self.moments = version, snapshots, moments
        if "params" in state:  # written before the current state was taken from the kept history
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(state["params"][n])
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self._restore(version)
        tokens = state.get("tokens", {})
        self.tokens = {v: str(tokens[v]) if v in tokens else new_token() for v in self.snapshots}
        self.rollback_epoch = int(state.get("rollback_epoch", 0))
        self.losses = {int(k): float(v) for k, v in state["losses"].items()}
        self.totals = {int(k): float(v) for k, v in state.get("totals", {}).items()}
        self._trim_losses()
        self.microbatches_applied = int(state["microbatches_applied"])
        self.duplicates = int(state["duplicates"])
        self.batches = {}
