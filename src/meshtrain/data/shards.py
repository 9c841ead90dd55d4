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
"""

from __future__ import annotations

import bisect
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


def write_token_bin(path: str | Path, tokens, vocab_size: int) -> None:
    """Write ``tokens`` as a pre-tokenized ``.bin`` source (headerless :func:`token_dtype` ids)."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}) to be written to {path}")
    array.astype(token_dtype(vocab_size)).tofile(path)


def read_token_bin(path: Path, vocab_size: int) -> np.ndarray:
    """The ``.bin`` source ``path`` memory-mapped as token ids, after checking its size and its
    largest id (:class:`ConfigError` for a ragged size or an id outside the vocabulary)."""
    dtype = token_dtype(vocab_size)
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


class TokenShards:
    """Several 1-D token arrays seen as one stream, read window by window as ``int64``."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.starts: list[int] = []
        total = 0
        for array in self.arrays:
            if array.ndim != 1:
                raise ValueError(f"expected 1-D token arrays, got shape {array.shape}")
            self.starts.append(total)
            total += len(array)
        self.total = total

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

    def slice(self, start: int, stop: int) -> TokenShards:
        """Tokens ``[start, stop)`` as a stream of views (no copy)."""
        start, stop = max(0, start), min(stop, self.total)
        parts = []
        for array, first in zip(self.arrays, self.starts, strict=True):
            lo, hi = max(start - first, 0), min(stop - first, len(array))
            if lo < hi:
                parts.append(array[lo:hi])
        return TokenShards(parts)

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
