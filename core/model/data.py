"""Byte-level data: a corpus of raw bytes (vocabulary 256, nothing to download) and batches that
are pure functions of (seed, t), so any process can rebuild any batch of a run.

The default corpus is the Python standard library's own `.py` sources (no download, present
wherever Python is). It depends on the Python installation; processes of one run check that they
agree with `Corpus.fingerprint`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass

import torch

from core.model.config import check_micro_batches
from core.model.corpus_format import FORMAT, MANIFEST, manifest_fingerprint  # noqa: F401 (re-exported)
from core.model.seeding import stable_seed

DEFAULT_CORPUS_MAX_BYTES = 8 * 1024 * 1024

VAL_FRACTION = 0.01
VAL_MIN_SEQUENCES = 4
# folders left out of the default corpus: installed packages vary between machines, tests are big
# and full of generated data
_DEFAULT_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """`train` and `val` are CPU tensors of token ids: uint8 bytes, or int32 ids of a model's
    tokenizer (val is the last 1% of the tokens, at least VAL_MIN_SEQUENCES sequences);
    `fingerprint` is the sha256 of all the bytes (and of the tokenizer, when there is one).

    A corpus of `peer data prepare` (load_prepared) has one (train, val) pair a source, memory-mapped
    from its file, in `parts`, with each source's `weights` (its share of the training windows);
    `train` and `val` are then the first source's."""

    train: torch.Tensor
    val: torch.Tensor
    fingerprint: str
    source: str
    parts: tuple = ()  # ((train, val), ...) of a prepared corpus's sources
    weights: tuple = ()  # each source's weight

    @property
    def num_bytes(self) -> int:
        if self.parts:
            return sum(t.numel() + v.numel() for t, v in self.parts)
        return self.train.numel() + self.val.numel()


def _files_below(root: str, excluded_dirs: frozenset[str] = frozenset(), suffix: str = "") -> list[str]:
    """Regular files below `root` ending with `suffix`, sorted by relative path; hidden files and
    folders (".git", ".DS_Store") and folders named in `excluded_dirs` are left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded_dirs]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not name.startswith(".") and name.endswith(suffix) and os.path.isfile(full):
                found.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(found)


def _read_concatenated(root: str, relpaths: list[str], max_bytes: int | None = None) -> bytes:
    parts, size = [], 0
    for rel in relpaths:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        parts.append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    raw = b"".join(parts)
    return raw if max_bytes is None else raw[:max_bytes]


@functools.lru_cache(maxsize=1)
def _default_corpus_bytes() -> tuple[bytes, str]:
    root = sysconfig.get_paths()["stdlib"]
    raw = _read_concatenated(root, _files_below(root, _DEFAULT_EXCLUDED_DIRS, ".py"), DEFAULT_CORPUS_MAX_BYTES)
    return raw, f"python stdlib sources ({root}, first {len(raw)} bytes)"


def _read_path(path: str) -> bytes:
    if not os.path.exists(path):
        raise ValueError(f"data path {path!r} does not exist")
    if os.path.isdir(path):
        files = _files_below(path)
        if not files:
            raise ValueError(f"data folder {path!r} holds no files")
        return _read_concatenated(path, files)
    with open(path, "rb") as f:
        return f.read()


def load_prepared(path: str, *, seq_len: int = 128, tokenizer=None) -> Corpus:
    """The corpus folder that `peer data prepare` wrote: each source's token file memory-mapped (no
    token is read before a window needs it), split as its manifest says. ValueError naming the folder
    for a manifest of another format, a file whose size or sha256 differs from the manifest (the
    hashes are checked once, streamed: `check=False` skips), tokens beyond `vocab_size`, or a split too
    short for one window of `seq_len`. `tokenizer`: the model's (None: the presets' bytes); the folder
    must have been prepared with it."""
    import json

    import numpy as np

    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"data folder {path!r}: unreadable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"data folder {path!r}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("fingerprint") != manifest_fingerprint(manifest):
        raise ValueError(f"data folder {path!r}: {MANIFEST} was changed after it was written (fingerprint)")
    want = "bytes" if tokenizer is None else tokenizer.fingerprint
    have = manifest.get("tokenizer")
    have = have.get("fingerprint") if isinstance(have, dict) else have
    if have != want:
        raise ValueError(
            f"data folder {path!r} was prepared with tokenizer {have}, this model's is {want} "
            "(prepare it again with `peer data prepare --tokenizer` naming the model's folder, or give bytes)"
        )
    parts, weights = [], []
    for src in manifest["sources"]:
        file = os.path.join(path, src["file"])
        dtype = np.dtype(manifest["dtype"])
        if not os.path.isfile(file) or os.path.getsize(file) != src["tokens"] * dtype.itemsize:
            raise ValueError(f"data folder {path!r}: {src['file']} is missing or not the size its manifest says")
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        if digest.hexdigest() != src["sha256"]:
            raise ValueError(f"data folder {path!r}: {src['file']} differs from its manifest's sha256")
        tokens = torch.from_numpy(np.memmap(file, dtype=dtype, mode="c"))  # (copy-on-write: never written back)
        train, val = tokens[: src["train_tokens"]], tokens[src["train_tokens"] :]
        if train.numel() < seq_len + 1:
            raise ValueError(
                f"data folder {path!r}: source {src['name']!r} has fewer than {seq_len + 1} training tokens"
            )
        parts.append((train, val))
        weights.append(float(src["weight"]))
    vals = [v for _, v in parts if v.numel() >= seq_len + 1]
    if len(vals) != len(parts) and any(v.numel() for _, v in parts):
        raise ValueError(f"data folder {path!r}: a source's held-out split is shorter than one window of {seq_len}")
    return Corpus(
        train=parts[0][0],
        val=parts[0][1],
        fingerprint=manifest["fingerprint"],
        source=f"{path} ({len(parts)} source(s), prepared)",
        parts=tuple(parts),
        weights=tuple(weights),
    )


def load_corpus(path: str | None = None, *, seq_len: int = 128, tokenizer=None) -> Corpus:
    """Read a text file, or a folder of them (recursively, sorted by relative path, as bytes), or
    with `path=None` the default corpus. The tokens are the bytes, or with `tokenizer` (an object
    with `encode(bytes) -> int tensor` and `fingerprint`, e.g. peer.hf.tokenizer.CorpusTokenizer)
    its ids. ValueError naming the path if it is missing or empty or too short to hold one training
    sequence and VAL_MIN_SEQUENCES held-out sequences of `seq_len`."""
    if path is not None and os.path.isfile(os.path.join(path, MANIFEST)):
        return load_prepared(path, seq_len=seq_len, tokenizer=tokenizer)
    if path is None:
        raw, source = _default_corpus_bytes()
    else:
        raw, source = _read_path(path), path
    if not raw:
        raise ValueError(f"data path {source!r} is empty")
    fingerprint = hashlib.sha256(raw).hexdigest()
    if tokenizer is None:
        data, unit = torch.frombuffer(bytearray(raw), dtype=torch.uint8), "bytes"
    else:
        data, unit = tokenizer.encode(raw), "tokens"
        fingerprint = hashlib.sha256(f"{fingerprint}:{tokenizer.fingerprint}".encode()).hexdigest()
        source = f"{source} (token ids of tokenizer {tokenizer.fingerprint})"
    window = seq_len + 1  # a sequence and its shifted labels
    n_val = max(int(data.numel() * VAL_FRACTION), VAL_MIN_SEQUENCES * window)
    if data.numel() < n_val + window:
        raise ValueError(
            f"data path {source!r} has {data.numel()} {unit}, fewer than the "
            f"{VAL_MIN_SEQUENCES * window + window} needed for one training sequence and "
            f"{VAL_MIN_SEQUENCES} held-out sequences of {seq_len} tokens"
        )
    return Corpus(train=data[:-n_val], val=data[-n_val:], fingerprint=fingerprint, source=source)


def make_batch(
    corpus: Corpus, seed: int, t: int, batch_size: int, seq_len: int, *, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch t of a run: (inputs, labels) LongTensors [batch_size, seq_len] with labels = inputs
    shifted by one. The start offsets are drawn uniformly from a generator seeded by (seed, t, split)
    only, so the batch is a pure function of its arguments and the corpus."""
    data = {"train": corpus.train, "val": corpus.val}.get(split)
    if data is None:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if len(corpus.parts) > 1:
        return _weighted_batch(corpus, seed, t, batch_size, seq_len, split)
    if data.numel() < seq_len + 1:
        raise ValueError(f"the {split} split has {data.numel()} bytes, fewer than one sequence of {seq_len} tokens")
    gen = torch.Generator(device="cpu").manual_seed(stable_seed("hivepipe-batch", seed, t, split))
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=gen)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _weighted_batch(corpus: Corpus, seed: int, t: int, batch_size: int, seq_len: int, split: str):
    """make_batch of a corpus of several sources: each row's source drawn by the sources' weights
    (the held-out split: by their held-out sizes), then its window uniformly in it, from the same
    generator seeded by (seed, t, split)."""
    index = 0 if split == "train" else 1
    datas = [p[index] for p in corpus.parts]
    weights = corpus.weights if split == "train" else tuple(float(d.numel()) for d in datas)
    usable = [w if d.numel() > seq_len else 0.0 for w, d in zip(weights, datas)]
    if not any(usable):
        raise ValueError(f"the {split} split has no source with a window of {seq_len} tokens")
    gen = torch.Generator(device="cpu").manual_seed(stable_seed("hivepipe-batch", seed, t, split))
    which = torch.multinomial(torch.tensor(usable, dtype=torch.float64), batch_size, replacement=True, generator=gen)
    rows = []
    for k in which.tolist():
        start = int(torch.randint(0, datas[k].numel() - seq_len, (1,), generator=gen))
        rows.append(datas[k][start : start + seq_len + 1].long())
    windows = torch.stack(rows)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


EVAL_ROWS = 8  # held-out windows of an evaluation during training (--eval-every)
EVAL_STEP = -1  # the pseudo-step they are drawn at (no training batch is drawn there)


def eval_windows(corpus: Corpus, seed: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's held-out windows: (inputs, labels) [EVAL_ROWS, seq_len], the same at every evaluation
    of a run, in the swarm (parameter_server/evaluate.py) and in `peer reference --eval-every`."""
    return make_batch(corpus, seed, EVAL_STEP, EVAL_ROWS, seq_len, split="val")


def eval_due(version: int, every: int, steps: int) -> bool:
    """Whether version `version` of a run of `steps` is evaluated under --eval-every `every`."""
    return every > 0 and version > 0 and (version % every == 0 or version == steps)


def split_micro_batches(inputs: torch.Tensor, labels: torch.Tensor, d: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch into d micro-batches of B/d contiguous rows, in order; ValueError if d does not
    divide B."""
    check_micro_batches(inputs.shape[0], d)
    rows = inputs.shape[0] // d
    return list(zip(inputs.split(rows), labels.split(rows)))
