"""``meshtrain prepare``: tokenize text sources once into a directory of memory-mappable shards.

The directory's layout is in :mod:`meshtrain.data.prepared` and ``docs/data.md``.
The sources are cut into pieces of about ``shard_bytes`` input bytes: ``.txt``/``.jsonl`` files
at line starts, ``.parquet`` files at row groups; consecutive small pieces share a job. Each job
becomes one shard, written by one of ``workers`` processes that read its pieces in bounded chunks,
so memory does not grow with the input and several workers share one large file. The cut points
do not depend on ``workers``, so the output is the same for any number of workers.

The token stream is the one training from the same raw files builds
(:func:`meshtrain.data.sources.load_token_stream`), read by the same readers
(:mod:`meshtrain.data.readers`): files in sorted order, each document (a ``.txt`` file, a
non-blank ``.jsonl`` line, a non-null parquet row) followed by the eos id (if any). A ``.txt``
document is tokenized piece by piece, cut after a newline followed by a non-space character: the
same ids for the byte tokenizer and for Hugging Face tokenizers whose pre-tokenizer splits there
(:func:`lines_split_safely`; otherwise each ``.txt`` file is tokenized whole).

Time is linear in the input and memory bounded by a few times the longest document, whatever the
line lengths: a ``.txt`` stretch without a cut point or a long ``.jsonl`` line is collected as a
list of chunks and joined once, and cut points are looked for in each new chunk only.

:func:`write_corpus` is the writer itself: ``meshtrain prepare`` calls it after checking its
arguments, and training from raw text sources calls it to fill its token cache
(:func:`meshtrain.data.sources.raw_corpus_dir`), so both write the same format the same way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import re
import sys
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from meshtrain.config import ConfigError
from meshtrain.data.encoding import (
    Encoder,
    ShardWriter,
    batches,
    lines_split_safely,
    safe_cut,
    write_txt,
)
from meshtrain.data.prepared import (
    FORMAT,
    MARKER,
    META,
    is_complete,
    is_prepared_dir,
    read_meta,
    tokenizer_hash,
)
from meshtrain.data.readers import (
    find_source_files,
    jsonl_texts,
    open_parquet,
    parquet_texts,
    text_chunks,
)
from meshtrain.data.shards import token_dtype
from meshtrain.data.supervised import DocumentFormat, masked_rows

SHARD_BYTES = 16 << 20
"""Input bytes per shard (a job of one worker)."""
OPTION_TEXT_FIELD = "--text-field"
"""How error messages name the text field (the command-line option)."""
_SCAN_BYTES = 1 << 16
_SAFE_LINE_START = re.compile(rb"\n(?=[\x21-\x7e])")  # a newline, then printable non-space ASCII
_OWN_FILE = re.compile(r"(shard-\d{5}\.(bin|idx|mask)|meta\.json|COMPLETE)(\.partial)?")
_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
# The encoder and shard writer live in meshtrain.data.encoding; these names are kept here.
_Encoder, _ShardWriter, _safe_cut, _batches = Encoder, ShardWriter, safe_cut, batches

# -------------------------------------------------------------------------------------- workers

_PROGRESS = None  # a shared counter of input bytes read (worker processes)
_STOP = None  # set by the parent when another job failed: stop early


def _report(done: int) -> None:
    if _STOP is not None and _STOP.is_set():
        raise ConfigError("stopped: another worker failed")
    if callable(_PROGRESS):
        _PROGRESS(done)
    elif _PROGRESS is not None:
        with _PROGRESS.get_lock():
            _PROGRESS.value += done


def _init_worker(counter, stop) -> None:
    global _PROGRESS, _STOP
    _PROGRESS, _STOP = counter, stop
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism


def _tokenize_job(job: dict) -> dict:
    """Worker: tokenize the pieces of one job into ``shard-NNNNN.bin``/``.idx`` (and ``.mask``
    for chat / prompt_completion data)."""
    encoder = _Encoder(job["tokenizer"], job["dtype"])
    fmt: DocumentFormat = job["format"]
    writer = _ShardWriter(Path(job["out"]) / f"shard-{job['index']:05d}", masked=fmt.masked)
    try:
        for path, kind, start, end, ends_file in job["pieces"]:
            if fmt.masked:  # .jsonl rows of chat / prompt_completion: ids and their loss mask
                rows = masked_rows(path, fmt, start, end, report=_report)
                for batch in batches(rows, length=lambda row: len(row[0])):
                    writer.write(*encoder.masked_documents(batch))
                continue
            if kind == "txt":
                write_txt(writer, encoder, text_chunks(path, start, end, final=ends_file,
                                                       report=_report), job["split"])
                if ends_file:
                    writer.write(encoder.eos_array(), np.array([len(encoder.eos_array())]))
                continue
            read = jsonl_texts if kind == "jsonl" else parquet_texts
            texts = read(path, job["field"], start, end, report=_report, setting=job["setting"])
            for batch in _batches(texts):
                writer.write(*encoder.documents(batch))
        writer.finish()
    finally:
        for handle in writer.handles:
            handle.close()
    shard = {"file": writer.stem.name + ".bin", "tokens": writer.tokens,
             "documents": writer.documents,
             "sources": [{"path": p[0], "kind": p[1], "start": p[2], "end": p[3]}
                         for p in job["pieces"]]}
    if fmt.masked:
        shard["mask"] = writer.stem.name + ".mask"
    return shard


# ------------------------------------------------------------------------------------- planning


def _cut_points(path: Path, size: int, step: int, pattern: re.Pattern) -> list[int]:
    """``[0, ..., size]``: offsets about ``step`` apart, each just after a ``pattern`` match."""
    points = [0]
    with open(path, "rb") as handle:
        target = step
        while target < size:
            handle.seek(target)
            position, found = target, None
            while found is None and (block := handle.read(_SCAN_BYTES)):
                match = pattern.search(block)
                if match:
                    found = position + match.start() + 1
                elif len(block) > 1:
                    position += len(block) - 1
                    handle.seek(position)
                else:
                    break
            if found is None or found >= size:
                break
            points.append(found)
            target = found + step
    return [*points, size]


def _parquet_groups(path: Path, field: str, setting: str) -> list[int]:
    """Uncompressed bytes of each row group; ConfigError when unreadable, without ``field`` or
    when ``field`` does not hold strings."""
    handle = open_parquet(path, field, setting)
    kind = str(handle.schema_arrow.field(field).type)
    if "string" not in kind:  # string, large_string, dictionary<values=string, ...>
        raise ConfigError(f'{path}: column "{field}" holds {kind}, not strings.')
    meta = handle.metadata
    return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]


def _plan(files: list[Path], field: str, shard_bytes: int, split: bool,
          setting: str = OPTION_TEXT_FIELD) -> tuple[list[list[tuple]], int]:
    """The pieces of every job, in corpus order: ``(path, kind, start, end, ends_file)``; and
    the input bytes workers will report (row-group sizes for parquet)."""
    pieces: list[tuple[tuple, int]] = []
    for path in files:
        kind, size = _KINDS[path.suffix.lower()], path.stat().st_size
        if kind == "parquet":
            sizes = _parquet_groups(path, field, setting)
            pieces += [((str(path), kind, i, i + 1, i == len(sizes) - 1), s)
                       for i, s in enumerate(sizes)]
            continue
        if kind == "txt" and not split:
            points = [0, size]
        else:
            points = _cut_points(path, size, shard_bytes, _SAFE_LINE_START)
        pieces += [((str(path), kind, a, b, b == size), b - a)
                   for a, b in itertools.pairwise(points)]
    jobs: list[list[tuple]] = []
    filled = 0
    for piece, size in pieces:
        if not jobs or (filled + size > shard_bytes and filled):
            jobs.append([])
            filled = 0
        jobs[-1].append(piece)
        filled += size
    return jobs, sum(size for _, size in pieces)


def _source_files(sources: list[str], out: Path) -> list[Path]:
    """The text files ``sources`` name, sorted as training sorts them; files under ``out``
    (an earlier output) are left out. ConfigError for a missing, unreadable or empty one."""
    found: dict[Path, Path] = {}
    for source in sources:
        if is_prepared_dir(Path(source).expanduser()):
            raise ConfigError(f'"{source}" is already a prepared corpus; give it to data.source '
                              "to train from it.")
        if not set("*?[") & set(source) and not Path(source).expanduser().exists():
            raise ConfigError(f'source "{source}" does not exist; give .txt, .jsonl or .parquet '
                              "files, directories or globs of them.")
        try:
            paths = find_source_files(source)
        except ConfigError as error:  # its messages name the config key; here it is a source
            raise ConfigError(str(error).replace("data.source: ", "source ", 1)) from None
        for path in paths:
            resolved = path.resolve()
            if out.resolve() not in resolved.parents:
                found.setdefault(resolved, path)
    files = sorted(found.values())
    if not files:
        raise ConfigError(f"{', '.join(sources)}: no .txt, .jsonl or .parquet file to prepare.")
    for path in files:
        if path.suffix.lower() not in _KINDS:
            raise ConfigError(f"{path}: meshtrain prepare reads text (.txt, .jsonl, .parquet); "
                              ".bin files are already tokenized: give them to data.source.")
        try:
            with open(path, "rb") as handle:
                handle.read(1)
        except OSError as error:
            raise ConfigError(f"{path}: cannot be read ({error.strerror or error}).") from None
        if path.stat().st_size == 0:
            raise ConfigError(f"{path}: the file is empty; remove it or leave it out.")
    return files


# ------------------------------------------------------------------------------------ prepare


def _clear(out: Path) -> None:
    """Remove what ``meshtrain prepare`` wrote in ``out`` (the marker first); nothing else."""
    (out / MARKER).unlink(missing_ok=True)
    for path in out.iterdir():
        if _OWN_FILE.fullmatch(path.name) and path.name != META:
            path.unlink()
    (out / META).unlink(missing_ok=True)


def _write_json(path: Path, data: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def tokenizer_identity(tokenizer) -> dict:
    """The ``tokenizer`` field of ``meta.json``: name, sha256, vocabulary size, eos id."""
    return {"name": tokenizer.name, "hash": tokenizer_hash(tokenizer),
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}


def write_corpus(files: list[Path], out: Path, tokenizer, *, text_field: str, fingerprint: str,
                 sources: list[dict], spec: str | None = None, workers: int = 1,
                 progress: bool = False, shard_bytes: int = SHARD_BYTES,
                 setting: str = OPTION_TEXT_FIELD, empty: str | None = None,
                 document_format: DocumentFormat | None = None) -> dict:
    """Tokenize the text ``files`` (in this order) with ``tokenizer`` into the directory ``out``
    (created; or cleared of what ``meshtrain prepare`` writes) as a finished prepared corpus whose
    ``COMPLETE`` marker holds ``fingerprint``; return its meta.

    ``document_format`` (default text) says what a document is: for chat and prompt_completion
    (``.jsonl`` files only) every shard gets a ``.mask`` beside it, the loss mask of its tokens.

    ``sources`` is what ``meta.json`` records of the files; ``setting`` how error messages name
    the text field; ``empty``, when given, the message of the :class:`ConfigError` raised when
    the files hold no token at all (else an empty corpus is written). ``workers`` > 1 needs
    ``spec``, the tokenizer's ``data.tokenizer`` string, for the spawned workers to load it. On
    any failure what was written is removed (and ``out`` too when this call created it).
    """
    fmt = document_format or DocumentFormat()
    for path in files if fmt.masked else ():
        if path.suffix.lower() != ".jsonl":
            raise ConfigError(f'{path}: data.format = "{fmt.kind}" reads .jsonl files only (one '
                              "JSON object per line); convert it, or prepare it separately as "
                              "text.")
    identity = tokenizer_identity(tokenizer)
    split = lines_split_safely(tokenizer)  # always true for bytes
    jobs, total = _plan(files, text_field, shard_bytes, split, setting)
    dtype = token_dtype(identity["vocab_size"])
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    _clear(out)
    meta = {"format": FORMAT, "complete": False, "fingerprint": fingerprint,
            "tokenizer": identity, "vocab_size": identity["vocab_size"], "dtype": dtype.name,
            "text_field": text_field, "shard_bytes": shard_bytes, "sources": sources}
    if fmt.masked:  # text corpora keep the meta.json they always had
        meta.update(data_format=fmt.kind, loss_mask="uint8",
                    chat_template=None if fmt.template is None else fmt.template.sha256)
    _write_json(out / META, meta)  # marks the directory as ours (unfinished) from the start
    spawned = workers > 1 and len(jobs) > 1
    if spawned and spec is None:
        raise ValueError("write_corpus with workers > 1 needs the tokenizer's spec")
    specs = [{"index": i, "pieces": pieces, "tokenizer": spec if spawned else tokenizer,
              "field": text_field, "dtype": dtype.str, "out": str(out), "split": split,
              "setting": setting, "format": fmt} for i, pieces in enumerate(jobs)]
    try:
        results = _run_jobs(specs, workers, progress, total)
        if empty is not None and not sum(r["tokens"] for r in results):
            raise ConfigError(empty)
    except BaseException:
        _clear(out)  # nothing half-written or complete-looking is left behind
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    meta.update(complete=True, tokens=sum(r["tokens"] for r in results),
                documents=sum(r["documents"] for r in results), shards=results)
    _write_json(out / META, meta)
    marker = out / (MARKER + ".partial")
    marker.write_text(fingerprint + "\n")
    os.replace(marker, out / MARKER)  # atomic: only a finished directory has COMPLETE
    directory = os.open(out, os.O_RDONLY)  # the renames themselves survive a power loss
    os.fsync(directory)
    os.close(directory)
    return meta


def prepare(sources: list[str], out: str | Path, tokenizer: str = "bytes", text_field: str = "text",
            workers: int = 1, progress: bool = False, shard_bytes: int = SHARD_BYTES,
            data_format: str = "text", chat_template: str = "") -> dict:
    """Tokenize ``sources`` (files, directories, globs) into the directory ``out``; return its
    meta (with ``"up_to_date": True`` when an earlier run already prepared the same input).
    ``data_format`` and ``chat_template`` are ``data.format`` and ``data.chat_template``'s: chat
    and prompt_completion ``.jsonl`` rows are stored with their loss mask (``docs/data.md``).

    Raises :class:`ConfigError` before any worker starts for a missing, unreadable or empty
    source, a parquet file without the ``text_field`` column, a tokenizer that does not load, or
    an ``out`` that is neither empty nor a prepared corpus; and after, for a bad ``.jsonl`` line
    (no marker is then written). ``progress`` draws a progress bar on stderr. With ``workers``
    > 1 the workers are started with multiprocessing's "spawn" (they do not inherit ``torch``),
    so a script calling this must do so under ``if __name__ == "__main__":``.
    """
    from meshtrain.data.tokenizer import load_tokenizer

    if workers < 1:
        raise ConfigError(f"--workers = {workers} must be at least 1.")
    if shard_bytes < 1:
        raise ConfigError(f"shard_bytes = {shard_bytes} must be at least 1.")
    out = Path(out).expanduser()
    files = _source_files(sources, out)
    try:
        loaded = load_tokenizer(tokenizer)
    except ConfigError as error:
        raise ConfigError(str(error).replace("data.tokenizer:", "--tokenizer:", 1)) from None
    fmt = _document_format(data_format, chat_template, tokenizer)
    stats = [{"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
             for p in files]
    key = [[str(p.resolve()), s["size"], s["mtime_ns"]] for p, s in zip(files, stats, strict=True)]
    fingerprint = hashlib.sha256(json.dumps(
        [FORMAT, key, text_field, tokenizer_hash(loaded), shard_bytes]
        + ([fmt.key()] if fmt.masked else [])).encode()).hexdigest()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a new or empty directory.")
    if is_complete(out) and read_meta(out)["fingerprint"] == fingerprint:
        return {**read_meta(out), "up_to_date": True}
    if out.is_dir() and any(out.iterdir()) and not is_prepared_dir(out):
        raise ConfigError(f"--out {out} exists and is not a prepared corpus (no {META} of "
                          "meshtrain prepare); give a new or empty directory, nothing in it is "
                          "deleted.")
    meta = write_corpus(files, out, loaded, text_field=text_field, fingerprint=fingerprint,
                        sources=stats, spec=tokenizer, workers=workers, progress=progress,
                        shard_bytes=shard_bytes, document_format=fmt,
                        empty=f"{', '.join(sources)}: no document to prepare (only blank lines "
                              "or null rows).")
    return {**meta, "up_to_date": False}


def _document_format(data_format: str, chat_template: str, tokenizer: str) -> DocumentFormat:
    """The :class:`DocumentFormat` of ``--format`` / ``--chat-template``; ConfigError naming the
    valid formats, or what the chat template lacks."""
    from meshtrain.config.sections import DATA_FORMATS

    if data_format not in DATA_FORMATS:
        raise ConfigError(f'--format "{data_format}" is not one of {", ".join(DATA_FORMATS)}.')
    if chat_template and data_format != "chat":
        raise ConfigError(f'--chat-template applies to --format chat only, not "{data_format}".')
    if data_format != "chat":
        return DocumentFormat(data_format)
    from meshtrain.data.chat_template import load_chat_template

    return DocumentFormat("chat", load_chat_template(chat_template, tokenizer, "--chat-template"))


def _run_jobs(jobs: list[dict], workers: int, progress: bool, total: int) -> list[dict]:
    """Run :func:`_tokenize_job` over ``jobs``: in this process when one worker (or one job)
    suffices, else in ``workers`` spawned processes; a rich progress bar on stderr."""
    global _PROGRESS
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = ("[progress.description]{task.description}", BarColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), disable=not progress) as bar:
        task = bar.add_task("tokenizing", total=total)
        if workers <= 1 or len(jobs) <= 1:
            _PROGRESS = lambda done: bar.advance(task, done)  # noqa: E731
            try:
                return [_tokenize_job(job) for job in jobs]
            finally:
                _PROGRESS = None
        context = multiprocessing.get_context("spawn")  # workers do not inherit torch
        counter, stop = context.Value("q", 0), context.Event()
        pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context,
                                   initializer=_init_worker, initargs=(counter, stop))
        futures = [pool.submit(_tokenize_job, job) for job in jobs]
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
                bar.update(task, completed=counter.value)
                for future in done:
                    future.result()  # the first failure is raised here
            return [future.result() for future in futures]
        except BrokenProcessPool:
            from meshtrain.errors import RunFailure

            raise RunFailure("a meshtrain prepare worker died (killed, or out of memory?); "
                             "nothing was marked complete: run it again.") from None
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
