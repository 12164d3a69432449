"""What crosses the wire between peers: msgpack metadata plus tensors in hivemind's
serialization, always as a stream of protobuf messages so that payloads above the 4 MiB unary cap
travel in chunks.

Every RPC of the project is a stream-in, stream-out hivemind handler (ServicerBase `rpc_*`).
The first message carries the msgpack metadata; tensors follow as hivemind `Tensor` parts
(split by `split_for_streaming`). An answer whose metadata holds `"error"` is a refusal: the caller
raises `RemoteError` with the server's message and its code (`"refusal"`, core/protocol/refusals.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import AsyncIterator, Iterable, Sequence

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from core.protocol.codecs import CODEC, UNIFORM_8BIT_OVERHEAD, compressed, serialize
from core.protocol.refusals import Refusal

CHUNK_BYTES = 1 << 20  # tensor parts of 1 MiB: far under the 4 MiB unary cap
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
# the messages of one stream follow each other at once (a sender packs the whole payload first): a
# gap this long between two of them, after the first, is a stalled stream, cut and reported
STALL_SECONDS = 20.0
# the longest single message a peer reads: a message holds the metadata or CHUNK_BYTES of tensor parts
# (a few of them), so this leaves room to spare; hivemind reads a whole message into memory before any
# handler sees it (its length comes first), so a longer one is refused from its length alone
MAX_MESSAGE_BYTES = 8 << 20
MESSAGES_REFUSED = {"count": 0, "largest": 0}  # over the bound, in this process


def bound_messages(limit: int = MAX_MESSAGE_BYTES) -> None:
    """Read no incoming message of more than `limit` bytes in this process (and its forks): hivemind's
    stream reader takes the message's length first and reads that many bytes whatever they are, so a
    single 1 GB message was held whole before `unpack` could refuse it. A longer one ends its stream
    at its length header, as a closed connection does, having read 9 bytes of it."""
    from hivemind.p2p import P2P

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > limit:
            MESSAGES_REFUSED["count"] += 1
            MESSAGES_REFUSED["largest"] = max(MESSAGES_REFUSED["largest"], length)
            raise asyncio.IncompleteReadError(b"", length)  # (hivemind closes the stream quietly)
        return await reader.readexactly(length)

    P2P.receive_raw_data = staticmethod(receive_raw_data)


class PayloadError(ValueError):
    """A request that does not fit what the handler expects (shape, dtype, NaN, unknown id, size...),
    or that the server refuses for another reason, named by `refusal` (core/protocol/refusals.py)."""

    def __init__(self, message: str, refusal: Refusal = Refusal.BAD_REQUEST):
        super().__init__(message)
        self.refusal = refusal

    def answer(self) -> dict:
        """The refusal as an answer's metadata: its text for a person, its code for the caller."""
        return refusal_answer(str(self), self.refusal)


def refusal_answer(text: str, refusal: Refusal = Refusal.BAD_REQUEST) -> dict:
    return {"error": text, "refusal": refusal.value}


def refused(e: Exception) -> dict:
    """The answer to a request refused by `e`: its own code when it carries one (PayloadError), else
    a bad request (a TaskPoolError, a stream that did not fit)."""
    return refusal_answer(str(e), getattr(e, "refusal", Refusal.BAD_REQUEST))


class StreamCut(ConnectionError):
    """A message stream that ended or stalled before its last tensor: the connection is at fault, not
    the request, so a caller may try again (a ConnectionError, as P2PLink retries). `meta`: the
    metadata that did arrive (None if none did): a `take` answer cut after it names the task the
    server leased, which the caller can hand back at once."""

    def __init__(self, message: str, meta: dict | None = None):
        super().__init__(message)
        self.meta = meta


class RemoteError(RuntimeError):
    """The remote peer refused the call; the message is the remote's explanation, `refusal` its code."""

    def __init__(self, message: str, refusal: Refusal = Refusal.BAD_REQUEST):
        super().__init__(message)
        self.refusal = refusal

    @classmethod
    def of(cls, where: str, answer: dict) -> "RemoteError":
        """The refusal `answer` (metadata holding "error") of the call `where`."""
        return cls(f"{where}: {answer['error']}", Refusal.of(answer.get("refusal")))


def encode_meta(meta: dict) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def decode_meta(raw: bytes) -> dict:
    if not raw:
        return {}
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise PayloadError(f"metadata is not valid msgpack: {e}") from None
    if not isinstance(meta, dict):
        raise PayloadError(f"metadata must be a map, got {type(meta).__name__}")
    return meta


# Uncompressed fp32 tensors of one message travel as one: hivemind's (de)serialization costs per
# tensor (a 14-tensor shard of 1 MB: 1.25 ms packed and 4.4 ms unpacked one by one, 0.6 and 0.4 ms
# as one, the copy into it 0.08 ms). Their shapes go in the metadata under FLAT; unpack splits them.
FLAT = "flat"
MAX_FLAT = 4096  # shapes one message may carry so


def pack(meta: dict, tensors: Sequence[torch.Tensor], message_type, compress: str = "none") -> list:
    """Metadata and tensors as a list of `message_type` (ExpertRequest or ExpertResponse) messages,
    fp32 tensors compressed with `compress` (COMPRESSION), or, uncompressed, sent as one (FLAT).
    The tensors travel as hivemind `Tensor` parts of CHUNK_BYTES, several to a message up to
    CHUNK_BYTES."""
    if compress == "none" and 1 < len(tensors) <= MAX_FLAT and all(t.dtype == torch.float32 for t in tensors):
        meta = dict(meta, **{FLAT: [list(t.shape) for t in tensors]})
        tensors = [torch.cat([t.detach().cpu().reshape(-1) for t in tensors])]
    messages = [message_type(metadata=encode_meta(dict(meta, n_tensors=len(tensors))))]
    size = CHUNK_BYTES  # the metadata's message takes no parts
    for t in tensors:
        for part in _parts(t, compress):
            if size >= CHUNK_BYTES:
                messages.append(message_type())
                size = 0
            messages[-1].tensors.add(**part)
            size += len(part["buffer"])
    return messages


def _parts(t: torch.Tensor, compress: str):
    """The fields of the hivemind `Tensor` parts one tensor travels as (what split_for_streaming
    makes of serialize_torch_tensor's message). An uncompressed tensor of a dtype numpy knows is cut
    straight from its memory: hivemind's path copies every byte four more times (into one bytes
    object, into a protobuf message, into the parts, into the messages holding them)."""
    t = t.detach().cpu().contiguous()
    if compressed(t, compress) or t.dtype == torch.bfloat16:
        whole = serialize(t, compress)
        for i, part in enumerate(split_for_streaming(whole, CHUNK_BYTES)):
            fields = {"buffer": part.buffer}
            if i == 0:
                fields.update(compression=part.compression, chunks=part.chunks, size=list(part.size), dtype=part.dtype)
            yield fields
        return
    raw = memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")
    chunks = max(1, math.ceil(len(raw) / CHUNK_BYTES))
    for i in range(chunks):
        fields = {"buffer": bytes(raw[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])}
        if i == 0:
            fields.update(
                compression=runtime_pb2.CompressionType.NONE,
                chunks=chunks,
                size=list(t.shape),
                dtype=str(t.dtype).replace("torch.", ""),
            )
        yield fields


def payload_bytes(messages: Iterable) -> int:
    return sum(m.ByteSize() for m in messages)


async def stream_of(messages: Iterable):
    """The messages as the async stream a P2P stream call sends and `unpack` reads."""
    for m in messages:
        yield m


async def _messages(stream: AsyncIterator, stall: float | None):
    """The stream's messages; StreamCut if a message after the first takes longer than `stall`
    seconds (the first waits for the handler's work; the rest are sent as soon as it is done)."""
    iterator = stream.__aiter__()
    count = 0
    while True:
        try:
            if stall and count:
                message = await asyncio.wait_for(iterator.__anext__(), stall)
            else:
                message = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise StreamCut(f"the stream stalled for {stall:.0f} s after {count} messages") from None
        count += 1
        yield message


async def unpack(
    stream: AsyncIterator, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, stall: float | None = None, accept: str = "none"
) -> tuple[dict, list[torch.Tensor]]:
    """Read a whole message stream back into (metadata, tensors). Refuses more than `max_bytes`, and
    compressed tensors other than the run's `accept` codec. A stream that ends before the tensors its
    metadata declares, or (with `stall`) waits longer than `stall` seconds for its next message,
    raises StreamCut."""
    meta = None
    groups: list[tuple] = []  # per tensor: its first part (the header) and every part's bytes
    total = 0
    try:
        async for message in _messages(stream, stall):
            total += message.ByteSize()
            if total > max_bytes:
                raise PayloadError(f"payload exceeds {max_bytes} bytes")
            if meta is None:
                meta = decode_meta(message.metadata)
            for part in message.tensors:
                if part.dtype:  # first chunk of a new tensor
                    groups.append((part, [part.buffer]))
                elif groups:
                    groups[-1][1].append(part.buffer)
                else:
                    raise PayloadError("tensor chunk without a header")
    except StreamCut as e:
        raise StreamCut(str(e), meta=None if meta is None else _cut_meta(meta)) from None
    if meta is None:
        raise PayloadError("empty request")
    declared = meta.pop("n_tensors", len(groups))
    if not isinstance(declared, int) or isinstance(declared, bool) or declared < 0:
        raise PayloadError(f"field 'n_tensors' must be a count, got {declared!r}")
    if len(groups) < declared:
        raise StreamCut(
            f"the stream ended after {len(groups)} of the {declared} tensors its metadata declares",
            meta=_cut_meta(meta),
        )
    if len(groups) > declared:
        raise PayloadError(f"metadata declares {declared} tensors, {len(groups)} arrived")
    for i, (head, buffers) in enumerate(groups):
        _check_header(i, head, sum(map(len, buffers)), accept)
    try:
        tensors = [_tensor(head, buffers) for head, buffers in groups]
    except Exception as e:
        raise PayloadError(f"tensor does not deserialize: {e}") from None
    if accept == "bf16":  # a bf16 run's activations and gradients travel as bfloat16: fp32 again here
        tensors = [t.float() if t.dtype == torch.bfloat16 else t for t in tensors]
    if FLAT in meta:
        tensors = _unflatten(meta.pop(FLAT), tensors)
    return meta, tensors


def _tensor(head, buffers: list[bytes]) -> torch.Tensor:
    """One tensor from its checked parts: an uncompressed one (but bfloat16, which hivemind sends
    in two forms) copied once from the parts into its own memory, any other through hivemind's
    deserialization of the parts joined."""
    if head.compression == runtime_pb2.CompressionType.NONE and head.dtype != "bfloat16":
        out = torch.empty(list(head.size), dtype=getattr(torch, head.dtype))
        if out.numel():
            raw, offset = memoryview(out.reshape(-1).numpy()).cast("B"), 0
            for b in buffers:
                raw[offset : offset + len(b)] = b
                offset += len(b)
        return out
    whole = runtime_pb2.Tensor()
    whole.CopyFrom(head)
    whole.buffer = b"".join(buffers)
    return deserialize_torch_tensor(whole)


def _cut_meta(meta: dict) -> dict:
    """The metadata a cut stream reports: the sender's own fields, not `pack`'s framing."""
    return {k: v for k, v in meta.items() if k not in ("n_tensors", FLAT)}


def _unflatten(shapes, tensors: list) -> list:
    """The fp32 tensors `pack` sent as one: views of it, one a shape; PayloadError unless the shapes
    are a list of tensor shapes that together hold exactly the one fp32 vector that arrived."""
    if (
        not isinstance(shapes, list)
        or not 1 <= len(shapes) <= MAX_FLAT
        or not all(
            isinstance(sh, list)
            and len(sh) <= MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in sh)
            for sh in shapes
        )
    ):
        raise PayloadError(f"field {FLAT!r} must list at most {MAX_FLAT} tensor shapes")
    if len(tensors) != 1 or tensors[0].dtype != torch.float32 or tensors[0].dim() != 1:
        raise PayloadError(f"field {FLAT!r} goes with one float32 vector, got {len(tensors)} tensors")
    sizes = [math.prod(sh) for sh in shapes]
    if sum(sizes) != tensors[0].numel():
        raise PayloadError(f"field {FLAT!r}: the shapes hold {sum(sizes)} values, {tensors[0].numel()} arrived")
    return [part.view(sh) for part, sh in zip(torch.split(tensors[0], sizes), shapes)]


# what a peer of this project sends (hivemind's NONE codec; bfloat16 as 2 bytes, or 4 in hivemind's
# legacy mode): anything else is refused before a tensor is built from it
_ITEM_BYTES = {
    "float32": (4,),
    "float16": (2,),
    "bfloat16": (2, 4),
    "float64": (8,),
    "int64": (8,),
    "int32": (4,),
    "int16": (2,),
    "int8": (1,),
    "uint8": (1,),
    "bool": (1,),
}
MAX_DIMS = 8


def _check_header(i: int, head, arrived: int, accept: str = "none") -> None:
    """PayloadError unless tensor `i`, whose first part is `head` and whose parts hold `arrived`
    bytes, is a tensor of a known dtype, uncompressed or in the run's codec, whose declared shape
    holds exactly those bytes (checked before anything is allocated)."""
    if head.compression not in (runtime_pb2.CompressionType.NONE, CODEC.get(accept)):
        raise PayloadError(
            f"tensor {i}: compression {head.compression} is not accepted (this run's --compress is {accept})"
        )
    if head.compression != runtime_pb2.CompressionType.NONE:
        shape = list(head.size)
        if head.dtype != "float32" or len(shape) > MAX_DIMS or any(d < 0 for d in shape):
            raise PayloadError(f"tensor {i}: a compressed tensor must be float32 of at most {MAX_DIMS} dims")
        numel = math.prod(shape)
        need = 2 * numel if head.compression == runtime_pb2.CompressionType.FLOAT16 else numel + UNIFORM_8BIT_OVERHEAD
        if arrived != need:
            raise PayloadError(
                f"tensor {i}: shape {shape} under codec {head.compression} needs {need} bytes, {arrived} arrived"
            )
        return
    if head.dtype not in _ITEM_BYTES:
        raise PayloadError(f"tensor {i}: dtype {head.dtype[:40]!r} is not accepted")
    shape = list(head.size)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise PayloadError(f"tensor {i}: shape {shape[: MAX_DIMS + 1]} is not a tensor shape")
    numel = math.prod(shape)
    if not any(numel * size == arrived for size in _ITEM_BYTES[head.dtype]):
        raise PayloadError(
            f"tensor {i}: shape {shape} of {head.dtype} needs {numel * _ITEM_BYTES[head.dtype][0]} "
            f"bytes, {arrived} arrived"
        )


RequestMessage = runtime_pb2.ExpertRequest
ResponseMessage = runtime_pb2.ExpertResponse


async def wait_to_redial(link, give_up: float) -> bool:
    """After a call to `link` failed with ConnectionError: sleep until its server may be dialled
    again (a dial in its backoff fails at once; at least a moment) and say True, or say False at
    once when that would pass `give_up` (a time.monotonic()). An in-process link has no backoff."""
    wait = max(getattr(link, "retry_in", lambda: 0.0)(), 0.25)
    if time.monotonic() + wait > give_up:
        return False
    await asyncio.sleep(wait)
    return True
