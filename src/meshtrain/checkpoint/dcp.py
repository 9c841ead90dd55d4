"""Layout-free training state on ``torch.distributed.checkpoint`` (DCP).

The checkpoint stores every parameter, and its fp32 Adam state, as the **full logical tensor of
the unsplit model** under stable names (``model.<param>``, ``optim.exp_avg.<param>``,
``optim.exp_avg_sq.<param>``, ``buffers.<buffer>``). Each rank contributes the rectangular
chunks it owns:

- a ZeRO shard is a contiguous range of a bucket's flat buffer; its intersection with one
  parameter is a flat range of that (possibly tensor-parallel) parameter, which splits into a few
  boxes (a partial row, whole rows, a partial row — recursively per dimension);
- the box is then moved to full-tensor coordinates by the piece's offset (tensor parallelism's
  split dimension, expert parallelism's first expert), from the parameter's sharding record
  (:class:`~meshtrain.parallel.sharding.ParamSharding`). Expert-parallel parameters whose experts
  were re-placed (:mod:`meshtrain.parallel.expert.placement`) hold experts in any order: their
  boxes are cut into runs of consecutive experts and each run goes to its experts' rows, so
  checkpoints stay in canonical expert order whatever the placement.

Copies held by several ranks (replicas over dp without ZeRO, over tp for norms) produce identical
write items that DCP's planner de-duplicates. Loading asks DCP for exactly the boxes the *new*
layout owns, and DCP reads the overlapping parts of whatever chunks were saved: any layout loads
any other, with no conversion step. The master weights (fp32) are what is saved, so precision
can change too.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_item_for_byteio,
    create_read_items_for_chunk_list,
)


@dataclass
class Chunk:
    """A box of the full tensor ``fqn`` held by this rank: ``tensor`` is a writable view."""

    fqn: str
    global_size: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit this model (shapes or names differ)."""


def flat_range_boxes(shape: Sequence[int], start: int, stop: int,
                     ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes ``(offsets, sizes)`` covering the flat range ``[start, stop)`` of a row-major tensor
    of ``shape``, in flat order; each box is itself contiguous in flat memory."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if start % inner:
        row = start // inner
        row_stop = min(stop, (row + 1) * inner)
        out += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start - row * inner,
                                                                  row_stop - row * inner)]
        start = row_stop
    full_stop = (stop // inner) * inner
    if full_stop > start:
        out.append(((start // inner, *zeros), ((full_stop - start) // inner, *shape[1:])))
        start = full_stop
    if start < stop:
        row = start // inner
        out += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0,
                                                                  stop - row * inner)]
    return out


def _flat_index(offsets: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for o, n in zip(offsets, shape, strict=True):
        index = index * n + o
    return index


def optimizer_chunks(optimizer, prefix: str = "") -> list[Chunk]:
    """Chunks of every parameter's fp32 master value and Adam moments held by this rank
    (names prefixed by ``prefix``: a DiLoCo replica group's own inner state)."""
    return shard_chunks(optimizer.engine, optimizer.shards,
                        {f"{prefix}model": [s.master for s in optimizer.shards],
                         f"{prefix}optim.exp_avg": optimizer.exp_avg,
                         f"{prefix}optim.exp_avg_sq": optimizer.exp_avg_sq})


def shard_chunks(engine, shards, sources: dict[str, list[torch.Tensor]]) -> list[Chunk]:
    """Chunks of per-parameter state laid out like the optimizer shards: ``sources`` maps a
    name prefix to one flat tensor per shard (the masters, a moment, DiLoCo's outer state)."""
    chunks: list[Chunk] = []
    sharded = engine.stage >= 1
    shardings = engine.shardings
    for index, shard in enumerate(shards):
        bucket = shard.bucket
        base = bucket.shard_start if sharded else 0
        for slot, start, length in bucket.segments(sharded):
            record = shardings[slot.name]
            full = record.full_shape_of(slot.shape)
            shift = record.global_offset(len(full))
            first = base + start - slot.offset  # flat position inside the parameter
            rows = record.expert_rows()
            for box in flat_range_boxes(slot.shape, first, first + length):
                for offsets, sizes, where in _global_boxes(*box, shift, rows):
                    at = start + _flat_index(offsets, slot.shape) - first
                    n = math.prod(sizes)
                    for prefix, tensors in sources.items():
                        chunks.append(Chunk(f"{prefix}.{slot.name}", full, where,
                                            tensors[index][at:at + n].view(sizes)))
    return chunks


def _global_boxes(offsets: tuple[int, ...], sizes: tuple[int, ...], shift: Sequence[int],
                  rows: list[int] | None):
    """``(offsets, sizes, offsets in the full tensor)`` of a local box: shifted by the piece's
    offset, or, for re-placed experts (``rows``: global expert of each local row), split into
    runs of consecutive experts along dim 0."""
    if rows is None:
        yield offsets, sizes, tuple(o + s for o, s in zip(offsets, shift, strict=True))
        return
    rest = tuple(o + s for o, s in zip(offsets[1:], shift[1:], strict=True))
    row, end = offsets[0], offsets[0] + sizes[0]
    while row < end:
        run = 1
        while row + run < end and rows[row + run] == rows[row] + run:
            run += 1
        yield (row, *offsets[1:]), (run, *sizes[1:]), (rows[row], *rest)
        row += run


def buffer_chunks(model: torch.nn.Module) -> list[Chunk]:
    """Persistent buffers (e.g. MoE expert biases), whole, from every rank that holds them."""
    persistent = set(model.state_dict().keys())
    return [Chunk(f"buffers.{name}", tuple(buf.shape), (0,) * buf.ndim, buf)
            for name, buf in model.named_buffers() if name in persistent]


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes this rank's chunks plus (on the coordinator) named byte blobs."""

    def __init__(self, chunks: list[Chunk], blobs: dict[str, bytes], release=None):
        """``release(tensor)``: called on each chunk once the writer has moved on from it
        (offloaded state drops its pages, :mod:`meshtrain.parallel.offload.store`)."""
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {(c.fqn, torch.Size(c.offsets)): c for c in chunks}
        self.blobs = blobs
        self.release = release
        self._resolved: torch.Tensor | None = None

    def create_local_plan(self) -> SavePlan:
        """One SHARD write item per chunk; BYTE_IO items for the blobs on the coordinator."""
        items = []
        for c in self.chunks.values():
            items.append(WriteItem(
                index=MetadataIndex(c.fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                               sizes=torch.Size(c.tensor.shape)),
                    properties=TensorProperties.create_from_tensor(c.tensor),
                    size=torch.Size(c.global_size))))
        if self.is_coordinator:
            items += [WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)
                      for name in self.blobs]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        """The tensor (detached, contiguous) or bytes behind ``write_item``.

        A chunk is a view into a flat ZeRO buffer. DCP's file writer clones any tensor whose
        storage is larger than the tensor, and keeps every written tensor until the rank's file
        is closed, so views would cost a copy of the rank's whole share during a save. A CPU
        view is therefore handed over as a tensor of its own storage over the same memory (no
        copy, through numpy), which the writer neither clones nor pays for keeping."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.blobs[write_item.index.fqn])
        chunk = self.chunks[(write_item.index.fqn, write_item.index.offset)]
        if self.release is not None:  # the writer is done with the chunk it asked for before
            if self._resolved is not None:
                self.release(self._resolved)
            self._resolved = chunk.tensor
        return _own_storage(chunk.tensor.detach().contiguous())


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or the same CPU memory as a tensor whose storage is exactly its bytes."""
    if (tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() == tensor.nbytes
            or tensor.dtype not in _NUMPY_DTYPES):
        return tensor
    return torch.from_numpy(tensor.numpy())


#: Dtypes numpy can view without a copy (bf16 and the fp8 kinds have no numpy dtype).
_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool}


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads, for each of this rank's chunks, the overlapping parts of the saved chunks."""

    def __init__(self, chunks: list[Chunk], blob_names: Sequence[str], release=None):
        """``release(tensor)``: called on each part of a chunk once it has been read into."""
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {(c.fqn, torch.Size(c.offsets)): c for c in chunks}
        self.blob_names = list(blob_names)
        self.blobs: dict[str, bytes] = {}
        self.release = release

    def create_local_plan(self) -> LoadPlan:
        """Read items for every chunk, refusing names or shapes the checkpoint lacks."""
        saved = self.metadata.state_dict_metadata
        requests: list[ReadItem] = []
        for c in self.chunks.values():
            md = saved.get(c.fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointMismatch(f"the checkpoint has no tensor {c.fqn!r}")
            if tuple(md.size) != tuple(c.global_size):
                raise CheckpointMismatch(f"{c.fqn}: checkpoint shape {tuple(md.size)} != model "
                                         f"shape {tuple(c.global_size)}")
            local = ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                         sizes=torch.Size(c.tensor.shape))
            requests += create_read_items_for_chunk_list(c.fqn, md, [local])
        for name in self.blob_names:
            if name in saved:
                requests.append(_create_read_item_for_byteio(MetadataIndex(name), 0,
                                                             MetadataIndex(name), 0, 0))
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The part of our chunk that this read fills (a view, written in place)."""
        chunk = self.chunks[(read_item.dest_index.fqn, read_item.dest_index.offset)]
        view = chunk.tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths,
                                                  strict=True)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Copy back when the reader handed us a different tensor than our view."""
        target = self.resolve_tensor(read_item)
        if tensor.data_ptr() != target.data_ptr():
            target.copy_(tensor)
        if self.release is not None:
            self.release(target)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Keep a named blob."""
        self.blobs[read_item.dest_index.fqn] = value.read()
