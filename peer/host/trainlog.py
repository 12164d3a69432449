"""A server's training log for a practitioner's tools (`--log-dir DIR`): one row a version this server
makes, in DIR/train.csv and, where the `tensorboard` package (or tensorboardX) is installed, as
TensorBoard scalars in DIR (event files written by tensorboardX: `pip install -e ".[logs]"`), under
the same names.

Columns: step (the version made), loss (the batch's mean token loss: known on the last stage, whose
servers hold the labels; empty elsewhere), val_loss (the held-out loss of that version, --eval-every:
a row of its own on the last stage's first frontal server, which computes it), lr (the schedule's rate of that update), grad_norm (the
batch gradient's global norm before clipping, with --clip-grad-norm; empty otherwise), tokens_per_s
(the batch's tokens over the time since the version before), volunteers (clients registered here),
tasks (tasks done here so far), bans (volunteers banned from the run). `peer swarm` gives its last
stage's first frontal server `--log-dir WORK_DIR/logs`."""

from __future__ import annotations

import csv
import logging
import os
import time

logger = logging.getLogger("hivepipe.serve")

COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "volunteers", "tasks", "bans")


def _summary_writer(directory: str):
    """tensorboardX's writer of TensorBoard event files (the `logs` extra), or None without it."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(directory)


class TrainingLog:
    def __init__(self, directory: str, server, clock=time.time):
        os.makedirs(directory, exist_ok=True)
        self.server, self.clock = server, clock
        self.path = os.path.join(directory, "train.csv")
        fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        self._file = open(self.path, "a", newline="")
        self._csv = csv.writer(self._file)
        if fresh:
            self._csv.writerow(COLUMNS)
            self._file.flush()
        self.tensorboard = _summary_writer(directory)
        if self.tensorboard is None:
            logger.warning('--log-dir: no TensorBoard writer (pip install -e ".[logs]"): %s only', self.path)
        self.recipe = server.run.training_recipe()
        self.tokens = server.run.batch_size * server.cfg.seq_len
        self._last: tuple[int, float] | None = None
        self.written: set[int] = set()

    def row(self, version: int) -> dict:
        s, t = self.server, version - 1
        loss = s.shard.losses.get(t) if s.last else None
        now = self.clock()
        rate = None
        if self._last is not None and self._last[0] == version - 1 and now > self._last[1]:
            rate = self.tokens / (now - self._last[1])
        self._last = (version, now)
        servers = set(s.directory.devices)
        return {
            "step": version,
            "loss": None if loss is None else loss / self.tokens,
            "val_loss": None,
            "lr": self.recipe.lr_at(t, s.run.steps),
            "grad_norm": s.clipping.grad_norms.get(t),
            "tokens_per_s": rate,
            "volunteers": sum(1 for p in s.clients if p != s.peer_id and p not in servers),
            "tasks": sum(c.tasks_done for c in s.clients.values()),
            "bans": len(s.bans.banned),
        }

    def on_step(self, version: int) -> None:
        """Write the row of `version` (once: a re-run after a failover makes a version again)."""
        if version in self.written:
            return
        self.written.add(version)
        row = self.row(version)
        self._csv.writerow(["" if row[c] is None else row[c] for c in COLUMNS])
        self._file.flush()
        if self.tensorboard is not None:
            for name in COLUMNS[1:]:
                if row[name] is not None:
                    self.tensorboard.add_scalar(f"train/{name}", row[name], version)
            self.tensorboard.flush()

    def on_eval(self, version: int, loss: float) -> None:
        """A held-out loss (--eval-every): a row of its own, with the step and val_loss only."""
        self._csv.writerow([version if c == "step" else loss if c == "val_loss" else "" for c in COLUMNS])
        self._file.flush()
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("train/val_loss", loss, version)
            self.tensorboard.flush()

    def close(self) -> None:
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
