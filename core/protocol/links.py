"""Link and compute emulation (DESIGN.md, "Testing on one machine"): a link profile (a cluster
file of docs/cost-model.md) gives the one-way delay and bandwidth between two devices, and
every send sleeps `delay + bytes / bandwidth` before it goes out, the way netem would delay it.
The cluster is anything with `delay`, `bandwidth`, ids and flops (scheduler.Cluster); reading the
file is the caller's (peer/runtime.py), so this floor does not import the planner."""

from __future__ import annotations

import asyncio


class LinkEmulator:
    def __init__(self, cluster=None, own_device: str | None = None, scale: float = 1.0):
        self.cluster = cluster
        self.own = own_device
        self.scale = scale  # shrink all emulated times (benchmarks run scaled-down clusters)

    def seconds(self, dst_device: str | None, nbytes: int) -> float:
        if self.cluster is None or self.own is None or dst_device is None or dst_device == self.own:
            return 0.0
        try:
            delay = self.cluster.delay(self.own, dst_device)
            bandwidth = self.cluster.bandwidth(self.own, dst_device)
        except (KeyError, ValueError):
            return 0.0  # a device the profile does not know: an unshaped link
        return self.scale * (delay + nbytes / bandwidth)

    async def send(self, dst_device: str | None, nbytes: int) -> None:
        s = self.seconds(dst_device, nbytes)
        if s > 0:
            await asyncio.sleep(s)

    def compute_slowdown(self) -> float:
        """How many times slower than the profile's fastest device this device computes (>= 1)."""
        if self.cluster is None or self.own is None:
            return 1.0
        flops = dict(zip(self.cluster.reliable_ids, self.cluster.reliable_flops))
        flops.update(zip(self.cluster.unreliable_ids, self.cluster.unreliable_flops))
        if self.own not in flops:
            return 1.0
        return max(max(flops.values()) / flops[self.own], 1.0)
