"""`peer join`: a volunteer. It finds the run in the DHT, picks a stage (`auto`: measured links and
the planner's rule), registers its compute power with the stage's servers, downloads the stage's
parameters, and pulls tasks until stopped or killed."""

from __future__ import annotations

import logging

from peer.errors import UsageError, check_identity_path
from peer.runtime import add_common_arguments, check_common, run_until_signalled

logger = logging.getLogger("hivepipe.join")


def add_arguments(p) -> None:
    p.add_argument(
        "--stage",
        default="auto",
        help="'auto' (the stage whose predicted step time improves most with this volunteer, by the "
        "planner's cost model; re-checked every --rebalance-period) or a stage index",
    )
    p.add_argument("--device-id", default=None, help="this volunteer's id (in --link-profile); default: a fresh one")
    p.add_argument("--probe-bytes", type=int, default=1 << 20, help="payload of the bandwidth probe")
    p.add_argument("--compute", type=float, default=None, help="override the measured compute power (rows/s)")
    p.add_argument(
        "--no-param-deltas",
        action="store_true",
        help="pull every parameter version whole (default: as its exact difference from the version held "
        "before it where the server finds that smaller; docs/scale.md)",
    )
    p.add_argument(
        "--rebalance-period",
        type=float,
        default=60.0,
        help="with --stage auto: seconds between checks whether another stage needs this volunteer "
        "more (0: never move)",
    )
    p.add_argument(
        "--identity-path",
        default=None,
        metavar="PATH",
        help="keep this volunteer's libp2p key here (made if missing): the same peer id on every start, "
        "for runs that admit only listed volunteers (`peer serve --volunteers-allow`)",
    )
    p.add_argument(
        "--die-at",
        default=None,
        metavar="POINT",
        help="fault injection for tests: SIGKILL this volunteer at the first POINT of the protocol "
        "(before_forward, during_forward, after_outputs, during_backward, after_input_grads, "
        "mid_grad_push, after_grad_push, pulling_params)",
    )
    p.add_argument(
        "--cheat",
        default=None,
        metavar="KIND[@AFTER][/EVERY]",
        help="TEST TOOL, never for real runs: after AFTER honest tasks (default 0) hand in wrong results "
        "(with /EVERY: on one task in EVERY only) "
        "(scale: x1e4, signflip, noise: +0.1 x RMS, zeros, bias: +3e-4 of the norm on one value, relay: "
        "input gradients x100 and the task handed back, unsent: forward tasks handed in without their outputs, support: noise under the tolerance "
        "on gradient coordinates that are zero, creep: every result x (1 + 1e-4)) to exercise the servers' checks; the "
        "servers ban such a volunteer",
    )
    add_common_arguments(p)


def check(args) -> None:
    """Every argument of `peer join` checked, and --cheat parsed; raises UsageError naming the bad one."""
    check_common(args)
    if args.stage != "auto":
        try:
            stage = int(args.stage)
        except ValueError:
            raise UsageError(f"--stage must be 'auto' or a stage index, got {args.stage!r}") from None
        if stage < 0:
            raise UsageError(f"--stage must be >= 0, got {stage}")
    from peer.volunteer.faults import KILL_POINTS

    if args.die_at is not None and args.die_at not in KILL_POINTS:
        raise UsageError(f"--die-at {args.die_at!r}: choose from {', '.join(KILL_POINTS)}")
    if args.cheat is not None:
        from peer.volunteer.cheat import Cheat

        try:
            args.cheat = Cheat.parse(args.cheat)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.compute is not None and args.compute <= 0:
        raise UsageError("--compute must be positive")
    if args.rebalance_period < 0:
        raise UsageError(f"--rebalance-period must be >= 0 seconds, got {args.rebalance_period}")
    if args.probe_bytes < 4:
        raise UsageError(f"--probe-bytes must be >= 4, got {args.probe_bytes}")
    check_identity_path(args.identity_path)
    if not args.initial_peers:
        raise UsageError("--initial-peers is required: the initial_peers= line printed by `peer serve` or `peer swarm`")


def run(args) -> int:
    check(args)
    import secrets

    from peer.host.state import PeerState, StateLine

    device = args.device_id or f"v-{secrets.token_hex(3)}"
    state = StateLine(device)
    # said before torch and hivemind are imported (seconds): the first line comes at once
    state.say(PeerState.STARTING, f"joining run {args.run_id}{'@' + args.run_fp if args.run_fp else ''}")
    from peer.host.volunteer import VolunteerSession
    from peer.lifetime import watch_parent

    watch_parent(args.parent_pid)
    return run_until_signalled(lambda stop: VolunteerSession(args, device, state).run(stop))
