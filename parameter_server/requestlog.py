"""A server's request log: every request that changed its state (and every task it created), in
order, so that a server killed and restarted with the same --checkpoint-dir replays them through the
same handlers on top of its last shard checkpoint and resumes its buffers, ledger, pools and credits.
Records are length-prefixed parameter_server.blob encodings of the record and its tensors (a log
written before holds torch.save blobs, read as they are); a torn last record (a crash mid-write) is
ignored. The log is compacted at every step to the batches a restart can still need."""
from __future__ import annotations

import os
import struct

from parameter_server import blob

_LEN = struct.Struct("<Q")


def _encode(record: dict, tensors: list) -> bytes:
    """One record (0.26 ms for a 0.9 MB gradient push, 0.006 ms for a record without tensors, most
    records: hand-ins, leases; torch.save took 1.4-3.2 and 0.1-0.2 ms)."""
    return blob.dumps({"record": record, "tensors": list(tensors)})


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
        item = blob.loads(data[at + _LEN.size : at + _LEN.size + n])
        out.append((item["record"], item["tensors"]))
        at += _LEN.size + n
    return out


class RequestLog:
    def __init__(self, path: str):
        self.path = path
        self.entries: list[tuple[int, bytes]] = [(int(r.get("batch", 0)), _encode(r, t)) for r, t in read_log(path)]
        self.f = open(path, "ab")

    def append(self, record: dict, tensors: list = ()) -> None:
        payload = _encode(record, list(tensors))
        self.entries.append((int(record.get("batch", 0)), payload))
        _write(self.f, payload)
        self.f.flush()

    def compact(self, keep_from_batch: int) -> None:
        """Drop the records of batches < keep_from_batch (atomically rewrites the file)."""
        self._rewrite([(b, payload) for b, payload in self.entries if b >= keep_from_batch])

    def drop_batches(self, lo: int, hi: int) -> None:
        """Drop the records of batches lo..hi-1 (a rollback undid them; atomically rewrites the file)."""
        self._rewrite([(b, payload) for b, payload in self.entries if not lo <= b < hi])

    def _rewrite(self, entries: list) -> None:
        self.entries = entries
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            for _, payload in self.entries:
                _write(f, payload)
        self.f.close()
        os.replace(tmp, self.path)
        self.f = open(self.path, "ab")


def _write(f, payload: bytes) -> None:
    f.write(_LEN.pack(len(payload)))
    f.write(payload)
