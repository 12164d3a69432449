"""A discrete-event core: simulated time, a queue of what happens when, and processes written as
generators that yield either a delay in seconds or a predicate on the simulated state (resumed once
it holds, after `changed()` says the state moved). The step model (scheduler/stepsim.py) plays the
swarm's protocol on it."""

from __future__ import annotations

import heapq
import itertools


class Events:
    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self._waiting: list = []  # (predicate, generator) of processes waiting on the state

    def at(self, t: float, fn, *args) -> None:
        """Call `fn(*args)` at simulated time `t`."""
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def start(self, gen) -> None:
        """Run the process `gen` from now."""
        self._step(gen, None)

    def _step(self, gen, _value) -> None:
        try:
            what = next(gen)
        except StopIteration:
            return
        if isinstance(what, (int, float)):
            self.at(self.now + max(float(what), 0.0), self._step, gen, None)
        else:  # a predicate on the state: resumed once it holds
            if what():
                self.at(self.now, self._step, gen, None)
            else:
                self._waiting.append((what, gen))

    def changed(self) -> None:
        """The state changed: resume the processes whose condition now holds."""
        still = []
        for pred, gen in self._waiting:
            if pred():
                self.at(self.now, self._step, gen, None)
            else:
                still.append((pred, gen))
        self._waiting = still

    def run(self, done, limit: float = 1e6) -> None:
        """Happen, in time order, until `done()` or nothing is left to happen or time passes `limit`."""
        while self._heap and not done():
            t, _, fn, args = heapq.heappop(self._heap)
            if t > limit:
                break
            self.now = t
            fn(*args)
