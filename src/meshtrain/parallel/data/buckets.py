"""Flat buckets: parameters laid end to end in one buffer, padded to divide over the dp ranks.

A :class:`FlatBucket` is the unit of data-parallel communication and of ZeRO sharding. Its
parameters become views into one flat buffer, so a bucket is reduced, reduce-scattered or
all-gathered with a single collective, and the optimizer works on contiguous shards.

Within a bucket, matrices (which get weight decay) come before vectors (norm weights, biases, which
do not), so any rank's shard intersects the decayed region in one contiguous range.

A bucket belongs to one reduction axis (``axis``): ``"dp"`` for parameters replicated over every
data-parallel rank, ``"edp"`` for expert parameters under expert parallelism, which only the
``dp × tp / ep`` ranks holding the same experts share. Buckets never mix axes, so each is
reduced (and, under ZeRO, sharded) over exactly the ranks that hold its parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass
class ParamSlot:
    """Where one parameter lives inside its bucket's flat buffer."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    decay: bool


def wants_weight_decay(param: torch.Tensor) -> bool:
    """Matrices decay; vectors (norm weights, biases) do not."""
    return param.ndim >= 2


class FlatBucket:
    """A group of parameters flattened into one padded buffer, sharded evenly over ``dp_size``."""

    def __init__(self, index: int, named_params: list[tuple[str, torch.nn.Parameter]],
                 dp_size: int, dp_rank: int, axis: str = "dp"):
        if not named_params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.axis = axis
        ordered = ([np for np in named_params if wants_weight_decay(np[1])]
                   + [np for np in named_params if not wants_weight_decay(np[1])])
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, param in ordered:
            n = param.numel()
            self.slots.append(ParamSlot(name, param, offset, n, param.shape,
                                        wants_weight_decay(param)))
            offset += n
        self.numel = offset
        self.decay_numel = sum(s.numel for s in self.slots if s.decay)
        self.padded_numel = -(-offset // dp_size) * dp_size
        self.shard_numel = self.padded_numel // dp_size
        self.shard_start = dp_rank * self.shard_numel
        self.dtype = ordered[0][1].dtype
        self.device = ordered[0][1].device
        if any(p.dtype != self.dtype for _, p in ordered):
            raise ValueError("all parameters of a bucket must share one dtype")

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The bucket's parameters, in buffer order."""
        return [s.param for s in self.slots]

    def new_buffer(self, dtype: torch.dtype | None = None, full: bool = True) -> torch.Tensor:
        """A zeroed flat buffer (full padded size, or one shard)."""
        return torch.zeros(self.padded_numel if full else self.shard_numel,
                           dtype=dtype or self.dtype, device=self.device)

    def shard(self, full_buffer: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full buffer (a view)."""
        return full_buffer[self.shard_start:self.shard_start + self.shard_numel]

    def flatten_params_into(self, buffer: torch.Tensor) -> None:
        """Copy the parameters' current values into ``buffer``."""
        with torch.no_grad():
            for s in self.slots:
                buffer[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))

    def bind_params(self, buffer: torch.Tensor) -> None:
        """Make every parameter a view into ``buffer`` (its storage is the parameter's now)."""
        for s in self.slots:
            s.param.data = buffer[s.offset:s.offset + s.numel].view(s.shape)

    def bind_grads(self, buffer: torch.Tensor) -> None:
        """Make every parameter's ``.grad`` a view into ``buffer`` (accumulated in place)."""
        for s in self.slots:
            s.param.grad = buffer[s.offset:s.offset + s.numel].view(s.shape)

    def decay_range_in_shard(self) -> tuple[int, int]:
        """``(start, end)`` of the weight-decayed elements in shard-local coordinates."""
        end = min(max(self.decay_numel - self.shard_start, 0), self.shard_numel)
        return 0, end

    def segments(self, sharded: bool) -> list[tuple[ParamSlot, int, int]]:
        """``(slot, start, length)`` of each parameter's elements in the full buffer, or (when
        ``sharded``) in this rank's shard, skipping parameters outside the shard."""
        if not sharded:
            return [(s, s.offset, s.numel) for s in self.slots]
        out = []
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        for s in self.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < b:
                out.append((s, a - lo, b - a))
        return out


def bucket_by_size_and_axis(named_params: list[tuple[str, torch.nn.Parameter]],
                            bucket_bytes: int, axis_of: Callable[[str], str],
                            alone: Callable[[str], bool] = lambda name: False,
                            ) -> list[tuple[str, list]]:
    """Group parameters (given in expected gradient-ready order) into buckets of about
    ``bucket_bytes`` each (a parameter larger than that gets a bucket of its own), with one open
    bucket per reduction axis (``axis_of(name)``: ``"dp"`` or ``"edp"``): parameters of
    different axes never share a bucket, and buckets are emitted in the order they fill up (so
    each axis's buckets keep the gradient-ready order). A parameter ``alone`` accepts (a tied
    embedding) gets a bucket of its own whatever its size. Returns ``(axis, params)`` pairs."""
    out: list[tuple[str, list]] = []
    open_buckets: dict[str, tuple[list, int]] = {}
    for name, param in named_params:
        axis = axis_of(name)
        if alone(name):
            out.append((axis, [(name, param)]))
            continue
        current, size = open_buckets.get(axis, ([], 0))
        nbytes = param.numel() * param.element_size()
        if current and size + nbytes > bucket_bytes:
            out.append((axis, current))
            current, size = [], 0
        current.append((name, param))
        open_buckets[axis] = (current, size + nbytes)
    out += [(axis, current) for axis, (current, _) in open_buckets.items() if current]
    return out
