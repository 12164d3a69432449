"""Hostile bytes: every `rpc_*` method of a live server (a
StageServer on a real hivemind P2P daemon; each also as a call over a session), called from an
outsider peer (its own daemon) with random metadata (not msgpack, wrong types, missing and extra
fields) and random tensor parts (odd dtypes, shapes, NaN/inf, declared sizes far beyond what
arrives, compression codes). The server answers each with an error or drops it, stays up, and its
parameters, version and task pool are unchanged; a request over --max-request-bytes is refused
while it arrives."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.runtime_pb2 import ExpertRequest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.protocol import methods
from core.protocol.session import MAX_OPEN_CALLS, Session, handle_name
from core.protocol.wire import stream_of, unpack
from parameter_server.service import StageServer
from tests.swarm.inprocess import TICKETS, make_run

FIELDS = [
    "task",
    "batch",
    "micro",
    "rows",
    "epoch",
    "slot",
    "version",
    "device",
    "compute",
    "tasks",
    "loss_sum",
    "names",
    "n_tensors",
    "stage",
    "lost",
    "layout",
    "from_batch",
    "retry",
    "result",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8,
)
metadata = st.one_of(
    st.binary(max_size=64),  # not msgpack, or msgpack of anything
    st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=10)), values, max_size=8).map(
        lambda d: msgpack.packb(d, use_bin_type=True)
    ),
)
DTYPES = ["float32", "float16", "bfloat16", "int64", "uint8", "bool", "object", "V100000000", "", "complex128", "<f4"]


@st.composite
def tensor_parts(draw):
    """A hivemind Tensor part: sometimes a real tensor (with NaN/inf), sometimes a header that lies."""
    if draw(st.booleans()):
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        t = torch.randn(shape) if shape else torch.randn(())
        if t.numel() and draw(st.booleans()):
            t.view(-1)[0] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        from hivemind.compression import serialize_torch_tensor

        return serialize_torch_tensor(t)
    return runtime_pb2.Tensor(
        buffer=draw(st.binary(max_size=64)),
        size=draw(st.lists(st.integers(0, 2**32 - 1), max_size=5)),  # uint32 in the proto
        dtype=draw(st.sampled_from(DTYPES)),
        compression=draw(st.integers(0, 6)),
        chunks=draw(st.integers(0, 3)),
    )


requests = st.tuples(metadata, st.lists(tensor_parts(), max_size=3), st.booleans())


class LiveServer:
    """A server of a tiny two-stage run (stage 0's frontal server, which builds batches), on a real
    P2P daemon, and an outsider's daemon connected to it; their event loop runs in a thread."""

    def __init__(self, max_request_bytes: int | None = None):
        from core.model.data import load_corpus
        from core.model.transformer import init_state

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        cfg, layout, run = make_run(steps=3)
        st0 = layout.stages[0]

        async def start():
            self.p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            self.server = StageServer(
                run=run,
                layout=layout,
                cfg=cfg,
                device_id=st0.frontal[0],
                peer_id=str(self.p2p.peer_id),
                stage_params=init_state(cfg, *st0.layers, 0),
                corpus=load_corpus(None, seq_len=cfg.seq_len),
                max_request_bytes=max_request_bytes,
                lease_tickets=TICKETS,
            )
            self.server.maybe_start_batches()
            await self.server.add_p2p_handlers(self.p2p)
            maddrs = [str(m) for m in await self.p2p.get_visible_maddrs()]
            self.outsider = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            self.stub = StageServer.get_stub(self.outsider, PeerID.from_base58(str(self.p2p.peer_id)))
            self.session = None

        self.run(start())

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def state(self) -> tuple:
        s = self.server
        params = tuple(float(p.detach().double().sum()) for p in s.shard.params.values())
        pool = s.pool.stats()
        return s.version, params, pool["queued"] + pool["leased"], pool["done"], sorted(s.issued), s.epoch

    async def call(self, method: str, messages: list) -> str:
        """`method` (a name of methods.NAMES: a stream call of its own, or `<name>@session`: a call over
        this outsider's session, opened again when one ends)."""

        async def roundtrip():
            if method.endswith(SESSION):
                if self.session is None or self.session.closed:
                    self.session = await Session().open(self.outsider, str(self.p2p.peer_id), handle_name())
                return await unpack(self.session.call(method.removesuffix(SESSION), messages))
            return await unpack(await getattr(self.stub, f"rpc_{method}")(stream_of(messages)))

        try:
            meta, _ = await asyncio.wait_for(roundtrip(), 20)
        except asyncio.TimeoutError:
            return "hung"
        except Exception as e:  # the stream dropped: allowed
            return f"dropped: {type(e).__name__}"
        return "error" if "error" in meta else f"answered {sorted(meta)}"

    def close(self):
        async def stop():
            if self.session is not None:
                self.session.close()
                await asyncio.wait_for(self.session.reader, 10)
            await self.outsider.shutdown()
            await self.p2p.shutdown()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def live():
    server = LiveServer()
    yield server
    server.close()


def _messages(meta: bytes, parts: list, split: bool) -> list:
    if split and parts:
        return [ExpertRequest(metadata=meta)] + [ExpertRequest(tensors=[p]) for p in parts]
    return [ExpertRequest(metadata=meta, tensors=parts)]


SESSION = "@session"


@pytest.mark.parametrize("method", methods.NAMES + tuple(f"{m}{SESSION}" for m in methods.NAMES))
def test_random_requests_are_refused_and_change_nothing(live, method):
    before = live.state()
    outcomes = []

    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(requests)
    def one(request):
        meta, parts, split = request
        outcomes.append(live.run(live.call(method, _messages(meta, parts, split))))

    one()
    assert "hung" not in outcomes
    # what may answer without an error: read-only methods, and register (which adds a client, not work)
    name = method.removesuffix(SESSION)
    if methods.METHODS[name].logged or name in ("take", "adopt_epoch", "push_replica"):
        assert not [o for o in outcomes if o.startswith("answered")], outcomes
    assert live.state() == before, method
    assert live.run(live.call("ping", _messages(msgpack.packb({}), [], False))).startswith("answered")


def test_a_request_over_max_request_bytes_is_refused_while_it_arrives():
    server = LiveServer(max_request_bytes=1 << 16)
    try:
        big = torch.zeros(64, 1024)  # 256 KiB
        from core.protocol.wire import pack

        before = server.state()
        for method in ("push_grads", f"push_grads{SESSION}"):
            result = server.run(server.call(method, pack({"batch": 0, "tasks": []}, [big], ExpertRequest)))
            assert result == "error" or result.startswith("dropped"), (method, result)
        assert server.server.counters["payload_errors"] == 0  # refused before the handler saw it
        assert server.state() == before
        small = pack({}, [], ExpertRequest)
        assert server.run(server.call("ping", small)).startswith("answered")
    finally:
        server.close()


def _framed(uid: str, meta: dict | None = None) -> ExpertRequest:
    return ExpertRequest(uid=uid, metadata=msgpack.packb({} if meta is None else meta))


@pytest.mark.parametrize(
    "uids, problem",
    [
        (["ping end"], "is not '<call> <method>"),
        (["x ping end"], "is not '<call> <method>"),
        (["1 ping finish"], "is not '<call> <method>"),
        (["1 " + "p" * 80 + " end"], "is not '<call> <method>"),
        (["1 no_such_method end"], "unknown method 'no_such_method'"),
        (["1 ping", "1 status end"], "is a ping call, a message of it says status"),
        ([f"{i} ping" for i in range(MAX_OPEN_CALLS + 1)], f"more than {MAX_OPEN_CALLS} calls of one session are open"),
    ],
)
def test_a_session_with_malformed_framing_ends_with_the_reason_and_changes_nothing(live, uids, problem):
    """A session whose messages do not frame calls ends with an error naming what is wrong, and the
    server keeps serving, its state unchanged; a call whose caller closes the session before its last
    message is answered as cut, not run (a complete `ping` like it is answered)."""
    before = live.state()

    async def session(messages, hold_open=False):
        read = asyncio.Event()

        async def requests():
            for m in messages:
                yield m
            if hold_open:  # open until the answers end, as a session's caller keeps it: the server's
                # refusal is then the only thing that ends the stream (once, under load, a session whose
                # requests had ended closed without the refusal's message)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(read.wait(), 10.0)

        answers = await live.stub.rpc_session(requests())
        got = []
        try:
            async for message in answers:
                got.append(message)
        except Exception as e:
            return got, str(e)
        finally:
            read.set()
        return got, None

    got, error = live.run(session([_framed(u) for u in uids], hold_open=True))
    assert error is not None and problem in error, (error, got)
    assert live.state() == before
    got, error = live.run(session([_framed("0 ping end"), _framed("1 ping"), _framed("2 status end")]))
    assert error is None and sorted(m.uid for m in got) == ["0 ping end", "1 ping end", "2 status end"], got
    answers = {m.uid.split()[0]: msgpack.unpackb(m.metadata) for m in got}
    assert "error" not in answers["0"] and "error" not in answers["2"], answers
    assert "ended before call 1's last message" in answers["1"].get("error", ""), answers
    assert live.state() == before


def test_a_single_oversized_message_is_refused_from_its_length_alone():
    """hivemind reads a message whole once its length header has come: a single 200 MB message was held
    in full before the request bound refused it. Now the stream ends at the header, with 9 bytes read."""
    from hivemind.p2p import P2P

    from core.protocol.wire import MESSAGES_REFUSED, bound_messages

    bound_messages(1 << 20)

    async def read(length: int, body: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
        try:
            return await asyncio.wait_for(P2P.receive_protobuf(ExpertRequest, reader), 5), len(reader._buffer)
        except asyncio.IncompleteReadError:
            return "refused", len(reader._buffer)

    before = MESSAGES_REFUSED["count"]
    body = b"\x00" * 4096
    assert asyncio.run(read(200 << 20, body)) == ("refused", 4096)  # nothing of the body was read
    assert MESSAGES_REFUSED["count"] == before + 1 and MESSAGES_REFUSED["largest"] >= 200 << 20
    ok = ExpertRequest(uid="x").SerializeToString()
    (message, _), left = asyncio.run(read(len(ok), ok))
    assert message.uid == "x" and left == 0


def test_a_live_server_drops_a_single_message_over_its_bound_and_keeps_serving():
    server = LiveServer(max_request_bytes=1 << 16)
    try:
        from core.protocol.wire import bound_messages

        bound_messages(1 << 16)  # as peer serve sets it from --max-request-bytes
        before = server.state()
        huge = ExpertRequest(
            metadata=msgpack.packb({"batch": 0}),
            tensors=[runtime_pb2.Tensor(buffer=b"\x00" * (4 << 20), size=[1 << 20], dtype="float32")],
        )
        result = server.run(server.call("push_grads", [huge]))
        assert result.startswith("dropped"), result
        assert server.state() == before
        assert server.run(server.call("ping", [ExpertRequest(metadata=msgpack.packb({}))])).startswith("answered")
    finally:
        from core.protocol.wire import MAX_MESSAGE_BYTES, bound_messages

        bound_messages(MAX_MESSAGE_BYTES)
        server.close()
