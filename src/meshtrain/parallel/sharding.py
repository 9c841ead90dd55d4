"""One typed record per parameter: how this rank's copy relates to the unsplit model's tensor.

A parallel layout replaces some parameters by this rank's piece (tensor parallelism splits one
dim, expert parallelism keeps ``E / ep`` experts) and changes how others are reduced (replicated
over tp, reduced over ``edp``). Every such fact about a parameter lives in its
:class:`ParamSharding`, and the records of a model live in one :class:`ShardingTable` keyed by the
parameter's qualified name (the plain model's name, which no layout changes). The table belongs to
the parallelised model (:class:`~meshtrain.parallel.state.ParallelState`), so it survives the move
off the meta device, where every parameter object is replaced, without copying anything.

Readers: the name-seeded initialisation (the full shape and how to cut the piece), the
data-parallel engine (reduction axis, gradient-norm and tp-partial bookkeeping), the final-weights
gather (the dims to gather over ep and tp), the checkpoint writer (full shape, offset of the piece
and the expert rows) and expert re-placement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshtrain.parallel.expert.placement import LayerPlacement


@dataclasses.dataclass(frozen=True)
class ParamSharding:
    """The sharding facts of one parameter on this rank (the defaults: a whole, plain parameter).

    ``full_shape``, ``shape`` and ``offset`` are set together for a parameter that holds a piece
    of a larger tensor: the unsplit tensor's shape, the piece's shape and where the piece starts
    in it (per dim). ``tp_dim``: the dim tensor parallelism splits; ``ep_dim``: the dim of the
    experts under expert parallelism, whose rows follow ``expert_placement`` (shared with the
    experts module, so re-placing experts updates every record of the layer). ``tp_replicated``:
    the parameter is the same on every tp rank; ``tp_partial_grad``: each tp rank's gradient is
    only its share and is summed over tp. ``dp_axis``: the group its gradient is reduced (and,
    under ZeRO, sharded) over, ``"dp"`` or ``"edp"``. ``tied``: the parameter is also held by
    another pipeline rank (a tied embedding, on the first and the last stage): its gradient is
    summed over the mesh's ``tied`` group, and it gets a data-parallel bucket of its own so both
    holders lay it out (and ZeRO-shard it) alike. ``tied_copy``: this rank's is the last stage's
    copy; the gradient norm and the final weights count the first stage's only.
    """

    full_shape: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None
    tp_dim: int | None = None
    tp_replicated: bool = False
    tp_partial_grad: bool = False
    ep_dim: int | None = None
    dp_axis: str = "dp"
    expert_placement: LayerPlacement | None = None
    tied: bool = False
    tied_copy: bool = False

    @classmethod
    def piece(cls, full_shape, shape, offset, **facts) -> ParamSharding:
        """The record of a parameter holding the ``shape`` piece at ``offset`` of a
        ``full_shape`` tensor (``facts``: the other fields)."""
        full_shape, shape, offset = tuple(full_shape), tuple(shape), tuple(offset)
        if not len(full_shape) == len(shape) == len(offset):
            raise ValueError(f"piece {shape} at {offset} does not match full shape {full_shape}")
        return cls(full_shape=full_shape, shape=shape, offset=offset, **facts)

    @property
    def is_piece(self) -> bool:
        """Whether this rank holds only a piece of the full tensor."""
        return self.full_shape is not None

    def full_shape_of(self, local_shape: Iterable[int]) -> tuple[int, ...]:
        """The full tensor's shape of a parameter whose local shape is ``local_shape``."""
        return self.full_shape if self.full_shape is not None else tuple(local_shape)

    def global_offset(self, ndim: int) -> tuple[int, ...]:
        """Where this rank's piece starts in the full tensor (zeros for a whole parameter)."""
        return self.offset if self.offset is not None else (0,) * ndim

    def expert_rows(self) -> list[int] | None:
        """The global expert of each local row of an expert-parallel parameter, else None."""
        placement = self.expert_placement
        return None if placement is None else placement.local_experts()

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (a tensor of the full shape): the experts of its slots
        along ``ep_dim`` (in slot order), the range at ``offset`` along every other split dim."""
        if not self.is_piece:
            return full
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, "
                             f"got {tuple(full.shape)}")
        out = full
        for dim, (start, size, whole) in enumerate(zip(self.offset, self.shape, self.full_shape,
                                                       strict=True)):
            if dim == self.ep_dim and self.expert_placement is not None:
                rows = torch.tensor(self.expert_placement.local_experts(), device=full.device)
                out = out.index_select(dim, rows)
            elif size != whole:
                out = out.narrow(dim, start, size)
        return out


#: The record of a parameter no layout touched.
WHOLE = ParamSharding()


class ShardingTable:
    """The :class:`ParamSharding` of every parameter of one model, by qualified name.

    The layouts add the records of the parameters they change; :meth:`align` then gives every
    other parameter the record of a whole one (:data:`WHOLE`) and drops the parameters a pipeline
    split removed, so looking up a name the model does not have is an error."""

    def __init__(self) -> None:
        self._records: dict[str, ParamSharding] = {}

    def __getitem__(self, name: str) -> ParamSharding:
        try:
            return self._records[name]
        except KeyError:
            raise KeyError(f"no sharding record for parameter {name!r}") from None

    def __setitem__(self, name: str, record: ParamSharding) -> None:
        if not isinstance(record, ParamSharding):
            raise TypeError(f"a sharding record must be a ParamSharding, got {type(record)}")
        self._records[name] = record

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def items(self) -> Iterator[tuple[str, ParamSharding]]:
        """``(name, record)`` of every parameter with a record."""
        return iter(self._records.items())

    def get(self, name: str) -> ParamSharding:
        """``name``'s record, or :data:`WHOLE` while it has none (for the layouts, which build
        the table one axis after another)."""
        return self._records.get(name, WHOLE)

    def update(self, name: str, **facts) -> ParamSharding:
        """Change some fields of ``name``'s record (starting from :data:`WHOLE` if it has none);
        returns the new record."""
        record = dataclasses.replace(self.get(name), **facts)
        self[name] = record
        return record

    def register(self, prefix: str, records: dict[str, ParamSharding]) -> None:
        """Add the records of one module's parameters (local name -> record) under the module's
        qualified name ``prefix``."""
        for local, record in records.items():
            self[f"{prefix}.{local}" if prefix else local] = record

    def align(self, names: Iterable[str]) -> None:
        """Make the table hold exactly ``names`` (the model's parameters): a record of a whole
        parameter for each name without one, none for names not listed (modules a pipeline
        split removed)."""
        names = list(names)
        self._records = {name: self._records.get(name, WHOLE) for name in names}
