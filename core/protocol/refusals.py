"""Why a server refused a call, as a code on the wire: clients branch on the code, never on the text.

A refusal's answer is `{"error": TEXT, "refusal": CODE}`: TEXT says it for a person (logs, the CLI),
CODE for the program. A server raises `PayloadError(text, Refusal.X)` (core/protocol/wire.py); the
caller's link raises `RemoteError` with the same code in `.refusal`. An answer without a code (a peer
of an older version, a refusal with nothing more to say) reads as BAD_REQUEST.
"""

from __future__ import annotations

import enum


class Refusal(str, enum.Enum):
    # the request itself: shape, dtype, NaN, unknown id, size, a field missing or wrong
    BAD_REQUEST = "bad_request"
    # the caller's layout epoch is older than the server's (a failover or a ban's rollback since):
    # fetch the layout again (get_layout) and retry
    STALE_EPOCH = "stale_epoch"
    # the caller's epoch is newer than the server's: that server has not adopted it yet
    FUTURE_EPOCH = "future_epoch"
    # the server does not know the caller as a volunteer of its stage (it restarted, or dropped it):
    # register, and retry once
    NOT_REGISTERED = "not_registered"
    # the caller is banned from the run (its work failed a check): final
    BANNED = "banned"
    # the caller is not on the run's --volunteers-allow list: final
    NOT_ALLOWED = "not_allowed"
    # what the call carried is already in the server's state (a batch applied, a step stepped): no
    # need to send it again
    ALREADY_APPLIED = "already_applied"
    # the server failed on it (a bug of its own): the caller did nothing wrong
    INTERNAL = "internal"

    @classmethod
    def of(cls, value: object) -> "Refusal":
        """The code of an answer's `refusal` field; BAD_REQUEST when absent or not one of ours."""
        try:
            return cls(value)
        except ValueError:
            return cls.BAD_REQUEST

    @property
    def final(self) -> bool:
        """A refusal that no retry, layout or registration will change."""
        return self in (Refusal.BANNED, Refusal.NOT_ALLOWED)
