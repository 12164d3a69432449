"""Fault injection for the tests: where `peer join --die-at POINT` SIGKILLs a volunteer, apart from
the worker so that `peer join` checks the flag before torch is imported (each is a point of the
protocol where a death must still leave every micro-batch applied exactly once), and the death itself,
which `peer serve --die-at-version` uses too."""

import os
import signal

KILL_POINTS = (
    "before_forward",
    "during_forward",
    "after_outputs",
    "during_backward",
    "after_input_grads",
    "mid_grad_push",
    "after_grad_push",
    "pulling_params",
)


def die_here() -> None:
    """SIGKILL this process and its group (its DHT process and p2p daemon), as a crash would."""
    os.killpg(os.getpgrp(), signal.SIGKILL)
