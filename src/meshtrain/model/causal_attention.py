"""Causal scaled-dot-product attention that skips the masked half on CPU.

PyTorch's CPU flash-attention kernel (fp32) works on key blocks as long as the whole sequence
when the sequence is shorter than about a thousand positions, so with ``is_causal=True`` it still
computes every query against every key and masks half of the products away. Splitting the
queries into a few row blocks, each attending only to the keys at or before its last position,
skips those products: query block ``i`` of ``n`` reads keys ``[0, end_i)``, causally masked only
where it overlaps itself. The result is the same attention (within fp32 rounding: the softmax
sums run over fewer masked zeros).

The blocks run as one autograd function (:class:`_QueryBlocks`) that calls the CPU flash
kernel and its backward directly (the ATen operators ``scaled_dot_product_attention``
dispatches to on a CPU, with an additive float mask, which is what they take), so that nothing
is written twice: the blocks' outputs go straight into one ``[B, S, H, D]`` tensor (the layout
the output projection reads, so the caller's reshape is free, and the one copy both the
projection and the backward keep), the query gradient is assembled block by block in the same
layout, and the key and value gradients of the longest block are the buffers the shorter
blocks add into. Left to autograd, every block's
slice of ``q``, ``k`` and ``v`` would get a zero-filled full-size gradient that the engine then
sums, and each block's output would be kept beside its joined copy.

Measured fp32 forward + backward on this project's reference CPUs (one thread, 4,096 tokens,
docs/performance.md): the blocks take 0.73–0.91 of the single call's time for 256–512
positions (head dims 32–128) on an AMD EPYC, about the same at 1,024, and are slower from 2,048
(where the kernel's own key blocks already skip the masked part) and in bf16; so the split is
used only for fp32 on CPU and sequences in :data:`SPLIT_SEQ_RANGE`. Elsewhere (GPUs, whose
kernels skip masked blocks themselves) the single call runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPLIT_SEQ_RANGE = (256, 1023)
"""Sequence lengths (inclusive) at which CPU fp32 causal attention runs as query blocks."""

QUERY_BLOCKS = 4
"""How many query blocks the split uses."""

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


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
    if not splits_queries(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return _QueryBlocks.apply(q, k, v)


def _block_bounds(seq: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each query block."""
    edges = [seq * i // QUERY_BLOCKS for i in range(QUERY_BLOCKS + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _block_mask(start: int, end: int, like: torch.Tensor) -> torch.Tensor | None:
    """Additive mask of query rows ``[start, end)`` over keys ``[0, end)``: row ``j`` may attend
    keys ``0 .. start + j``. None for the first block, which is plainly causal."""
    if start == 0:
        return None
    blocked = torch.ones(end - start, end, dtype=torch.bool, device=like.device).tril(start)
    return torch.zeros(blocked.shape, dtype=like.dtype, device=like.device).masked_fill_(
        blocked.logical_not_(), float("-inf"))


class _QueryBlocks(torch.autograd.Function):
    """Causal attention as query blocks through the CPU flash kernel, forward and backward."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, seq, head_dim = q.shape
        joined = q.new_empty(batch, seq, heads, head_dim)
        sums = []
        for start, end in _block_bounds(seq):
            out, logsumexp = _flash(q[:, :, start:end], k[:, :, :end], v[:, :, :end], 0.0,
                                    start == 0, attn_mask=_block_mask(start, end, q))
            joined[:, start:end].copy_(out.transpose(1, 2))
            sums.append(logsumexp)
        ctx.save_for_backward(q, k, v, joined, *sums)
        return joined.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, joined, *sums = ctx.saved_tensors
        out = joined.transpose(1, 2)
        grad_q = torch.empty_like(joined)  # [B, S, H, D], the query projection's layout
        grad_k = grad_v = None
        blocks = _block_bounds(q.shape[2])
        for index in reversed(range(len(blocks))):  # the longest block first: its dk, dv
            start, end = blocks[index]              # are the full-length buffers
            gq, gk, gv = _flash_backward(grad[:, :, start:end], q[:, :, start:end],
                                         k[:, :, :end], v[:, :, :end], out[:, :, start:end],
                                         sums[index], 0.0, start == 0,
                                         attn_mask=_block_mask(start, end, q))
            grad_q[:, start:end].copy_(gq.transpose(1, 2))
            if grad_k is None:
                grad_k, grad_v = gk, gv
            else:
                grad_k[:, :, :end].add_(gk)
                grad_v[:, :, :end].add_(gv)
        return grad_q.transpose(1, 2), grad_k, grad_v
