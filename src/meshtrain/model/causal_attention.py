"""Causal scaled-dot-product attention that skips the masked half on CPU.

PyTorch's CPU flash-attention kernel (fp32) works on key blocks as long as the whole sequence
when the sequence is shorter than about a thousand positions, so with ``is_causal=True`` it still
computes every query against every key and masks half of the products away. Splitting the
queries into a few row blocks, each attending only to the keys at or before its last position,
skips those products: query block ``i`` of ``n`` reads keys ``[0, end_i)``, causally masked only
where it overlaps itself. The result is the same attention (within fp32 rounding: the softmax
sums run over fewer masked zeros).

Measured fp32 forward + backward on this project's reference CPU (one thread, 4,096 tokens,
docs/performance.md): 4 blocks take 0.73–0.91 of the single call's time for 256–512 positions
(head dims 32–128), about the same at 1,024, and are slower from 2,048 (where the kernel's own
key blocks already skip the masked part) and in bf16; so the split is used only for fp32 on
CPU and sequences in :data:`SPLIT_SEQ_RANGE`. Elsewhere (GPUs, whose kernels skip masked
blocks themselves) the single call runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPLIT_SEQ_RANGE = (256, 1023)
"""Sequence lengths (inclusive) at which CPU fp32 causal attention runs as query blocks."""

QUERY_BLOCKS = 4
"""How many query blocks the split uses."""


def splits_queries(q: torch.Tensor) -> bool:
    """Whether :func:`causal_attention` runs ``q`` [B, H, S, D] as query blocks."""
    low, high = SPLIT_SEQ_RANGE
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and low <= q.shape[2] <= high)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [B, Hq, S, D] over k/v [B, Hkv, S, D] (grouped-query when the
    head counts differ); returns [B, Hq, S, D], as ``scaled_dot_product_attention``.

    Where :func:`splits_queries` holds, the result is a transposed view of a [B, S, Hq, D]
    tensor, so the caller's ``transpose(1, 2).reshape(B, S, -1)`` costs no copy.
    """
    gqa = q.shape[1] != k.shape[1]
    if not splits_queries(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    seq = q.shape[2]
    bounds = [seq * i // QUERY_BLOCKS for i in range(QUERY_BLOCKS + 1)]
    blocks = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        q_block, k_block, v_block = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
        if start == 0:
            out = F.scaled_dot_product_attention(q_block, k_block, v_block, is_causal=True,
                                                 enable_gqa=gqa)
        else:
            # query start + j may attend keys 0 .. start + j (True = may attend)
            mask = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(start)
            out = F.scaled_dot_product_attention(q_block, k_block, v_block, attn_mask=mask,
                                                 enable_gqa=gqa)
        blocks.append(out.transpose(1, 2))
    return torch.cat(blocks, dim=1).transpose(1, 2)
