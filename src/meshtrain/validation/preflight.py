"""Checks of the environment a valid config will run in, before any worker starts.

:func:`meshtrain.validation.run_config.validate_config` judges the config by itself; these checks
look at the machine: that the run directory can be written, that every data file can be read, is
not empty, and (for pre-tokenized ``.bin`` files) holds ids inside the tokenizer's vocabulary and
at least one whole sample. Each failure is a :class:`~meshtrain.config.ConfigError` (exit 2) that
names the path and what to do, raised before anything in the run directory is written or
overwritten.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from meshtrain.config import Config, ConfigError


def check_before_launch(config: Config) -> None:
    """Every check below, in order."""
    check_writable_dir(config.train.run_dir, "train.run_dir")
    if config.checkpoint.dir:
        check_writable_dir(config.checkpoint.dir, "checkpoint.dir")
    check_data_files(config)


def check_writable_dir(path_text: str, key: str) -> None:
    """``path_text`` is (or can be created as) a directory this process can write into.

    Creates the directory when missing (as the run would) and writes and removes a probe file,
    which also catches read-only mounts that permission bits do not show.
    """
    path = Path(path_text).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".meshtrain-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        if path.exists() and not path.is_dir():
            reason = "it is a file, not a directory"
        raise ConfigError(f'{key} = "{path_text}" is not a writable directory ({reason}); '
                          f"choose another directory (e.g. --run-dir runs/NAME).") from None


def _check_readable(path: Path) -> int:
    """Size of ``path`` after reading its first byte; ConfigError when unreadable or empty."""
    try:
        with open(path, "rb") as handle:
            handle.read(1)
        size = path.stat().st_size
    except OSError as error:
        raise ConfigError(f"data.source: cannot read {path} ({error.strerror or error}); check "
                          f"its permissions, or point data.source elsewhere.") from None
    if size == 0:
        raise ConfigError(f"data.source: {path} is empty; remove it or point data.source at "
                          f"files with data.")
    return size


def _check_bin(path: Path, vocab_size: int) -> int:
    """Number of tokens in a ``.bin`` file; ConfigError on a ragged size or an id >= vocab."""
    from meshtrain.data.shards import max_token, token_dtype

    dtype = token_dtype(vocab_size)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(f"data.source: {path} has {size} bytes, not a whole number of "
                          f"{dtype.itemsize}-byte token ids ({dtype.name}, the .bin format for a "
                          f"vocabulary of {vocab_size}).")
    # Ordinary bounded reads, not a memory map: a map's pages would count in this process's
    # resident memory, up to the whole corpus.
    top = max_token(path, dtype)
    if top >= vocab_size:
        raise ConfigError(
            f"data.source: {path} holds token id {top}, outside the tokenizer's vocabulary "
            f"of {vocab_size} (data.tokenizer = the tokenizer it was written with?).")
    return size // dtype.itemsize


def check_data_files(config: Config) -> None:
    """Every data file is readable and non-empty; ``.bin`` ids fit the vocabulary; a ``.bin``
    corpus holds at least one sample; ``.parquet`` files open and have the text column; a
    prepared directory is finished, whole, and was written with ``data.tokenizer``."""
    data = config.data
    for source in data.replica_sources:  # each replica group's own source, checked alike
        check_data_files(dataclasses.replace(
            config, data=dataclasses.replace(data, source=source, replica_sources=[])))
    if data.source == "builtin":
        return
    from meshtrain.data.prepared import is_prepared_dir, open_prepared
    from meshtrain.data.sources import find_source_files
    from meshtrain.data.tokenizer import load_tokenizer, tokenizer_vocab_size

    if is_prepared_dir(Path(data.source).expanduser()):  # meshtrain prepare's output
        shards = open_prepared(Path(data.source).expanduser(), load_tokenizer(data.tokenizer))
        total = sum(len(shard) for shard in shards)
        if total < config.train.seq_len + 1:
            raise ConfigError(f'data.source = "{data.source}" holds {total} tokens, fewer than one '
                              f"sample needs (train.seq_len + 1 = {config.train.seq_len + 1}).")
        return
    files = find_source_files(data.source)
    sizes = [_check_readable(path) for path in files]
    suffix = files[0].suffix.lower()
    if suffix == ".bin":
        vocab = tokenizer_vocab_size(data.tokenizer)
        total = sum(_check_bin(path, vocab) for path in files)
        if total < config.train.seq_len + 1:
            raise ConfigError(f'data.source = "{data.source}" holds {total} tokens, fewer than one '
                              f"sample needs (train.seq_len + 1 = {config.train.seq_len + 1}).")
    elif suffix == ".parquet":
        for path in files:
            _check_parquet(path, data.text_field)
    elif data.tokenizer == "bytes" and sum(sizes) + len(files) < config.train.seq_len + 1:
        raise ConfigError(f'data.source = "{data.source}" holds {sum(sizes)} bytes, fewer than one '
                          f"sample needs (train.seq_len + 1 = {config.train.seq_len + 1} tokens).")


def _check_parquet(path: Path, field: str) -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f'reading {path} needs the "pyarrow" package '
                          f'(pip install "meshtrain[data]").') from None
    try:
        names = pq.read_schema(path).names
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for damaged files
        raise ConfigError(f"data.source: {path} is not a readable Parquet file ({error}).") \
            from None
    if field not in names:
        raise ConfigError(f'data.source: {path} has no column "{field}" (data.text_field); '
                          f"columns: {', '.join(names)}.")
