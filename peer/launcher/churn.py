"""`peer swarm --churn F`: SIGKILL (and replace) a fraction F of the volunteers each step, each kill
at a random moment within the step it is meant for.

The launcher sees the run's version through the servers' DHT records, which change once per
announce period: a fast run (tiny model, steps of 0.5 s) can pass several steps between two
looks, or all of them. So the kills are timers on the event loop, not checks in the launcher's
polling loop (a kill meant for 0.3 s from now happens then, not at the next poll, which may come
after the run's end), the steps passed unseen get their share too, and the first step gets its
share as soon as every server is up."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Protocol

logger = logging.getLogger("hivepipe.swarm")


class Volunteers(Protocol):
    volunteers: dict

    def kill_volunteer(self, name: str) -> None: ...


class Churn:
    def __init__(
        self, swarm: Volunteers, fraction: float, rng: random.Random, loop: asyncio.AbstractEventLoop | None = None
    ):
        if not 0 <= fraction <= 1:
            raise ValueError(f"churn is a fraction in [0, 1], got {fraction}")
        self.swarm, self.fraction, self.rng = swarm, fraction, rng
        self.loop = loop or asyncio.get_running_loop()
        self.pending: dict[int, tuple[asyncio.TimerHandle, str]] = {}  # kill number -> (its timer, whom)
        self.scheduled = 0
        self.stopped = False

    def _count(self, n_volunteers: int) -> int:
        """Kills for one step: fraction x volunteers on average, the remainder a coin toss (40% and
        60% of 4 volunteers are 1.6 and 2.4 kills per step, not both 2)."""
        share = self.fraction * n_volunteers
        return min(n_volunteers, int(share) + (self.rng.random() < share - int(share)))

    def steps_began(self, steps: int, within: float) -> None:
        """`steps` steps' kills, each at a random moment of the next `within` seconds (the step
        expected next; steps that passed unseen put theirs there too)."""
        if self.stopped or self.fraction == 0:
            return
        for _ in range(steps):
            names = sorted(self.swarm.volunteers)
            for name in self.rng.sample(names, self._count(len(names))):
                self.scheduled += 1
                delay = self.rng.uniform(0, max(within, 0.0))
                self.pending[self.scheduled] = (self.loop.call_later(delay, self._fire, self.scheduled), name)

    def step_ended(self) -> None:
        """A kill meant for the step that just ended happens now, at its boundary: every step loses
        its share of volunteers however fast it ran."""
        for number in sorted(self.pending):
            self.pending[number][0].cancel()
            self._fire(number)

    def _fire(self, number: int) -> None:
        _, name = self.pending.pop(number)
        if self.stopped or name not in self.swarm.volunteers:
            return
        logger.info("churn: killing volunteer %s", name)
        self.swarm.kill_volunteer(name)

    def stop(self) -> None:
        """The run is over: no more kills."""
        self.stopped = True
        for handle, _ in self.pending.values():
            handle.cancel()
        self.pending.clear()
