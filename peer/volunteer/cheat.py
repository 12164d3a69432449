"""A volunteer that lies, for tests and benchmarks of the servers' checks (`peer join --cheat
KIND[@AFTER][/EVERY]`): after AFTER honest tasks, every result it hands in (a forward task's outputs, an
input gradient, its parameter gradients and loss) is corrupted the same way, or with /EVERY only the
results of one task in EVERY (the first after AFTER, then every EVERY-th: a patient liar); `relay` sends
only a task's input gradient (x100) and hands the task back, so that no gradient push of its own would
check it; `unsent` hands its forward tasks in as done without pushing their outputs; `support` adds
noise under the checks' tolerance (5e-4 of the norm) on 200 coordinates of each gradient whose true
value is zero (an embedding row of a token not in the batch: AdamW would move each by about a
learning-rate step); `creep` scales every result by 1 + 1e-4, under the tolerance and along the result
itself.
Not a feature for users."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("hivepipe.worker")

KINDS = ("scale", "signflip", "noise", "zeros", "bias", "relay", "unsent", "support", "creep")
SCALE = 1e4  # "multiplies its gradients by 1e4"
CREEP = 1e-4  # "scales every result by 1 + 1e-4": under the tolerance, in the result's own direction
BIAS = 3e-4  # "biases one coordinate by 3e-4 of its result's norm": under the checks' 1e-3 tolerance
NOISE = 0.1  # Gaussian noise of 0.1 x the tensor's RMS: a relative L2 error of about 0.1
RELAY = 100.0  # "sends its input gradient x100 ... then hands the task back"
SUPPORT_NOISE, SUPPORT_COORDS = 5e-4, 200  # "noise under the 1e-3 tolerance on 200 ... coordinates"


@dataclass
class Cheat:
    kind: str
    after: int = 0  # honest tasks before the lies start
    seed: int = 0
    every: int = 1  # from then on, lie on one task in `every`
    said: bool = field(default=False, repr=False, compare=False)  # the first lie was logged

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> "Cheat":
        """'scale', 'noise@12', 'signflip@12/20' -> Cheat; ValueError naming what is wrong."""
        head, _, every = text.partition("/")
        kind, _, after = head.partition("@")
        if kind not in KINDS:
            raise ValueError(f"--cheat {text!r}: kind must be one of {', '.join(KINDS)}")
        if after and not after.isdigit():
            raise ValueError(f"--cheat {text!r}: AFTER must be a count of honest tasks (an integer >= 0)")
        if "/" in text and not (every.isdigit() and int(every) >= 1):
            raise ValueError(f"--cheat {text!r}: EVERY must be a count of tasks (an integer >= 1)")
        return cls(kind, int(after or 0), seed, int(every or 1))

    def active(self, tasks_done: int) -> bool:
        """Whether the task after `tasks_done` finished ones is a lie."""
        return tasks_done >= self.after and (tasks_done - self.after) % self.every == 0

    def tensor(self, t: "torch.Tensor") -> "torch.Tensor":
        import torch  # (here: `peer join` parses --cheat before torch is imported)

        if self.kind == "scale":
            return t * SCALE
        if self.kind == "relay":
            return t * RELAY
        if self.kind == "creep":
            return t * (1 + CREEP)
        if self.kind in ("unsent", "support"):
            return t
        if self.kind == "signflip":
            return -t
        if self.kind == "zeros":
            return torch.zeros_like(t)
        if self.kind == "bias":  # (where the value is not zero: a lie there is `support`'s, checked apart)
            out = t.clone()
            if out.view(-1)[0] != 0:
                out.view(-1)[0] += BIAS * float(torch.linalg.vector_norm(t.float()))
            return out
        gen = torch.Generator().manual_seed(self.seed)
        self.seed += 1
        rms = t.float().pow(2).mean().sqrt()
        return t + NOISE * rms * torch.randn(t.shape, generator=gen, dtype=t.dtype)

    def gradient(self, g: "torch.Tensor") -> "torch.Tensor":
        """A parameter gradient as handed in: `tensor`'s lie, or for `support` the noise on zeros."""
        if self.kind != "support":
            return self.tensor(g)
        import torch

        zero = (g.flatten() == 0).nonzero().flatten()
        if zero.numel() == 0:
            return g
        gen = torch.Generator().manual_seed(self.seed)
        self.seed += 1
        pick = zero[torch.randperm(zero.numel(), generator=gen)[:SUPPORT_COORDS]]
        signs = torch.randint(0, 2, (pick.numel(),), generator=gen).to(g.dtype) * 2 - 1
        out = g.clone().flatten()
        out[pick] = signs * SUPPORT_NOISE * float(torch.linalg.vector_norm(g.float())) / pick.numel() ** 0.5
        return out.view_as(g)

    def loss(self, x: float | None) -> float | None:
        if x is None:
            return None
        if self.kind in ("bias", "relay", "unsent", "support"):
            return x
        return {"scale": x * SCALE, "signflip": -x, "zeros": 0.0, "creep": x * (1 + CREEP)}.get(
            self.kind, x * (1 + NOISE)
        )

    def lies_now(self, tasks_done: int, device_id: str, batch: int | None = None) -> bool:
        """Whether the task after `tasks_done` finished ones is a lie (said once, when the lies start)."""
        lying = self.active(tasks_done)
        if lying and not self.said:
            self.said = True
            logger.warning(
                "%s: cheat %s: handing in wrong results from task %d (batch %s) on%s",
                device_id,
                self.kind,
                tasks_done + 1,
                batch,
                f", one task in {self.every}" if self.every > 1 else "",
            )
        return lying

    def corrupt(self, gin, grads: dict, loss):
        """A task's input gradient (or None), parameter gradients and loss, as this liar hands them in."""
        return (
            None if gin is None else self.tensor(gin),
            {n: self.gradient(g) for n, g in grads.items()},
            self.loss(loss),
        )
