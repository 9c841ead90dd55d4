"""Read a training checkpoint's full tensors in one process, one tensor at a time (for
``meshtrain convert --to-hf`` and inspection), whatever layout it was saved at."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtrain.checkpoint import manager
from meshtrain.checkpoint.dcp import Chunk, ChunkLoadPlanner
from meshtrain.checkpoint.safe_reader import SafeFileSystemReader
from meshtrain.config import Config, ConfigError, config_from_dict


def read_checkpoint_tensors(path: str | Path) -> tuple[Config, Iterator[tuple[str, torch.Tensor]]]:
    """The run config and an iterator of ``(parameter or buffer name, full fp32 tensor)`` of the
    checkpoint at ``path`` (a ``step_N`` directory, or a checkpoint root: its newest valid one)."""
    path = Path(path)
    if not (path / manager.MANIFEST).is_file():
        newest = manager.newest_valid(path, warn=False)
        if newest is None:
            raise ConfigError(f"{path} holds no valid meshtrain checkpoint.")
        path = newest
    problem = manager.verify(path)
    if problem is not None:
        raise ConfigError(f"checkpoint {path} is not usable: {problem}.")
    reader = SafeFileSystemReader(str(path))
    metadata = reader.read_metadata()
    planner = ChunkLoadPlanner([], ["meta"])
    dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    config = config_from_dict(json.loads(planner.blobs["meta"])["config"])

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            for prefix in ("model.", "buffers."):
                if key.startswith(prefix):
                    full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                    chunk = Chunk(key, tuple(md.size), (0,) * len(md.size), full)
                    dcp.load({}, storage_reader=SafeFileSystemReader(str(path)),
                             planner=ChunkLoadPlanner([chunk], []), no_dist=True)
                    yield key[len(prefix):], full
    return config, tensors()
