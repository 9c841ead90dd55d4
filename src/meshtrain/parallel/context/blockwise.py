"""Exact attention of a query chunk over several key/value blocks, merged by log-sum-exp.

Under context parallelism a rank's query chunk ``c`` (positions ``c·L .. c·L + L``) attends to
keys ``0 .. (c + 1)·L``: blocks ``0 .. c - 1`` fully, block ``c`` causally. Handing SDPA that
shape with a boolean mask works on any device, but SDPA turns the mask into a float bias of
``L × (c + 1)·L`` elements and keeps it for backward in every layer, which undoes much of what
splitting the sequence saves. Here each block is one flash-attention call without a mask (the
full prefix, then the causal square), and the partial outputs are merged exactly with their
log-sum-exps (``out = Σ_b exp(lse_b - lse) · out_b``, ``lse = logsumexp_b lse_b``). Backward runs
each block's flash backward with the *merged* output and log-sum-exp, which gives each block's
share of the exact gradient (the softmax normaliser is the whole row's); the query's gradient is
their sum. This is the merge ring attention uses, applied to blocks already on this rank.

It uses the CPU flash-attention operator with its log-sum-exp output
(``aten::_scaled_dot_product_flash_attention_for_cpu``); :func:`blockwise_supported` says where it
is available, and other devices use the masked SDPA call.
"""

from __future__ import annotations

import math

import torch

_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                          None)


def blockwise_supported(q: torch.Tensor) -> bool:
    """Whether :func:`blockwise_attention` runs for ``q`` (CPU fp32/bf16 with the operator)."""
    return (_flash is not None and _flash_backward is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16))


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, causal, scale, *kv):
        outs, lses = [], []
        for block, is_causal in enumerate(causal):
            out, lse = _flash(q, kv[2 * block], kv[2 * block + 1], 0.0, is_causal, scale=scale)
            outs.append(out)
            lses.append(lse)
        if len(outs) == 1:
            out, lse = outs[0], lses[0]
        else:
            lse = torch.logsumexp(torch.stack(lses), dim=0)
            out = sum(o.float() * torch.exp(b - lse)[..., None] for o, b in zip(outs, lses,
                                                                                  strict=True))
            out = out.to(q.dtype)
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, out, lse, *kv)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse, *kv = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q = None
        grads_kv = []
        for block, is_causal in enumerate(ctx.causal):
            gq, gk, gv = _flash_backward(grad_out, q, kv[2 * block], kv[2 * block + 1], out, lse,
                                         0.0, is_causal, scale=ctx.scale)
            grad_q = gq if grad_q is None else grad_q + gq
            grads_kv += [gk, gv]
        return grad_q, None, None, *grads_kv


def blockwise_attention(q: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor, bool]]
                        ) -> torch.Tensor:
    """Softmax attention of ``q`` ``[B, Hq, L, D]`` over the concatenation of ``blocks``, each
    ``(k, v, causal)`` with ``k``/``v`` ``[B, Hkv, n, D]`` (grouped-query heads allowed); a causal
    block must be square (``n = L``, the queries' own positions) and others are fully visible."""
    causal = tuple(flag for _, _, flag in blocks)
    kv = [t for k, v, _ in blocks for t in (k, v)]  # views of the gathered keys: no copies
    return _BlockwiseAttention.apply(q, causal, 1.0 / math.sqrt(q.shape[-1]), *kv)
