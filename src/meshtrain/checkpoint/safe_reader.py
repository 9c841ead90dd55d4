"""Reading a checkpoint's DCP ``.metadata`` without running it.

``torch.distributed.checkpoint`` writes the index of a checkpoint (which tensor chunk is where)
as a pickle, ``.metadata``, and its ``FileSystemReader`` loads it with :func:`pickle.load`: a
planted checkpoint would run whatever its ``.metadata`` names, before any tensor is read, and
the manifest's checksums cannot tell (they have no key: whoever plants the file recomputes them).
Every DCP read in meshtrain therefore goes through :class:`SafeFileSystemReader`, whose
:meth:`~SafeFileSystemReader.read_metadata` admits only the classes DCP's metadata is made of
(:data:`METADATA_GLOBALS`) and refuses any other global, naming the file and the global,
without importing or calling it; :func:`metadata_problem` does the same check for
:func:`meshtrain.checkpoint.manager.verify`, so ``checkpoint.resume = auto`` skips such a
checkpoint for an older good one and a named checkpoint is refused before a worker starts. The
tensor files are read by DCP with ``torch.load(weights_only=True)``, which builds tensors only.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from meshtrain.host.safe_unpickle import DisallowedGlobal, restricted_load

METADATA_FILE = ".metadata"

_MD = "torch.distributed.checkpoint.metadata"
_TORCH_CONSTANTS = sorted(
    name for name, value in vars(torch).items()
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)))

METADATA_GLOBALS = frozenset({
    (_MD, "Metadata"), (_MD, "StorageMeta"), (_MD, "TensorStorageMetadata"),
    (_MD, "BytesStorageMetadata"), (_MD, "ChunkStorageMetadata"), (_MD, "TensorProperties"),
    (_MD, "MetadataIndex"), (_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a layout: a lookup by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("builtins", "set"), ("builtins", "frozenset"),
    *(("torch", name) for name in _TORCH_CONSTANTS),  # dtypes, layouts, memory formats
})
"""The globals a DCP ``.metadata`` file names (found with :mod:`pickletools` in meshtrain's
checkpoints, of this torch and of an earlier release): DCP's own metadata classes, the storage
record of the file system writer, ``torch.Size``, torch's dtypes / layouts / memory formats,
paths (the checkpoint id) and sets. Each builds data only."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint's ``.metadata`` names something besides DCP's metadata (refused unread)."""


def read_metadata_file(path: str | os.PathLike) -> Metadata:
    """The DCP :class:`Metadata` in the file ``path``, built from :data:`METADATA_GLOBALS`
    only; :class:`UnsafeCheckpointError` for a file naming any other global, holding anything
    but a ``Metadata``, or pointing a chunk outside its directory."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            metadata = restricted_load(handle, METADATA_GLOBALS, f"checkpoint file {path}")
    except DisallowedGlobal as error:
        raise UnsafeCheckpointError(str(error)) from None
    except OSError:
        raise
    except Exception as error:  # not a pickle of DCP metadata: never a usable checkpoint
        raise UnsafeCheckpointError(f"checkpoint file {path} is not readable DCP metadata: "
                                    f"{type(error).__name__}: {error}") from error
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"checkpoint file {path} holds a {type(metadata).__name__}, "
                                    "not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        relative = str(getattr(info, "relative_path", ""))
        if (not relative or PurePosixPath(relative).name != relative
                or PureWindowsPath(relative).name != relative or relative in (".", "..")):
            raise UnsafeCheckpointError(f"checkpoint file {path} points a chunk at "
                                        f"{relative!r}, outside its directory")
    return metadata


def metadata_problem(directory: Path) -> str | None:
    """None when ``directory``'s ``.metadata`` reads as DCP metadata (see
    :func:`read_metadata_file`) or is not there (nothing to run; a saved checkpoint's manifest
    lists the file, so the checksums find it missing), else what is wrong with it, in words."""
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        return None
    try:
        read_metadata_file(path)
    except UnsafeCheckpointError as error:
        return str(error)
    except OSError as error:
        return f"{METADATA_FILE} cannot be read: {error}"
    return None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader with :meth:`read_metadata` through
    :func:`read_metadata_file` (tensor files are read as DCP reads them, weights only)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's metadata (``rank``: a rank's own ``__<rank>.metadata``, as DCP)."""
        metadata = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
