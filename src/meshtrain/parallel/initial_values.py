"""Initial values of a parallelised model's pieces, equal to the unsplit model's.

A parallel layout may have replaced a parameter by this rank's piece; its sharding record
(:class:`~meshtrain.parallel.sharding.ParamSharding`) gives the full shape and where the piece sits,
and the model's name-seeded draws (:mod:`meshtrain.model.init`) generate just that piece, so every
layout starts from the same model as one process.
"""

from __future__ import annotations

import math

import torch

from meshtrain.config import ModelConfig
from meshtrain.model.init import init_box, init_range, init_tensor
from meshtrain.parallel.sharding import ParamSharding


def initial_value(name: str, param: torch.Tensor, seed: int, config: ModelConfig,
                  sharding: ParamSharding | None = None,
                  flat_range: tuple[int, int] | None = None) -> torch.Tensor:
    """The initial value (fp32, CPU) of this rank's piece of parameter ``name``, or with
    ``flat_range = (start, stop)`` only elements ``[start, stop)`` of the flattened piece (1-D).

    A parallel layout may have replaced a parameter by this rank's piece; its sharding record
    (``sharding``, :class:`~meshtrain.parallel.sharding.ParamSharding`) then gives the full shape
    and where the piece sits, so the values match the unsplit model's. Only the piece is
    generated, block by block (:func:`init_box`; a range of a whole parameter or of a piece that
    is one contiguous range of the full tensor with :func:`init_range`): no rank ever draws a
    full tensor it does not hold. Experts re-placed out of order are drawn one expert at a time.
    """
    piece = sharding is not None and sharding.is_piece
    if not piece:
        if flat_range is None:
            return init_tensor(name, param.shape, seed, config)
        return init_range(name, param.shape, *flat_range, seed, config)
    full, shape = tuple(sharding.full_shape), tuple(param.shape)
    offset = sharding.global_offset(len(full))
    rows = sharding.expert_rows()
    dim = sharding.ep_dim
    in_order = rows is None or rows == list(range(rows[0], rows[0] + len(rows)))
    if flat_range is not None and in_order and full[1:] == shape[1:] and not any(offset[1:]):
        base = offset[0] * math.prod(full[1:])  # the piece is rows offset[0]... of the full one
        return init_range(name, full, base + flat_range[0], base + flat_range[1], seed, config)
    if in_order:
        first = list(offset)
        if rows is not None:
            first[dim] = rows[0]
        value = init_box(name, full, first, shape, seed, config)
    else:
        one = list(shape)
        one[dim] = 1
        value = torch.cat([init_box(name, full, [*offset[:dim], row, *offset[dim + 1:]], one,
                                    seed, config) for row in rows], dim=dim)
    return value if flat_range is None else value.reshape(-1)[flat_range[0]:flat_range[1]]
