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
:mod:`meshtrain.data.shards`. :func:`find_source_files` resolves a source (a file, a directory, a
glob) to the files these readers read. This module imports neither torch nor pyarrow at import
time.

Time and memory are linear in the input whatever the line lengths: a line that spans many chunks
is collected as a list of pieces and joined once, and line ends are looked for in each new chunk
only, so a ``.jsonl`` line (a document) is held at most a few times over, never re-copied per
chunk.
"""

from __future__ import annotations

import codecs
import glob
import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from meshtrain.config import ConfigError
from meshtrain.data.prepared import is_prepared_dir, prepared_shard_files

READ_BYTES = 4 << 20
"""Input bytes read (and decoded, tokenized, written) at a time."""
CONFIG_TEXT_FIELD = "data.text_field"
"""The ``setting`` that names the text field in training's error messages."""

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet", ".bin")
"""Suffixes of the files a source may hold: text (read here) or pre-tokenized ``.bin``."""
BUILTIN_SOURCE = "builtin"
"""The ``data.source`` value that selects the built-in corpus."""
_GLOB_CHARS = frozenset("*?[")

Report = Callable[[int], None] | None


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


def jsonl_objects(path: str | Path, start: int = 0, end: int | None = None,
                  report: Report = None) -> Iterator[tuple[int, object]]:
    """``(number, value)`` of each non-blank line in bytes ``[start, end)`` of a ``.jsonl`` file
    (``start`` at a line start; the whole file by default): its parsed JSON and its number
    counted from ``start`` (:func:`line_of` gives the file's). Raises :class:`ConfigError`
    naming the file and line for a line that is not valid JSON."""
    number = 0
    for line in _lines(text_chunks(path, start, end, final=True, report=report)):
        number += 1
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}, line {line_of(path, start, number)}: not valid JSON "
                              f"({error.msg}).") from None
        del line  # a long line is not held beside its document
        yield number, value


def line_of(path: str | Path, start: int, number: int) -> int:
    """The line number in the file of line ``number`` of a piece starting at byte ``start``."""
    return line_number(path, start) + number


def jsonl_texts(path: str | Path, field: str, start: int = 0, end: int | None = None,
                report: Report = None, setting: str = CONFIG_TEXT_FIELD) -> Iterator[str]:
    """The documents of the lines in bytes ``[start, end)`` of a ``.jsonl`` file (``start`` at a
    line start; the whole file by default): each non-blank line's string ``field``.

    Raises :class:`ConfigError` naming the file and line for a line that is not valid JSON, not
    an object with ``field``, or whose ``field`` is not a string.
    """
    for number, record in jsonl_objects(path, start, end, report):
        problem = None
        if not isinstance(record, dict) or field not in record:
            problem = (f'no "{field}" field ({setting}); each line must be a JSON object '
                       f'like {{"{field}": "..."}}.')
        elif not isinstance(record[field], str):
            problem = f'field "{field}" is {type(record[field]).__name__}, not a string.'
        if problem:
            raise ConfigError(f"{path}, line {line_of(path, start, number)}: {problem}")
        text = record[field]
        del record
        yield text


def _lines(chunks) -> Iterator[str]:
    """The ``\\n``-separated lines of the concatenated ``chunks`` (the last one even when empty).

    Linear in the input: a line's pieces are collected in a list and joined once, and each chunk
    is split by itself, so a line spanning many chunks is never re-copied per chunk.
    """
    pending: list[str] = []  # pieces of the line not ended yet
    for chunk in chunks:
        lines = chunk.split("\n")
        del chunk
        if len(lines) == 1:
            pending.append(lines.pop())
            continue
        if pending:
            pending.append(lines[0])
            lines[0] = "".join(pending)
            pending.clear()
        if lines[-1]:
            pending.append(lines[-1])
        lines.pop()
        lines.reverse()
        while lines:
            yield lines.pop()  # popped, not kept here: the consumer may drop a long line
    lines = ["".join(pending)]
    pending.clear()
    yield lines.pop()


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
