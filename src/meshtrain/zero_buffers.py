"""Sizes of the ZeRO runtime's reduction buffers that the planner's memory model also counts.

Kept apart from :mod:`meshtrain.parallel.data.staging` (which needs torch) so that
``meshtrain estimate`` and ``plan`` read the runtime's own figure without importing torch.
"""

INITIAL_PAIRS = 2
"""``(full bucket, shard)`` gradient buffer pairs a ZeRO-2/3 staging pool starts with: one
accumulating while the other is reduced (:class:`meshtrain.parallel.data.staging.StagingPool`)."""
