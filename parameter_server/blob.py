"""A server's own files (checkpoints, replicas, kept versions, request-log records) as bytes: any
picklable structure, each tensor in it replaced by a reference (dtype, shape, size) and its data
appended raw after the pickle, copied once. torch.save wrote the same through a zip archive: a kept
version of a 230k-parameter shard (its parameters and AdamW moments, 8 MB) 5.7-6.3 ms of processor
time to write against 2.2-2.6 ms here, 3.2-5.8 ms to read against 2.2-3.4; a 0.9 MB gradient push
1.4-3.2 ms against 0.26. A file written by torch.save before (it starts with b"PK", a zip archive)
still loads."""

from __future__ import annotations

import io
import os
import pickle
import struct

import torch

MAGIC = b"HPB1"
_LEN = struct.Struct("<Q")


def dumps(obj) -> bytes:
    flat: list[torch.Tensor] = []

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.Tensor):
                data = o.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                flat.append(data)
                return str(o.dtype).removeprefix("torch."), tuple(o.shape), data.numel()
            return None

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    header = buf.getvalue()
    return b"".join([MAGIC, _LEN.pack(len(header)), header, *(memoryview(t.numpy()) for t in flat)])


def loads(blob: bytes):
    if not blob.startswith(MAGIC):  # torch.save, as written before
        return torch.load(io.BytesIO(blob), weights_only=False)
    (n,) = _LEN.unpack_from(blob, len(MAGIC))
    at = len(MAGIC) + _LEN.size + n
    view = memoryview(blob)

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, ref):
            nonlocal at
            dtype, shape, nbytes = ref
            # (frombuffer refuses an empty buffer; the bytearray is the tensor's own memory)
            raw = (
                torch.frombuffer(bytearray(view[at : at + nbytes]), dtype=torch.uint8)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            at += nbytes
            return raw.view(getattr(torch, dtype)).reshape(shape)

    return _Unpickler(io.BytesIO(view[len(MAGIC) + _LEN.size : len(MAGIC) + _LEN.size + n])).load()


def save(obj, path: str) -> None:
    """Write `obj` to `path` atomically (beside it, then renamed: a crash leaves the old file)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(dumps(obj))
    os.replace(tmp, path)


def load(path: str):
    with open(path, "rb") as f:
        return loads(f.read())
