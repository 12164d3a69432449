"""Held-out evaluation during training (--eval-every N): at every N-th version, and at the last, the
mean token loss of that version on a fixed set of held-out windows, computed by the servers.

The windows are `eval_windows`: EVAL_ROWS windows of the corpus's held-out split drawn once for the
run (by its seed), the same at every evaluation. Stage 0's first frontal server, once it has made
version v, runs stage 0's slice at version v on the windows' inputs (in its checks' thread, on the
parameters of every slot of the stage, core.model.precision's rounding included) and sends the
activations to the next stage's first frontal server (`eval_forward`, a server-only method), which
runs its own slice at version v (waiting for it to be made) and passes them on; the last stage's
first frontal server, which holds the labels, computes the loss. So an evaluation moves the windows'
activations once through the pipeline between servers, and the volunteers' work is not held up by it.
The loss is logged, in that server's status (`eval_losses`), its training log and `peer swarm`'s
summary; `peer reference --eval-every N` computes the same numbers on the same windows."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable

import torch

from core.model.data import EVAL_ROWS, eval_due, eval_windows
from core.model.task_math import forward_rows
from core.model.transformer import loss_sum
from core.protocol.fields import field as mfield
from core.protocol.wire import PayloadError, RemoteError
from parameter_server.place import ServerPlace

logger = logging.getLogger("hivepipe.server")

EVAL_WAIT = 300.0  # the longest a stage waits for the version an evaluation is of
EVALS_KEPT = 256  # evaluations a server keeps in its status


class Evaluation:
    """A server's part of the held-out evaluation, given what it reads of its server: `place` (its
    device id, stage, role, index in the role, whether its stage is the last), the run (`run`: its
    seed and steps), the model's `cfg`, the `corpus` and the sequence length `seq`; `epoch()`,
    `layout()`, `version()`, `step_event()` and `replaying()` as they are now; `recompute(version, fn)`
    (fn run on this stage's slice at that version, in the checks' thread), `device` (where),
    `connector` (device -> a link, or None) and `outbox` (its background work). `every` 0: nothing is
    evaluated. `maybe_evaluate(version)` is the step callback of the server that `starts` each
    evaluation; `on_eval` callbacks (version, held-out loss) are called on the last stage."""

    def __init__(
        self,
        every: int,
        *,
        place: ServerPlace,
        run,
        cfg,
        corpus,
        seq: int,
        epoch: Callable[[], int],
        layout: Callable[[], object],
        version: Callable[[], int],
        step_event: Callable[[], asyncio.Event],
        replaying: Callable[[], bool],
        recompute: Callable,
        device,
        connector: Callable[[str], object],
        outbox,
    ) -> None:
        self.eval_every = every
        self.place, self.run, self.cfg, self.corpus, self.seq = place, run, cfg, corpus, seq
        self.epoch, self.layout, self.version, self.step_event = epoch, layout, version, step_event
        self.replaying, self.recompute, self.device = replaying, recompute, device
        self.connector, self.outbox = connector, outbox
        self.eval_losses: dict[int, float] = {}
        self.evals_started: set[int] = set()  # versions whose evaluation this server started (stage 0)
        self.evals_seen: set[int] = set()  # versions whose activations reached this server
        self.on_eval: list = []  # callbacks (version, held-out loss) on the last stage

    @property
    def starts(self) -> bool:
        """Whether this server starts each evaluation (stage 0's first frontal server, evaluating)."""
        p = self.place
        return self.eval_every > 0 and p.stage == 0 and p.role == "frontal" and p.index == 0

    def maybe_evaluate(self, version: int) -> None:
        if self.replaying() or not eval_due(version, self.eval_every, self.run.steps) or version in self.evals_started:
            return
        self.evals_started.add(version)
        self.outbox.spawn(self._evaluate(version))

    async def _evaluate(self, version: int) -> None:
        """Stage 0's part of the evaluation of `version`, then the rest of the pipeline's."""
        try:
            x, _ = eval_windows(self.corpus, self.run.seed, self.seq)
            await self._eval_stage(version, x, self.epoch())
        except Exception as e:  # (an evaluation never stops training: said, and the run goes on)
            logger.warning("%s: the evaluation of version %d failed: %s", self.place.device_id, version, e)

    def forget_evals_from(self, version: int) -> None:
        """A ban's rollback to `version` (Failover.adopt): the versions after it are made again, and so
        evaluated again; what was said of the undone ones is dropped."""
        for store in (self.evals_started, self.evals_seen):
            store.difference_update({v for v in store if v > version})
        for v in [v for v in self.eval_losses if v > version]:
            del self.eval_losses[v]

    async def _eval_stage(self, version: int, x: torch.Tensor, epoch: int) -> None:
        """Run this stage's slice at `version` (of layout epoch `epoch`'s lineage) on `x`; the loss
        here on the last stage, else on to the next stage's first frontal server. An epoch that
        begins meanwhile ends it (a rollback re-makes the version: it is evaluated again)."""
        out = await self.recompute(version, lambda model: forward_rows(model, x, self.device))
        if self.epoch() != epoch:
            logger.info(
                "%s: the evaluation of version %d ends at layout epoch %d", self.place.device_id, version, self.epoch()
            )
            return
        if self.place.last:
            _, labels = eval_windows(self.corpus, self.run.seed, self.seq)
            loss = float(loss_sum(out, labels)) / labels.numel()
            self._note_eval(version, loss)
            return
        nxt = self.layout().stages[self.place.stage + 1].frontal[0]
        link = self.connector(nxt)
        if link is None:
            raise ConnectionError(f"{nxt} is not reachable from here")
        await link.call("eval_forward", {"version": version, "epoch": epoch}, [out], timeout=EVAL_WAIT + 60.0)

    def _note_eval(self, version: int, loss: float) -> None:
        self.eval_losses[version] = loss
        for old in sorted(self.eval_losses)[:-EVALS_KEPT]:
            del self.eval_losses[old]
        logger.info(
            "%s: held-out loss at version %d: %.4f (perplexity %.2f)",
            self.place.device_id,
            version,
            loss,
            math.exp(min(loss, 50.0)),
        )
        for cb in self.on_eval:
            cb(version, loss)

    async def on_eval_forward(self, meta, tensors, sender):
        """The previous stage's activations of the held-out windows at version `version`."""
        version = mfield(meta, "version", int)
        if self.eval_every <= 0 or not eval_due(version, self.eval_every, self.run.steps):
            raise PayloadError(f"version {version} is not one this run evaluates (--eval-every {self.eval_every})")
        if self.place.role != "frontal" or self.place.stage == 0:
            raise PayloadError(f"{self.place.device_id} is not a frontal server past stage 0")
        if len(tensors) != 1:
            raise PayloadError(f"eval_forward carries one tensor, got {len(tensors)}")
        x = tensors[0]
        want = (EVAL_ROWS, self.seq, self.cfg.hidden)
        if tuple(x.shape) != want or x.dtype != torch.float32 or not torch.isfinite(x).all():
            raise PayloadError(
                f"eval_forward activations must be finite float32 {list(want)}, got {x.dtype} {list(x.shape)}"
            )
        if version in self.evals_seen:  # (a call repeated after a lost answer)
            return {"ok": True, "duplicate": True}
        self.evals_seen.add(version)
        deadline = asyncio.get_running_loop().time() + EVAL_WAIT
        while self.version() < version:  # (this stage may be a version behind the one before it)
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise PayloadError(f"version {version} was not made here within {EVAL_WAIT:.0f} s")
            try:
                await asyncio.wait_for(self.step_event().wait(), left)
            except asyncio.TimeoutError:
                pass
        try:  # (of the sender's epoch, checked on arrival: one that began since ends it)
            await self._eval_stage(version, x, mfield(meta, "epoch", int, optional=True) or 0)
        except (ConnectionError, RemoteError, asyncio.TimeoutError) as e:
            logger.warning("%s: the evaluation of version %d stopped here: %s", self.place.device_id, version, e)
        return {"ok": True}
