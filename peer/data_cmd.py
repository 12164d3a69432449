"""`peer data prepare SOURCE[:WEIGHT]... -o DIR`: a training corpus as memory-mapped token files.

Each SOURCE is a text file (one document), a `.jsonl` file (one document a line, its `text` field), a
`.parquet` file (one document a row, its `text` column; needs pyarrow: `pip install -e ".[data]"`) or
a folder of such files (every file below it, sorted by relative path, hidden ones left out). Its
documents are tokenized with the byte tokenizer (the presets' 256 byte values; the document separator
is byte 0, which UTF-8 text never holds) or a Transformers tokenizer folder (`--tokenizer DIR`; the
separator is its end-of-sequence token), an end-of-document token after each document, and written to
one file a source, DIR/source-K.bin (uint8, uint16 or uint32 by the vocabulary). The last
`--val-fraction` of each source's tokens is its held-out split. DIR/manifest.json says what is where:
the tokenizer, each source's name, weight (the share of training windows drawn from it), token
counts, documents and the sha256 of its file, and the corpus's `fingerprint` (the sha256 of the rest),
which is part of a run's config: a server whose data differs refuses to join, naming both.

Memory stays bounded whatever the corpus's size: a text file is read in blocks (cut at a line end for
a Transformers tokenizer), jsonl a line at a time, parquet a record batch at a time, and tokens go to
disk as they come. The output is written to a temporary folder beside DIR and renamed at the end, so
a bad input (an unreadable file, a jsonl line that is not an object with a string `text`, an empty
source) is an error naming the file and the line, and leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile

from peer.errors import UsageError

BYTE_EOD = 0  # the byte tokenizer's end of document (NUL: never in UTF-8 text)
BLOCK = 16 << 20  # bytes of a text file read at a time
BATCH_ROWS = 1024  # parquet rows read at a time


def add_arguments(p) -> None:
    p.add_argument("action", choices=["prepare"], help="prepare: tokenize sources into a corpus folder")
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE[:WEIGHT]",
        help="text files, .jsonl (field 'text'), .parquet (column 'text') or folders of them; WEIGHT "
        "(default 1) is the source's share of the training windows",
    )
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="the corpus folder to write (must not exist)")
    p.add_argument(
        "--tokenizer", default="bytes", help="bytes (the presets' tokenizer), or a Transformers tokenizer folder"
    )
    p.add_argument("--val-fraction", type=float, default=0.01, help="held-out share of each source's tokens")
    p.add_argument(
        "--include",
        action="append",
        default=None,
        metavar="GLOB",
        help="in a folder, only the files whose names match (repeatable, e.g. --include '*.md'); default: all",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_source(text: str) -> tuple[str, float]:
    """'path' or 'path:WEIGHT' -> (path, weight); UsageError naming it otherwise."""
    path, weight = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head and not os.path.exists(text):
        try:
            weight = float(tail)
        except ValueError:
            raise UsageError(f"source {text!r}: the weight after ':' must be a number") from None
        path = head
        if not weight > 0 or weight == float("inf"):
            raise UsageError(f"source {text!r}: the weight must be a positive number")
    if not os.path.exists(path):
        raise UsageError(f"source {path!r} does not exist")
    return path, weight


def _files_of(path: str, include: list[str] | None = None) -> list[str]:
    """The files of a source: itself, or every file below a folder (sorted by relative path; hidden
    ones left out; with `include`, only names matching one of its globs)."""
    import fnmatch

    if not os.path.isdir(path):
        return [path]
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [
            os.path.join(dirpath, n)
            for n in filenames
            if not n.startswith(".") and (not include or any(fnmatch.fnmatch(n, g) for g in include))
        ]
    files = sorted(found, key=lambda f: os.path.relpath(f, path))
    if not files:
        matching = f" matching {' or '.join(include)}" if include else ""
        raise UsageError(f"source {path!r} is a folder with no files{matching}")
    return files


class Tokens:
    """The byte tokenizer or a Transformers one: `documents` of a file -> token arrays."""

    def __init__(self, spec: str):
        import numpy as np

        self.np = np
        if spec == "bytes":
            self.hf, self.vocab_size, self.eod, self.name = None, 256, BYTE_EOD, "bytes"
        else:
            from peer.hf.tokenizer import load_tokenizer, tokenizer_fingerprint

            try:
                self.hf = load_tokenizer(spec)
            except Exception as e:  # (a folder Transformers cannot read a tokenizer from)
                raise UsageError(f"--tokenizer {spec!r}: {e}") from None
            if self.hf.eos_token_id is None:
                raise UsageError(f"--tokenizer {spec!r} has no end-of-sequence token to separate documents")
            self.vocab_size, self.eod = len(self.hf), int(self.hf.eos_token_id)
            self.name = {"path": os.path.abspath(spec), "fingerprint": tokenizer_fingerprint(self.hf)}
        self.dtype = "uint8" if self.vocab_size <= 256 else "uint16" if self.vocab_size <= 65536 else "uint32"

    def encode(self, text: bytes, where: str):
        np = self.np
        if self.hf is None:
            ids = np.frombuffer(text, dtype=np.uint8)
            if BYTE_EOD in text:
                raise UsageError(f"{where}: holds byte 0, the byte tokenizer's document separator (not text?)")
            return ids
        try:
            s = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        return np.asarray(self.hf.encode(s, add_special_tokens=False), dtype=self.dtype)

    def documents(self, path: str):
        """(token array, None) pieces of a document, then (None, True) at its end, for each document of
        the file at `path`."""
        if path.endswith(".jsonl"):
            yield from self._jsonl(path)
        elif path.endswith(".parquet"):
            yield from self._parquet(path)
        else:
            yield from self._text(path)

    def _text(self, path: str):
        carry = b""
        with open(path, "rb") as f:
            while True:
                block = f.read(BLOCK)
                if not block:
                    break
                if self.hf is not None:  # (cut at a line end: a token does not cross it)
                    block, cut = carry + block, None
                    cut = block.rfind(b"\n")
                    block, carry = (block, b"") if cut < 0 else (block[: cut + 1], block[cut + 1 :])
                if block:
                    yield self.encode(block, path), None
            if carry:
                yield self.encode(carry, path), None
        yield None, True

    def _jsonl(self, path: str):
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise UsageError(f"{where}: not a JSON line ({e})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise UsageError(f"{where}: a line must be a JSON object with a string field 'text'")
                yield self.encode(record["text"].encode("utf-8"), where), None
                yield None, True

    def _parquet(self, path: str):
        try:
            import pyarrow.parquet as pq
        except ModuleNotFoundError:
            raise UsageError(f'{path}: reading .parquet needs pyarrow: pip install -e ".[data]"') from None
        try:
            f = pq.ParquetFile(path)
        except Exception as e:  # (pyarrow's own errors: not a parquet file, a truncated one)
            raise UsageError(f"{path}: not a readable parquet file ({e})") from None
        if "text" not in f.schema_arrow.names:
            raise UsageError(f"{path}: no column 'text' (columns: {', '.join(f.schema_arrow.names)})")
        row = 0
        for batch in f.iter_batches(columns=["text"], batch_size=BATCH_ROWS):
            for value in batch.column(0).to_pylist():
                row += 1
                if not isinstance(value, str):
                    raise UsageError(f"{path}: row {row}: 'text' must be a string, got {type(value).__name__}")
                yield self.encode(value.encode("utf-8"), f"{path}: row {row}"), None
                yield None, True


def prepare(
    sources: list[tuple[str, float]],
    out: str,
    tokenizer: str,
    val_fraction: float,
    progress: bool,
    include: list[str] | None = None,
) -> dict:
    """Write the corpus folder `out` (see the module's docstring); returns its manifest."""
    import numpy as np
    from tqdm import tqdm

    from core.model.corpus_format import FORMAT, MANIFEST, manifest_fingerprint

    if not 0 <= val_fraction < 1:
        raise UsageError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if os.path.exists(out):
        raise UsageError(f"--out {out!r} exists: give a new folder")
    tok = Tokens(tokenizer)
    files = [(path, _files_of(path, include)) for path, _ in sources]
    total = sum(os.path.getsize(f) for _, fs in files for f in fs)
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".prepare-", dir=parent)
    except OSError as e:
        raise UsageError(f"--out {out!r}: cannot write there: {e.strerror}") from None
    eod = np.asarray([tok.eod], dtype=tok.dtype)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr, disable=not progress)
    entries = []
    try:
        for k, ((path, weight), (_, paths)) in enumerate(zip(sources, files)):
            name = f"source-{k}.bin"
            digest, count, docs = hashlib.sha256(), 0, 0
            with open(os.path.join(work, name), "wb") as sink:
                for file in paths:
                    for ids, end in tok.documents(file):
                        part = eod if end else ids.astype(tok.dtype, copy=False)
                        raw = part.tobytes()
                        sink.write(raw)
                        digest.update(raw)
                        count += part.size
                        docs += bool(end)
                    bar.update(os.path.getsize(file))
            if count == docs:
                raise UsageError(f"source {path!r} holds no text")
            n_val = int(count * val_fraction)
            entries.append(
                {
                    "name": path,
                    "weight": weight,
                    "file": name,
                    "tokens": count,
                    "train_tokens": count - n_val,
                    "val_tokens": n_val,
                    "documents": docs,
                    "sha256": digest.hexdigest(),
                }
            )
        manifest = {
            "format": FORMAT,
            "tokenizer": tok.name,
            "vocab_size": tok.vocab_size,
            "eod": tok.eod,
            "dtype": tok.dtype,
            "val_fraction": val_fraction,
            "sources": entries,
        }
        manifest["fingerprint"] = manifest_fingerprint(manifest)
        with open(os.path.join(work, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        os.rename(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        bar.close()
    return manifest


def run(args) -> int:
    sources = [parse_source(s) for s in args.sources]
    try:
        manifest = prepare(
            sources, args.out, args.tokenizer, args.val_fraction, not args.no_progress, include=args.include
        )
    except OSError as e:
        raise UsageError(f"{getattr(e, 'filename', None) or 'a source'}: {e.strerror or e}") from None
    tokens = sum(s["tokens"] for s in manifest["sources"])
    docs = sum(s["documents"] for s in manifest["sources"])
    print(
        f"{args.out}: {tokens:,} tokens in {docs:,} documents from {len(sources)} source(s), "
        f"{sum(s['val_tokens'] for s in manifest['sources']):,} held out; fingerprint {manifest['fingerprint'][:16]}"
    )
    return 0
