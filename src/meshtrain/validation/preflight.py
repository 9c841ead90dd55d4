"""Checks of the environment a valid config will run in, before any worker starts.

:func:`meshtrain.validation.run_config.validate_config` judges the config by itself; these checks
look at the machine: that the run directory can be written, that every data file of every
source the run reads (``data.source``, each of ``data.sources`` or ``data.replica_sources``,
``data.valid_source``) can be read and is not empty, that the token ids of prepared directories
and pre-tokenized ``.bin`` files lie inside the vocabulary (one vectorised pass over each file
in bounded chunks, remembered per unchanged file: :func:`meshtrain.data.shards.scan_token_file`),
and that a source holds at least one whole sample. Each failure is a
:class:`~meshtrain.config.ConfigError` (exit 2) that names the key, the path and what to do,
raised before anything in the run directory is written or overwritten.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from meshtrain.config import Config, ConfigError


def check_before_launch(config: Config, verbose: bool = False) -> None:
    """Every check below, in order (``verbose``: print the token range checks' cost)."""
    check_writable_dir(config.train.run_dir, "train.run_dir")
    if config.checkpoint.dir:
        check_writable_dir(config.checkpoint.dir, "checkpoint.dir")
    check_data_files(config, verbose)


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


def _check_readable(path: Path, key: str = "data.source") -> int:
    """Size of ``path`` after reading its first byte; ConfigError when unreadable or empty."""
    try:
        with open(path, "rb") as handle:
            handle.read(1)
        size = path.stat().st_size
    except OSError as error:
        raise ConfigError(f"{key}: cannot read {path} ({error.strerror or error}); check "
                          f"its permissions, or point {key} elsewhere.") from None
    if size == 0:
        raise ConfigError(f"{key}: {path} is empty; remove it or point {key} at files with "
                          "data.")
    return size


def model_vocab_size(config: Config) -> int:
    """The model's vocabulary: ``model.vocab_size`` when set, else the tokenizer's."""
    if config.model.vocab_size:
        return config.model.vocab_size
    from meshtrain.data.tokenizer import tokenizer_vocab_size

    return tokenizer_vocab_size(config.data.tokenizer)


def replica_groups_here(config: Config) -> list[int]:
    """The replica groups whose processes this launch runs, so that a site reads only its own
    ``data.replica_sources`` entry: the one ``parallel.replica_group`` of a fault-tolerant group;
    under torchrun or ``srun`` the group of this rank (the replica dimension is the outermost,
    so rank // (world / replicas)); every group when this launch starts all the processes."""
    par = config.parallel
    if par.replicas <= 1:
        return [0]
    if par.replica_fault_tolerance:
        return [par.replica_group]
    from meshtrain.host.job import in_existing_job, job_rank, job_world_size

    if in_existing_job():
        per_group = max(1, job_world_size() // par.replicas)
        return [min(job_rank() // per_group, par.replicas - 1)]
    return list(range(par.replicas))


def token_sources(config: Config) -> list[tuple[str, str]]:
    """``(key, source)`` of every source this launch reads: ``data.source``, or each of
    ``data.sources`` (a mixture), or the ``data.replica_sources`` entries of the groups it runs
    (:func:`replica_groups_here`: a site never opens another site's data), and
    ``data.valid_source``."""
    data = config.data
    if data.replica_sources:
        pairs = [(f"data.replica_sources[{i}]", data.replica_sources[i])
                 for i in replica_groups_here(config)]
    elif data.sources:
        pairs = [(f"data.sources[{i}]", item["path"]) for i, item in enumerate(data.sources)]
    else:
        pairs = [("data.source", data.source)]
    if data.valid_source:
        pairs.append(("data.valid_source", data.valid_source))
    return pairs


def _report(verbose: bool, scan, what: str, vocab: int) -> None:
    if not verbose:
        return
    how = (f"in {scan.seconds:.2f} s" if scan.scanned
           else f"(remembered from an earlier check, {scan.seconds:.3f} s)")
    print(f"meshtrain: checked {scan.tokens:,} tokens of {what} {how}: largest id "
          f"{scan.max_id} < vocabulary {vocab}", file=sys.stderr, flush=True)


def _check_bin(path: Path, vocab_size: int, key: str = "data.source", tokenizer: str = "bytes"):
    """Range check (:class:`~meshtrain.data.shards.TokenScan`) of a ``.bin`` file; ConfigError
    on a ragged size or an id >= the tokenizer's vocabulary ``vocab_size``."""
    from meshtrain.data.shards import check_token_file, token_dtype

    dtype = token_dtype(vocab_size)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(f"{key}: {path} has {size} bytes, not a whole number of "
                          f"{dtype.itemsize}-byte token ids ({dtype.name}, the .bin format for a "
                          f"vocabulary of {vocab_size}).")
    # Ordinary bounded reads, not a memory map: a map's pages would count in this process's
    # resident memory, up to the whole corpus.
    try:
        return check_token_file(path, dtype, vocab_size,
                                f'the tokenizer "{tokenizer}" (data.tokenizer, which .bin ids '
                                "are read with)")
    except ConfigError as error:
        raise ConfigError(f"{key}: {error}") from None


def _too_short(key: str, source: str, tokens: int, seq_len: int, unit: str = "tokens") -> None:
    if tokens < seq_len + 1:
        raise ConfigError(f'{key} = "{source}" holds {tokens} {unit}, fewer than one sample '
                          f"needs (train.seq_len + 1 = {seq_len + 1} tokens).")


def check_data_files(config: Config, verbose: bool = False) -> None:
    """Every source the run reads (:func:`token_sources`) is checked before launch: its files
    are readable and non-empty; the token ids of a prepared directory and of ``.bin`` files are
    range-checked (a prepared directory against the model's vocabulary, :func:`model_vocab_size`;
    ``.bin`` files against the tokenizer's, whose size also fixes their element type); a token
    source holds at least one sample; ``.parquet`` files open and have the text column; a
    prepared directory is finished, whole, and was written with ``data.tokenizer``. ``verbose``:
    print what each range check read and how long it took."""
    for key, source in token_sources(config):
        _check_source(config, key, source, verbose)


def _check_source(config: Config, key: str, source: str, verbose: bool) -> None:
    data = config.data
    if source == "builtin":
        return
    from meshtrain.data.prepared import check_prepared_ids, is_prepared_dir, open_prepared
    from meshtrain.data.readers import find_source_files
    from meshtrain.data.tokenizer import load_tokenizer, tokenizer_vocab_size

    # The sample-size check concerns what is trained on, not the held-out source.
    seq_len = 0 if key == "data.valid_source" else config.train.seq_len
    directory = Path(source).expanduser()
    if is_prepared_dir(directory):  # meshtrain prepare's output
        shards = open_prepared(directory, load_tokenizer(data.tokenizer))
        vocab = model_vocab_size(config)
        whose = ("the model's vocabulary (model.vocab_size)" if config.model.vocab_size
                 else "the model's vocabulary (data.tokenizer's, as model.vocab_size = 0)")
        try:
            scan = check_prepared_ids(directory, vocab, whose)
        except ConfigError as error:
            raise ConfigError(f"{key}: {error}") from None
        _report(verbose, scan, str(directory), vocab)
        _too_short(key, source, sum(len(shard) for shard in shards), seq_len)
        return
    files = find_source_files(source)
    sizes = [_check_readable(path, key) for path in files]
    suffix = files[0].suffix.lower()
    if suffix == ".bin":
        vocab = tokenizer_vocab_size(data.tokenizer)
        scans = [_check_bin(path, vocab, key, data.tokenizer) for path in files]
        scan = scans[0]
        for more in scans[1:]:
            scan = scan + more
        _report(verbose, scan, source, vocab)
        _too_short(key, source, scan.tokens, seq_len)
    elif suffix == ".parquet":
        for path in files:
            _check_parquet(path, data.text_field, key)
    elif data.tokenizer == "bytes" and data.format == "text":  # a chat template adds bytes
        _too_short(key, source, sum(sizes) + len(files), seq_len, "bytes")


def _check_parquet(path: Path, field: str, key: str = "data.source") -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f'reading {path} needs the "pyarrow" package '
                          f'(pip install "meshtrain[data]").') from None
    try:
        names = pq.read_schema(path).names
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for damaged files
        raise ConfigError(f"{key}: {path} is not a readable Parquet file ({error}).") from None
    if field not in names:
        raise ConfigError(f'{key}: {path} has no column "{field}" (data.text_field); '
                          f"columns: {', '.join(names)}.")
