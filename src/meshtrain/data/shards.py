"""Token files on disk and the token streams read from them through memory maps.

Token ids are stored as headerless little-endian ``uint16`` arrays, or ``uint32`` when the
vocabulary exceeds 65535 (:func:`token_dtype`, the one rule for both pre-tokenized ``.bin``
sources and the shards of ``meshtrain prepare``). :func:`write_token_bin` writes a ``.bin``
source and :func:`read_token_bin` reads one back after checking it.

A :class:`TokenShards` is a sequence of 1-D ``uint16``/``uint32`` arrays (usually ``np.memmap``
views of ``.bin`` or ``.npy`` files) seen as one token stream. Reading a window copies only that
window into an ``int64`` array, so a process's memory does not grow with the corpus: the file
pages stay in the page cache and are shared by every process on the host. torch is imported only
where a tensor is made, so ``meshtrain prepare``'s workers can import this module cheaply.

Token ids are range-checked once per file (:func:`scan_token_file`, :func:`check_token_file`):
the largest id is found by vectorised reads of bounded chunks, and the result is remembered in
this process and on disk (:func:`scan_cache_dir`) under the file's identity (path, device, inode,
size, modification and status-change times, element type), so the launcher's check and every
worker's load of the same unchanged file scan it once in all. Any write to the file changes its
status-change time (which, unlike the modification time, cannot be set back), so a changed file
is scanned again.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from meshtrain.config import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

_SCAN_CHUNK = 1 << 22  # tokens read per chunk when checking a file's ids (4-16 MiB)


def token_dtype(vocab_size: int) -> np.dtype:
    """The element type of stored token ids for a vocabulary of ``vocab_size`` ids: little-endian
    ``uint16``, or ``uint32`` when the vocabulary exceeds 65535."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def open_bin(path: Path, dtype: np.dtype) -> np.ndarray:
    """``path`` as a read-only memory map of ``dtype`` ids (an empty array for an empty file)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def max_token(path: Path, dtype: np.dtype, offset: int = 0) -> int:
    """The largest id in the token file ``path`` (-1 when empty), read in bounded chunks.

    Reads with ordinary file reads rather than through a memory map, so checking a large file
    does not leave its pages counted in this process's resident memory.
    """
    top = -1
    with open(path, "rb") as handle:
        handle.seek(offset)
        while True:
            chunk = np.fromfile(handle, dtype=dtype, count=_SCAN_CHUNK)
            if not chunk.size:
                return top
            top = max(top, int(chunk.max()))


@dataclasses.dataclass(frozen=True)
class TokenScan:
    """What a range check of token files found."""

    tokens: int
    """Token ids read (or remembered)."""
    max_id: int
    """The largest id; -1 when there are none."""
    seconds: float
    """Time the check took (reading the files, or the remembered results)."""
    scanned: int
    """Of ``tokens``, how many were read now (0: every result was remembered)."""

    def __add__(self, other: TokenScan) -> TokenScan:
        return TokenScan(self.tokens + other.tokens, max(self.max_id, other.max_id),
                         self.seconds + other.seconds, self.scanned + other.scanned)


SCAN_CACHE_ENV = "MESHTRAIN_DATA_CACHE"
"""The environment variable of the token cache (:func:`meshtrain.data.sources.data_cache_dir`);
range checks are remembered in its ``token-ids`` folder."""
_SCANNED: dict[tuple, tuple[int, int]] = {}


def scan_cache_dir() -> Path:
    """Where range checks are remembered: the ``token-ids`` folder of the token cache,
    ``$MESHTRAIN_DATA_CACHE/token-ids``, else ``$XDG_CACHE_HOME/meshtrain/tokens/token-ids``
    (``~/.cache/meshtrain/tokens/token-ids``)."""
    if os.environ.get(SCAN_CACHE_ENV):
        return Path(os.environ[SCAN_CACHE_ENV]).expanduser() / "token-ids"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "meshtrain" / "tokens" / "token-ids"


def _identity(path: Path, dtype: np.dtype) -> tuple:
    stat = path.stat()
    return (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns,
            stat.st_ctime_ns, np.dtype(dtype).str)


def _remembered(key: tuple) -> tuple[int, int] | None:
    if key in _SCANNED:
        return _SCANNED[key]
    entry = scan_cache_dir() / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".json")
    try:
        record = json.loads(entry.read_text())
        if record.get("key") == list(key):
            return int(record["tokens"]), int(record["max_id"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _remember(key: tuple, tokens: int, top: int) -> None:
    _SCANNED[key] = (tokens, top)
    folder = scan_cache_dir()
    entry = folder / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".json")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = entry.with_name(f"{entry.stem}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"key": list(key), "tokens": tokens, "max_id": top}))
        os.replace(partial, entry)  # atomic: ranks checking the same file at once never see half
    except OSError:
        pass  # an unwritable cache only means the next process scans again


def scan_token_file(path: Path, dtype: np.dtype) -> TokenScan:
    """Token count and largest id of the token file ``path`` of ``dtype`` ids: remembered when
    this file, unchanged (same path, inode, size, modification and status-change times), was
    scanned before by any process (see the module docstring), else read with
    :func:`max_token`."""
    start = time.perf_counter()
    path = Path(path)
    key = _identity(path, dtype)
    found = _remembered(key)
    if found is not None:
        return TokenScan(found[0], found[1], time.perf_counter() - start, 0)
    tokens = path.stat().st_size // np.dtype(dtype).itemsize
    top = max_token(path, dtype)
    _remember(key, tokens, top)
    return TokenScan(tokens, top, time.perf_counter() - start, tokens)


def record_scan(path: Path, dtype: np.dtype, max_id: int) -> None:
    """Remember that the token file ``path``, as it is now, holds ids up to ``max_id``: for a
    writer that knows it (``meshtrain prepare`` as it writes a shard), so that the first check
    need not read the file. Call it after the file is closed; any later write makes the record
    stale (its status-change time moves), and the file is then read again."""
    path = Path(path)
    _remember(_identity(path, dtype), path.stat().st_size // np.dtype(dtype).itemsize,
              int(max_id))


def check_token_file(path: Path, dtype: np.dtype, vocab_size: int, vocabulary: str) -> TokenScan:
    """:func:`scan_token_file`, refusing (:class:`ConfigError` naming the file, the id and the
    vocabulary) a file holding an id >= ``vocab_size``; ``vocabulary`` says whose it is (e.g.
    ``"the model's vocabulary (model.vocab_size)"``)."""
    scan = scan_token_file(path, dtype)
    if scan.max_id >= vocab_size:
        raise ConfigError(
            f"{path} holds token id {scan.max_id}, but {vocabulary} has only {vocab_size} ids "
            f"(0 .. {vocab_size - 1}); was it written with another tokenizer (data.tokenizer), "
            "or is it damaged?")
    return scan


def write_token_bin(path: str | Path, tokens, vocab_size: int) -> None:
    """Write ``tokens`` as a pre-tokenized ``.bin`` source (headerless :func:`token_dtype` ids)."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}) to be written to {path}")
    array.astype(token_dtype(vocab_size)).tofile(path)


def read_token_bin(path: Path, vocab_size: int) -> np.ndarray:
    """The ``.bin`` source ``path`` memory-mapped as token ids, after checking its size and its
    largest id (:class:`ConfigError` for a ragged size or an id outside the vocabulary; the id
    check is remembered, :func:`scan_token_file`)."""
    dtype = token_dtype(vocab_size)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
            f"{path}: {size} bytes is not a whole number of {dtype.itemsize}-byte tokens; "
            f"expected little-endian {dtype.name} ids for a vocabulary of {vocab_size}."
        )
    check_token_file(path, dtype, vocab_size, "the tokenizer's vocabulary")
    return open_bin(path, dtype)


class TokenShards:
    """Several 1-D token arrays seen as one stream, read window by window as ``int64``.

    ``masks``, when given, holds one loss mask per array (``uint8``, 1 = the token is trained on
    as a target, 0 = it is not; ``None`` for an array whose tokens are all trained on), the same
    length as its array: :meth:`mask_window` reads it beside :meth:`window`, and :meth:`slice`
    and :meth:`concat` keep it aligned with the tokens (``docs/data.md``, the loss mask).
    """

    def __init__(self, arrays: list[np.ndarray], masks: list[np.ndarray | None] | None = None):
        if masks is not None and len(masks) != len(arrays):
            raise ValueError(f"{len(masks)} masks for {len(arrays)} token arrays")
        pairs = [(a, None if masks is None else masks[i]) for i, a in enumerate(arrays) if len(a)]
        self.arrays = [a for a, _ in pairs]
        self.masks: list[np.ndarray | None] | None = None
        if any(m is not None for _, m in pairs):
            self.masks = [m for _, m in pairs]
        self.starts: list[int] = []
        total = 0
        for array, mask in pairs:
            if array.ndim != 1:
                raise ValueError(f"expected 1-D token arrays, got shape {array.shape}")
            if mask is not None and mask.shape != array.shape:
                raise ValueError(f"a loss mask of shape {mask.shape} for tokens {array.shape}")
            self.starts.append(total)
            total += len(array)
        self.total = total

    @classmethod
    def concat(cls, streams: list[TokenShards]) -> TokenShards:
        """The ``streams`` one after another (views, no copy), masks kept with their tokens."""
        arrays = [a for stream in streams for a in stream.arrays]
        masks = [m for stream in streams
                 for m in (stream.masks or [None] * len(stream.arrays))]
        return cls(arrays, masks)

    @property
    def has_mask(self) -> bool:
        """Whether some token of the stream is not trained on (a loss mask is carried)."""
        return self.masks is not None

    def without_mask(self) -> TokenShards:
        """The same tokens with every one trained on (``data.train_on = "all"``)."""
        return TokenShards(self.arrays)

    @classmethod
    def of(cls, tokens) -> TokenShards:
        """``tokens`` (a TokenShards, a tensor or an array) as a :class:`TokenShards`."""
        import torch

        if isinstance(tokens, TokenShards):
            return tokens
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1:
                raise ValueError(f"expected a 1-D token stream, got shape {tuple(tokens.shape)}")
            tokens = tokens.numpy()
        return cls([np.asarray(tokens)])

    def __len__(self) -> int:
        return self.total

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as a fresh ``int64`` array."""
        if start < 0 or start + length > self.total:
            raise IndexError(f"window [{start}, {start + length}) outside {self.total} tokens")
        out = np.empty(length, dtype=np.int64)
        shard = bisect.bisect_right(self.starts, start) - 1
        filled = 0
        while filled < length:
            array, offset = self.arrays[shard], start + filled - self.starts[shard]
            take = min(length - filled, len(array) - offset)
            out[filled:filled + take] = array[offset:offset + take]
            filled += take
            shard += 1
        return out

    def mask_window(self, start: int, length: int) -> np.ndarray | None:
        """The loss mask of tokens ``[start, start + length)`` as a fresh ``bool`` array (True =
        trained on); ``None`` when the stream carries no mask (every token is trained on)."""
        if self.masks is None:
            return None
        if start < 0 or start + length > self.total:
            raise IndexError(f"window [{start}, {start + length}) outside {self.total} tokens")
        out = np.ones(length, dtype=bool)
        shard = bisect.bisect_right(self.starts, start) - 1
        filled = 0
        while filled < length:
            array, mask = self.arrays[shard], self.masks[shard]
            offset = start + filled - self.starts[shard]
            take = min(length - filled, len(array) - offset)
            if mask is not None:
                out[filled:filled + take] = mask[offset:offset + take] != 0
            filled += take
            shard += 1
        return out

    def slice(self, start: int, stop: int) -> TokenShards:
        """Tokens ``[start, stop)`` (and their loss mask) as a stream of views (no copy)."""
        start, stop = max(0, start), min(stop, self.total)
        parts, masks = [], []
        for i, (array, first) in enumerate(zip(self.arrays, self.starts, strict=True)):
            lo, hi = max(start - first, 0), min(stop - first, len(array))
            if lo < hi:
                parts.append(array[lo:hi])
                mask = None if self.masks is None else self.masks[i]
                masks.append(None if mask is None else mask[lo:hi])
        return TokenShards(parts, masks)

    def rfind(self, token: int, stop: int, limit: int = 1 << 24) -> int:
        """Position of the last ``token`` before ``stop`` within ``limit`` tokens, read in
        bounded windows; -1 when there is none."""
        position, first = min(stop, self.total), max(0, stop - limit)
        while position > first:
            length = min(1 << 16, position - first)
            hits = np.flatnonzero(self.window(position - length, length) == token)
            if hits.size:
                return position - length + int(hits[-1])
            position -= length
        return -1

    def to_tensor(self) -> Tensor:
        """The whole stream as one ``int64`` tensor (copies it all; for small streams and tests)."""
        import torch

        return torch.from_numpy(self.window(0, self.total))

    def tolist(self) -> list[int]:
        """The whole stream as a list of ints (small streams and tests)."""
        return self.window(0, self.total).tolist()
