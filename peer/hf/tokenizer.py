"""Tokenizers for the Transformers side: the byte vocabulary hivepipe's presets train on, written as
a tokenizer that `AutoTokenizer.from_pretrained` loads (token id = byte value), and a model's own
tokenizer applied to a training corpus (in pieces, with a progress bar and an on-disk cache).
Imports `tokenizers`/`transformers` only when called."""

from __future__ import annotations

import hashlib
import logging
import os
import sys

from core.model.config import BYTE_VOCAB

logger = logging.getLogger("hivepipe.hf")

PIECE_BYTES = 1 << 20  # a corpus is tokenized in pieces of about 1 MiB, cut after a newline


def _byte_symbols() -> list[str]:
    """One printable unicode character per byte value (the GPT-2 byte-level alphabet): printable
    Latin-1 bytes stand for themselves, the others are moved to code points 256 and up."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def byte_tokenizer():
    """A Transformers fast tokenizer whose ids are the UTF-8 bytes of the text (vocabulary 256, no
    special tokens, nothing added), i.e. exactly hivepipe's byte vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    assert tok.get_vocab_size() == BYTE_VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, model_max_length=1 << 30)


def load_tokenizer(path: str):
    """The tokenizer saved in a Transformers model directory (a ValueError naming the directory if it
    has none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a missing tokenizer
        raise ValueError(f"{path}: no tokenizer that AutoTokenizer can load: {str(e).splitlines()[0][:300]}") from None


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides a tokenizer's ids (its serialized form)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pieces(raw: bytes) -> list[bytes]:
    out, start = [], 0
    while start < len(raw):
        end = raw.find(b"\n", start + PIECE_BYTES)
        end = len(raw) if end < 0 else end + 1
        out.append(raw[start:end])
        start = end
    return out


class CorpusTokenizer:
    """Turns a corpus's bytes into token ids with a model's tokenizer: decoded as UTF-8 (bad bytes
    replaced), cut into ~1 MiB pieces after newlines (so the ids do not depend on anything but the
    bytes), no special tokens added. Results are cached under `cache_dir` by (bytes, tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int, cache_dir: str | None = None, progress: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        root = os.environ.get("HIVEPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hivepipe")
        self.cache_dir = cache_dir or os.path.join(root, "tokens")
        self.progress = progress

    def encode(self, raw: bytes):
        """int32 CPU tensor of the ids; ValueError if an id does not fit the model's vocabulary."""
        import numpy as np
        import torch
        from tqdm import tqdm

        key = hashlib.sha256(raw).hexdigest()[:24] + "-" + self.fingerprint
        cached = os.path.join(self.cache_dir, key + ".npy")
        if os.path.exists(cached):
            try:
                ids = np.load(cached)
                logger.info("token ids from the cache %s", cached)
                return torch.from_numpy(ids.astype(np.int32))
            except (OSError, ValueError) as e:
                logger.warning("ignoring an unreadable token cache %s: %s", cached, e)
        pieces = _pieces(raw)
        parts = []
        for piece in tqdm(
            pieces, desc="tokenizing", unit="MiB", file=sys.stderr, disable=not self.progress or len(pieces) < 2
        ):
            parts.append(
                np.asarray(
                    self.tokenizer.encode(piece.decode("utf-8", errors="replace"), add_special_tokens=False),
                    dtype=np.int64,
                )
            )
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"the tokenizer gives id {int(ids.max())}, outside the model's vocabulary of {self.vocab_size}"
            )
        ids = ids.astype(np.int32)
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            tmp = cached + f".{os.getpid()}.tmp.npy"
            np.save(tmp, ids)
            os.replace(tmp, cached)
        except OSError as e:
            logger.info("cannot cache token ids in %s: %s", self.cache_dir, e)
        return torch.from_numpy(ids)
