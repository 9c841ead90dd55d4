"""Deferred weight gradients: the pipeline's real ``I``/``W`` split (zero-bubble schedules, 1F1B's
early gradient sends).

Linear layers (``nn.Linear`` through :func:`linear`, the tensor-parallel column/row/head-select
layers, the MoE expert matmuls through :func:`grouped_expert_matmul`) use a custom autograd
Function.
Outside a :func:`deferring` block its backward is an ordinary matmul backward. Inside one, it
computes only the input gradient and pushes onto the active :class:`WeightGradQueue` a closure that
holds ``(input, grad_output)``; the pipeline's ``W`` pass later runs these closures:
``grad_weight = grad_output^T @ input`` (summed over tokens), with no collective and without
walking the autograd graph again. The result reaches the parameter through
``torch.autograd.backward(param, grad)`` on the leaf, so ``.grad`` accumulation and every
post-accumulate hook (data-parallel bucket reduction, ZeRO) fire exactly as for a plain backward.

Inside a :func:`plain_matmuls` block the linear layers run as plain ``F.linear``, with no Python
autograd step (the expert matmuls keep their function, which they run everywhere). A schedule
that splits only some backwards (1F1B splits those whose input gradient the previous stage waits
for in its cool-down) runs the other micro-batches' forwards that way, at a plain layer's cost.

Parameters outside these matmuls (norm weights, the MoE router, embeddings, biases of modules
not routed here) get their gradients during ``I``; they are cheap elementwise or lookup grads.
A weight that is not a leaf (e.g. a row selection of a replicated parameter) is also handled
during ``I``, because its graph is freed once ``I`` ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from meshtrain.model.grouped_gemm import grouped_input_grad, grouped_matmul, grouped_weight_grad

_ACTIVE: list[WeightGradQueue] = []
_PLAIN: list[bool] = []  # non-empty inside plain_matmuls()


class WeightGradQueue:
    """The deferred weight-gradient work of one backward (one micro-batch at one stage)."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, int | None, Callable[[], torch.Tensor]]] = []

    def push(self, param: torch.Tensor, index: int | None,
             fn: Callable[[], torch.Tensor]) -> None:
        """Record that ``fn()`` is ``param``'s gradient (or of ``param[index]``)."""
        self.entries.append((param, index, fn))

    def run(self) -> None:
        """Compute every recorded weight gradient and accumulate it into the parameters."""
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for param, index, fn in self.entries:
            g = fn()
            key = id(param)
            if index is None:
                if key in grads:
                    grads[key][1].add_(g)
                else:
                    grads[key] = (param, g)
            else:
                if key not in grads:
                    grads[key] = (param, torch.zeros(param.shape, dtype=g.dtype,
                                                     device=g.device))
                grads[key][1][index].add_(g)
        self.entries.clear()
        if grads:
            params, values = zip(*grads.values(), strict=True)
            torch.autograd.backward(list(params), list(values))


@contextlib.contextmanager
def deferring(queue: WeightGradQueue) -> Iterator[WeightGradQueue]:
    """Inside this block, backward passes of :func:`linear`/:func:`grouped_expert_matmul` defer
    their
    weight gradients to ``queue``."""
    _ACTIVE.append(queue)
    try:
        yield queue
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def plain_matmuls() -> Iterator[None]:
    """Inside this block, :func:`linear` runs plain ``F.linear`` (its backward cannot be
    deferred): the forward of a micro-batch whose backward runs whole (``B``), under a schedule
    that defers the weight gradients of other micro-batches."""
    _PLAIN.append(True)
    try:
        yield
    finally:
        _PLAIN.pop()


def _deferral(weight: torch.Tensor) -> WeightGradQueue | None:
    if _ACTIVE and weight.is_leaf and weight.requires_grad:
        return _ACTIVE[-1]
    return None


def _weight_grad(x: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
    """``sum over tokens of go^T x`` for ``y = x W^T``."""
    return go.reshape(-1, go.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        # The parameter itself, not a saved copy: under activation checkpointing a saved tensor
        # comes back as a recomputed alias, and a deferred gradient must reach the real leaf.
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, go):
        (x,), weight = ctx.saved_tensors, ctx.weight
        gx = go @ weight if ctx.needs_input_grad[0] else None
        gw = gb = None
        queue = _deferral(weight)
        if queue is not None:
            queue.push(weight, None, lambda: _weight_grad(x, go))
            if ctx.has_bias:
                queue.push(ctx.bias_param, None, lambda: go.reshape(-1, go.shape[-1]).sum(0))
        else:
            if ctx.needs_input_grad[1]:
                gw = _weight_grad(x, go)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = go.reshape(-1, go.shape[-1]).sum(0)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose weight (and bias) gradient can be deferred (see module docstring)."""
    if (_PLAIN or not torch.is_grad_enabled() or not weight.requires_grad
            or not weight.is_leaf):
        return torch.nn.functional.linear(x, weight, bias)
    if bias is not None and not bias.is_leaf:
        return torch.nn.functional.linear(x, weight, bias)
    return _deferrable_linear(x, weight, bias)


def _deferrable_linear(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    # Never traced by torch.compile (meshtrain.parallel.compile marks it): the backward decides
    # at run time whether a W queue is active, which a traced backward graph would freeze.
    return _LinearWithBias.apply(x, weight, bias) if bias is not None else \
        _Linear.apply(x, weight, None)


class _LinearWithBias(_Linear):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.bias_param = bias
        return _Linear.forward(ctx, x, weight, bias)


class _GroupedExpertMatmul(torch.autograd.Function):
    """Rows of ``x`` grouped by expert times their expert's slice of ``w`` [E, in, out]
    (:mod:`meshtrain.model.grouped_gemm`)."""

    @staticmethod
    def forward(ctx, x, w, groups):
        ctx.save_for_backward(x)
        ctx.w, ctx.groups = w, groups  # the parameter itself (see _Linear.forward)
        return grouped_matmul(x, w, groups)

    @staticmethod
    def backward(ctx, go):
        (x,), w, groups = ctx.saved_tensors, ctx.w, ctx.groups
        go = go.contiguous()  # the grouped kernels take no broadcast (stride 0) gradient
        gx = grouped_input_grad(go, w, groups) if ctx.needs_input_grad[0] else None
        gw = None
        queue = _deferral(w)
        if queue is not None:
            queue.push(w, None, lambda: grouped_weight_grad(x, go, groups))
        elif ctx.needs_input_grad[1]:
            gw = grouped_weight_grad(x, go, groups)
        return gx, gw, None


def grouped_expert_matmul(x: torch.Tensor, w: torch.Tensor, groups) -> torch.Tensor:
    """Every expert's rows of ``x`` times its ``w[e]`` in one grouped GEMM
    (:class:`~meshtrain.model.grouped_gemm.ExpertGroups` ``groups``), with the weight gradient
    deferrable like :func:`linear`'s."""
    if not torch.is_grad_enabled() or not w.requires_grad or not w.is_leaf:
        return grouped_matmul(x, w, groups)
    return _deferrable_expert_matmul(x, w, groups)


def _deferrable_expert_matmul(x: torch.Tensor, w: torch.Tensor, groups) -> torch.Tensor:
    return _GroupedExpertMatmul.apply(x, w, groups)  # not traced: see _deferrable_linear


class DeferrableLinear(torch.nn.Linear):
    """``nn.Linear`` whose weight gradient can be deferred; :func:`make_deferrable` switches
    existing modules to it in place (same parameters, same names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` through :func:`linear`."""
        return linear(x, self.weight, self.bias)


def make_deferrable(module: torch.nn.Module) -> None:
    """Switch every plain ``nn.Linear`` under ``module`` to :class:`DeferrableLinear`, and turn
    on ``defer_weight_grads`` of the layers that have it (the tensor-parallel linears)."""
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = DeferrableLinear
        elif hasattr(m, "defer_weight_grads"):
            m.defer_weight_grads = True
