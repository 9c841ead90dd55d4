"""Counted collectives: the one door every collective of every axis goes through.

Each call records, for its axis, the **bus bytes per rank** it moved (the nccl-tests convention, so
numbers compare across world sizes and with the cost model):

=================  ==========================
all-reduce          2 (n - 1) / n · S
all-gather          (n - 1) / n · S   (S = the gathered, full size)
reduce-scatter      (n - 1) / n · S   (S = the full input size)
all-to-all          (n - 1) / n · S
broadcast           S  (ring/tree lower bound per rank)
send / recv         S
=================  ==========================

and the number of calls. :class:`CommLog` also keeps each rank's last few collectives (axis, op,
shape, dtype, call site) so that a hang can later be explained by what each rank was last doing.
Groups of size one are no-ops and record nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the flat-tensor collectives; use whichever this torch has.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass
class CollectiveRecord:
    """One collective as it was issued on this rank."""

    axis: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    bus_bytes: int
    site: str
    time_s: float


def _call_site() -> str:
    """``file:line`` of the first caller outside this module (cheap: no traceback objects)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


def bus_bytes(op: str, full_bytes: int, group_size: int) -> int:
    """Bus bytes per rank of one collective on a full tensor of ``full_bytes`` (see module doc)."""
    n = group_size
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * full_bytes // n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * full_bytes // n
    if op in ("send", "recv", "broadcast"):
        return full_bytes
    if op == "all_gather_object":  # diagnostics only: pickled size unknown, not counted
        return 0
    raise ValueError(f"unknown collective {op!r}")


class CommLog:
    """Per-axis byte and call counters, plus a short ring of this rank's recent collectives."""

    def __init__(self, history: int = 32):
        self.bytes: dict[str, int] = collections.defaultdict(int)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.recent: collections.deque[CollectiveRecord] = collections.deque(maxlen=history)

    def record(self, axis: str, op: str, tensor_shape: Sequence[int], dtype: torch.dtype,
               full_bytes: int, group_size: int) -> None:
        """Count one collective."""
        moved = bus_bytes(op, full_bytes, group_size)
        self.bytes[axis] += moved
        self.calls[axis] += 1
        self.recent.append(CollectiveRecord(axis, op, tuple(tensor_shape), str(dtype), moved,
                                            _call_site(), time.time()))

    def reset(self) -> None:
        """Start a new counting window (the trainer calls this at the start of each step)."""
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, int]:
        """Bytes per axis since the last reset, as a plain dict (for metrics)."""
        return dict(self.bytes)

    def describe_recent(self) -> str:
        """Human-readable list of the last collectives, newest last."""
        return "\n".join(f"  {r.axis:>3} {r.op:<15} {r.shape} {r.dtype} at {r.site}"
                         for r in self.recent) or "  (none)"


class CountedComm:
    """Collectives over one axis's process group, counted into a :class:`CommLog`.

    ``group`` is ``None`` when the axis has a single rank: every method then returns at once.
    """

    def __init__(self, axis: str, group: dist.ProcessGroup | None, size: int, log: CommLog):
        self.axis = axis
        self.group = group
        self.size = size
        self.log = log

    @property
    def active(self) -> bool:
        """True when the axis has more than one rank."""
        return self.size > 1

    def _nbytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                   async_op: bool = False):
        """In-place all-reduce over the axis."""
        if not self.active:
            return None
        self.log.record(self.axis, "all_reduce", tensor.shape, tensor.dtype, self._nbytes(tensor),
                        self.size)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Gather equal shards into ``output`` (concatenated along dim 0)."""
        if not self.active:
            output.copy_(shard.reshape(output.shape))
            return None
        self.log.record(self.axis, "all_gather", output.shape, output.dtype, self._nbytes(output),
                        self.size)
        return _all_gather_flat(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter_into(self, shard: torch.Tensor, full: torch.Tensor,
                            op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False):
        """Reduce ``full`` over the axis and keep this rank's equal dim-0 shard in ``shard``."""
        if not self.active:
            shard.copy_(full.reshape(shard.shape))
            return None
        self.log.record(self.axis, "reduce_scatter", full.shape, full.dtype, self._nbytes(full),
                        self.size)
        return _reduce_scatter_flat(shard, full, op=op, group=self.group, async_op=async_op)

    def all_to_all_single(self, output: torch.Tensor, inputs: torch.Tensor,
                          output_splits: list[int] | None = None,
                          input_splits: list[int] | None = None, async_op: bool = False):
        """All-to-all with optional variable splits along dim 0."""
        if not self.active:
            output.copy_(inputs)
            return None
        self.log.record(self.axis, "all_to_all", inputs.shape, inputs.dtype,
                        self._nbytes(inputs), self.size)
        return dist.all_to_all_single(output, inputs, output_splits, input_splits,
                                      group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int = 0, async_op: bool = False):
        """Broadcast from the axis rank ``src_group_rank``."""
        if not self.active:
            return None
        self.log.record(self.axis, "broadcast", tensor.shape, tensor.dtype, self._nbytes(tensor),
                        self.size)
        src = dist.get_global_rank(self.group, src_group_rank)
        return dist.broadcast(tensor, src=src, group=self.group, async_op=async_op)

    def all_gather_object(self, obj) -> list:
        """Gather a picklable object from every rank of the axis (diagnostics, not hot path)."""
        if not self.active:
            return [obj]
        self.log.record(self.axis, "all_gather_object", (), torch.uint8, 0, self.size)
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def send(self, tensor: torch.Tensor, dst_group_rank: int, tag: int = 0):
        """Non-blocking point-to-point send to an axis rank; returns the work handle."""
        self.log.record(self.axis, "send", tensor.shape, tensor.dtype, self._nbytes(tensor), 2)
        return dist.isend(tensor, dst=dist.get_global_rank(self.group, dst_group_rank),
                          group=self.group, tag=tag)

    def recv(self, tensor: torch.Tensor, src_group_rank: int, tag: int = 0):
        """Non-blocking point-to-point receive from an axis rank; returns the work handle."""
        self.log.record(self.axis, "recv", tensor.shape, tensor.dtype, self._nbytes(tensor), 2)
        return dist.irecv(tensor, src=dist.get_global_rank(self.group, src_group_rank),
                          group=self.group, tag=tag)
