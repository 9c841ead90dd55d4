"""The mean of a tensor over a group, sent as 8-bit values with one fp32 scale per block.

DiLoCo's pseudo-gradients cross the slowest link; ``parallel.outer_grad_dtype = "int8"`` or
``"fp8"`` sends them in one byte per value (Streaming DiLoCo, Douillard et al. 2025, sends
low-precision outer gradients). Eight-bit values cannot be summed in flight without overflow or
a second rounding per hop, so the mean is taken in two exchanges, as a reduce-scatter and an
all-gather would be, with the sum in fp32 in between:

1. every rank quantizes its tensor in blocks of :data:`BLOCK` values (scale = the block's
   largest magnitude over the format's largest value: 127 for int8, 448 for fp8 e4m3) and sends
   chunk ``j`` of it to rank ``j`` (all-to-all);
2. rank ``j`` dequantizes the chunks it received, sums them in fp32, divides by the group size,
   quantizes that mean again and all-gathers it, so every rank dequantizes the same bytes and
   the groups end with identical values.

Each value is rounded twice (once per exchange); the relative error per value is at most about
2 × 1/254 of its block's largest magnitude for int8, and fp8's 3 mantissa bits give ~2 × 1/16 of
the value itself. The bytes moved per rank are ``2 (n − 1)/n × (1 + 4/BLOCK)`` per value,
a quarter of an fp32 all-reduce's ``2 (n − 1)/n × 4``, half of bf16's.

The same two exchanges serve any coordinate-wise reduction (:func:`exchange_reduce`), in 8 bits
or in fp32 / bf16: DiLoCo's robust aggregates (:mod:`meshtrain.training.diloco.robust`) hand it
their reducer, which runs on rank ``j`` over every group's chunk ``j`` (a group left out of the
round is ignored there), and the mean is the reducer that sums and divides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshtrain.config.runtime_facts import QUANTIZED_BLOCK as BLOCK
from meshtrain.config.runtime_facts import QUANTIZED_FORMATS as FORMATS


def quantize(values: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (fp32, a multiple of :data:`BLOCK` long) as uint8 bytes and per-block fp32
    scales."""
    blocks = values.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / FORMATS[kind]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = blocks / scales[:, None]
    if kind == "int8":
        quantized = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        quantized = scaled.to(torch.float8_e4m3fn)
    return quantized.view(torch.uint8).reshape(-1), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """The fp32 values of :func:`quantize`'s ``data`` and ``scales``."""
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    return (data.view(dtype).float().view(-1, BLOCK) * scales[:, None]).reshape(-1)


def quantized_mean(comm, values: torch.Tensor, size: int, kind: str) -> torch.Tensor:
    """The mean of fp32 ``values`` over the ``size`` ranks of ``comm`` (a counted
    :class:`~meshtrain.parallel.comm.AxisComm`), exchanged as ``kind`` (``int8`` or ``fp8``);
    identical on every rank."""
    return exchange_reduce(comm, values, size, lambda rows: rows.sum(dim=0) / size, kind)


def exchange_reduce(comm, values: torch.Tensor, size: int,
                    reducer: Callable[[torch.Tensor], torch.Tensor],
                    kind: str | torch.dtype) -> torch.Tensor:
    """``reducer`` applied coordinate-wise over the ``size`` ranks of ``comm``, in the two
    exchanges above: rank ``j`` receives chunk ``j`` of every rank's fp32 ``values`` and hands
    ``reducer`` a ``(size, chunk)`` fp32 tensor (row ``r`` from rank ``r``), whose ``(chunk,)``
    result is all-gathered. ``kind``: ``int8`` / ``fp8`` (8 bits with per-block scales) or the
    torch dtype to send in (fp32, bf16). Identical on every rank."""
    n = values.numel()
    quantized = isinstance(kind, str)
    align = BLOCK if quantized else 1
    per_rank = -(-n // (size * align)) * align
    padded = values.new_zeros(per_rank * size, dtype=torch.float32)
    padded[:n] = values
    if not quantized:
        sent = padded.to(kind)
        got = torch.empty_like(sent)
        comm.all_to_all_single(got, sent)
        mine = reducer(got.float().view(size, per_rank)).to(kind)
        gathered = mine.new_empty(per_rank * size)
        comm.all_gather_into(gathered, mine)
        return gathered.float()[:n]
    data, scales = quantize(padded, kind)
    got_data, got_scales = torch.empty_like(data), torch.empty_like(scales)
    comm.all_to_all_single(got_data, data)
    comm.all_to_all_single(got_scales, scales)
    mine = reducer(received_rows(got_data, got_scales, size, kind))
    data, scales = quantize(mine, kind)
    all_data = data.new_empty(per_rank * size)
    all_scales = scales.new_empty(per_rank * size // BLOCK)
    comm.all_gather_into(all_data, data)
    comm.all_gather_into(all_scales, scales)
    return dequantize(all_data, all_scales, kind)[:n]


def received_rows(data: torch.Tensor, scales: torch.Tensor, size: int, kind: str) -> torch.Tensor:
    """The ``(size, chunk)`` fp32 rows a rank reduces from the bytes and scales it received in
    the all-to-all (row ``r`` from rank ``r``)."""
    return dequantize(data, scales, kind).view(size, -1)
