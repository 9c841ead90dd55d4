"""Tensor-at-a-time reading and writing of (sharded) safetensors directories.

:class:`TensorReader` opens a directory holding ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (the Hugging Face layout), and reads one tensor at a time through
``safetensors.safe_open`` (memory-mapped, so nothing else is loaded). Shards named
``model-0000i-of-0000K.safetensors`` without their index are an interrupted save (the index is
written last) and are refused.

:class:`ShardedWriter` writes such a directory without ever holding more than one tensor: the
caller declares every tensor's name, shape and dtype up front, which fixes each tensor's byte
offset, so the header is written first and the tensors may then arrive in any order (each is
written at its offset). The files follow the safetensors format (8-byte little-endian header
length, JSON header padded to 8 bytes, raw little-endian data) and are written under ``.tmp``
names, fsynced and renamed into place only once complete; then the index (if sharded) is written
the same way, and last the directory is fsynced.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from meshtrain.checkpoint.atomic import fsync_dir, readable, write_atomically
from meshtrain.config import ConfigError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def has_weights(directory: str | Path) -> bool:
    """Whether ``directory`` holds complete weights: an index, or one ``model.safetensors``."""
    directory = Path(directory)
    return (directory / INDEX_NAME).is_file() or (directory / SINGLE_NAME).is_file()


def complete_weights_dir(directory: Path) -> bool:
    """Whether ``directory`` is a whole weights directory: weights and ``config.json``."""
    return directory.is_dir() and has_weights(directory) \
        and (directory / "config.json").is_file()


def current_weights_dir(directory: str | Path) -> Path:
    """``directory`` itself, unless it is missing because a save (``RUN_DIR/final``, a
    conversion's ``--out``) was interrupted between its two renames: then the complete previous
    set left aside as ``<name>.old-<token>`` (:func:`meshtrain.checkpoint.atomic.readable`)."""
    return readable(directory, complete_weights_dir) or Path(directory)


def dtype_from_code(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code such as ``"BF16"``."""
    if code not in _CODE_DTYPES:
        raise ConfigError(f"safetensors dtype {code} is not supported here.")
    return _CODE_DTYPES[code]


class TensorReader:
    """Read tensors one by one from a directory of safetensors files (a context manager).

    Uses ``model.safetensors.index.json`` when present, else ``model.safetensors``, else every
    ``*.safetensors`` file of the directory. Files are opened lazily and closed by :meth:`close`.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ConfigError(f"{index}: not a safetensors index ({error}).") from None
            self.files = {name: self.directory / file for name, file in weight_map.items()}
            missing = sorted({path.name for path in self.files.values() if not path.is_file()})
            if missing:
                raise ConfigError(f"{index} lists files that are missing: "
                                  f"{', '.join(missing[:3])}.")
        else:
            paths = [self.directory / SINGLE_NAME] if (self.directory / SINGLE_NAME).is_file() \
                else sorted(self.directory.glob("*.safetensors"))
            if not paths:
                raise ConfigError(f"{self.directory}: no safetensors weights found (only "
                                  "*.safetensors checkpoints are read, never pickled .bin files).")
            if any(_SHARD_NAME.fullmatch(path.name) for path in paths):
                raise ConfigError(f"{self.directory}: safetensors shards without {INDEX_NAME}: "
                                  "an incomplete (interrupted) save; the index is written last.")
            for path in paths:
                for name in self._open(path).keys():
                    self.files[name] = path

    def _open(self, path: Path):
        from safetensors import SafetensorError, safe_open

        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as error:
                raise ConfigError(f"{path}: unreadable safetensors file ({error}).") from None
        return self._handles[path]

    def keys(self) -> list[str]:
        """Every tensor name, in the order of the index / files."""
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (read now, on the CPU, in its stored dtype)."""
        if name not in self.files:
            raise ConfigError(f"{self.directory}: tensor {name} is missing.")
        return self._open(self.files[name]).get_tensor(name)

    def shape(self, name: str) -> list[int]:
        """The stored shape of ``name`` without reading it."""
        return list(self._open(self.files[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of ``name`` without reading it."""
        return dtype_from_code(self._open(self.files[name]).get_slice(name).get_dtype())

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` of the first file (empty when none)."""
        if not self.files:
            return {}
        return self._open(next(iter(self.files.values()))).metadata() or {}

    def close(self) -> None:
        """Drop every open file handle."""
        self._handles.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardedWriter:
    """Write a planned set of tensors to one or more safetensors files, one tensor at a time.

    ``plan`` lists ``(name, shape, dtype)`` for every tensor. With ``max_shard_bytes`` smaller
    than the total, tensors are packed (in plan order) into ``{basename}-0000i-of-0000n
    .safetensors`` files plus ``{basename}.safetensors.index.json``; otherwise one
    ``{basename}.safetensors`` is written. :meth:`write` accepts the tensors in any order;
    :meth:`close` checks that each was written exactly once and renames the files into place.
    """

    def __init__(self, directory: str | Path, plan: Iterable[tuple[str, tuple, torch.dtype]],
                 max_shard_bytes: int | None = None, basename: str = "model",
                 metadata: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.basename = basename
        self.entries: dict[str, tuple[tuple, torch.dtype, int]] = {}
        for name, shape, dtype in plan:
            if name in self.entries:
                raise ValueError(f"tensor {name} planned twice")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self.entries[name] = (tuple(shape), dtype, nbytes)
        self.total_bytes = sum(entry[2] for entry in self.entries.values())
        limit = max_shard_bytes or self.total_bytes
        groups: list[list[str]] = [[]]
        size = 0
        for name, (_, _, nbytes) in self.entries.items():
            if groups[-1] and size + nbytes > limit:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
        self.sharded = len(groups) > 1
        self.locations: dict[str, tuple[int, int]] = {}  # name -> (file index, byte offset)
        self.paths: list[Path] = []
        self.handles = []
        for number, names in enumerate(groups, start=1):
            file = f"{basename}-{number:05d}-of-{len(groups):05d}.safetensors" if self.sharded \
                else f"{basename}.safetensors"
            self.paths.append(self.directory / file)
            self._open_shard(len(self.paths) - 1, names, metadata or {"format": "pt"})
        self.written: set[str] = set()

    def _open_shard(self, index: int, names: list[str], metadata: dict[str, str]) -> None:
        """Create shard ``index``: header now, data region sized; tensors fill it later."""
        # Widest dtypes first keeps every tensor aligned to its element size.
        names = sorted(names, key=lambda n: -self.entries[n][1].itemsize)
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        offset = 0
        for name in names:
            shape, dtype, nbytes = self.entries[name]
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        start = 8 + len(text)
        for name in names:
            self.locations[name] = (index, start + header[name]["data_offsets"][0])
        handle = open(self.tmp_path(index), "wb+")  # noqa: SIM115 - closed in close()/abort()
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        handle.truncate(start + offset)
        self.handles.append(handle)

    def tmp_path(self, index: int) -> Path:
        """Where shard ``index`` is written until :meth:`close`."""
        return self.paths[index].with_name(self.paths[index].name + ".tmp")

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``name``; its shape and dtype must be the planned ones."""
        if name not in self.entries:
            raise ValueError(f"tensor {name} was not planned")
        if name in self.written:
            raise ValueError(f"tensor {name} written twice")
        shape, dtype, nbytes = self.entries[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                             f"planned {shape} {dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        index, offset = self.locations[name]
        handle = self.handles[index]
        handle.seek(offset)
        handle.write(memoryview(data))
        self.written.add(name)

    def close(self) -> list[Path]:
        """Check completeness, fsync and rename the files into place (+ the index, atomically),
        fsync the directory; return the files."""
        missing = [name for name in self.entries if name not in self.written]
        if missing:
            self.abort()
            raise ValueError(f"{len(missing)} planned tensors never written, e.g. {missing[:3]}")
        for index, handle in enumerate(self.handles):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            self.tmp_path(index).replace(self.paths[index])
        self.handles = []
        if self.sharded:
            weight_map = {name: self.paths[self.locations[name][0]].name for name in self.entries}
            index_doc = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            write_atomically(self.directory / f"{self.basename}.safetensors.index.json",
                             json.dumps(index_doc, indent=2))
        fsync_dir(self.directory)
        return list(self.paths)

    def abort(self) -> None:
        """Close and delete the partial files."""
        for index, handle in enumerate(self.handles):
            handle.close()
            self.tmp_path(index).unlink(missing_ok=True)
        self.handles = []

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
