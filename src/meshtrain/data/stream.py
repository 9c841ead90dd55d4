"""Training data: corpus sources, one token stream, fixed-length packing, a deterministic sampler.

:func:`load_token_stream` turns ``data.source`` into one 1-D token tensor; :class:`PackedDataset`
cuts it into ``(inputs, targets)`` samples; :class:`GlobalBatchSampler` assigns each step's global
batch to data-parallel ranks and micro-batches as contiguous slices, so the sequences of a step
never depend on the layout. :class:`~meshtrain.data.train_data.TrainData` ties them together
and holds the resumable position.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from meshtrain.config import ConfigError, DataConfig
from meshtrain.data.builtin_corpus import builtin_corpus_texts
from meshtrain.data.shards import TokenShards, max_token, open_bin
from meshtrain.data.tokenizer import ByteTokenizer

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet", ".bin")
BUILTIN_SOURCE = "builtin"
_GLOB_CHARS = frozenset("*?[")


# --------------------------------------------------------------------------------------- sources


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
        from meshtrain.data.prepared import is_prepared_dir, prepared_shard_files

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


def _jsonl_texts(path: Path, field: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                msg = f"{path}, line {line_number}: not valid JSON ({error.msg})."
                raise ConfigError(msg) from None
            if not isinstance(record, dict) or field not in record:
                raise ConfigError(
                    f'{path}, line {line_number}: no "{field}" field (data.text_field); each '
                    f'line must be a JSON object like {{"{field}": "..."}}.'
                )
            if not isinstance(record[field], str):
                raise ConfigError(
                    f'{path}, line {line_number}: field "{field}" is '
                    f"{type(record[field]).__name__}, not a string."
                )
            texts.append(record[field])
    return texts


def _parquet_texts(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        msg = f'reading {path} needs the "pyarrow" package (pip install "meshtrain[data]").'
        raise ConfigError(msg) from None
    try:
        schema = pq.read_schema(path)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for damaged files
        raise ConfigError(f"{path}: not a readable Parquet file ({error}).") from None
    if field not in schema.names:
        columns = ", ".join(schema.names)
        raise ConfigError(f'{path}: no column "{field}" (data.text_field); columns: {columns}.')
    column = pq.read_table(path, columns=[field]).column(field)
    return [text for text in column.to_pylist() if text is not None]


def _document_texts(path: Path, field: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [path.read_text(encoding="utf-8", errors="replace")]
    if suffix == ".jsonl":
        return _jsonl_texts(path, field)
    return _parquet_texts(path, field)


def bin_dtype(vocab_size: int) -> np.dtype:
    """The element type of a ``.bin`` token file for a vocabulary of ``vocab_size`` ids."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def write_token_bin(path: str | Path, tokens, vocab_size: int) -> None:
    """Write ``tokens`` as a ``.bin`` file for :func:`load_token_stream` (see its format)."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}) to be written to {path}")
    array.astype(bin_dtype(vocab_size)).tofile(path)


def _read_bin(path: Path, vocab_size: int) -> np.ndarray:
    """``path`` memory-mapped as token ids, after checking its size and its largest id."""
    dtype = bin_dtype(vocab_size)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
            f"{path}: {size} bytes is not a whole number of {dtype.itemsize}-byte tokens; "
            f"expected little-endian {dtype.name} ids for a vocabulary of {vocab_size}."
        )
    top = max_token(path, dtype)
    if top >= vocab_size:
        raise ConfigError(
            f"{path}: token id {top} is outside the tokenizer's vocabulary "
            f"({vocab_size}); was it written with a different tokenizer?"
        )
    return open_bin(path, dtype)


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
        return build().astype(bin_dtype(vocab_size))
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
    np.save(partial, stream.astype(bin_dtype(vocab_size)))
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
      65535 (:func:`write_token_bin` writes one). Several ``.bin`` files are concatenated.
    - a directory written by ``meshtrain prepare`` (:mod:`meshtrain.data.prepare`): its shards,
      memory-mapped after checking they are complete and were written with ``tokenizer``
      (``data.text_field`` and ``data.max_bytes`` do not apply; prepare decided the documents).

    Results are cached in-process per (source, files' sizes and mtimes, tokenizer), so building
    :class:`TrainData` twice in one process tokenizes once; with ``cache_dir`` tokenized text is
    also kept on disk there (worth it for slow Hugging Face tokenizers; bytes take ~0.2 s/4 MB).
    """
    from meshtrain.data.prepared import is_prepared_dir, open_prepared

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
        stream = [_read_bin(path, tokenizer.vocab_size) for path in files]
    else:
        stream = _disk_cached(key, cache_dir, tokenizer.vocab_size, lambda: encode_documents(
            [text for path in files for text in _document_texts(path, data.text_field)], tokenizer))
    tokens = TokenShards(stream if isinstance(stream, list) else [stream])
    if len(_STREAM_CACHE) >= _STREAM_CACHE_SIZE:
        _STREAM_CACHE.pop(next(iter(_STREAM_CACHE)))
    _STREAM_CACHE[key] = tokens
    return tokens


# ------------------------------------------------------------------------------- packing/sampling


class PackedDataset:
    """Fixed-length samples cut from one token stream, with next-token targets.

    Sample ``i`` is ``(tokens[i*L : i*L+L], tokens[i*L+1 : i*L+L+1])`` for ``L = seq_len``:
    consecutive non-overlapping windows whose targets are the inputs shifted by one. Documents run
    across sample boundaries (separated by eos), so no token is wasted on padding.
    """

    def __init__(self, tokens: TokenShards | Tensor, seq_len: int):
        if seq_len < 1:
            raise ConfigError(f"train.seq_len = {seq_len} must be at least 1.")
        self.tokens = TokenShards.of(tokens)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        window = torch.from_numpy(self.tokens.window(index * self.seq_len, self.seq_len + 1))
        return window[:-1], window[1:]

    def batch(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        """Samples ``indices`` stacked: ``(inputs, targets)``, each ``[len(indices), seq_len]``."""
        length = self.seq_len + 1
        window = np.empty((len(indices), length), dtype=np.int64)
        for row, index in enumerate(indices):
            window[row] = self.tokens.window(index * self.seq_len, length)
        window = torch.from_numpy(window)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def rank_microbatches(indices: list, dp_rank: int, dp_size: int,
                      microbatches: int) -> list[list]:
    """Data-parallel rank ``dp_rank``'s contiguous share of a global batch's ``indices``, cut
    into ``microbatches`` equal lists (every sampler and the evaluator split batches this way,
    so the sequences of a batch never depend on the layout)."""
    per_rank = len(indices) // dp_size
    per_micro = per_rank // microbatches
    mine = indices[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [mine[j * per_micro:(j + 1) * per_micro] for j in range(microbatches)]


class GlobalBatchSampler:
    """Deterministic assignment of samples to steps, data-parallel ranks and micro-batches.

    Epoch ``e`` visits the samples in ``torch.randperm`` order from a generator seeded with
    ``seed * 1_000_003 + e``; epochs are concatenated into one stream and the global batch of step
    ``k`` is stream positions ``[k*GB, (k+1)*GB)`` (it may straddle two epochs). That batch does
    not depend on ``dp_size`` or ``microbatches``: rank ``r`` takes the contiguous slice
    ``[r*GB/dp, (r+1)*GB/dp)`` and micro-batch ``j`` is the ``j``-th equal chunk of that slice.
    ``step`` is the position of the next step to train, saved by :meth:`state_dict`.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, microbatches: int = 1):
        if num_samples < 1:
            raise ConfigError("the training data holds no complete sample; add data or shorten "
                              "train.seq_len.")
        if global_batch < 1 or dp_size < 1 or microbatches < 1:
            raise ConfigError(f"train.global_batch ({global_batch}), dp ({dp_size}) and "
                              f"microbatches ({microbatches}) must all be at least 1.")
        if global_batch % (dp_size * microbatches):
            raise ConfigError(
                f"train.global_batch = {global_batch} is not divisible by dp × microbatches = "
                f"{dp_size} × {microbatches} = {dp_size * microbatches}; choose a multiple of "
                f"{dp_size * microbatches}."
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.microbatches = microbatches
        self.step = 0
        self._epochs: dict[int, Tensor] = {}

    def epoch_order(self, epoch: int) -> Tensor:
        """The permutation of ``range(num_samples)`` that epoch ``epoch`` visits (an int32
        tensor, int64 beyond 2^31 samples)."""
        if epoch not in self._epochs:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            if len(self._epochs) >= 2:  # a step spans at most two epochs when GB <= num_samples
                self._epochs.pop(min(self._epochs))
            # int32 halves the largest per-corpus allocation (the same permutation as int64)
            dtype = torch.int32 if self.num_samples < 2**31 else torch.int64
            self._epochs[epoch] = torch.randperm(self.num_samples, generator=generator,
                                                 dtype=dtype)
        return self._epochs[epoch]

    def global_indices(self, step: int) -> list[int]:
        """Sample indices of the whole global batch of ``step`` (all ranks, all micro-batches)."""
        indices: list[int] = []
        position, end = step * self.global_batch, (step + 1) * self.global_batch
        while position < end:
            epoch, offset = divmod(position, self.num_samples)
            take = min(end - position, self.num_samples - offset)
            indices.extend(self.epoch_order(epoch)[offset : offset + take].tolist())
            position += take
        return indices

    def local_microbatch_indices(self, step: int) -> list[list[int]]:
        """This rank's share of step ``step``, split into ``microbatches`` equal lists."""
        return rank_microbatches(self.global_indices(step), self.dp_rank, self.dp_size,
                                 self.microbatches)

    def advance(self) -> None:
        """Move past the current step."""
        self.step += 1

    def state_dict(self) -> dict[str, int]:
        """The resumable position: the next step, and the settings it is only valid under."""
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``; refuse a position saved under another seed/global batch."""
        for key in ("seed", "global_batch"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data order: it was saved with {key} = {state[key]} but "
                    f"this run uses {key} = {getattr(self, key)}; the same step would select "
                    f"different samples. Restore train.{key} = {state[key]} or start afresh."
                )
        self.step = int(state["step"])


def hold_out_tail(tokens: TokenShards, fraction: float,
                  eos_id: int | None) -> tuple[TokenShards, TokenShards]:
    """Split ``tokens`` into (training, held-out): the held-out part is at least the last
    ``fraction`` of the stream, starting at the beginning of the document the cut falls in (right
    after the eos before it), so no document is split; at the cut itself when the tokenizer has
    no eos or no eos precedes it within 16M tokens."""
    cut = int(len(tokens) * (1 - fraction))
    if eos_id is not None:
        boundary = tokens.rfind(eos_id, cut)
        if boundary >= 0:
            cut = boundary + 1
    return tokens.slice(0, cut), tokens.slice(cut, len(tokens))
