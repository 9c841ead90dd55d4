"""Readers of text sources: one per format (``.txt``, ``.jsonl``, ``.parquet``), shared by
training from raw files (:func:`meshtrain.data.sources.load_token_stream`) and by
``meshtrain prepare`` (:mod:`meshtrain.data.prepare`), so both see the same documents.

Every reader streams: it reads a file, or one piece of it (a byte range starting at a line of a
``.txt``/``.jsonl`` file, a range of row groups of a ``.parquet`` file), in bounded chunks, and
decodes text as Python's text mode does (UTF-8, bad bytes replaced, universal newlines).
``report(n)``, when given, is called with the input bytes each chunk consumed (``meshtrain
prepare``'s progress bar, and where one of its workers learns that another one failed).

What a document is: a whole ``.txt`` file; each non-blank ``.jsonl`` line, a JSON object whose
``field`` is a string; each non-null row of a ``.parquet`` file's string column ``field``.
``setting`` names where ``field`` came from in error messages (``data.text_field`` for training,
``--text-field`` for ``meshtrain prepare``). Pre-tokenized ``.bin`` files are not text: see
:mod:`meshtrain.data.shards`. This module imports neither torch nor pyarrow at import time.
"""

from __future__ import annotations

import codecs
import io
import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from meshtrain.config import ConfigError

READ_BYTES = 4 << 20
"""Input bytes read (and decoded, tokenized, written) at a time."""
CONFIG_TEXT_FIELD = "data.text_field"
"""The ``setting`` that names the text field in training's error messages."""

Report = Callable[[int], None] | None


def text_chunks(path: str | Path, start: int = 0, end: int | None = None, final: bool = True,
                report: Report = None) -> Iterator[str]:
    """Bytes ``[start, end)`` of ``path`` (to its end when ``end`` is None) decoded as Python's
    text mode does (UTF-8, bad bytes replaced, universal newlines), in chunks of about
    :data:`READ_BYTES`. ``final``: the range ends the file (an incomplete last character is
    then decoded, as U+FFFD). Reports the bytes read. The ``.txt`` reader: a ``.txt`` document is
    the concatenation of a whole file's chunks."""
    if end is None:
        end = os.path.getsize(path)
    decoder = io.IncrementalNewlineDecoder(
        codecs.getincrementaldecoder("utf-8")(errors="replace"), translate=True)
    with open(path, "rb") as handle:
        handle.seek(start)
        position = start
        while position < end:
            data = handle.read(min(READ_BYTES, end - position))
            if not data:
                break
            position += len(data)
            if report is not None:
                report(len(data))
            yield decoder.decode(data, final=final and position >= end)


def line_number(path: str | Path, offset: int) -> int:
    """Lines (as text mode counts them) before byte ``offset`` of ``path``."""
    return sum(chunk.count("\n") for chunk in text_chunks(path, 0, offset, final=False))


def jsonl_texts(path: str | Path, field: str, start: int = 0, end: int | None = None,
                report: Report = None, setting: str = CONFIG_TEXT_FIELD) -> Iterator[str]:
    """The documents of the lines in bytes ``[start, end)`` of a ``.jsonl`` file (``start`` at a
    line start; the whole file by default): each non-blank line's string ``field``.

    Raises :class:`ConfigError` naming the file and line for a line that is not valid JSON, not
    an object with ``field``, or whose ``field`` is not a string.
    """
    carry, number = "", 0
    chunks = itertools.chain(text_chunks(path, start, end, final=True, report=report), [None])
    for chunk in chunks:
        lines = (carry + chunk).split("\n") if chunk is not None else [carry]
        carry = lines.pop() if chunk is not None else ""
        for line in lines:
            number += 1
            if not line.strip():
                continue
            try:
                record, problem = json.loads(line), None
            except json.JSONDecodeError as error:
                record, problem = None, f"not valid JSON ({error.msg})."
            if problem is None and (not isinstance(record, dict) or field not in record):
                problem = (f'no "{field}" field ({setting}); each line must be a JSON object '
                           f'like {{"{field}": "..."}}.')
            elif problem is None and not isinstance(record[field], str):
                problem = f'field "{field}" is {type(record[field]).__name__}, not a string.'
            if problem:
                where = line_number(path, start) + number
                raise ConfigError(f"{path}, line {where}: {problem}")
            yield record[field]


def open_parquet(path: str | Path, field: str, setting: str = CONFIG_TEXT_FIELD):
    """``path`` opened as a ``pyarrow.parquet.ParquetFile`` with a column ``field``.

    Raises :class:`ConfigError` when pyarrow is not installed, the file is not readable Parquet,
    or it has no column ``field``.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f'reading {path} needs the "pyarrow" package '
                          '(pip install "meshtrain[data]").') from None
    try:
        handle = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for damaged files
        raise ConfigError(f"{path}: not a readable Parquet file ({error}).") from None
    names = handle.schema_arrow.names
    if field not in names:
        raise ConfigError(f'{path}: no column "{field}" ({setting}); columns: '
                          f"{', '.join(names)}.")
    return handle


def parquet_texts(path: str | Path, field: str, first: int = 0, last: int | None = None,
                  report: Report = None, setting: str = CONFIG_TEXT_FIELD) -> Iterator[str]:
    """The documents of row groups ``[first, last)`` of a ``.parquet`` file (all by default):
    the non-null values of column ``field``, read 1024 rows at a time; reports each row group's
    uncompressed bytes. Raises :class:`ConfigError` as :func:`open_parquet` does."""
    handle = open_parquet(path, field, setting)
    last = handle.metadata.num_row_groups if last is None else last
    for group in range(first, last):
        for batch in handle.iter_batches(batch_size=1024, row_groups=[group], columns=[field]):
            yield from (text for text in batch.column(0).to_pylist() if text is not None)
        if report is not None:
            report(handle.metadata.row_group(group).total_byte_size)


def document_texts(path: str | Path, field: str,
                   setting: str = CONFIG_TEXT_FIELD) -> Iterator[str]:
    """Every document of the whole text file ``path``, chosen by its suffix (see the module
    docstring): a ``.txt`` file is one document, ``.jsonl``/``.parquet`` files hold many."""
    suffix = Path(path).suffix.lower()
    if suffix == ".txt":
        yield "".join(text_chunks(path))
    elif suffix == ".jsonl":
        yield from jsonl_texts(path, field, setting=setting)
    elif suffix == ".parquet":
        yield from parquet_texts(path, field, setting=setting)
    else:
        raise ValueError(f"{path}: not a text source (.txt, .jsonl, .parquet)")
