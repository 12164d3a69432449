"""Checked work: a server re-runs a sample of its volunteers' work on its own CPU (or GPU) and bans a
volunteer whose results do not match. A task's result is a pure function of the parameter version and
its rows (peer/model/task_math.py), so a re-run gives the same numbers up to floating-point order.

What is checked, where it arrives:
- a gradient push (every server of the stage, for its own shard slot): every task it covers is re-run
  (inputs and labels from the stage's frontal servers, output gradients from its backward servers,
  parameters of the task's version from every shard), and the summed gradient of this slot, the loss
  sum (last stage) and, on a frontal server, the input gradients this volunteer handed in for its
  rows are compared;
- a forward task's outputs (a backward server of a stage that is not the last).

A volunteer's first `probation` contributions at a server are all checked; after that each one with
probability `verify_rate`, drawn when the work arrives from a secret of this server's own (os.urandom
at start, never sent): the run's seed and the server's name are public, and a liar that could compute
the draws would lie only on the contributions not drawn. Checks run beside the step (spawned, the compute in a thread of their
own): an honest run pays only the recomputed share. A mismatch bans the volunteer: the server refuses
it at once and reports it to the run's first server, which bans it on every server and starts a layout
epoch that rolls every shard back to the first batch the volunteer contributed to (within the kept
versions) and runs again from there; the machinery is failover's (parameter_server/failover.py).
Must not step parameters itself."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import os
import random

import torch

from parameter_server.drift import DriftTest
from parameter_server.layout import owners
from parameter_server.updates import RETAIN
from peer.model.precision import compute_dtype, rounded
from peer.model.task_math import backward_rows, forward_rows
from peer.model.update_rule import version_for_batch
from peer.protocol import methods
from peer.protocol.params import NotReady, fetch_slot
from peer.protocol.refusals import Refusal
from peer.protocol.retry import Attempts
from peer.protocol.tasks import TaskId
from peer.protocol.wire import PayloadError, RemoteError, roundtrip, rows_field
from peer.protocol.wire import field as mfield

logger = logging.getLogger("hivepipe.server")

BANNED = "banned from this run"  # (the refusal's words for a person; its code is Refusal.BANNED)
# Relative L2 distance above which a re-run disagrees. Honest re-runs differ by summation order only:
# scripts/bench_trust.py measures at most ~1e-6 on one CPU; CPU against GPU (TF32 off) stays below 1e-4.
TOLERANCE = 1e-3
# At --precision bf16 each matmul's output is rounded to bfloat16: a re-run on the same kind of device is
# bit-identical, but one whose kernels cut the sums otherwise (another device, another row split) is not:
# a 4-row gradient of the `small` model computed as two 2-row halves is 2.0e-3 from the whole at bf16.
# The tolerance is ten times that; a liar scaling its work x100 (or biasing it, drift.py) is still caught.
TOLERANCE_BF16 = 2e-2
# Where a gradient's re-run is exactly zero (an embedding row of a token not in the batch, in every
# codec that keeps zeros exact: none, bf16), the push must be zero too: AdamW divides by the
# coordinate's own running scale, so noise far under TOLERANCE there moves the parameter by about a
# learning-rate step. The pushed mass off the re-run's support, relative to the re-run's norm, must not
# pass this (honest: exactly 0).
SUPPORT_TOLERANCE = 1e-6
EXACT_ZEROS = ("none", "bf16")
DEFAULT_VERIFY_RATE = 0.1
DEFAULT_PROBATION = 4
# A gradient push whose norm per row passes NORM_FACTOR x the median of the last NORM_HISTORY pushes of
# its shard slot (anyone's) is re-run whatever the sample says: a patient liar that scales a few
# percent of its pushes after probation is caught at its first such lie, not after 1 / verify_rate
NORM_FACTOR, NORM_HISTORY = 4.0, 64
HOLD_SECONDS = 60.0  # the longest a server holds its steps between a ban and the rollback's epoch
# The longest a step waits for a check of work it would put beyond a rollback's reach (a check runs
# about as long as the task it re-runs; this bounds a check stuck on a lost server's answers).
CHECK_HOLD_SECONDS = 120.0
BAN_PATIENCE = 30.0  # how long the coordinator tries to reach each server with a ban
REPORT_TRIES = 30  # how often a server that caught a cheater tries to tell the run's coordinator (0.5 s apart)
PIN_REFRESH, PIN_EXPIRY = 5.0, 15.0  # a server's pin is said again this often, and forgotten unsaid this long


def rollback_target(first: int, kept_from: int, versions: list[int]) -> int:
    """The version a ban rolls every shard back to, for a liar whose first work was batch `first`, when
    the oldest version every server still keeps is `kept_from` and the servers' slots are at `versions`.
    The first batch re-run, t, computes on version_for_batch(t) (t - 1, the delayed update), which must
    still be kept: past the window's start the oldest version kept is where a re-run starts from, not
    where it rolls back to. And a server that has not reached the liar's first batch applied none of
    its work: the run goes back no further than the slowest server's version (an epoch's
    `rollback_to` is at most its `from_batch`)."""
    target = first if version_for_batch(first) >= kept_from else max(first, kept_from + 1)
    return min(target, min(versions))


def distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 distance of `got` from `want` (absolute below a tiny floor, for all-zero results)."""
    diff = float(torch.linalg.vector_norm((got.float() - want.float()).flatten()))
    scale = float(torch.linalg.vector_norm(want.float().flatten()))
    return diff / max(scale, 1e-6 * max(want.numel(), 1) ** 0.5)


class Verification:
    """StageServer's checks of volunteers' work and bans (a part of parameter_server.service.StageServer)."""

    def _init_verification(self, verify_rate: float, probation: int, device: str = "cpu") -> None:
        if not 0.0 <= verify_rate <= 1.0:
            raise ValueError(f"verify rate must be in [0, 1], got {verify_rate}")
        if probation < 0:
            raise ValueError(f"probation must be >= 0 contributions, got {probation}")
        self.verify_rate, self.probation = verify_rate, probation
        self.verify_device = torch.device(device)  # where re-runs compute (the server's --device)
        secret = os.urandom(32)  # which contributions are re-run, and the drift test's directions
        self.verify_rng = random.Random(secret[:16])
        self.banned: dict[str, str] = {}  # peer id -> why (kept across layout epochs)
        # bans heard of (made here, or ordered by a coordinator) whose rollback epoch has not come yet:
        # the ban log a new coordinator orders itself, should the one that banned die before its epoch
        self.pending_bans: dict[str, str] = {}
        self.push_norms: dict[int, collections.deque] = {}  # slot -> recent pushes' norms per row
        self._ordering_ban = False
        # per volunteer, forgotten once it has left and its batches are out of the kept window
        # (Verification.forget_departed; a run of days sees tens of thousands of volunteers come and go)
        self.checks_passed: dict[str, int] = {}  # peer id -> its checks passed here (probation ends at `probation`)
        # peer ids whose probation ended with their differences not drifting (drift.suspicious): until
        # then a ban would roll back to their first work (unsettled_first)
        self.cleared: set[str] = set()
        self.contributed: dict[str, set[int]] = {}  # peer id -> batches it sent work of (kept window)
        # peer id -> the first batch it ever sent work of here, kept past the window: a ban then says
        # which of its work stays applied instead of rolling back to the window's start in silence
        self.first_contributed: dict[str, int] = {}
        self.verify_counts = {"checked": 0, "passed": 0, "caught": 0, "skipped": 0, "tasks_rerun": 0}
        self.passed_distance: dict[str, float] = {}  # peer -> the largest distance of a check it passed
        self.departed_distance = 0.0  # the same, of volunteers forgotten (forget_departed) and never banned
        self.drift = DriftTest(secret[16:])  # consistent small lies, along directions secret to this server (drift.py)
        self._verify_model = None
        self._verify_params: dict[int, dict[str, torch.Tensor]] = {}
        self._verify_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.ban_lock = asyncio.Lock()
        self.hold_steps_until: float | None = None  # set by a ban, cleared by the next layout epoch
        # pins: the oldest batch each server of the run (by peer id, this one's included) asks every
        # server to keep within a rollback's reach; of each other server, its last pin's seq and when
        # it came (pins_heard: a pin not said again for PIN_EXPIRY is forgotten)
        self.pins: dict[str, int] = {}
        self.pins_heard: dict[str, tuple[int, float]] = {}
        self.pin_sent: tuple[int | None, float] = (None, float("-inf"))  # (none said yet: nothing to clear)
        self.pin_seq = 0  # the last pin sent from here
        self.checks_pending: dict[int, int] = {}  # batch -> checks of its work not judged yet
        self.check_hold_since: float | None = None  # when a step began to wait for a check (checks_hold)

    def steps_held(self) -> bool:
        """True while a ban's rollback epoch is awaited (Updates._maybe_step does not step)."""
        if self.hold_steps_until is None:
            return False
        if self.clock() < self.hold_steps_until:
            return True
        logger.warning("%s: no layout epoch came within %.0f s of a ban: stepping again", self.device_id, HOLD_SECONDS)
        self.hold_steps_until = None
        return False

    def checks_hold(self, version: int) -> bool:
        """True while making version `version + 1` here would put work still being checked beyond a
        rollback's reach. A ban rolls back to the liar's first batch t, re-run on version_for_batch(t),
        which every server of the run must still keep; once this one has made `version + 1`, the others
        (at most two versions ahead of it per stage boundary, which is what snapshots_kept allows for)
        keep every version from `version + 2 - RETAIN` on. So a check of work of such a batch is waited
        for: a lying volunteer's work cannot outrun its checks, however far behind they fall (on a loaded
        machine they lagged a dozen tasks behind, and a liar's first batches then stayed applied). Bounded
        by CHECK_HOLD_SECONDS, should a check hang on a lost server."""
        reach = version + 2 - RETAIN
        late = [t for t in self.checks_pending if version_for_batch(t) < reach]
        if not late:
            self.check_hold_since = None
            return False
        now = self.clock()
        if self.check_hold_since is None:
            self.check_hold_since = now
            self.verify_counts["steps_held_for_checks"] = self.verify_counts.get("steps_held_for_checks", 0) + 1
            logger.debug("%s: version %d waits for the checks of batch %d", self.device_id, version + 1, min(late))
        if now - self.check_hold_since < CHECK_HOLD_SECONDS:
            return True
        logger.warning(
            "%s: a check of batch %d has run for %.0f s: stepping on (a ban from it may not reach all of that work)",
            self.device_id,
            min(late),
            now - self.check_hold_since,
        )
        return False

    # pins ----------------------------------------------------------------------------------------
    def unsettled_first(self) -> int | None:
        """The oldest batch of work sent here by a registered volunteer not yet past its checks: its
        first work on while its probation has not ended with differences that do not drift (a liar
        under the tolerance drifts from its 3rd check: it stays there until banned), its work in the
        kept window on while its differences drift after that (drift.suspicious). A ban of it would
        roll back there."""
        firsts, suspects = [], self.drift.suspects()
        for peer, batches in self.contributed.items():
            if peer not in self.clients or peer in self.banned or not batches:
                continue
            if self.probation > 0 and peer not in self.cleared:
                firsts.append(self.first_contributed.get(peer, min(batches)))
            elif peer in suspects:
                firsts.append(min(batches))
        return min(firsts, default=None)

    def update_pins(self) -> None:
        """Pin the versions a ban may still need: this server's pin (unsettled_first) goes to every
        server of the run when it changes (and every PIN_REFRESH seconds while there is one), and every shard kept here
        keeps the versions from the run's oldest pin on (ShardState.pinned_from, bounded by PIN_EXTRA).
        Without it a liar whose checked work came a task every few steps was banned with its first
        batches beyond the kept versions (the drift test needs 5 checks), its work staying applied."""
        now = self.clock()
        for peer, (_, at) in self.pins_heard.items():  # (its seq stays: a late, older pin is still refused)
            if now - at > PIN_EXPIRY:
                self.pins.pop(peer, None)
        mine = self.unsettled_first()
        if mine is None:
            self.pins.pop(self.peer_id, None)
        else:
            self.pins[self.peer_id] = mine
        if mine != self.pin_sent[0] or (mine is not None and now - self.pin_sent[1] > PIN_REFRESH):
            self.pin_sent = (mine, now)
            self._spawn(self._send_pin(mine))
        self._apply_pins()

    def _apply_pins(self) -> None:
        oldest = min(self.pins.values(), default=None)
        pinned = None if oldest is None else version_for_batch(oldest)
        for shard in [*self.hosted.values(), *self.replicas.values()]:
            shard.pinned_from = pinned

    async def _send_pin(self, batch: int | None) -> None:
        self.pin_seq += 1
        meta = {"batch": -1 if batch is None else batch, "seq": self.pin_seq}
        for d in [d for st in self.layout.stages for d in st.servers if d != self.device_id]:
            try:
                await self._server_call(d, "pin", meta)
            except (ConnectionError, RemoteError, PayloadError, asyncio.TimeoutError) as e:
                logger.debug("%s: pin to %s: %r", self.device_id, d, e)  # (sent again within PIN_REFRESH)

    async def on_pin(self, meta, tensors, sender):
        """A server's pin (update_pins): -1 for none. `seq` orders a server's pins (sent concurrently)."""
        batch, seq = mfield(meta, "batch", int), mfield(meta, "seq", int)
        if batch < -1:
            raise PayloadError(f"field 'batch' must be a batch or -1, got {batch}")
        if seq < self.pins_heard.get(sender, (0, 0.0))[0]:
            return {"ok": True}
        self.pins_heard[sender] = (seq, self.clock())
        if batch < 0:
            self.pins.pop(sender, None)
        else:
            self.pins[sender] = batch
        self._apply_pins()
        return {"ok": True}

    # what arrives ------------------------------------------------------------------------------
    def honest_distance(self) -> float:
        """The largest distance of a passed check of a volunteer not banned: how far honest re-runs go."""
        return max([self.departed_distance] + [d for p, d in self.passed_distance.items() if p not in self.banned])

    def _banned_check(self, sender: str) -> None:
        if sender in self.banned:
            raise PayloadError(f"peer {sender[-8:]} is {BANNED}: {self.banned[sender]}", Refusal.BANNED)

    def _note_contribution(self, sender: str, t: int, shared_by: int = 1) -> bool:
        """Remember that `sender` (a volunteer) sent work of batch t; True if this one is to be checked.
        Work that `shared_by` servers receive (a gradient push goes to every shard server) is checked by
        each with probability p = 1 - (1 - verify_rate) ** (1 / shared_by), drawn apart, so that it is
        re-run by at least one of them with probability verify_rate: every time at 1.0 (as
        verify_rate / shared_by, a push of two shard servers went unchecked one time in four at 1.0);
        on probation every server checks it."""
        if not self._note_work(sender, t):
            return False
        # on probation until `probation` checks passed (a check skipped for want of its rows does not count),
        # and again while its differences drift one way (drift.py)
        return (
            self.checks_passed.get(sender, 0) < self.probation
            or self.drift.suspicious(sender)
            or self.verify_rng.random() < 1.0 - (1.0 - self.verify_rate) ** (1.0 / shared_by)
        )

    def unusual_norm(self, slot: int, grads: list[torch.Tensor], rows: int) -> bool:
        """Whether a gradient push of `rows` rows is far larger than the slot's recent pushes (NORM_FACTOR
        x their median norm per row); the push joins the slot's history either way."""
        norm = float(torch.sqrt(sum(g.float().pow(2).sum() for g in grads))) / max(rows, 1)
        history = self.push_norms.setdefault(slot, collections.deque(maxlen=NORM_HISTORY))
        typical = sorted(history)[len(history) // 2] if len(history) >= 8 else None
        history.append(norm)
        if typical is None or norm <= NORM_FACTOR * typical:
            return False
        self.verify_counts["unusual_norms"] = self.verify_counts.get("unusual_norms", 0) + 1
        return True

    def _note_work(self, sender: str, t: int) -> bool:
        """Remember that `sender` (a volunteer) sent work of batch t, which a ban's rollback must reach:
        also work checked with another message (an input gradient, relayed to the previous stage at
        once and checked with its sender's gradient push, which may never come). False when there is
        nothing to remember: a replayed request, or a server's work."""
        if self.replaying or self._is_server(sender):
            return False
        kept = self._kept_from()
        batches = self.contributed.setdefault(sender, set())
        batches.add(t)
        self.first_contributed[sender] = min(t, self.first_contributed.get(sender, t))
        batches.difference_update([b for b in batches if b < kept])
        return True

    def _kept_from(self) -> int:
        return self.version - self.shard.keep_versions

    def forget_departed(self) -> None:
        """Forget what this server remembers of volunteers that have left (not registered here) and
        whose contributions are all older than the kept versions, which no rollback can reach: their
        batches for a ban, and their passed checks (one that comes back is on probation again)."""
        kept = self._kept_from()
        for peer in [p for p in self.contributed if p not in self.clients]:
            if all(b < kept for b in self.contributed[peer]):
                del self.contributed[peer]
                self.first_contributed.pop(peer, None)
        for peer in [p for p in self.checks_passed if p not in self.clients and p not in self.contributed]:
            del self.checks_passed[peer]
            self.cleared.discard(peer)
            self.drift.forget(peer)
        for peer in [p for p in self.passed_distance if p not in self.clients and p not in self.contributed]:
            if peer not in self.banned:  # (gone for good, never banned: its distances were honest)
                self.departed_distance = max(self.departed_distance, self.passed_distance[peer])
            del self.passed_distance[peer]

    def _check_later(self, t: int, check, *args) -> None:
        """Check work of batch t beside the step (`check(epoch, *args)`), counted in checks_pending."""
        self.checks_pending[t] = self.checks_pending.get(t, 0) + 1
        self._spawn(self._guarded(t, check(self.epoch, *args)))

    async def _guarded(self, t: int, coro) -> None:
        try:
            await coro
        except (PayloadError, RemoteError, ConnectionError, asyncio.TimeoutError, KeyError) as e:
            # what a re-run needs is gone (an epoch began, the batch was forgotten): not evidence
            self.verify_counts["skipped"] += 1
            logger.debug("%s: check skipped: %r", self.device_id, e)
        except Exception:  # a bug in a check is no evidence against anyone: said, and the server goes on
            self.verify_counts["skipped"] += 1
            logger.exception("%s: a check failed", self.device_id)
        finally:
            left = self.checks_pending.get(t, 0) - 1
            if left > 0:
                self.checks_pending[t] = left
            else:
                self.checks_pending.pop(t, None)
            if self.check_hold_since is not None:
                self._maybe_step()  # a step waited for this check

    # re-running --------------------------------------------------------------------------------
    async def _server_call(self, device: str, method: str, meta: dict) -> tuple[dict, list]:
        if method in methods.STAMPED and "epoch" not in meta:  # (a check reads its own epoch's lineage)
            meta = dict(meta, epoch=self.epoch)
        if device == self.device_id:
            answer, tensors = await self.handle(method, dict(meta), [], self.peer_id)
            if "error" in answer:
                raise RemoteError.of(f"{device}.{method}", answer)
            return answer, tensors
        link = self.connector(device) if self.connector is not None else None
        if link is None:
            raise ConnectionError(f"{device} is not reachable from here")
        return await link.call(method, meta, [], timeout=30.0)

    async def _held_rows(self, what: str, t: int, m: int, a: int, b: int) -> list[torch.Tensor]:
        """Rows [a, b) of what the stage's servers hold for (t, m): 'inputs' (inputs and labels, from
        the frontal servers) or 'output_grads' (from the backward servers), stitched across segments."""
        servers = self.st.frontal if what == "inputs" else self.st.backward
        parts = []
        for j, x, y in owners(self.rows, len(servers), a, b):
            _, tensors = await self._server_call(
                servers[j], "get_held", {"what": what, "batch": t, "micro": m, "rows": [x, y]}
            )
            parts.append(tensors)
        # as the volunteer received them (under the run's --compress): the check re-runs what it ran
        return [roundtrip(torch.cat([p[i] for p in parts]), self.compress) for i in range(len(parts[0]))]

    async def _params_at(self, version: int) -> dict[str, torch.Tensor]:
        if version in self._verify_params:
            return self._verify_params[version]
        epoch = self.epoch
        state: dict[str, torch.Tensor] = {}
        for slot, host in enumerate(self.st.hosts):
            if slot in self.hosted:
                snap = self.hosted[slot].params_at(version)
                if snap is None:
                    raise PayloadError(f"version {version} of slot {slot} is no longer held")
                state.update(snap)
                continue
            try:
                meta, tensors = await fetch_slot(
                    functools.partial(self._server_call, host), host, slot, version, patience=5.0, poll=0.05
                )
            except NotReady as e:
                raise PayloadError(str(e)) from None
            state.update(zip(meta["names"], tensors))
        if self.epoch != epoch:  # (its slots may come from two lineages: nothing kept, nothing judged)
            raise PayloadError(f"layout epoch {self.epoch} began while version {version} was fetched")
        # a task computes on the parameters in the run's precision (peer.model.precision): so does its check
        state = rounded(state, self.run.precision)
        self._verify_params[version] = state
        for v in [v for v in self._verify_params if v < version - 1]:
            del self._verify_params[v]
        return state

    async def _recompute(self, version: int, fn):
        """Run fn(model) on this stage's slice holding parameters `version`, in the check's own thread."""
        from peer.model.transformer import build_slice

        params = await self._params_at(version)
        if self._verify_executor is None:
            self._verify_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verify")
            lo, hi = self.st.layers
            self._verify_model = build_slice(self.cfg, lo, hi, self.run.seed, device=self.verify_device)
            self._verify_model.compute_dtype = compute_dtype(self.run.precision)

        def work():
            self._verify_model.load_state_dict({k: v.to(self.verify_device) for k, v in params.items()})
            return fn(self._verify_model)

        return await asyncio.get_running_loop().run_in_executor(self._verify_executor, work)

    def _judge(
        self, epoch: int, sender: str, what: str, d: float, t: int, seen: list, tolerance: float | None = None
    ) -> bool:
        """True if the distance `d` is within tolerance (it joins `seen`, the check's distances, which
        count as honest once the whole check has passed). A check that outlived its layout epoch judges
        nothing: a rollback may have re-made the rows it read (an honest worker's result on a liar's
        activations would then differ from a re-run on the clean ones)."""
        if self.epoch != epoch:
            raise PayloadError(f"the check began in layout epoch {epoch}, the run is at {self.epoch}")
        if tolerance is None:  # (the run's precision's: TOLERANCE, or TOLERANCE_BF16)
            tolerance = TOLERANCE_BF16 if self.run.precision == "bf16" else TOLERANCE
            if d <= tolerance:
                seen.append(d)
                return True
        elif d <= tolerance:
            return True
        self._caught(sender, f"{what} of batch {t} is {d:.3g} (relative L2) from this server's re-run", t)
        return False

    async def _drifts(self, epoch: int, sender: str, kind: str, got: torch.Tensor, want: torch.Tensor, t: int) -> bool:
        """True (and the volunteer caught) when its differences of `kind` from this server's re-runs keep
        one direction, check after check, past what rounding does (drift.py); a check that outlived its
        layout epoch judges nothing. The projections run in the checks' thread, beside the step."""
        hit = await asyncio.get_running_loop().run_in_executor(
            self._verify_executor, self.drift.add, sender, kind, got, want
        )
        if hit is None:
            return False
        if self.epoch != epoch:
            raise PayloadError(f"the check began in layout epoch {epoch}, the run is at {self.epoch}")
        n = self.drift.sums[(sender, kind)][1]
        self.verify_counts["drift_caught"] = self.verify_counts.get("drift_caught", 0) + 1
        self._caught(
            sender,
            f"its {kind} differ from this server's re-runs the same way check after check "
            f"(Q {hit[0]:.1f} > {hit[1]:.1f} after {n} checks)",
            t,
        )
        return True

    def _passed(self, sender: str, seen: list) -> None:
        """A whole check passed (every distance within the tolerance, no drift yet). Its distances count
        as an honest re-run's while the volunteer is not banned (a liar under the tolerance passes
        checks until the drift test has seen enough of them): `honest_distance`."""
        self.passed_distance[sender] = max([self.passed_distance.get(sender, 0.0), *seen])
        self.verify_counts["passed"] += 1
        self.checks_passed[sender] = self.checks_passed.get(sender, 0) + 1
        self.contributions.check_passed(sender)
        if self.checks_passed[sender] >= self.probation and not self.drift.suspicious(sender):
            self.cleared.add(sender)

    async def _check_outputs(self, epoch: int, sender: str, t: int, m: int, a: int, b: int, out: torch.Tensor) -> None:
        (x, _) = await self._held_rows("inputs", t, m, a, b)
        want = roundtrip(
            await self._recompute(version_for_batch(t), lambda model: forward_rows(model, x, self.verify_device)),
            self.compress,
        )
        self.verify_counts["checked"] += 1
        self.verify_counts["tasks_rerun"] += 1
        seen: list[float] = []
        if self._judge(
            epoch, sender, f"the outputs of rows {a}-{b} of micro-batch {m}", distance(out, want), t, seen
        ) and not await self._drifts(epoch, sender, "outputs", out, want, t):
            self._passed(sender, seen)

    async def _check_push(
        self, epoch: int, sender: str, t: int, ids: list[str], slot: int, grads: list[torch.Tensor], loss: float | None
    ) -> None:
        names = self.slot_names[slot]
        total = {n: torch.zeros_like(g) for n, g in zip(names, grads)}
        loss_sum, gins = 0.0, []
        held = []  # every task's rows first: the re-runs may queue behind other checks, the rows do not wait
        for task in ids:
            tid = TaskId.parse(task)
            (a, b), m = tid.rows, tid.micro
            held.append((m, a, b, await self._backward_rows_held(t, m, a, b)))
        for m, a, b, rows in held:
            gin, ls, full = await self._rerun_backward(t, rows)
            for n in names:
                total[n].add_(full[n])
            loss_sum += ls or 0.0
            gins.append((m, a, b, gin))
        self.verify_counts["checked"] += 1
        self.verify_counts["tasks_rerun"] += len(ids)
        got = torch.cat([g.flatten() for g in grads])
        want = torch.cat([roundtrip(total[n], self.compress).flatten() for n in names])
        seen: list[float] = []
        if not self._judge(
            epoch, sender, f"its gradient of shard slot {slot} over {len(ids)} tasks", distance(got, want), t, seen
        ):
            return
        if self.compress in EXACT_ZEROS:
            off = want == 0
            leak = float(torch.linalg.vector_norm(got[off].float())) / max(
                float(torch.linalg.vector_norm(want.float())), 1e-30
            )
            what = f"its gradient of shard slot {slot} where the re-run's is zero ({int((got[off] != 0).sum())} values)"
            if not self._judge(epoch, sender, what, leak, t, seen, SUPPORT_TOLERANCE):
                return
        if await self._drifts(epoch, sender, f"gradients of shard slot {slot}", got, want, t):
            return
        if (
            self.last
            and loss is not None
            and not self._judge(epoch, sender, "its loss sum", abs(loss - loss_sum) / max(abs(loss_sum), 1e-6), t, seen)
        ):
            return
        if self.role == "frontal" and self.stage > 0:
            lo, hi = self.seg
            for m, a, b, gin in gins:
                buf = self.grad_buffers.get((t, m))
                if (
                    lo <= a
                    and b <= hi
                    and buf is not None
                    and buf.has(a, b)
                    and self.gin_senders.get((t, m, a, b)) == sender
                ):
                    mine, theirs = roundtrip(gin, self.compress), buf.slice(a, b)[0]
                    if not self._judge(
                        epoch,
                        sender,
                        f"its input gradient of rows {a}-{b} of micro-batch {m}",
                        distance(theirs, mine),
                        t,
                        seen,
                    ) or await self._drifts(epoch, sender, "input gradients", theirs, mine, t):
                        return
        self._passed(sender, seen)

    async def _backward_rows_held(self, t: int, m: int, a: int, b: int) -> tuple:
        """What re-running rows [a, b) of micro-batch m of batch t backward needs: (inputs, labels,
        output gradient or None on the last stage)."""
        x, labels = await self._held_rows("inputs", t, m, a, b)
        g = None if self.last else (await self._held_rows("output_grads", t, m, a, b))[0]
        return x, labels, g

    async def _rerun_backward(self, t: int, rows: tuple):
        """(input gradient, loss sum, parameter gradients) of a backward re-run of `rows` on the
        version batch t computes on."""
        x, labels, g = rows
        tokens = self.run.batch_size * self.cfg.seq_len
        return await self._recompute(
            version_for_batch(t),
            lambda model: backward_rows(
                model, x, self.verify_device, tokens, out_grad=g, labels=labels if self.last else None
            ),
        )

    def _back_input_grads(self, sender: str, t: int, pieces: list) -> None:
        """A gradient push from `sender` credited here (a frontal server of a stage > 0) for `pieces`
        (task id, micro-batch, rows): an input gradient of the same rows handed in by someone else was
        relayed with no push of its own behind it (its task handed back or let run out, and run again):
        it is re-run on its own, whatever the sample says (a liar that relays a lie and never pushes
        the gradient that would check it is caught, and the ban's rollback reaches batch t)."""
        if self.role != "frontal" or self.stage == 0 or self.replaying:
            return
        for _, m, (a, b) in pieces:
            key = (t, m, a, b)
            first = self.gin_senders.get(key)
            if first is None or first == sender or key in self.gin_orphans or self._is_server(first):
                continue
            self.gin_orphans.add(key)
            self.counters["input_grads_orphaned"] = self.counters.get("input_grads_orphaned", 0) + 1
            self._check_later(t, self._check_input_grad, first, t, m, a, b)

    async def _check_input_grad(self, epoch: int, sender: str, t: int, m: int, a: int, b: int) -> None:
        """Re-run rows [a, b) of micro-batch m of batch t and compare the input gradient `sender` handed
        in for them (held here) with the re-run's."""
        gin, _, _ = await self._rerun_backward(t, await self._backward_rows_held(t, m, a, b))
        buf = self.grad_buffers.get((t, m))
        if buf is None or not buf.has(a, b) or self.gin_senders.get((t, m, a, b)) != sender:
            raise KeyError(f"the input gradient of rows {a}-{b} of batch {t} micro-batch {m} is gone")
        self.verify_counts["checked"] += 1
        self.verify_counts["tasks_rerun"] += 1
        theirs, mine = buf.slice(a, b)[0], roundtrip(gin, self.compress)
        seen: list[float] = []
        what = f"its input gradient of rows {a}-{b} of micro-batch {m} (with no gradient push of its own)"
        if self._judge(epoch, sender, what, distance(theirs, mine), t, seen) and not await self._drifts(
            epoch, sender, "input gradients", theirs, mine, t
        ):
            self._passed(sender, seen)

    # bans --------------------------------------------------------------------------------------
    def _ban_here(self, peer: str, why: str) -> None:
        if peer in self.banned:
            return
        self.banned[peer] = why
        self.clients.pop(peer, None)
        n = len(self.pool.client_left(peer))
        logger.warning("%s: volunteer %s banned (%s); %d of its leases re-queued", self.device_id, peer[-8:], why, n)

    def _caught(self, peer: str, why: str, t: int) -> None:
        if peer in self.banned:
            return
        self.verify_counts["caught"] += 1
        self._ban_here(peer, why)
        self.pending_bans.setdefault(peer, why)
        self.hold_steps_until = self.clock() + HOLD_SECONDS  # no step until the ban's rollback (on_ban)
        self._spawn(self._report(peer, why))

    def order_pending_bans(self) -> None:
        """Periodic (maintenance): the run's coordinator orders, one at a time, the bans it heard of
        whose rollback epoch never came: a coordinator that died (or froze and was failed over) after
        every server heard its ban and before its epoch left the liar's work applied (0.27 from the
        reference in the third trust pass); the next coordinator holds the same ban log."""
        for peer in [p for p in self.pending_bans if p in self.ordered_bans()]:
            del self.pending_bans[peer]
        if not self.pending_bans or self._ordering_ban or self.ban_lock.locked() or self.replaying:
            return
        if self.coordinator() != self.device_id:
            return
        peer, why = next(iter(self.pending_bans.items()))
        self._ordering_ban = True

        async def order():
            try:
                await self.ban_and_roll_back(peer, why)
            except Exception as e:  # (a server not reachable yet: tried again at the next maintenance)
                logger.info("%s: ordering the ban of %s failed: %r", self.device_id, peer[-8:], e)
            finally:
                self._ordering_ban = False

        self._spawn(order())

    def coordinator(self) -> str:
        """The server that orders bans (and their rollbacks) into layout epochs: the run's first."""
        return next(d for st in self.layout.stages for d in st.servers)

    async def _report(self, peer: str, why: str) -> None:
        async for attempt in Attempts(
            f"{self.device_id}: reporting {peer[-8:]}", tries=REPORT_TRIES, pause=0.5, log=logger
        ):
            try:
                coordinator = self.coordinator()
                if coordinator == self.device_id:
                    await self.ban_and_roll_back(peer, why)
                else:
                    await self._server_call(coordinator, "report_cheat", {"peer": peer, "why": why})
                return
            except Exception as e:
                attempt.failed(e)
        logger.warning(
            "%s: %s was caught cheating but could not be reported in %d tries", self.device_id, peer[-8:], REPORT_TRIES
        )

    async def _server_call_patiently(self, device: str, method: str, meta: dict) -> tuple[dict, list]:
        """_server_call, tried again for up to BAN_PATIENCE seconds while `device` cannot be reached
        (a ban early in a run met a coordinator whose directory did not list a server of another stage
        yet: the ban's epoch was never made, and the liar's work stayed applied)."""
        async for attempt in Attempts(f"{self.device_id}: {method} to {device}", within=BAN_PATIENCE, log=logger):
            try:
                return await self._server_call(device, method, meta)
            except (ConnectionError, asyncio.TimeoutError) as e:
                if attempt.last:
                    raise
                attempt.failed(e)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _ban_reported(self, peer: str, why: str) -> None:
        try:
            await self.ban_and_roll_back(peer, why)
        except Exception as e:  # said, not lost in a task nobody awaits; the servers step again after HOLD_SECONDS
            logger.error("%s: the ban of %s could not be ordered: %r", self.device_id, peer[-8:], e)

    async def on_report_cheat(self, meta, tensors, sender):
        peer, why = mfield(meta, "peer", str), mfield(meta, "why", str)
        if self.coordinator() != self.device_id:
            raise PayloadError(f"{self.device_id} does not coordinate this run's bans ({self.coordinator()} does)")
        if self._is_server(peer):
            raise PayloadError(f"{peer[-8:]} is a server of this run: servers are trusted, not banned")
        self._spawn(self._ban_reported(peer, why))
        return {"ok": True}

    async def on_ban(self, meta, tensors, sender):
        """Ban `peer` here; answer the first batch it ever contributed to here (one already out of the
        kept window too: the coordinator then says which of its work stays applied), the oldest version
        kept and the versions of the slots hosted here."""
        peer, why = mfield(meta, "peer", str), mfield(meta, "why", str)
        self._ban_here(peer, why)
        if peer not in self.ordered_bans():
            self.pending_bans.setdefault(peer, why)
        # no step until the rollback's epoch arrives: a step now would apply the liar's work and could
        # push the version to roll back to out of the kept window (bounded, should the coordinator die)
        self.hold_steps_until = self.clock() + HOLD_SECONDS
        batches = self.contributed.get(peer)
        first = min(batches) if batches else -1
        return {
            "first_batch": min(first, self.first_contributed.get(peer, first)) if batches else -1,
            "versions": [sh.version for sh in self.hosted.values()],
            "kept_from": max(sh.kept_from() for sh in self.hosted.values()),
        }

    async def ban_and_roll_back(self, peer: str, why: str) -> dict | None:
        """(The coordinator) ban `peer` on every server and start a layout epoch that drops every
        unapplied contribution and rolls every shard back to the first batch it contributed to (as far
        as the kept versions allow), then runs again from there. Returns the epoch record (None if the
        peer was banned by an earlier epoch)."""
        async with self.ban_lock:
            if peer in self.ordered_bans():
                return None
            answers = []
            for st in self.layout.stages:
                for d in st.servers:
                    answers.append(await self._server_call_patiently(d, "ban", {"peer": peer, "why": why}))
            firsts = [a["first_batch"] for a, _ in answers if a["first_batch"] >= 0]
            versions = [v for a, _ in answers for v in a["versions"]]
            kept_from = max(a["kept_from"] for a, _ in answers)
            record = {
                "epoch": self.epoch + 1,
                "layout": self.layout.to_dict(),
                "banned": sorted(set(self.ordered_bans()) | {peer}),
                "lost": list((self.epoch_record or {}).get("lost", [])),
            }
            first = min(firsts) if firsts else None
            if first is not None and first < max(versions):
                target = rollback_target(first, kept_from, versions)
                if target > first:
                    logger.error(
                        "%s: %s's work of batches %d..%d stays applied: versions before %d are no longer kept",
                        self.device_id,
                        peer[-8:],
                        first,
                        target - 1,
                        target,
                    )
                record["rollback_to"] = target
            low = min(versions + ([record["rollback_to"]] if "rollback_to" in record else []))
            record["from_batch"] = min(low, self.run.steps - 1)
            await self.send_epoch(record, [d for st in self.layout.stages for d in st.servers])
            self.adopt(record)
            logger.warning(
                "%s: volunteer %s banned from the run; epoch %d %s",
                self.device_id,
                peer[-8:],
                record["epoch"],
                f"rolled back to version {record['rollback_to']}"
                if "rollback_to" in record
                else "(nothing of it was applied)",
            )
            return record

    # the rows a check needs --------------------------------------------------------------------
    async def on_get_held(self, meta, tensors, sender):
        """Rows this server holds for a check: 'inputs' (a frontal server: inputs and labels) or
        'output_grads' (a backward server)."""
        what = mfield(meta, "what", str)
        t, m = self._batch_micro(meta, check_applied=False)
        a, b = rows_field(meta, "rows", self.rows)
        want = {"inputs": ("frontal", self.buffers), "output_grads": ("backward", self.grad_buffers)}.get(what)
        if want is None:
            raise PayloadError(f"field 'what' must be 'inputs' or 'output_grads', got {what!r}")
        role, store = want
        if self.role != role:
            raise PayloadError(f"{what} are held by {role} servers")
        buf = store.get((t, m))
        if buf is None or not buf.has(a, b):
            raise PayloadError(f"{what} of rows [{a}, {b}) of batch {t} micro-batch {m} are not held here")
        x, y = buf.slice(a, b)
        return {"ok": True}, [x] if y is None else [x, y]
