"""Tokenizing documents into the shards of a prepared corpus: the encoder (text to ids, as
training from raw files tokenizes, and chat / prompt_completion documents to ids and loss mask)
and the shard writer (``shard-NNNNN.bin``, ``.idx`` and, for masked data, ``.mask``), used by
``meshtrain prepare``'s workers (:mod:`meshtrain.data.prepare`).

A ``.txt`` piece is tokenized in stretches cut after a newline followed by a non-space character
(:func:`write_txt`), which gives the ids of tokenizing it whole for the byte tokenizer and for
tokenizers that split there (:func:`lines_split_safely`).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np

BATCH_CHARS = 1 << 20
"""Characters of ``.jsonl``/``.parquet`` documents tokenized together."""


def safe_cut(text: str) -> int:
    """Index just after the last newline followed by a non-space character (0: none)."""
    cut = text.rfind("\n", 0, len(text) - 1)
    while cut >= 0 and text[cut + 1].isspace():
        cut = text.rfind("\n", 0, cut)
    return cut + 1


def batches(texts, limit: int = BATCH_CHARS, length=len):
    """``texts`` in consecutive lists of at least ``limit`` characters (the last one shorter);
    a text of ``limit`` characters or more is a list of its own. ``length``: the characters of
    an item (items that are not strings: ``(text, spans)`` pairs)."""
    batch, size = [], 0
    for text in texts:
        if length(text) >= limit and batch:
            yield batch
            batch, size = [], 0
        batch.append(text)
        size += length(text)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class Encoder:
    """Tokenizes text into ``dtype`` arrays the way
    :func:`~meshtrain.data.sources.encode_documents` does. ``tokenizer``: a loaded tokenizer, or
    the ``data.tokenizer`` string of one (what a spawned worker gets)."""

    def __init__(self, tokenizer, dtype: str):
        from meshtrain.data.tokenizer import ByteTokenizer, load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.bytes = isinstance(self.tokenizer, ByteTokenizer)
        self.dtype = np.dtype(dtype)
        self.eos = self.tokenizer.eos_id

    def text(self, text: str) -> np.ndarray:
        """Ids of a piece of one document (no eos)."""
        if self.bytes:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(self.dtype)
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64).astype(self.dtype)

    def documents(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Ids of whole documents, each followed by eos; and each one's end offset."""
        if self.bytes and len(texts) == 1:  # a long document: no copy beyond its ids
            encoded = texts[0].encode("utf-8")
            extra = 0 if self.eos is None else 1
            out = np.empty(len(encoded) + extra, dtype=self.dtype)
            out[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
            if extra:
                out[-1] = self.eos
            return out, np.array([len(out)], dtype=np.int64)
        if self.bytes:
            encoded = [text.encode("utf-8") for text in texts]
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
            flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(self.dtype)
        else:
            encode_batch = getattr(self.tokenizer, "encode_batch", None)
            ids = encode_batch(texts) if encode_batch else [self.tokenizer.encode(t) for t in texts]
            lengths = np.fromiter(map(len, ids), np.int64, len(ids))
            flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64,
                               int(lengths.sum())).astype(self.dtype)
        ends = np.cumsum(lengths)
        if self.eos is None:
            return flat, ends
        return np.insert(flat, ends, self.eos), ends + np.arange(1, len(ends) + 1)

    def masked_documents(self, documents: list[tuple[str, list]]
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ids of whole ``(text, spans)`` documents, each followed by eos; each one's end
        offset; and the loss mask of every id (:mod:`meshtrain.data.supervised`: 1 where a token
        overlaps a span; the eos as the document's last token)."""
        from meshtrain.data.supervised import encode_masked

        ids, masks, ends, total = [], [], [], 0
        for tokens, mask in encode_masked(documents, self.tokenizer):
            if self.eos is not None:
                tokens = np.append(tokens, self.eos)
                mask = np.append(mask, mask[-1] if len(mask) else 0)
            ids.append(tokens.astype(self.dtype))
            masks.append(mask.astype(np.uint8))
            total += len(tokens)
            ends.append(total)
        if not ids:
            return np.zeros(0, self.dtype), np.zeros(0, np.int64), np.zeros(0, np.uint8)
        return np.concatenate(ids), np.array(ends, dtype=np.int64), np.concatenate(masks)

    def eos_array(self) -> np.ndarray:
        """The eos id as a 1-token array (empty when the tokenizer has none)."""
        return np.array([] if self.eos is None else [self.eos], dtype=self.dtype)


def lines_split_safely(tokenizer) -> bool:
    """Whether tokenizing text piece by piece, cut after a newline followed by a non-space
    character, gives the ids of tokenizing it whole (checked on probe strings)."""
    probes = ["The cat sat.\nThe dog ran!\n\nThe end\n", "x = 1\n    y = (2, 3)\nz\n\n\n  w\n",
              "über naïve 123\n456 日本語\n«quoted»\n-- done", "a\nb\n c\td\r\ne"]
    for text in probes:
        cuts, rest = [], text
        while (cut := safe_cut(rest)) > 0:
            cuts.insert(0, rest[cut:])
            rest = rest[:cut]
        pieces = [rest, *cuts]
        if [i for piece in pieces for i in tokenizer.encode(piece)] != tokenizer.encode(text):
            return False
    return True


class ShardWriter:
    """Appends tokens and document ends to ``STEM.bin.partial``/``.idx.partial`` (and, when
    ``masked``, each token's loss mask to ``.mask.partial``); ``finish`` makes them durable and
    renames them into place."""

    def __init__(self, stem: Path, masked: bool = False):
        self.stem = stem
        self.kinds = ("bin", "idx", "mask") if masked else ("bin", "idx")
        self.bin = open(f"{stem}.bin.partial", "wb")
        self.idx = open(f"{stem}.idx.partial", "wb")
        self.mask = open(f"{stem}.mask.partial", "wb") if masked else None
        self.tokens = self.documents = 0

    @property
    def handles(self) -> list:
        """The open files."""
        return [self.bin, self.idx] + ([self.mask] if self.mask is not None else [])

    def write(self, tokens: np.ndarray, ends: np.ndarray | None = None,
              mask: np.ndarray | None = None) -> None:
        """Append ``tokens``, and the ends (relative to ``tokens``) of documents ending in it;
        and their loss ``mask`` (``uint8``, one per token) to a masked shard."""
        if (mask is None) != (self.mask is None) or (mask is not None
                                                      and len(mask) != len(tokens)):
            raise ValueError("a masked shard takes one mask byte per token, an unmasked none")
        if mask is not None:
            np.asarray(mask, dtype=np.uint8).tofile(self.mask)
        tokens.tofile(self.bin)
        if ends is not None and len(ends):
            (np.asarray(ends, dtype=np.int64) + self.tokens).astype("<i8").tofile(self.idx)
            self.documents += len(ends)
        self.tokens += len(tokens)

    def finish(self) -> None:
        """Flush and fsync the files, then rename them to their final names."""
        for handle in self.handles:
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        for kind in self.kinds:
            os.replace(f"{self.stem}.{kind}.partial", f"{self.stem}.{kind}")


def write_txt(writer: ShardWriter, encoder: Encoder, chunks, split: bool) -> None:
    """Tokenize the text ``chunks`` (of one ``.txt`` piece) into ``writer``: chunk by chunk for
    bytes, cut after the last newline followed by a non-space character for a tokenizer that
    ``split``s safely there, else whole. Linear: the text since the last cut is a list of chunks
    joined once, and a cut is looked for in the newest chunk only (the text before it has none,
    but for its last character: a newline whose next character was not read yet)."""
    pending: list[str] = []
    for chunk in chunks:
        if not chunk:
            continue
        if encoder.bytes:
            writer.write(encoder.text(chunk))
            continue
        if split:
            tail = pending[-1][-1:] if pending else ""
            cut = safe_cut(tail + chunk) - len(tail)
            if cut >= 0 and (cut or tail):
                writer.write(encoder.text("".join([*pending, chunk[:cut]])))
                pending.clear()
                chunk = chunk[cut:]
        if chunk:
            pending.append(chunk)
    if pending:
        writer.write(encoder.text("".join(pending)))
