"""Lease tickets: what binds a result to the lease of the task it answers.

A server that leases a task hands its client a ticket, an HMAC over (task id, client's peer id, the
lease's attempt, the layout epoch) under a key every server of the run derives from the run key (and
nobody else can). Every method that hands a server a result (outputs, input gradients, a gradient
push with its loss) carries the ticket of each task it answers, and the receiving server, which is
often not the one that leased the task, checks it against the caller's peer id (libp2p authenticates
it): a result is accepted only from a client that holds or held a lease of that very task, in this
layout epoch. An outsider, a registered stranger and a volunteer answering another's task hold no
such ticket. A re-issued lease of the same task gets a ticket of its own (another attempt), so both
holders may answer and the first answer counts; the second is dropped as a duplicate.

The ticket says who may answer, not that the answer is right: checked work (parameter_server/verify.py)
does that."""

from __future__ import annotations

import hashlib
import hmac

import msgpack

from core.protocol.wire import PayloadError

LABEL = b"hivepipe lease tickets"
MAC_HEX = 32  # 128 bits of HMAC-SHA256: forging one is a 2^128 guess
MAX_TICKET = 64  # characters: "<attempt>.<epoch>.<mac>"
MAX_COMPLETE = 1024  # task ids one `complete` (or a take's or heartbeat's 'complete' field) may carry


class LeaseTickets:
    """Issues and checks the tickets of one run (the key: `SigningKey.derive(LABEL)` of the run key)."""

    def __init__(self, key: bytes):
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("a lease ticket key is at least 16 bytes")
        self._key = key

    @classmethod
    def of_run_key(cls, run_key) -> "LeaseTickets":
        return cls(run_key.derive(LABEL))

    def _mac(self, task_id: str, client: str, attempt: int, epoch: int) -> str:
        payload = msgpack.packb([task_id, client, attempt, epoch])
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()[:MAC_HEX]

    def issue(self, task_id: str, client: str, attempt: int, epoch: int) -> str:
        return f"{int(attempt)}.{int(epoch)}.{self._mac(task_id, client, int(attempt), int(epoch))}"

    def check(self, ticket, task_id: str, client: str, epoch: int) -> int:
        """The attempt of the lease `ticket` proves `client` holds (or held) of `task_id` in layout
        epoch `epoch`; PayloadError saying what is wrong otherwise."""
        if ticket is None:
            raise PayloadError(
                f"no lease ticket for task {task_id}: a result is accepted only from the holder "
                "of the task's lease (its ticket comes with `take`)"
            )
        parts = ticket.split(".") if isinstance(ticket, str) and len(ticket) <= MAX_TICKET else []
        if len(parts) != 3 or not all(p.isdigit() for p in parts[:2]):
            raise PayloadError(f"malformed lease ticket for task {task_id}: expected <attempt>.<epoch>.<mac>")
        attempt, ticket_epoch, mac = int(parts[0]), int(parts[1]), parts[2]
        if ticket_epoch != epoch:
            raise PayloadError(f"the lease of task {task_id} is of layout epoch {ticket_epoch}, the run is at {epoch}")
        if not hmac.compare_digest(mac, self._mac(task_id, client, attempt, epoch)):
            raise PayloadError(f"{client[-8:]} holds no lease of task {task_id}")
        return attempt
