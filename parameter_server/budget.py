"""The bytes of requests a server holds before it has answered them, bounded per peer and in all.

A request's messages are read into memory as they arrive (hivemind reads each one whole), and a
request is bounded (a server's by `--max-request-bytes`, any other peer's by the largest request a
volunteer sends: `client_request_bytes` below); but nothing bounded how many of them one peer keeps
unfinished: one outsider session holding 64 unfinished 14 MiB requests open grew a server by 1.0 GiB
(three sessions: 2.3 GiB). Every request of a peer that is not one of the run's servers takes its
bytes from this budget as they arrive and gives them back once it is answered (or cut); a message
that would take a peer past `per_peer`, or all peers past `total`, ends its request with an error
that names the limit, and the bytes it held are given back at once. The run's servers (replicas,
relays, epochs) are not counted: they are the operator's own."""

from __future__ import annotations

from core.protocol.wire import PayloadError

PEER_REQUESTS = 2  # a volunteer may hold this many of its largest requests' worth of bytes unanswered
TOTAL_REQUESTS = 8  # and all of them together this many of a server's largest (a replica's)


class RequestBudget:
    """Bytes of unanswered requests, per peer and in all, under `per_peer` and `total`."""

    def __init__(self, per_peer: int, total: int):
        if per_peer <= 0 or total < per_peer:
            raise ValueError(f"a request budget needs 0 < per_peer <= total, got {per_peer} and {total}")
        self.per_peer, self.total = per_peer, total
        self.held: dict[str, int] = {}
        self.in_all = 0
        self.refused = 0  # requests ended for the budget

    @classmethod
    def for_requests(cls, client_request_bytes: int, max_request_bytes: int) -> "RequestBudget":
        """A volunteer's share sized by the largest request a volunteer sends (a gradient push of the
        stage: two pushes in flight at once, as a worker's flush and a re-run's push may be); the
        total by a server's largest (a replica), as before."""
        return cls(PEER_REQUESTS * client_request_bytes, TOTAL_REQUESTS * max(client_request_bytes, max_request_bytes))

    def take(self, peer: str, n: int) -> None:
        """Count `n` more bytes held for `peer`; PayloadError (nothing counted) past either limit."""
        mine = self.held.get(peer, 0)
        if mine + n > self.per_peer:
            self.refused += 1
            raise PayloadError(
                f"peer {peer[-8:]} holds {mine + n} bytes of unanswered requests here, over the "
                f"{self.per_peer} one peer may: finish or cancel the ones in flight first"
            )
        if self.in_all + n > self.total:
            self.refused += 1
            raise PayloadError(
                f"this server holds {self.in_all + n} bytes of unanswered requests, over its "
                f"{self.total}: try again shortly"
            )
        self.held[peer] = mine + n
        self.in_all += n

    def give(self, peer: str, n: int) -> None:
        """Give back `n` bytes `peer` held (its request answered or cut)."""
        if n <= 0:
            return
        left = self.held.get(peer, 0) - n
        if left > 0:
            self.held[peer] = left
        else:
            self.held.pop(peer, None)
        self.in_all = max(0, self.in_all - n)


def default_max_request_bytes(stage_params: dict, rows: int, cfg) -> int:
    """The largest request a server of this stage needs, with room to spare: a replica of the whole
    stage's shard (parameters and AdamW's two moments, fp32), or a micro-batch's activations and
    their gradients, plus 16 MiB for metadata and framing."""
    stage_bytes = sum(t.numel() for t in stage_params.values()) * 4
    activations = rows * cfg.seq_len * max(cfg.hidden, cfg.vocab_size) * 4
    return 3 * stage_bytes + 2 * activations + (16 << 20)


def client_request_bytes(stage_params: dict, rows: int, cfg) -> int:
    """The largest request a volunteer sends a server of this stage: a gradient push of every slot of
    the stage in fp32 (after failovers one server may host them all) or a micro-batch's activations and
    their gradients, plus 4 MiB for its task list and framing. A third of a server's own bound (no
    AdamW moments: replicas travel only between servers)."""
    stage_bytes = sum(t.numel() for t in stage_params.values()) * 4
    activations = rows * cfg.seq_len * max(cfg.hidden, cfg.vocab_size) * 4
    return max(stage_bytes, 2 * activations) + (4 << 20)
