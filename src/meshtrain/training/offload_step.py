"""The optimizer step over offloaded state, a chunk at a time, where the state lives.

With ``parallel.offload`` (:mod:`meshtrain.parallel.offload`) the fp32 masters and both Adam
moments of a rank's ZeRO shard are CPU tensors of an
:class:`~meshtrain.parallel.offload.store.OffloadStore`: in host memory, or pages of
memory-mapped files (nvme). :func:`streamed_step` walks each shard's two ranges (decayed and
not, as :class:`~meshtrain.training.optimizer.FlatAdamW` does) in chunks of
``parallel.offload_chunk_mb``:

1. asks the kernel to start reading the next chunk of every tensor (``MADV_WILLNEED``: the disk
   reads of chunk ``k + 1`` overlap the arithmetic of chunk ``k``);
2. scales the gradient chunk by the clipping factor (what ``clip_grad_norm`` would have done to
   the whole gradient), copies it to the host when it lives on a GPU;
3. runs AdamW on the chunk on the CPU (:meth:`FlatAdamW.update_range`: PyTorch's fused AdamW
   kernel, or the eager formula where there is none);
4. releases the chunk's pages of the master, moments and gradient from the process.

Then the engine writes the masters back into the parameters (a chunk at a time when they are
separate) and, at ZeRO 1-2, all-gathers them. At most one chunk of each of the four tensors is
resident at once (plus the chunk being prefetched), whatever the shard's size.

Overlap with the next step (``parallel.offload_overlap``, ZeRO-3 only): the step runs on a
background thread instead, shard by shard in the order the next forward gathers the buckets
(:meth:`~meshtrain.parallel.data.zero3.ParameterGatherer.forward_order`), each gradient shard
zeroed once read; a gather waits only for its own bucket's update, so the update of later
blocks overlaps the forward of earlier ones, and anything else that reads the optimizer's state
(a checkpoint, the final save) waits for the whole step. Each update still uses the gradients
of the step just taken: the result is the same, bit for bit, as without the overlap (unlike
DeepSpeed's delayed parameter update, which applies a step's update one step later and so
changes the training trajectory; meshtrain does not offer that). At ZeRO 1-2 the parameters
are all-gathered after the step, a collective every rank must issue in order, so the step runs
in line there.

The result is bit-identical to the step without offload: every element goes through the same
operations, and chunks start at multiples of
:data:`~meshtrain.parallel.offload.store.ALIGN` elements from their range's start, so the fused
kernel (which splits its range into 64-byte units and vectorises within them) takes the same
path for every element as in one call over the whole range.
"""

from __future__ import annotations

import threading

import torch


@torch.no_grad()
def streamed_step(optimizer, lr: float):
    """One AdamW update of ``optimizer`` (a :class:`~meshtrain.training.optimizer.FlatAdamW`
    whose state is offloaded) at learning rate ``lr``, then the parameters are refreshed.
    Returns the :class:`PendingStep` running it in the background (``offload_overlap`` at
    ZeRO-3), else None (done)."""
    coef, optimizer.clip_coef = optimizer.clip_coef, None
    optimizer.step_count += 1
    if optimizer.fused:
        optimizer._step_tensor(torch.device("cpu"))
    engine = optimizer.engine
    if optimizer.offload.overlap and engine.stage == 3 and engine.gatherer is not None:
        return PendingStep(optimizer, lr, coef, engine.gatherer.forward_order())
    for index in range(len(optimizer._shards)):
        _update_shard(optimizer, index, lr, coef)
    engine.after_step(optimizer._shards)
    return None


def _update_shard(optimizer, index: int, lr: float, coef: torch.Tensor | None) -> None:
    """AdamW on shard ``index``, a chunk at a time (the module docstring's steps 1-4)."""
    store, shard = optimizer.offload, optimizer._shards[index]
    m, v = optimizer._exp_avg[index], optimizer._exp_avg_sq[index]
    grad, master = shard.grad(), shard.master
    for lo, hi, decay in optimizer.ranges(shard.decay_end, master.numel()):
        pieces = list(store.chunks(lo, hi))
        for at, (a, b) in enumerate(pieces):
            if at + 1 < len(pieces):
                c, d = pieces[at + 1]
                store.prefetch(master[c:d], m[c:d], v[c:d], grad[c:d])
            store.populate(master[a:b], m[a:b], v[a:b], grad[a:b])
            g = grad[a:b]
            if coef is not None:
                g.mul_(coef.to(g.dtype))
            if g.device.type != "cpu":
                g = _to_host(optimizer, g)
            if g.dtype != torch.float32:
                g = g.float()
            optimizer.update_range(master[a:b], g, m[a:b], v[a:b], decay, lr)
            store.release(master[a:b], m[a:b], v[a:b], grad[a:b])


def _to_host(optimizer, chunk: torch.Tensor) -> torch.Tensor:
    """A gradient chunk on the GPU copied into a reused pinned host buffer."""
    buffer = getattr(optimizer, "_host_grad", None)
    if buffer is None or buffer.numel() < chunk.numel() or buffer.dtype != chunk.dtype:
        buffer = torch.empty(optimizer.offload.chunk_numel, dtype=chunk.dtype,
                             pin_memory=True)
        optimizer._host_grad = buffer
    return buffer[:chunk.numel()].copy_(chunk)


class PendingStep:
    """A ZeRO-3 offloaded step running on a background thread, one bucket's shard after another
    in ``order``; :meth:`wait` for one bucket (a gather) or all of them."""

    def __init__(self, optimizer, lr: float, coef: torch.Tensor | None, order: list[int]):
        self.optimizer = optimizer
        self.done = {index: threading.Event() for index in order}
        self.error: BaseException | None = None
        optimizer.engine.pending = self
        self.thread = threading.Thread(target=self._run, args=(lr, coef, order),
                                       name="meshtrain-offload-step", daemon=True)
        self.thread.start()

    @torch.no_grad()
    def _run(self, lr: float, coef: torch.Tensor | None, order: list[int]) -> None:
        optimizer, engine = self.optimizer, self.optimizer.engine
        try:
            for index in order:
                _update_shard(optimizer, index, lr, coef)
                shard = optimizer._shards[index]
                if shard.master is not shard.bucket.master_source:
                    engine._write_master(shard.bucket, shard.master)
                engine.offload.zero(shard.bucket.grad_shard)  # read: ready for the next step
                self.done[index].set()
        except BaseException as error:  # handed to whoever waits
            self.error = error
            for event in self.done.values():
                event.set()

    def wait(self, index: int | None = None) -> None:
        """Until bucket ``index``'s shard is updated (None: every shard); re-raises a failure
        of the background step."""
        if index is None:
            self.thread.join()
            if self.optimizer.engine.pending is self:
                self.optimizer.engine.pending = None
        elif index in self.done:
            self.done[index].wait()
        if self.error is not None:
            raise RuntimeError("the offloaded optimizer step failed") from self.error
