"""Byte corpus loading and batches that are pure functions of (seed, t)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from core.model.data import VAL_MIN_SEQUENCES, load_corpus, make_batch, split_micro_batches


def test_default_corpus_is_stdlib_source(default_corpus):
    c = default_corpus
    assert c.train.dtype == torch.uint8 and c.val.dtype == torch.uint8
    assert 1_000_000 < c.num_bytes <= 8 * 1024 * 1024
    assert c.val.numel() >= VAL_MIN_SEQUENCES * 33 and c.val.numel() >= c.num_bytes // 100
    assert b"def " in bytes(c.train[:100_000].tolist())
    again = load_corpus(None, seq_len=32)
    assert again.fingerprint == c.fingerprint and torch.equal(again.val, c.val)
    all_bytes = torch.cat([c.train, c.val]).numpy().tobytes()
    assert hashlib.sha256(all_bytes).hexdigest() == c.fingerprint


def test_folder_is_read_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"B" * 300)
    (tmp_path / "a.raw").write_bytes(b"A" * 300)
    (tmp_path / "c.txt").write_bytes(b"C" * 300)
    (tmp_path / ".hidden").write_bytes(b"H" * 300)
    c = load_corpus(str(tmp_path), seq_len=8)
    raw = torch.cat([c.train, c.val]).numpy().tobytes()
    assert raw == b"A" * 300 + b"B" * 300 + b"C" * 300
    assert c.source == str(tmp_path)
    single = load_corpus(str(tmp_path / "a.raw"), seq_len=8)
    assert single.num_bytes == 300


def test_bad_paths_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt.*does not exist"):
        load_corpus(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt.*empty"):
        load_corpus(str(empty))
    folder = tmp_path / "dir"
    folder.mkdir()
    with pytest.raises(ValueError, match="dir.*no files"):
        load_corpus(str(folder))
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 200)
    with pytest.raises(ValueError, match="short.txt.*200 bytes"):
        load_corpus(str(short), seq_len=128)


def test_batch_is_a_pure_function_of_seed_and_t(default_corpus):
    x, y = make_batch(default_corpus, 5, 3, 8, 32)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = make_batch(default_corpus, 5, 3, 8, 32)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(make_batch(default_corpus, 5, 4, 8, 32)[0], x)
    assert not torch.equal(make_batch(default_corpus, 6, 3, 8, 32)[0], x)
    # each row is a window of the training bytes
    train = bytes(default_corpus.train.tolist())
    for row, lab in zip(x, y):
        assert bytes(row.tolist()) + bytes([lab[-1].item()]) in train
    v, _ = make_batch(default_corpus, 5, 3, 8, 32, split="val")
    assert bytes(v[0].tolist()) in bytes(default_corpus.val.tolist())


_BATCH_IN_CHILD = """
import hashlib
from core.model.data import load_corpus, make_batch
c = load_corpus(None, seq_len=32)
x, y = make_batch(c, 11, 42, 16, 32)
print(c.fingerprint, hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())
"""


def test_batch_is_identical_in_separate_processes():
    outs = {
        subprocess.run([sys.executable, "-c", _BATCH_IN_CHILD], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(outs) == 1
    fingerprint, digest = outs.pop().split()
    c = load_corpus(None, seq_len=32)
    x, y = make_batch(c, 11, 42, 16, 32)
    assert fingerprint == c.fingerprint
    assert digest == hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()


def test_split_micro_batches(default_corpus):
    x, y = make_batch(default_corpus, 0, 0, 12, 32)
    parts = split_micro_batches(x, y, 3)
    assert len(parts) == 3
    assert all(px.shape == (4, 32) and py.shape == (4, 32) for px, py in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    assert len(split_micro_batches(x, y, 1)) == 1
    for d in (5, 0, 24):
        with pytest.raises(ValueError, match="divide"):
            split_micro_batches(x, y, d)
