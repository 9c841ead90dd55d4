"""Training data storage: token shards read through memory maps (see :mod:`.shards`), and the
prepared-corpus directories ``meshtrain prepare`` writes (:mod:`.prepare`) and training reads.

A prepared directory (the format ``docs/data.md`` describes)::

    shard-00000.bin   headerless little-endian uint16 (uint32 when vocab > 65535) token ids
    shard-00000.idx   int64 shard-local end offsets (in tokens) of the documents ending there
    shard-00000.mask  chat / prompt_completion data only: one uint8 per token, 1 = trained on
    meta.json         format, tokenizer name/hash, vocab size, dtype, counts, per-shard counts
    COMPLETE          written last (atomically); a directory without it is not finished

The shards' element type is :func:`~meshtrain.data.shards.token_dtype` of the vocabulary size,
as for ``.bin`` sources. This module only reads (numpy and the standard library; no torch), so
tokenizer worker processes can import the package cheaply.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from meshtrain.config import ConfigError
from meshtrain.data.shards import TokenScan, TokenShards, check_token_file, open_bin

FORMAT = "meshtrain-tokens-1"
"""The ``format`` field of a prepared directory's ``meta.json``."""
META, MARKER = "meta.json", "COMPLETE"


def tokenizer_hash(tokenizer) -> str:
    """sha256 of a tokenizer's ``tokenizer.json`` (of a fixed label for the byte tokenizer)."""
    path = getattr(tokenizer, "path", None)
    data = Path(path).read_bytes() if path is not None else f"meshtrain-{tokenizer.name}".encode()
    return hashlib.sha256(data).hexdigest()


def read_meta(directory: str | Path) -> dict | None:
    """The ``meta.json`` of a prepared ``directory``; ``None`` when it has none of this format."""
    try:
        meta = json.loads((Path(directory) / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def is_prepared_dir(directory: str | Path) -> bool:
    """Whether ``directory`` was written by ``meshtrain prepare`` (finished or not)."""
    return Path(directory).is_dir() and read_meta(Path(directory)) is not None


def is_complete(directory: str | Path) -> bool:
    """Whether ``directory`` holds a finished prepared corpus (its marker matches its meta)."""
    directory = Path(directory)
    meta = read_meta(directory)
    try:
        marker = (directory / MARKER).read_text().strip()
    except OSError:
        return False
    return meta is not None and meta.get("complete") is True and marker == meta["fingerprint"]


def prepared_shard_files(directory: str | Path) -> list[Path] | None:
    """The shard files of a finished prepared ``directory``; ``None`` when it is not one.

    Raises :class:`ConfigError` for a directory ``meshtrain prepare`` started but did not finish.
    """
    directory = Path(directory)
    if not is_prepared_dir(directory):
        return None
    if not is_complete(directory):
        raise ConfigError(f"{directory} is an unfinished prepared corpus (no {MARKER} marker: "
                          "meshtrain prepare was interrupted or failed); run meshtrain prepare "
                          "again to finish it.")
    return [directory / shard["file"] for shard in read_meta(directory)["shards"]]


def open_prepared(directory: str | Path, tokenizer,
                  vocab_size: int | None = None) -> list[np.ndarray]:
    """The shards of a prepared ``directory`` as read-only memory maps, after checking it.

    Raises :class:`ConfigError` when it is unfinished, was written with another tokenizer or
    vocabulary, or a shard (or its index) is missing or truncated; with ``vocab_size`` (the
    model's vocabulary) also when a shard holds an id >= ``vocab_size``
    (:func:`check_prepared_ids`; what the launcher's preflight does, once per launch).
    """
    directory = Path(directory)
    if not is_prepared_dir(directory):
        raise ConfigError(f"{directory}: not a prepared corpus (no {META} of meshtrain prepare).")
    prepared_shard_files(directory)  # raises for an unfinished one
    meta = read_meta(directory)
    if (meta["vocab_size"] != tokenizer.vocab_size
            or meta["tokenizer"]["hash"] != tokenizer_hash(tokenizer)):
        raise ConfigError(
            f"{directory} was prepared with tokenizer {meta['tokenizer']['name']} (vocab "
            f"{meta['vocab_size']}, sha256 {meta['tokenizer']['hash'][:12]}), but this run uses "
            f"{tokenizer.name} (vocab {tokenizer.vocab_size}, sha256 "
            f"{tokenizer_hash(tokenizer)[:12]}); set data.tokenizer to the one it was prepared "
            "with, or prepare it again with --tokenizer.")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    arrays = []
    for shard in meta["shards"]:
        path = directory / shard["file"]
        index = path.with_suffix(".idx")
        size = path.stat().st_size if path.is_file() else None
        if size != shard["tokens"] * dtype.itemsize:
            state = "missing" if size is None else f"{size} bytes"
            raise ConfigError(f"{path}: {state}, but {META} expects {shard['tokens']} {dtype.name} "
                              f"tokens = {shard['tokens'] * dtype.itemsize} bytes (truncated or "
                              "damaged?); prepare the corpus again.")
        if not index.is_file() or index.stat().st_size != 8 * shard["documents"]:
            raise ConfigError(f"{index}: missing or not {shard['documents']} int64 document "
                              "ends; prepare the corpus again.")
        mask = directory / shard["mask"] if "mask" in shard else None
        if mask is not None and (not mask.is_file() or mask.stat().st_size != shard["tokens"]):
            raise ConfigError(f"{mask}: missing or not {shard['tokens']} bytes (one loss-mask "
                              "byte per token); prepare the corpus again.")
        arrays.append(open_bin(path, dtype))
    if vocab_size is not None:
        check_prepared_ids(directory, vocab_size)
    return arrays


def open_prepared_stream(directory: str | Path, tokenizer) -> TokenShards:
    """The prepared ``directory`` as one token stream (:func:`open_prepared`'s memory maps),
    with its loss mask when it holds chat or prompt_completion data (``shard-NNNNN.mask``, one
    ``uint8`` per token, memory-mapped too)."""
    directory = Path(directory)
    arrays = open_prepared(directory, tokenizer)
    meta = read_meta(directory)
    if not meta.get("loss_mask"):
        return TokenShards(arrays)
    masks = [open_bin(directory / shard["mask"], np.dtype(np.uint8)) for shard in meta["shards"]]
    return TokenShards(arrays, masks)


def data_format_of(directory: str | Path) -> str:
    """What the documents of a prepared ``directory`` are: ``text``, ``chat`` or
    ``prompt_completion`` (``meshtrain prepare --format``)."""
    return (read_meta(directory) or {}).get("data_format", "text")


def check_prepared_ids(directory: str | Path, vocab_size: int,
                       vocabulary: str = "the model's vocabulary") -> TokenScan:
    """Every shard of the prepared ``directory`` (opened by :func:`open_prepared`) range-checked
    against ``vocab_size`` ids (:func:`~meshtrain.data.shards.check_token_file`: chunked reads,
    remembered per unchanged shard); :class:`ConfigError` names the shard, the id and the
    vocabulary. Returns what the check read and found."""
    directory = Path(directory)
    meta = read_meta(directory)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    total = TokenScan(0, -1, 0.0, 0)
    for shard in meta["shards"]:
        total = total + check_token_file(directory / shard["file"], dtype, vocab_size, vocabulary)
    return total


def document_ends(directory: str | Path) -> np.ndarray:
    """End offsets (in tokens, over the whole stream) of every document of a prepared corpus."""
    directory = Path(directory)
    meta, start, parts = read_meta(directory), 0, []
    for shard in meta["shards"]:
        parts.append(np.fromfile(directory / shard["file"].replace(".bin", ".idx"), "<i8") + start)
        start += shard["tokens"]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
