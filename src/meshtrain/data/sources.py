"""Where training tokens come from: the files ``data.source`` names, and one token stream built
from them, from a directory ``meshtrain prepare`` wrote, or from the built-in corpus.

:func:`find_source_files` resolves a file, directory or glob to its data files;
:func:`load_token_stream` turns ``data.source`` into one token stream
(:class:`~meshtrain.data.shards.TokenShards`). Text files are read by
:mod:`meshtrain.data.readers` (the readers ``meshtrain prepare`` uses too), pre-tokenized ``.bin``
files by :func:`~meshtrain.data.shards.read_token_bin`.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from meshtrain.config import ConfigError, DataConfig
from meshtrain.data.builtin_corpus import builtin_corpus_texts
from meshtrain.data.prepared import (
    is_prepared_dir,
    open_prepared,
    prepared_shard_files,
)
from meshtrain.data.readers import document_texts
from meshtrain.data.shards import TokenShards, read_token_bin, token_dtype
from meshtrain.data.tokenizer import ByteTokenizer

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet", ".bin")
"""Suffixes of the files a source may hold: text (:mod:`.readers`) or pre-tokenized ``.bin``."""
BUILTIN_SOURCE = "builtin"
"""The ``data.source`` value that selects the built-in corpus."""
_GLOB_CHARS = frozenset("*?[")


def _supported(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in SUPPORTED_SUFFIXES


def _files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if _supported(p))


def find_source_files(source: str) -> list[Path]:
    """The data files ``source`` names: a file, a directory (searched recursively) or a glob.

    Only files with a suffix in :data:`SUPPORTED_SUFFIXES` are used; the result is sorted so the
    corpus order is the same on every machine. Raises :class:`ConfigError` naming ``source`` when
    nothing usable matches, and when pre-tokenized ``.bin`` files are mixed with text files (their
    token ids could not be combined with freshly tokenized text safely).
    """
    supported = ", ".join(SUPPORTED_SUFFIXES)
    path = Path(source).expanduser()
    if _GLOB_CHARS & set(source):
        files: set[Path] = set()
        for match in glob.glob(str(path), recursive=True):
            match_path = Path(match)
            if match_path.is_dir():
                files.update(_files_under(match_path))
            elif _supported(match_path):
                files.add(match_path)
        found = sorted(files)
    elif path.is_dir():
        found = prepared_shard_files(path)  # meshtrain prepare's output; raises when unfinished
        if found is None:  # prepared corpora inside the directory are not its data files
            files_under = _files_under(path)
            skip = {d for d in {p.parent for p in files_under} if is_prepared_dir(d)}
            found = [p for p in files_under if p.parent not in skip]
    elif path.is_file():
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise ConfigError(
                f'data.source: "{source}" has an unsupported suffix "{path.suffix}"; '
                f'supported: {supported} (or "{BUILTIN_SOURCE}").'
            )
        found = [path]
    else:
        raise ConfigError(
            f'data.source: "{source}" does not exist. Give a file, a directory or a glob of '
            f'{supported} files, or "{BUILTIN_SOURCE}" for the built-in corpus.'
        )
    if not found:
        raise ConfigError(
            f'data.source: "{source}" matches no usable file; supported suffixes: {supported} '
            f'(or "{BUILTIN_SOURCE}" for the built-in corpus).'
        )
    kinds = {p.suffix.lower() == ".bin" for p in found}
    if len(kinds) > 1:
        raise ConfigError(f'data.source: "{source}" mixes pre-tokenized .bin files with text '
                          "files; point it at one kind only.")
    return found


def encode_documents(texts: list[str], tokenizer) -> np.ndarray:
    """All ``texts`` tokenized and concatenated, each followed by ``tokenizer.eos_id`` (if any)."""
    eos = [] if tokenizer.eos_id is None else [np.array([tokenizer.eos_id], dtype=np.int64)]
    if isinstance(tokenizer, ByteTokenizer):
        pieces = [tokenizer.encode_array(text) for text in texts]
    elif hasattr(tokenizer, "encode_batch"):
        pieces = [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]
    else:
        pieces = [np.asarray(tokenizer.encode(text), dtype=np.int64) for text in texts]
    parts = [part for piece in pieces for part in (piece.astype(np.int64), *eos)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


_STREAM_CACHE: dict[tuple, TokenShards] = {}
_STREAM_CACHE_SIZE = 4


def _stream_key(data: DataConfig, tokenizer, files: list[Path]) -> tuple:
    tokenizer_file = getattr(tokenizer, "path", None)
    files = [*files, tokenizer_file] if tokenizer_file is not None else files
    stats = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in map(Path, files))
    return (data.source, data.text_field, data.max_bytes, tokenizer.name, tokenizer.vocab_size,
            tokenizer.eos_id, stats, sys.version, sysconfig.get_paths()["stdlib"])


def _disk_cached(key: tuple, cache_dir: str | Path | None, vocab_size: int, build) -> np.ndarray:
    """``build()``, or its result saved under ``cache_dir`` by an earlier run with the same key.

    With a ``cache_dir`` the result is stored there as ``uint16``/``uint32`` and returned as a
    read-only memory map of that file, so it is not held in this process's memory.
    """
    if cache_dir is None:
        return build().astype(token_dtype(vocab_size))
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"tokens-{digest}.npy"
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            pass  # a damaged cache file is rebuilt below
    stream = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")
    np.save(partial, stream.astype(token_dtype(vocab_size)))
    os.replace(partial, path)  # atomic: ranks writing the same entry at once never see half a file
    del stream
    return np.load(path, mmap_mode="r")


def load_token_stream(data: DataConfig, tokenizer,
                      cache_dir: str | Path | None = None) -> TokenShards:
    """The whole corpus ``data.source`` as one token stream (:class:`TokenShards`).

    ``.bin`` files and on-disk cache entries are memory-mapped, not loaded: the stream is read
    window by window, so a process's memory does not grow with the corpus.

    Documents are tokenized with ``tokenizer`` (no special tokens) and each is followed by
    ``tokenizer.eos_id`` when the tokenizer has one. What a document is depends on the source:

    - ``builtin``: each standard-library file of :func:`builtin_corpus_texts` (``data.max_bytes``
      bounds its size; the bound applies to the built-in corpus only).
    - ``.txt``: each file.
    - ``.jsonl``: each non-blank line, a JSON object whose ``data.text_field`` is a string.
    - ``.parquet``: each non-null row of the string column ``data.text_field`` (read with pyarrow).
    - ``.bin``: already tokenized and taken as-is (no eos added): a headerless array of
      little-endian ``uint16`` token ids, or ``uint32`` when the tokenizer's ``vocab_size`` exceeds
      65535 (:func:`~meshtrain.data.shards.write_token_bin` writes one). Several ``.bin`` files
      are concatenated.
    - a directory written by ``meshtrain prepare`` (:mod:`meshtrain.data.prepare`): its shards,
      memory-mapped after checking they are complete and were written with ``tokenizer``
      (``data.text_field`` and ``data.max_bytes`` do not apply; prepare decided the documents).

    Results are cached in-process per (source, files' sizes and mtimes, tokenizer), so building
    :class:`~meshtrain.data.train_data.TrainData` twice in one process tokenizes once; with
    ``cache_dir`` tokenized text is also kept on disk there (worth it for slow Hugging Face
    tokenizers; bytes take ~0.2 s/4 MB).
    """
    if is_prepared_dir(Path(data.source).expanduser()):  # meshtrain prepare's output: memory maps
        return TokenShards(open_prepared(Path(data.source).expanduser(), tokenizer))
    builtin = data.source == BUILTIN_SOURCE
    files = [] if builtin else find_source_files(data.source)
    key = _stream_key(data, tokenizer, files)
    if key in _STREAM_CACHE:
        return _STREAM_CACHE[key]
    if builtin:
        stream = _disk_cached(key, cache_dir, tokenizer.vocab_size, lambda: encode_documents(
            builtin_corpus_texts(data.max_bytes), tokenizer))
    elif files[0].suffix.lower() == ".bin":
        stream = [read_token_bin(path, tokenizer.vocab_size) for path in files]
    else:
        stream = _disk_cached(key, cache_dir, tokenizer.vocab_size, lambda: encode_documents(
            [text for path in files for text in document_texts(path, data.text_field)], tokenizer))
    tokens = TokenShards(stream if isinstance(stream, list) else [stream])
    if len(_STREAM_CACHE) >= _STREAM_CACHE_SIZE:
        _STREAM_CACHE.pop(next(iter(_STREAM_CACHE)))
    _STREAM_CACHE[key] = tokens
    return tokens
