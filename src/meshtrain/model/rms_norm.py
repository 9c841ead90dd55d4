"""RMSNorm's forward and backward in a few whole-tensor passes, for fp32 on CPU.

``F.rms_norm`` on CPU runs its forward as one kernel, but its backward as a chain of autograd
element-wise ops, several passes over the activation each way. :class:`RMSNormFunction`
writes the backward by hand from the forward's saved ``rstd``, with ``x̂ = x · rstd`` and
``g = dy · w``:

    dx = rstd · (g − x̂ · mean(g · x̂))        dw = Σ_rows dy · x̂

(the mean over the normalised dimension), using ``vecdot`` for the forward's sum of squares
and the backward's row sums and ``addcmul`` for the difference, so each is
one pass. Measured on this project's reference CPU (one thread, [8, 256, 256], caches flushed
between calls, docs/performance.md): forward + backward 1.67 ms against ``F.rms_norm``'s 4.6.
GPUs keep ``F.rms_norm``, whose CUDA backward is one fused kernel.
"""

from __future__ import annotations

import torch


class RMSNormFunction(torch.autograd.Function):
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dimension, with the backward
    above."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        squares = torch.linalg.vecdot(x, x).unsqueeze(-1)
        rstd = torch.rsqrt(squares.div_(width).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        width = x.shape[-1]
        normed = x * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            scaled = grad * weight
            mean = torch.linalg.vecdot(scaled, normed).unsqueeze(-1).div_(-width)
            grad_x = torch.addcmul(scaled, normed, mean).mul_(rstd)
        if ctx.needs_input_grad[1]:
            grad_w = normed.mul_(grad).reshape(-1, width).sum(0)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension scaled by ``weight`` (both fp32): the
    hand-written backward on CPU, ``F.rms_norm`` elsewhere."""
    if x.device.type == "cpu":
        return RMSNormFunction.apply(x, weight, eps)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
