"""Where the data-parallel engine keeps the shards a rank owns, and how it touches them.

:class:`ShardStorage` is the part of
:class:`~meshtrain.parallel.data.engine.DataParallelEngine` that allocates a bucket's parameter
shard (ZeRO-3), gradient shard (ZeRO 2-3) and fp32 master, and every whole-shard operation on
them (accumulating a reduced gradient, zeroing, writing the master back into the parameters,
handing the parameter shard to a ZeRO-3 gather). Here they are ordinary tensors on the bucket's
device; :class:`~meshtrain.parallel.data.offloaded.OffloadedEngine` overrides each to keep them
in an :class:`~meshtrain.parallel.offload.store.OffloadStore` and walk them a chunk at a time.
"""

from __future__ import annotations

import torch

from meshtrain.parallel.data.buckets import FlatBucket


class ShardStorage:
    """Default shard storage on the bucket's device (a mixin of the engine)."""

    offload = None
    """The :class:`~meshtrain.parallel.offload.store.OffloadStore` holding offloaded shards
    (None: nothing offloaded)."""

    pending = None
    """An optimizer step still updating this engine's shards in the background (offload with
    ``parallel.offload_overlap``): ``pending.wait(bucket_index)`` for one, ``wait()`` for all."""

    def wait_for_step(self) -> None:
        """Return once no optimizer step is updating the shards in the background."""
        if self.pending is not None:
            self.pending.wait()

    def _new_shard(self, b: FlatBucket, dtype: torch.dtype, role: str) -> torch.Tensor:
        """A zeroed shard-sized buffer of ``b`` for ``role`` (``"param"`` or ``"grad"``)."""
        return b.new_buffer(dtype, full=False)

    def _master_of(self, b: FlatBucket, source: torch.Tensor) -> torch.Tensor:
        """The fp32 master of ``b``'s shard whose parameter values are ``source``: ``source``
        itself when fp32, else an fp32 copy."""
        return source if source.dtype == torch.float32 else source.detach().float().clone()

    def _write_master(self, b: FlatBucket, master: torch.Tensor) -> None:
        """Copy an updated ``master`` into the parameters it is separate from."""
        b.master_source.copy_(master)

    def _add_to_grad_shard(self, b: FlatBucket, reduced: torch.Tensor) -> None:
        """Accumulate a reduce-scattered gradient into ``b``'s gradient shard."""
        b.grad_shard.add_(reduced)

    def _zero_grad_shard(self, b: FlatBucket) -> None:
        """Zero ``b``'s gradient shard."""
        b.grad_shard.zero_()

    def _settle(self, tensor: torch.Tensor) -> None:
        """``tensor`` (a shard or a piece of one) is not needed again soon: let it go from
        memory if it lives somewhere it can be fetched back from."""

    def gather_source(self, b: FlatBucket) -> torch.Tensor:
        """What a ZeRO-3 gather of ``b`` reads this rank's part from (on ``b``'s device)."""
        return b.param_shard

    def gather_done(self, b: FlatBucket) -> None:
        """A ZeRO-3 gather of ``b`` has read :meth:`gather_source`."""
