"""What a server says of the run: the last loss, seconds per step and the time left (its progress
line), the loss at the end, and the run's summary file (a part of peer.host.server.ServerHost, given
the server and the directory it reads)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("hivepipe.serve")


class RunReport:
    """The run as server `device` sees it: its own shard and the records of the others."""

    def __init__(self, server, directory, run_cfg, cfg, device: str, peer_id: str):
        self.server, self.directory, self.run_cfg, self.cfg = server, directory, run_cfg, cfg
        self.device, self.peer_id = device, peer_id
        self.stage, self.role = server.stage, server.role

    def loss_at_end(self) -> float | None:
        """The last batch's loss per token (None while it is not known here)."""
        latest = self.latest_loss()
        return latest[1] if latest is not None and latest[0] == self.run_cfg.steps - 1 else None

    def latest_loss(self) -> tuple[int, float] | None:
        """(batch, loss per token) of the newest batch whose loss is known here: the last stage's own,
        or a last-stage server's record."""
        if self.server.last:
            sums = dict(self.server.shard.losses)
        else:
            last_stage = set(self.server.layout.stages[-1].servers)
            sums = {}
            for r in self.directory.records.values():
                if r.get("kind") == "server" and r.get("device") in last_stage:
                    sums.update({int(k): v for k, v in (r.get("losses") or {}).items()})
        if not sums:
            return None
        batch = max(sums)
        return batch, sums[batch] / (self.run_cfg.batch_size * self.cfg.seq_len)

    def seconds_per_step(self) -> float | None:
        """Seconds per version over this server's last versions (their wall times), None before two."""
        times = sorted(self.server.report.step_times.items())
        if len(times) < 2 or times[-1][1] <= times[0][1]:
            return None
        return (times[-1][1] - times[0][1]) / (times[-1][0] - times[0][0])

    def write_summary(self, checkpoint_dir: str | None) -> str | None:
        """At the run's end: `DEVICE.run-summary.json` in `checkpoint_dir` (peer.summary_cmd,
        `peer summary`), where it outlasts the run's records; its path (None without a folder)."""
        from peer.summary_cmd import write_summary

        if not checkpoint_dir:
            return None
        server, loss, per_step = self.server, self.latest_loss(), self.seconds_per_step()
        evals = server.evaluation.eval_losses
        servers = set(self.directory.known.values()) | {self.peer_id}
        summary = {
            "run_id": self.run_cfg.run_id,
            "device": self.device,
            "stage": self.stage,
            "role": self.role,
            "last_stage": server.last,
            "steps": self.run_cfg.steps,
            "version": server.version,
            "finished_at": time.time(),
            "loss": loss[1] if loss else None,
            "loss_batch": loss[0] if loss else None,
            "eval_loss": evals[max(evals)] if evals else None,
            "eval_version": max(evals) if evals else None,
            "tokens_per_second": self.run_cfg.batch_size * self.cfg.seq_len / per_step if per_step else None,
            "microbatches_applied": min(sh.microbatches_applied for sh in server.hosted.values()),
            "volunteers": server.contributions.table(server.bans.banned, servers),
        }
        try:
            return write_summary(checkpoint_dir, self.device, summary)
        except OSError as e:  # (the run is over: say it, do not fail the exit for it)
            logger.warning("%s: could not write its run summary: %s", self.device, e)
            return None

    def progress_text(self) -> str:
        """What the progress line says: step/steps, the last loss, tokens/s and the time left over
        this server's last versions, the volunteers registered here."""
        from core.protocol.values import format_duration

        server, steps = self.server, self.run_cfg.steps
        parts = [f"step {server.version}/{steps}"]
        loss = self.latest_loss()
        if loss is not None:
            parts.append(f"loss {loss[1]:.4f}")
        per_step = self.seconds_per_step()
        if per_step is not None:
            parts.append(f"{self.run_cfg.batch_size * self.cfg.seq_len / per_step:,.0f} tokens/s")
            parts.append(f"about {format_duration(max(0, steps - server.version) * per_step)} left")
        servers = set(self.directory.servers.values()) | {self.peer_id}
        parts.append(f"{len(set(server.clients) - servers)} volunteers here")
        return ", ".join(parts)
