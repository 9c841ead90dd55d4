"""The runtime's sizing facts that the planner prices as well, in one torch-free place.

The runtime (which needs torch) and the planner (which must not) read these same definitions, so
``meshtrain estimate`` and ``plan`` price what the runtime does without importing torch:

- :func:`bus_bytes`: bus bytes per rank of one collective (the nccl-tests convention), which
  :mod:`meshtrain.parallel.comm` counts and the planner's communication model prices;
- :data:`INITIAL_PAIRS`: the ZeRO-2/3 staging pool's first gradient buffers
  (:mod:`meshtrain.parallel.data.staging`);
- :data:`QUANTIZED_BLOCK` and :data:`QUANTIZED_FORMATS`: the 8-bit outer-gradient format of DiLoCo
  (:mod:`meshtrain.training.diloco.quantized_reduce`);
- :func:`fragment_of_parameters`: which Streaming DiLoCo fragment each parameter belongs to
  (:mod:`meshtrain.training.diloco.outer`).
"""

from __future__ import annotations

import re

INITIAL_PAIRS = 2
"""``(full bucket, shard)`` gradient buffer pairs a ZeRO-2/3 staging pool starts with: one
accumulating while the other is reduced (:class:`meshtrain.parallel.data.staging.StagingPool`)."""

QUANTIZED_BLOCK = 256
"""Values per fp32 scale in DiLoCo's 8-bit outer-gradient exchange."""

QUANTIZED_FORMATS = {"int8": 127.0, "fp8": 448.0}
"""The 8-bit formats and their largest finite magnitude (int8 symmetric, fp8 e4m3)."""


def bus_bytes(op: str, full_bytes: int, group_size: int) -> int:
    """Bus bytes per rank of one collective on a full tensor of ``full_bytes`` (the table in
    :mod:`meshtrain.parallel.comm`)."""
    n = group_size
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * full_bytes // n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * full_bytes // n
    if op in ("send", "recv", "broadcast"):
        return full_bytes
    if op in ("all_gather_object", "barrier"):  # diagnostics / sync only: not counted
        return 0
    raise ValueError(f"unknown collective {op!r}")


def fragment_of_parameters(sizes: list[tuple[str, int]], fragments: int) -> dict[str, int]:
    """Each parameter's fragment (0 .. ``fragments`` - 1) from ``(name, elements)`` pairs:
    units (the embedding, each block, the rest) in model order, each in the fragment its
    midpoint by element count falls in."""
    def unit(name: str) -> int:
        match = re.match(r"layers\.(\d+)\.", name)
        if match:
            return int(match.group(1)) + 1
        return 0 if "embed" in name else 1 << 30

    totals: dict[int, int] = {}
    for name, numel in sizes:
        totals[unit(name)] = totals.get(unit(name), 0) + numel
    everything, before, where = max(sum(totals.values()), 1), 0, {}
    for key in sorted(totals):
        where[key] = min(fragments - 1, int(fragments * (before + totals[key] / 2) / everything))
        before += totals[key]
    return {name: where[unit(name)] for name, _ in sizes}


LOSS_CHUNK_ELEMENTS = 8 * 2**20
"""Logits the chunked cross-entropy converts to fp32 at once (32 MiB;
:mod:`meshtrain.training.cross_entropy`): a chunk is as many rows as fit. The memory estimates
count one such chunk and its temporary."""
