"""Context parallelism (``parallel.cp``): every sequence split over ``cp`` ranks.

:mod:`~meshtrain.parallel.context.sequence` says which tokens each rank holds (two of ``2 × cp``
chunks, balanced for causal attention), :mod:`~meshtrain.parallel.context.attention` computes
attention against the whole sequence's all-gathered keys and values, and
:func:`apply_context_parallel` installs both on a model. Parameters are not split: cp ranks hold
the same weights and reduce their gradients together with the data-parallel ranks (the mesh's
``dp_cp`` group).
"""

from meshtrain.parallel.context.apply import apply_context_parallel
from meshtrain.parallel.context.sequence import (
    chunks_of_rank,
    context_layout,
    local_positions,
    shard_sequence,
)

__all__ = ["apply_context_parallel", "chunks_of_rank", "context_layout", "local_positions",
           "shard_sequence"]
