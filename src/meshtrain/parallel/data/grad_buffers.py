"""Where a data-parallel rank's gradients live between and across steps.

:class:`GradientBuffers` is the part of
:class:`~meshtrain.parallel.data.engine.DataParallelEngine` that keeps each parameter's
gradient in its bucket's flat buffer at ZeRO 0-1 and resets the buffers for the next step.

At ZeRO 0-1 a parameter's ``.grad`` is a view of its slice of the bucket's gradient buffer,
which autograd accumulates into in place. :meth:`GradientBuffers.zero_grad` does not clear the
buffers: it drops every ``.grad``, autograd hands over each parameter's first gradient of the
next step as a new tensor, and :meth:`GradientBuffers._keep_grad_in_buffer` copies it over the
slice and binds the slice again (one pass over the gradients, where zeroing the buffer and
adding into it take two). A parameter that gets no gradient in a step still has the previous
step's sum in its slice; :meth:`GradientBuffers._zero_missing_grads` zeroes it before the
bucket is reduced. Gradients kept in another dtype than the parameters (fp32 main gradients of
bf16 parameters) cannot be views: they are added into a zeroed buffer and ``.grad`` dropped.
ZeRO 2-3 hold only gradient shards (:class:`~.shard_storage.ShardStorage`).

A pipeline's step runs several micro-batches' backward passes (and deferred weight gradients)
and reduces once at its end, so at ZeRO 0-1 it needs no per-parameter work during backward:
:meth:`GradientBuffers.bind_zeroed_grads` zeroes the buffers and binds every ``.grad`` before
the step, and the engine removes its hooks until a step that is not pipelined.
"""

from __future__ import annotations

import torch

from meshtrain.parallel.data.buckets import FlatBucket


class GradientBuffers:
    """Gradient buffers of the engine's buckets (a mixin of the engine: it reads ``stage``,
    ``grad_dtype``, ``buckets`` and the parameter-to-slot maps, and registers its
    ``_on_grad_ready`` as every parameter's post-accumulate hook)."""

    def register_grad_hooks(self) -> None:
        """Make ``_on_grad_ready`` every parameter's post-accumulate hook (again, after
        :meth:`remove_grad_hooks`)."""
        if self._grad_hooks is None:
            self._grad_hooks = [slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)
                                for b in self.buckets for slot in b.slots]

    def remove_grad_hooks(self) -> None:
        """Drop the hooks until :meth:`register_grad_hooks` (the next step that is not
        pipelined calls it). Pipelined steps at ZeRO 0-1 (:meth:`bind_zeroed_grads`) need none:
        the hooks' Python, called between large kernels, cost ~20 us a call, ~2 ms of a pipeline
        stage's step at the bench shape (docs/performance.md)."""
        for handle in self._grad_hooks or ():
            handle.remove()
        self._grad_hooks = None

    def bind_zeroed_grads(self) -> bool:
        """Before a pipelined step at ZeRO 0-1 with gradients in the parameters' dtype: zero each
        gradient buffer and bind every ``.grad`` to its slice, so that autograd adds every
        micro-batch's gradient (and every deferred ``W``) in place. Returns False, binding
        nothing, where gradients are kept otherwise (ZeRO 2-3, fp32 gradients of bf16
        parameters)."""
        if self.stage >= 2 or any(self._separate_grads(b) for b in self.buckets):
            return False
        for b in self.buckets:
            b.grad_buffer.zero_()
            for slot in b.slots:
                slot.param.grad = self._grad_slice(b, slot).view(slot.shape)
        return True

    def _separate_grads(self, b: FlatBucket) -> bool:
        """Whether ``b``'s gradients live in a buffer of another dtype than its parameters
        (fp32 main gradients of bf16 parameters): autograd's ``.grad`` cannot be a view of it."""
        return self.grad_dtype != b.dtype

    @staticmethod
    def _grad_slice(b: FlatBucket, slot) -> torch.Tensor:
        """``slot``'s parameter's slice of ``b``'s gradient buffer, flat."""
        return b.grad_buffer[slot.offset:slot.offset + slot.numel]

    def _keep_grad_in_buffer(self, bucket: FlatBucket, slot) -> None:
        """Autograd accumulates in place into the bound view; the step's first gradient of a
        parameter (``.grad`` dropped by :meth:`zero_grad`), or one a user set, is a new tensor:
        copy it over the parameter's slice of the flat buffer and bind the slice. With separate
        (fp32) gradient buffers, add the micro-batch's gradient in and drop it."""
        view = self._grad_slice(bucket, slot)
        grad = slot.param.grad
        if self._separate_grads(bucket):
            view.add_(grad.reshape(-1))
            slot.param.grad = None
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad.reshape(-1))
            slot.param.grad = view.view(slot.shape)

    def _zero_missing_grads(self, b: FlatBucket) -> None:
        """Zero (and bind) the slice of each parameter of ``b`` that got no gradient since
        :meth:`zero_grad`: it still holds the previous step's sum."""
        for s in b.slots:
            if s.param.grad is None:
                view = self._grad_slice(b, s)
                view.zero_()
                s.param.grad = view.view(s.shape)

    def zero_grad(self) -> None:
        """Reset the gradients for the next step: drop every ``.grad``; zero only what is added
        into (separate-dtype buffers at ZeRO 0-1, the gradient shards at ZeRO 2-3)."""
        for b in self.buckets:
            if self.stage >= 2:
                self._zero_grad_shard(b)
            elif self._separate_grads(b):
                b.grad_buffer.zero_()
            for slot in b.slots:
                slot.param.grad = None
        self._accumulated.clear()

    def gradient_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s accumulated gradient on this rank, shaped like it, in ``grad_dtype``
        (stages 0-1, which hold full gradients: a view of the gradient buffer)."""
        if self.stage >= 2:
            raise ValueError(f"ZeRO stage {self.stage} holds only gradient shards")
        slot = self._slot_of[id(param)]
        return self._grad_slice(self._bucket_of[id(param)], slot).view(slot.shape)
