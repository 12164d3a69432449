"""A stage server's RPC surface: every call arrives as a stream (`rpc_<method>`, or one call of a
session, `rpc_session`), is counted, bounded (a stranger's request by the request budget and the
volunteer bound, refused while its bytes arrive), decoded, checked for the caller's right and the
layout epoch, and dispatched to the server's `on_<method>` handler; a refusal changes nothing and is
answered with its code (core/protocol/refusals.py). A part of a server, built with what it reads of
it (parameter_server/parts.py); the server's `rpc_*` methods, which hivemind's servicer finds, hand
each stream to it (service.py)."""

from __future__ import annotations

import logging
from typing import AsyncIterator, Awaitable, Callable

from hivemind.p2p import P2PContext
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse

from core.protocol import methods, session
from core.protocol.refusals import Refusal
from core.protocol.tasks import batch_of
from core.protocol.traffic import CALLS, SESSION_CALLS, TRAFFIC, VALUES
from core.protocol.wire import STALL_SECONDS, PayloadError, StreamCut, pack, refusal_answer, refused, unpack
from taskpool import TaskPoolError

logger = logging.getLogger("hivepipe.server")


def _batch_of(meta: dict) -> int:
    """The batch a logged request concerns (for compacting the request log)."""
    if isinstance(meta.get("batch"), int):
        return meta["batch"]
    return batch_of(meta.get("task")) or 0


class RpcSurface:
    """A server's calls in and answers out, given what they read of it: `device_id`, `compress` (the
    run's wire codec), `links` (answers go back over a caller's emulated link), the request bounds
    (`request_budget` for strangers, `max_request_bytes` for servers, `max_client_request_bytes` for
    volunteers), `counters`, its `directory`, `checks` and `arrivals`; `handler_of(method)` (the
    method's `on_*`), `device_of(peer)`; as they are now: `log()` (the request log, or None) and
    `replaying()`."""

    def __init__(
        self,
        *,
        device_id: str,
        compress: str,
        links,
        request_budget,
        max_request_bytes: int,
        max_client_request_bytes: int,
        counters: dict,
        directory,
        checks,
        arrivals,
        handler_of: Callable[[str], Callable[..., Awaitable]],
        device_of: Callable[[str], str | None],
        log: Callable[[], object],
        replaying: Callable[[], bool],
    ) -> None:
        self.device_id, self.compress, self.links, self.request_budget = device_id, compress, links, request_budget
        self.max_request_bytes, self.max_client_request_bytes = max_request_bytes, max_client_request_bytes
        self.counters, self.directory, self.checks, self.arrivals = counters, directory, checks, arrivals
        self.handler_of, self.device_of, self.log, self.replaying = handler_of, device_of, log, replaying

    async def rpc_session(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertRequest]:
        """Calls multiplexed over one stream (core/protocol/session.py), each served as `rpc_<method>`
        serves a stream call of its own."""

        def run_call(method: str, messages: AsyncIterator[ExpertRequest]):
            SESSION_CALLS[method] += 1
            return self.serve(method, messages, context, answer_type=ExpertRequest)

        async for message in session.serve(requests, run_call, self.request_limit(str(context.remote_id))):
            yield message

    def request_limit(self, peer: str) -> int:
        """The largest request `peer` may send: a server's replicas, or what a volunteer sends."""
        return self.max_request_bytes if self.directory.is_server(peer) else self.max_client_request_bytes

    async def serve(
        self, method: str, requests: AsyncIterator[ExpertRequest], context: P2PContext, answer_type=ExpertResponse
    ):
        peer = str(context.remote_id)
        budget = None if self.directory.is_server(peer) else self.request_budget
        held = [0]  # bytes of this request counted in the budget, given back once it is answered

        async def counted():
            async for message in requests:
                n = message.ByteSize()
                TRAFFIC[f"{method}.request"] += n
                if budget is not None:
                    budget.take(peer, n)
                    held[0] += n
                yield message

        CALLS[method] += 1
        try:
            async for message in self._serve_counted(method, counted(), peer, answer_type):
                yield message
        finally:
            if budget is not None:
                budget.give(peer, held[0])

    async def _serve_counted(self, method: str, requests: AsyncIterator, peer: str, answer_type):
        """Read the request, run it, and yield its answer's messages."""
        try:
            # a request beyond the limit is refused while its bytes arrive, before any tensor is built
            meta, tensors = await unpack(
                requests, max_bytes=self.request_limit(peer), stall=STALL_SECONDS, accept=self.compress
            )
        except (PayloadError, StreamCut) as e:
            logger.debug("%s: %s request from %s refused: %s", self.device_id, method, peer[-8:], e)
            rmeta, rtensors = refused(e), []
        else:
            VALUES[method] += sum(t.numel() for t in tensors)
            rmeta, rtensors = await self.handle(method, meta, tensors, peer)
        out = pack(
            rmeta, rtensors, answer_type, compress=self.compress if method in methods.COMPRESSED_ANSWERS else "none"
        )
        nbytes = sum(m.ByteSize() for m in out)
        TRAFFIC[f"{method}.response"] += nbytes
        await self.links.send(self.device_of(peer), nbytes)
        for message in out:
            yield message

    async def handle(self, method: str, meta: dict, tensors: list, sender: str) -> tuple[dict, list]:
        """Run one request; any PayloadError/TaskPoolError becomes an error answer that changes nothing."""
        handler = self.handler_of(method)
        try:
            if method in methods.SERVER_ONLY:
                self.checks.only_servers(sender)
            elif method not in methods.OPEN:
                self.arrivals.refuse_banned(sender)
            if method in methods.EPOCHED:
                self.checks.check_epoch(meta)
            result = await handler(dict(meta), tensors, sender)
        except (PayloadError, TaskPoolError) as e:
            self.counters["payload_errors"] += 1
            logger.info("%s rejected %s from %s: %s", self.device_id, method, sender[-8:], e)
            return refused(e), []
        except Exception as e:  # a bug: answer, log, keep serving
            logger.exception("%s failed on %s", self.device_id, method)
            return refusal_answer(f"internal error: {type(e).__name__}: {e}", Refusal.INTERNAL), []
        result = result if isinstance(result, tuple) else (result, [])
        log = self.log()
        if (
            log is not None
            and not self.replaying()
            and method in methods.LOGGED
            and result[0].get("result") != "duplicate"
        ):
            log.append({"method": method, "meta": meta, "sender": sender, "batch": _batch_of(meta)}, tensors)
        return result
