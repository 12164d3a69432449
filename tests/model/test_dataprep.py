"""`peer data prepare`: sources of every kind into memory-mapped token files with a manifest, windows
read by (seed, step) from the map with the sources' weights, and bad input named by file and line,
leaving nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from core.model.data import MANIFEST, load_corpus, make_batch
from peer.data_cmd import BYTE_EOD, parse_source, prepare
from peer.errors import UsageError

DOC = "def f(x):\n    return x * 2\n" * 40  # 1,160 bytes of text


def sources(tmp_path):
    (tmp_path / "a.txt").write_text(DOC)
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "one.txt").write_text(DOC[:500])
    (folder / "sub" / "two.txt").write_text(DOC[500:])
    (folder / ".hidden").write_text("left out")
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"text": f"document {i}: " + DOC[: 40 + i], "id": i}) + "\n")
        f.write("\n")  # (a blank line is no document)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [DOC[:300], DOC[300:900]], "n": [1, 2]}), tmp_path / "t.parquet")
    return tmp_path


def test_every_kind_of_source_is_tokenized_with_a_separator_after_each_document(tmp_path):
    src = sources(tmp_path)
    out = tmp_path / "corpus"
    chosen = [(str(src / "a.txt"), 1.0), (str(src / "folder"), 1.0), (str(src / "docs.jsonl"), 3.0)]
    chosen.append((str(src / "t.parquet"), 0.5))
    manifest = prepare(chosen, str(out), "bytes", 0.1, progress=False)
    assert sorted(os.listdir(out)) == [MANIFEST, "source-0.bin", "source-1.bin", "source-2.bin", "source-3.bin"]
    a, folder, docs, table = manifest["sources"]
    assert (a["documents"], folder["documents"], docs["documents"], table["documents"]) == (1, 2, 30, 2)
    assert a["tokens"] == len(DOC) + 1 and folder["tokens"] == len(DOC) + 2
    assert [s["weight"] for s in manifest["sources"]] == [1.0, 1.0, 3.0, 0.5]
    raw = np.fromfile(out / "source-1.bin", dtype=np.uint8)
    assert raw.tobytes() == DOC[:500].encode() + bytes([BYTE_EOD]) + DOC[500:].encode() + bytes([BYTE_EOD])
    first = json.loads((src / "docs.jsonl").read_text().splitlines()[0])["text"].encode()
    assert np.fromfile(out / "source-2.bin", dtype=np.uint8)[: len(first) + 1].tobytes() == first + b"\0"
    for s in manifest["sources"]:
        assert s["val_tokens"] == int(s["tokens"] * 0.1) and s["train_tokens"] + s["val_tokens"] == s["tokens"]
    assert json.loads((out / MANIFEST).read_text()) == manifest


def test_a_prepared_corpus_is_read_from_the_map_by_seed_and_step_with_the_sources_weights(tmp_path):
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("a" * 5000)
    two.write_text("b" * 5000)
    prepare([(str(one), 3.0), (str(two), 1.0)], str(tmp_path / "c"), "bytes", 0.05, progress=False)
    corpus = load_corpus(str(tmp_path / "c"), seq_len=16)
    assert len(corpus.parts) == 2 and corpus.weights == (3.0, 1.0)
    assert all(t.dtype == torch.uint8 for t, _ in corpus.parts)  # (bytes: one byte a token on disk and in the map)
    x, y = make_batch(corpus, 0, 7, 8, 16)
    x2, y2 = make_batch(load_corpus(str(tmp_path / "c"), seq_len=16), 0, 7, 8, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(x[:, 1:], y[:, :-1])
    rows = torch.cat([make_batch(corpus, 0, t, 16, 16)[0][:, 0] for t in range(50)])
    share = float((rows == ord("a")).float().mean())
    assert 0.68 < share < 0.82, share  # 3:1 -> 0.75 of the windows from the first source
    vx, _ = make_batch(corpus, 0, 0, 8, 16, split="val")
    assert vx.shape == (8, 16)
    # the fingerprint is the manifest's: the same files give the same one
    prepare([(str(one), 3.0), (str(two), 1.0)], str(tmp_path / "again"), "bytes", 0.05, progress=False)
    assert load_corpus(str(tmp_path / "again"), seq_len=16).fingerprint == corpus.fingerprint


def test_a_swarm_on_a_prepared_corpus_equals_the_reference_on_it(tmp_path):
    from peer.reference import train_reference
    from tests.swarm.harness import rel_diff
    from tests.swarm.inprocess import InProcessSwarm, make_run

    (tmp_path / "a.txt").write_text(DOC * 4)
    with open(tmp_path / "b.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": DOC[i:] + str(i)}) + "\n")
    prepare(
        [(str(tmp_path / "a.txt"), 1.0), (str(tmp_path / "b.jsonl"), 2.0)], str(tmp_path / "c"), "bytes", 0.1, False
    )
    cfg, layout, run = make_run(steps=3)
    corpus = load_corpus(str(tmp_path / "c"), seq_len=cfg.seq_len)
    state = asyncio.run(InProcessSwarm(cfg, layout, run, corpus=corpus).train(timeout=120))
    ref, _ = train_reference(
        cfg, corpus, steps=3, seed=0, batch_size=16, micro_batches=4, delay=1, lr=2e-3, progress=False
    )
    assert rel_diff(state, ref) < 1e-5


def bad_sources(tmp_path):
    (tmp_path / "ok.txt").write_text(DOC)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nul.txt").write_bytes(b"text\0more")
    (tmp_path / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / "notjson.jsonl").write_text('{"text": "fine"}\n\n{"text": broken\n')
    (tmp_path / "number.jsonl").write_text('{"text": 3}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    (tmp_path / "fake.parquet").write_text("not parquet")
    return tmp_path


@pytest.mark.parametrize(
    "name,words",
    [
        ("notext.jsonl", "notext.jsonl:2: a line must be a JSON object with a string field 'text'"),
        ("notjson.jsonl", "notjson.jsonl:3: not a JSON line"),
        ("number.jsonl", "number.jsonl:1: a line must be a JSON object"),
        ("empty.txt", "empty.txt' holds no text"),
        ("nul.txt", "nul.txt: holds byte 0"),
        ("nocol.parquet", "nocol.parquet: no column 'text' (columns: body)"),
        ("fake.parquet", "fake.parquet: not a readable parquet file"),
    ],
)
def test_bad_input_is_named_by_file_and_line_and_leaves_nothing_behind(tmp_path, name, words):
    src = bad_sources(tmp_path)
    before = sorted(os.listdir(src))
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        prepare([(str(src / "ok.txt"), 1.0), (str(src / name), 1.0)], str(src / "out"), "bytes", 0.01, False)
    assert sorted(os.listdir(src)) == before  # no output folder, no temporary one


def test_a_folder_can_be_narrowed_to_the_files_whose_names_match(tmp_path):
    folder = tmp_path / "src"
    (folder / "__pycache__").mkdir(parents=True)
    (folder / "a.py").write_text(DOC)
    (folder / "__pycache__" / "a.pyc").write_bytes(b"\x00binary")
    with pytest.raises(UsageError, match="a.pyc: holds byte 0"):  # (all files: the binary one refused)
        prepare([(str(folder), 1.0)], str(tmp_path / "all"), "bytes", 0.01, False)
    manifest = prepare([(str(folder), 1.0)], str(tmp_path / "py"), "bytes", 0.01, False, include=["*.py"])
    assert manifest["sources"][0]["tokens"] == len(DOC) + 1
    with pytest.raises(UsageError, match=r"no files matching \*.md"):
        prepare([(str(folder), 1.0)], str(tmp_path / "md"), "bytes", 0.01, False, include=["*.md"])


def test_sources_and_weights_are_checked_before_anything_is_read(tmp_path):
    (tmp_path / "a.txt").write_text(DOC)
    assert parse_source(str(tmp_path / "a.txt") + ":2.5") == (str(tmp_path / "a.txt"), 2.5)
    for bad, words in [
        (str(tmp_path / "missing.txt"), "does not exist"),
        (str(tmp_path / "a.txt") + ":x", "the weight after ':' must be a number"),
        (str(tmp_path / "a.txt") + ":0", "the weight must be a positive number"),
    ]:
        with pytest.raises(UsageError, match=words):
            parse_source(bad)
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError, match="exists: give a new folder"):
        prepare([(str(tmp_path / "a.txt"), 1.0)], str(tmp_path / "out"), "bytes", 0.01, False)


def test_the_command_says_what_it_wrote_and_exits_2_on_bad_input(tmp_path):
    (tmp_path / "a.txt").write_text(DOC)
    (tmp_path / "b.jsonl").write_text('{"no": 1}\n')
    cmd = [sys.executable, "-m", "peer.cli", "data", "prepare", "--no-progress"]
    ok = subprocess.run([*cmd, str(tmp_path / "a.txt"), "-o", str(tmp_path / "c")], capture_output=True, text=True)
    assert ok.returncode == 0 and f"{len(DOC) + 1:,} tokens in 1 documents" in ok.stdout, ok.stderr
    bad = subprocess.run([*cmd, str(tmp_path / "b.jsonl"), "-o", str(tmp_path / "d")], capture_output=True, text=True)
    assert bad.returncode == 2 and "b.jsonl:1:" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "d").exists()


def test_a_changed_corpus_file_or_manifest_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text(DOC * 3)
    prepare([(str(tmp_path / "a.txt"), 1.0)], str(tmp_path / "c"), "bytes", 0.1, False)
    data = bytearray((tmp_path / "c" / "source-0.bin").read_bytes())
    data[10] ^= 1
    (tmp_path / "c" / "source-0.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="differs from its manifest's sha256"):
        load_corpus(str(tmp_path / "c"), seq_len=16)
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    manifest["sources"][0]["weight"] = 9.0
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="changed after it was written"):
        load_corpus(str(tmp_path / "c"), seq_len=16)
