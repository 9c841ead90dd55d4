"""Streaming readers of ``meshtrain prepare``'s sources: one piece of a ``.txt``/``.jsonl``
file (a byte range starting at a line) or of a ``.parquet`` file (a range of row groups), in
bounded chunks, decoded exactly as training decodes them (UTF-8, bad bytes replaced, universal
newlines). ``report(n)``, when given, is called with the input bytes each chunk consumed
(the progress bar, and where a worker learns that another one failed)."""

from __future__ import annotations

import codecs
import io
import itertools
import json

from meshtrain.config import ConfigError

READ_BYTES = 4 << 20  # bytes read (and decoded, tokenized, written) at a time
BATCH_CHARS = 1 << 20  # characters of jsonl/parquet documents tokenized together


def text_chunks(path: str, start: int, end: int, final: bool, report=None):
    """Bytes ``[start, end)`` of ``path`` decoded as Python's text mode does (UTF-8, bad bytes
    replaced, universal newlines), in chunks of about ``READ_BYTES``; reports bytes read."""
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


def line_number(path: str, offset: int) -> int:
    """Lines (as text mode counts them) before byte ``offset`` of ``path``."""
    return sum(chunk.count("\n") for chunk in text_chunks(path, 0, offset, final=False))


def jsonl_texts(path: str, start: int, end: int, field: str, report=None):
    """The documents of the lines in ``[start, end)``: ConfigError naming a bad line."""
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
                problem = (f'no "{field}" field (--text-field); each line must be a JSON object '
                           f'like {{"{field}": "..."}}.')
            elif problem is None and not isinstance(record[field], str):
                problem = f'field "{field}" is {type(record[field]).__name__}, not a string.'
            if problem:
                where = line_number(path, start) + number
                raise ConfigError(f"{path}, line {where}: {problem}")
            yield record[field]


def parquet_texts(path: str, first: int, last: int, field: str, report=None):
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(path)
    for group in range(first, last):
        for batch in handle.iter_batches(batch_size=1024, row_groups=[group], columns=[field]):
            yield from (text for text in batch.column(0).to_pylist() if text is not None)
        if report is not None:
            report(handle.metadata.row_group(group).total_byte_size)


def batches(texts, limit: int = BATCH_CHARS):
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
