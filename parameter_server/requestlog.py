"""A server's request log: every request that changed its state (and every task it created), in
order, so that a server killed and restarted with the same --checkpoint-dir replays them through the
same handlers on top of its last shard checkpoint and resumes its buffers, ledger, pools and credits.
Records are length-prefixed: a magic, a pickle of the record and each tensor's dtype, shape and
size, then the tensors' raw bytes (a log written before holds torch.save blobs, read as they are); a
torn last record (a crash mid-write) is ignored. The log is compacted at every step to the batches a
restart can still need."""
from __future__ import annotations

import io
import os
import pickle
import struct

import torch

_LEN = struct.Struct("<Q")
_MAGIC = b"HPL1"  # a torch.save blob (the format before) starts with b"PK" (a zip archive)


def _encode(record: dict, tensors: list) -> bytes:
    """One record: its tensors' bytes copied once, into the record (torch.save's archive cost 1.4-3.2
    ms for a 0.9 MB gradient push and 0.1-0.2 ms for a record without tensors, most of them: hand-ins,
    leases; this 0.26 and 0.006 ms)."""
    flat = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    specs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape), f.numel()) for t, f in zip(tensors, flat)]
    header = pickle.dumps({"record": record, "tensors": specs}, protocol=pickle.HIGHEST_PROTOCOL)
    size = len(_MAGIC) + _LEN.size + len(header) + sum(f.numel() for f in flat)
    return b"".join([_LEN.pack(size), _MAGIC, _LEN.pack(len(header)), header, *(memoryview(f.numpy()) for f in flat)])


def _decode(blob: bytes) -> tuple[dict, list]:
    if not blob.startswith(_MAGIC):  # torch.save, as written before
        item = torch.load(io.BytesIO(blob), weights_only=False)
        return item["record"], item["tensors"]
    at = len(_MAGIC) + _LEN.size
    (n,) = _LEN.unpack_from(blob, len(_MAGIC))
    item = pickle.loads(blob[at : at + n])
    at += n
    tensors = []
    for dtype, shape, nbytes in item["tensors"]:
        raw = (torch.frombuffer(bytearray(blob[at : at + nbytes]), dtype=torch.uint8) if nbytes
               else torch.empty(0, dtype=torch.uint8))  # (frombuffer refuses an empty buffer)
        tensors.append(raw.view(getattr(torch, dtype)).reshape(shape))
        at += nbytes
    return item["record"], tensors


def read_log(path: str) -> list[tuple[dict, list]]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, at)
        if at + _LEN.size + n > len(data):
            break  # torn tail
        out.append(_decode(data[at + _LEN.size : at + _LEN.size + n]))
        at += _LEN.size + n
    return out


class RequestLog:
    def __init__(self, path: str):
        self.path = path
        self.entries: list[tuple[int, bytes]] = [(int(r.get("batch", 0)), _encode(r, t)) for r, t in read_log(path)]
        self.f = open(path, "ab")

    def append(self, record: dict, tensors: list = ()) -> None:
        blob = _encode(record, list(tensors))
        self.entries.append((int(record.get("batch", 0)), blob))
        self.f.write(blob)
        self.f.flush()

    def compact(self, keep_from_batch: int) -> None:
        """Drop the records of batches < keep_from_batch (atomically rewrites the file)."""
        self._rewrite([(b, blob) for b, blob in self.entries if b >= keep_from_batch])

    def drop_batches(self, lo: int, hi: int) -> None:
        """Drop the records of batches lo..hi-1 (a rollback undid them; atomically rewrites the file)."""
        self._rewrite([(b, blob) for b, blob in self.entries if not lo <= b < hi])

    def _rewrite(self, entries: list) -> None:
        self.entries = entries
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            for _, blob in self.entries:
                f.write(blob)
        self.f.close()
        os.replace(tmp, self.path)
        self.f = open(self.path, "ab")
