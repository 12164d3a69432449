"""The one table of RPC methods a parameter server offers, with what the rest of the system needs
to know of each: whether it belongs to a layout epoch, whether a caller may repeat it after a lost
answer, whether it changes server state (and so is written to the request log), and who may call
it. The servicer, the client link and the retry policy all read this table; a method is added here
or nowhere."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    epoched: bool  # carries the caller's layout epoch; refused from an older one
    retry: bool  # safe to repeat when the answer was lost (credits, relays, ledger entries de-duplicate)
    logged: bool  # changes the server's state: written to its request log, replayed after a restart
    caller: str  # "client" (a registered worker), "server" (of the run), or "anyone"
    # hands the server a task's result: accepted only from a holder of that task's lease, for the task's
    # own rows and version (a client: the lease ticket that came with `take`, core/protocol/leases.py;
    # `complete`: the pool's own record of who held it); from anyone else refused, changing nothing
    leased: bool = False
    # not epoched, but a caller of an epoch may name it: answered from that epoch's lineage (a version
    # read from a host that adopted a rollback is the re-made one, see on_get_params)
    epoch_optional: bool = False


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("register", epoched=False, retry=True, logged=False, caller="anyone"),
        # a lost `take` answer is a lease that will expire: not repeated
        Method("take", epoched=True, retry=False, logged=False, caller="client"),
        Method("complete", epoched=True, retry=True, logged=True, caller="client", leased=True),
        Method("fail", epoched=True, retry=True, logged=False, caller="client"),
        Method("get_params", epoched=False, retry=True, logged=False, caller="anyone", epoch_optional=True),
        Method("push_grads", epoched=True, retry=True, logged=True, caller="client", leased=True),
        Method("push_inputs", epoched=True, retry=True, logged=True, caller="server"),
        Method("get_inputs", epoched=True, retry=True, logged=False, caller="client"),
        Method("push_input_grads", epoched=True, retry=True, logged=True, caller="client", leased=True),
        Method("push_outputs", epoched=True, retry=True, logged=True, caller="client", leased=True),
        Method("push_output_grads", epoched=True, retry=True, logged=True, caller="server"),
        Method("ping", epoched=False, retry=True, logged=False, caller="anyone"),
        Method("status", epoched=False, retry=True, logged=False, caller="anyone"),
        # a copy of the lineage a ban's rollback undid is refused where the rollback is adopted
        Method("push_replica", epoched=True, retry=True, logged=False, caller="server"),
        Method("adopt_epoch", epoched=False, retry=True, logged=False, caller="server"),
        Method("get_layout", epoched=False, retry=True, logged=False, caller="anyone"),
        # checked work (parameter_server/verify.py): the rows a re-run needs, a caught cheater reported to
        # the run's coordinator, and its ban on every server (the rollback travels as adopt_epoch)
        Method("get_held", epoched=True, retry=True, logged=False, caller="server"),
        Method("report_cheat", epoched=False, retry=True, logged=False, caller="server"),
        Method("ban", epoched=False, retry=True, logged=False, caller="server"),
        # the oldest batch a server's volunteers on probation sent work of: every server keeps its version
        Method("pin", epoched=False, retry=True, logged=False, caller="server"),
        # done tasks whose results never reached the server asking: queued again (parameter_server/rescue.py)
        Method("requeue_missing", epoched=True, retry=True, logged=False, caller="server"),
        # a batch's gradient sums of squares, slot by slot, for global norm clipping (parameter_server/clipping.py)
        Method("grad_norm", epoched=False, retry=True, logged=False, caller="server"),
        # the held-out windows' activations at an evaluated version, on to the next stage (parameter_server/evaluate.py)
        Method("eval_forward", epoched=True, retry=True, logged=False, caller="server"),
    )
}

NAMES = tuple(METHODS)
EPOCHED = frozenset(n for n, m in METHODS.items() if m.epoched)
# what a server's own calls (checks, rescues, clipping) stamp with its layout epoch unless they name one
STAMPED = frozenset(n for n, m in METHODS.items() if m.epoched or m.epoch_optional)
LOGGED = frozenset(n for n, m in METHODS.items() if m.logged)
NOT_RETRIED = frozenset(n for n, m in METHODS.items() if not m.retry)
LEASED = frozenset(n for n, m in METHODS.items() if m.leased)
SERVER_ONLY = frozenset(n for n, m in METHODS.items() if m.caller == "server")
# what travels compressed under a run's --compress (core/protocol/codecs.py): activations, their gradients
# and gradient pushes; parameters, replicas and the rows a check reads stay exact
COMPRESSED_REQUESTS = frozenset({"push_outputs", "push_inputs", "push_input_grads", "push_output_grads", "push_grads"})
COMPRESSED_ANSWERS = frozenset({"take", "get_inputs"})
# what a banned volunteer may still call: reads that change nothing
OPEN = frozenset({"get_params", "ping", "status", "get_layout"})
