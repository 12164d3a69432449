"""A server's request log: every request that changed its state (and every task it created), in
order, so that a server killed and restarted with the same --checkpoint-dir replays them through the
same handlers on top of its last shard checkpoint and resumes its buffers, ledger, pools and credits.
Records are length-prefixed torch.save blobs; a torn last record (a crash mid-write) is ignored.
The log is compacted at every step to the batches a restart can still need."""
from __future__ import annotations

import io
import os
import struct

import torch

_LEN = struct.Struct("<Q")


def _encode(record: dict, tensors: list) -> bytes:
    buf = io.BytesIO()
    torch.save({"record": record, "tensors": [t.detach().cpu() for t in tensors]}, buf)
    blob = buf.getvalue()
    return _LEN.pack(len(blob)) + blob


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
        item = torch.load(io.BytesIO(data[at + _LEN.size : at + _LEN.size + n]), weights_only=False)
        out.append((item["record"], item["tensors"]))
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
