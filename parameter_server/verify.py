"""Checked work: a server re-runs a sample of its volunteers' work on its own CPU (or GPU) and bans a
volunteer whose results do not match. A task's result is a pure function of the parameter version and
its rows (core/model/task_math.py), so a re-run gives the same numbers up to floating-point order.

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
versions) and runs again from there (parameter_server/bans.py; the machinery is failover's). What each
volunteer sent, and whether it is drawn for a check: parameter_server/arrivals.py.
Must not step parameters itself."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import random

import torch

from core.layout import owners
from core.model.precision import compute_dtype, rounded
from core.model.task_math import backward_rows, forward_rows
from core.model.update_rule import version_for_batch
from core.protocol import methods
from core.protocol.codecs import roundtrip
from core.protocol.fields import field as mfield
from core.protocol.fields import rows_field
from core.protocol.params import NotReady, fetch_slot
from core.protocol.tasks import TaskId
from core.protocol.wire import PayloadError, RemoteError
from parameter_server.drift import DriftTest

logger = logging.getLogger("hivepipe.server")

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


def distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 distance of `got` from `want` (absolute below a tiny floor, for all-zero results)."""
    diff = float(torch.linalg.vector_norm((got.float() - want.float()).flatten()))
    scale = float(torch.linalg.vector_norm(want.float().flatten()))
    return diff / max(scale, 1e-6 * max(want.numel(), 1) ** 0.5)


class Verification:
    """StageServer's checks of volunteers' work (a part of parameter_server.service.StageServer); a
    check that fails hands the volunteer to Bans (bans.py), and Pins (pins.py) keeps what a ban needs."""

    def _init_verification(self, verify_rate: float, probation: int, device: str = "cpu") -> None:
        """The check settings' values are checked here; what was sent, and the sample, are the
        `arrivals` part's (built from them: StageServer)."""
        if not 0.0 <= verify_rate <= 1.0:
            raise ValueError(f"verify rate must be in [0, 1], got {verify_rate}")
        if probation < 0:
            raise ValueError(f"probation must be >= 0 contributions, got {probation}")
        self.verify_device = torch.device(device)  # where re-runs compute (the server's --device)
        secret = os.urandom(32)  # which contributions are re-run, and the drift test's directions
        self.verify_rng = random.Random(secret[:16])
        self.verify_counts = {"checked": 0, "passed": 0, "caught": 0, "skipped": 0, "tasks_rerun": 0}
        self.drift = DriftTest(secret[16:])  # consistent small lies, along directions secret to this server (drift.py)
        self._verify_model = None
        self._verify_params: dict[int, dict[str, torch.Tensor]] = {}
        self._verify_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.checks_pending: dict[int, int] = {}  # batch -> checks of its work not judged yet

    def forget_checks(self) -> None:
        """A rollback re-makes the versions after it: the re-runs' cached parameters are of the undone lineage."""
        self._verify_params = {}

    def check_later(self, t: int, check, *args) -> None:
        """Check work of batch t beside the step (`check(epoch, *args)`), counted in checks_pending."""
        self.checks_pending[t] = self.checks_pending.get(t, 0) + 1
        self.outbox.spawn(self._guarded(t, check(self.epoch, *args)))

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
            if self.pins.check_hold_since is not None:
                self.maybe_step()  # a step waited for this check

    # re-running --------------------------------------------------------------------------------
    async def server_call(self, device: str, method: str, meta: dict) -> tuple[dict, list]:
        if method in methods.STAMPED and "epoch" not in meta:  # (a check reads its own epoch's lineage)
            meta = dict(meta, epoch=self.epoch)
        if device == self.device_id:
            answer, tensors = await self.surface.handle(method, dict(meta), [], self.peer_id)
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
            _, tensors = await self.server_call(
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
                    functools.partial(self.server_call, host), host, slot, version, patience=5.0, poll=0.05
                )
            except NotReady as e:
                raise PayloadError(str(e)) from None
            state.update(zip(meta["names"], tensors))
        if self.epoch != epoch:  # (its slots may come from two lineages: nothing kept, nothing judged)
            raise PayloadError(f"layout epoch {self.epoch} began while version {version} was fetched")
        # a task computes on the parameters in the run's precision (core.model.precision): so does its check
        state = rounded(state, self.run.precision)
        self._verify_params[version] = state
        for v in [v for v in self._verify_params if v < version - 1]:
            del self._verify_params[v]
        return state

    async def recompute(self, version: int, fn):
        """Run fn(model) on this stage's slice holding parameters `version`, in the check's own thread."""
        from core.model.transformer import build_slice

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
        self.bans.caught(sender, f"{what} of batch {t} is {d:.3g} (relative L2) from this server's re-run")
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
        self.bans.caught(
            sender,
            f"its {kind} differ from this server's re-runs the same way check after check "
            f"(Q {hit[0]:.1f} > {hit[1]:.1f} after {n} checks)",
        )
        return True

    def passed_check(self, sender: str, seen: list) -> None:
        """A whole check passed (every distance within the tolerance, no drift yet). Its distances count
        as an honest re-run's while the volunteer is not banned (a liar under the tolerance passes
        checks until the drift test has seen enough of them): `honest_distance`."""
        self.arrivals.passed(sender, seen)
        self.contributions.check_passed(sender)

    async def check_outputs(self, epoch: int, sender: str, t: int, m: int, a: int, b: int, out: torch.Tensor) -> None:
        (x, _) = await self._held_rows("inputs", t, m, a, b)
        want = roundtrip(
            await self.recompute(version_for_batch(t), lambda model: forward_rows(model, x, self.verify_device)),
            self.compress,
        )
        self.verify_counts["checked"] += 1
        self.verify_counts["tasks_rerun"] += 1
        seen: list[float] = []
        if self._judge(
            epoch, sender, f"the outputs of rows {a}-{b} of micro-batch {m}", distance(out, want), t, seen
        ) and not await self._drifts(epoch, sender, "outputs", out, want, t):
            self.passed_check(sender, seen)

    async def check_push(
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
        self.passed_check(sender, seen)

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
        return await self.recompute(
            version_for_batch(t),
            lambda model: backward_rows(
                model, x, self.verify_device, tokens, out_grad=g, labels=labels if self.last else None
            ),
        )

    def back_input_grads(self, sender: str, t: int, pieces: list) -> None:
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
            if first is None or first == sender or key in self.gin_orphans or self.directory.is_server(first):
                continue
            self.gin_orphans.add(key)
            self.counters["input_grads_orphaned"] = self.counters.get("input_grads_orphaned", 0) + 1
            self.check_later(t, self._check_input_grad, first, t, m, a, b)

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
            self.passed_check(sender, seen)

    # the rows a check needs --------------------------------------------------------------------
    async def on_get_held(self, meta, tensors, sender):
        """Rows this server holds for a check: 'inputs' (a frontal server: inputs and labels) or
        'output_grads' (a backward server)."""
        what = mfield(meta, "what", str)
        t, m = self.checks.batch_micro(meta, check_applied=False)
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
