"""Where training tokens come from: the files ``data.source`` names, and one token stream built
from them, from a directory ``meshtrain prepare`` wrote, or from the built-in corpus.

:func:`~meshtrain.data.readers.find_source_files` resolves a file, directory or glob to its data
files; :func:`load_token_stream` turns ``data.source`` into one token stream
(:class:`~meshtrain.data.shards.TokenShards`). Text files are read by
:mod:`meshtrain.data.readers` (the readers ``meshtrain prepare`` uses too), pre-tokenized ``.bin``
files by :func:`~meshtrain.data.shards.read_token_bin`.

Raw text sources (``.txt``, ``.jsonl``, ``.parquet``) are tokenized once, streaming, into a
directory of the prepared format (:func:`raw_corpus_dir`, written by
:func:`meshtrain.data.prepare.write_corpus`) in the token cache (:func:`data_cache_dir`), and
memory-mapped from there like a prepared directory: no rank holds the corpus in its memory.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import sysconfig
from pathlib import Path

import numpy as np

from meshtrain.config import ConfigError, DataConfig
from meshtrain.data.builtin_corpus import builtin_corpus_texts
from meshtrain.data.prepare import SHARD_BYTES, write_corpus
from meshtrain.data.prepared import (
    FORMAT,
    is_complete,
    is_prepared_dir,
    open_prepared,
    open_prepared_stream,
    tokenizer_hash,
)
from meshtrain.data.readers import (
    BUILTIN_SOURCE,
    CONFIG_TEXT_FIELD,
    find_source_files,
)
from meshtrain.data.shards import TokenShards, read_token_bin, token_dtype
from meshtrain.data.supervised import DocumentFormat, document_format
from meshtrain.data.tokenizer import ByteTokenizer

CACHE_ENV = "MESHTRAIN_DATA_CACHE"
"""The environment variable that moves the token cache (:func:`data_cache_dir`)."""
_RAW_VERSION = 1  # bump when the token stream of a raw source changes: old entries are not reused
_HASH_BYTES = 1 << 20


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
    masked = () if data.format == "text" else (data.format, data.chat_template, data.train_on)
    return (data.source, data.text_field, data.max_bytes, tokenizer.name, tokenizer.vocab_size,
            tokenizer.eos_id, stats, sys.version, sysconfig.get_paths()["stdlib"], *masked)


def data_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The token cache: ``cache_dir`` when given, else ``$MESHTRAIN_DATA_CACHE``, else
    ``$XDG_CACHE_HOME/meshtrain/tokens`` (``~/.cache/meshtrain/tokens``).

    It holds one ``tokens-<key>/`` directory (the prepared format) per tokenized raw text source,
    its ``tokens-<key>.lock``, and the built-in corpus's ``tokens-<key>.npy`` when a
    ``cache_dir`` is given; the remembered range checks of token files are in its ``token-ids/``
    (:func:`meshtrain.data.shards.scan_cache_dir`, which reads the same variable). Nothing
    removes entries: delete the directory to reclaim the space.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "meshtrain" / "tokens"


def file_sha256(path: str | Path) -> str:
    """sha256 of the bytes of ``path``, read in 1 MiB blocks (~1.8 GB/s with SHA extensions)."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def _raw_key(files: list[Path], hashes: list[str], text_field: str, tokenizer,
             fmt: DocumentFormat | None = None) -> str:
    """The cache key of a raw source: what its token stream depends on, nothing else (not the
    paths, sizes or mtimes: the same bytes anywhere share one entry, changed bytes never do);
    for chat / prompt_completion data also the format and the chat template."""
    kinds = [path.suffix.lower() for path in files]
    masked = [fmt.key()] if fmt is not None and fmt.masked else []
    return hashlib.sha256(json.dumps(
        [FORMAT, _RAW_VERSION, list(zip(kinds, hashes, strict=True)), text_field,
         tokenizer_hash(tokenizer), tokenizer.vocab_size, tokenizer.eos_id, SHARD_BYTES, *masked]
    ).encode()).hexdigest()


def raw_corpus_dir(data: DataConfig, tokenizer, cache_dir: str | Path | None = None,
                   files: list[Path] | None = None) -> Path:
    """The prepared-format directory holding the raw text source ``data.source`` tokenized with
    ``tokenizer``; tokenized into the token cache (:func:`data_cache_dir`) first if no process
    did it before.

    The entry is ``tokens-<key>``, ``key`` a sha256 of the files' contents (hashed, streaming, on
    every call), their kinds and order, ``data.text_field`` and the tokenizer (its file's sha256,
    vocabulary, eos). One process writes it, the first to take ``tokens-<key>.lock`` (an
    ``flock``), into ``.tokens-<key>.<host>.<pid>.partial`` and renames it into place when it is
    complete; the others wait on the lock and then find it whole. An entry damaged since (a
    shard truncated or removed) is written again. Tokenizing streams document by document
    (:func:`~meshtrain.data.prepare.write_corpus`), so memory does not grow with the source.
    Raises :class:`ConfigError` as the readers do (a bad ``.jsonl`` line: nothing is left
    behind), and when the cache cannot be created.
    """
    files = find_source_files(data.source) if files is None else files
    fmt = document_format(data)
    hashes = [file_sha256(path) for path in files]
    root = data_cache_dir(cache_dir)
    entry = root / f"tokens-{_raw_key(files, hashes, data.text_field, tokenizer, fmt)[:32]}"
    if _usable(entry, tokenizer):
        return entry
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = os.open(root / f"{entry.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ConfigError(f"the token cache {root} cannot be written ({error.strerror or error}) "
                          f"to tokenize data.source = \"{data.source}\"; set {CACHE_ENV} to a "
                          "writable directory, or prepare the source with meshtrain prepare and "
                          "train from its output.") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process writes the entry
            locked = True
        except OSError as error:  # a file system without locks: each writer renames its own
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            locked = False
        if not _usable(entry, tokenizer):
            _write_entry(entry, files, hashes, data.text_field, tokenizer, locked, fmt)
    finally:
        os.close(handle)  # releases the lock; the lock file stays (removing it would race)
    return entry


def _usable(entry: Path, tokenizer) -> bool:
    """Whether the cache ``entry`` is complete and whole (every shard and index of its size)."""
    if not is_complete(entry):
        return False
    try:
        open_prepared(entry, tokenizer)
    except (ConfigError, OSError):
        return False
    return True


def _write_entry(entry: Path, files: list[Path], hashes: list[str], text_field: str,
                 tokenizer, locked: bool = True, fmt: DocumentFormat | None = None) -> None:
    """Tokenize ``files`` into ``entry`` through a temporary directory renamed into place.
    ``locked``: this process holds the entry's lock, which every writer takes, so any other
    temporary directory of the entry was left by a writer that died, and is removed."""
    root = entry.parent
    for stale in root.glob(f".{entry.name}.*.partial") if locked else ():
        shutil.rmtree(stale, ignore_errors=True)
    partial = root / f".{entry.name}.{socket.gethostname()}.{os.getpid()}.partial"
    sources = [{"path": str(path), "size": path.stat().st_size, "sha256": digest}
               for path, digest in zip(files, hashes, strict=True)]
    try:
        write_corpus(files, partial, tokenizer, text_field=text_field,
                     fingerprint=entry.name.removeprefix("tokens-"), sources=sources,
                     shard_bytes=SHARD_BYTES, setting=CONFIG_TEXT_FIELD, document_format=fmt)
        if entry.exists():
            shutil.rmtree(entry)  # damaged: mapped files stay readable to processes using them
        try:
            os.rename(partial, entry)
        except OSError:
            if not _usable(entry, tokenizer):  # another writer (no lock on this fs) won
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    directory = os.open(root, os.O_RDONLY)  # the rename survives a power loss
    os.fsync(directory)
    os.close(directory)


def _disk_cached(key: tuple, cache_dir: str | Path | None, vocab_size: int, build) -> np.ndarray:
    """``build()``, or its result saved under ``cache_dir`` by an earlier run with the same key
    (the built-in corpus, which ``data.max_bytes`` bounds).

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

    Everything but the built-in corpus is memory-mapped, not loaded: the stream is read window
    by window, so a process's memory does not grow with the corpus.

    Documents are tokenized with ``tokenizer`` (no special tokens) and each is followed by
    ``tokenizer.eos_id`` when the tokenizer has one. What a document is depends on the source:

    - ``builtin``: each standard-library file of :func:`builtin_corpus_texts` (``data.max_bytes``
      bounds its size; the bound applies to the built-in corpus only). Tokenized in memory (and
      kept under ``cache_dir`` when one is given).
    - ``.txt``: each file.
    - ``.jsonl``: each non-blank line, a JSON object whose ``data.text_field`` is a string.
    - ``.parquet``: each non-null row of the string column ``data.text_field`` (read with pyarrow).
    - ``.bin``: already tokenized and taken as-is (no eos added): a headerless array of
      little-endian ``uint16`` token ids, or ``uint32`` when the tokenizer's ``vocab_size`` exceeds
      65535 (:func:`~meshtrain.data.shards.write_token_bin` writes one). Several ``.bin`` files
      are concatenated.
    - a directory written by ``meshtrain prepare`` (:mod:`meshtrain.data.prepare`): its shards,
      memory-mapped after checking they are complete and were written with ``tokenizer``
      (``data.text_field``, ``data.format`` and ``data.max_bytes`` do not apply; prepare decided
      the documents), and their loss mask when they hold chat or prompt_completion data.

    With ``data.format`` ``chat`` or ``prompt_completion`` each ``.jsonl`` row is one document
    (:mod:`meshtrain.data.supervised`) and the stream carries its loss mask, unless
    ``data.train_on = "all"``.

    ``.txt``, ``.jsonl`` and ``.parquet`` sources are tokenized once into the token cache under
    ``cache_dir`` (default :func:`data_cache_dir`) and memory-mapped from there
    (:func:`raw_corpus_dir`): the stream is the one ``meshtrain prepare`` writes of the same
    files. Results are also cached in-process per (source, files' sizes and mtimes, tokenizer),
    so building :class:`~meshtrain.data.train_data.TrainData` twice in one process reads the
    files once.
    """
    if is_prepared_dir(Path(data.source).expanduser()):  # meshtrain prepare's output: memory maps
        tokens = open_prepared_stream(Path(data.source).expanduser(), tokenizer)
        return tokens.without_mask() if data.train_on == "all" else tokens
    builtin = data.source == BUILTIN_SOURCE
    files = [] if builtin else find_source_files(data.source)
    if data.format != "text" and (builtin or files[0].suffix.lower() == ".bin"):
        raise ConfigError(f'data.format = "{data.format}" reads .jsonl rows, but data.source = '
                          f'"{data.source}" is {"the built-in corpus" if builtin else ".bin ids"};'
                          ' give .jsonl files, or a directory meshtrain prepare --format wrote.')
    key = (*_stream_key(data, tokenizer, files), str(data_cache_dir(cache_dir)))
    if key in _STREAM_CACHE:
        return _STREAM_CACHE[key]
    if builtin:
        tokens = TokenShards([_disk_cached(key[:-1], cache_dir, tokenizer.vocab_size,
                                           lambda: encode_documents(
                                               builtin_corpus_texts(data.max_bytes), tokenizer))])
    elif files[0].suffix.lower() == ".bin":
        tokens = TokenShards([read_token_bin(path, tokenizer.vocab_size) for path in files])
    else:
        tokens = open_prepared_stream(raw_corpus_dir(data, tokenizer, cache_dir, files), tokenizer)
        if data.train_on == "all":
            tokens = tokens.without_mask()
    if len(_STREAM_CACHE) >= _STREAM_CACHE_SIZE:
        _STREAM_CACHE.pop(next(iter(_STREAM_CACHE)))
    _STREAM_CACHE[key] = tokens
    return tokens
