"""The data-parallel engine with this rank's ZeRO shard offloaded (``parallel.offload``).

:class:`OffloadedEngine` is :class:`~meshtrain.parallel.data.engine.DataParallelEngine` with its
shard storage (:class:`~meshtrain.parallel.data.shard_storage.ShardStorage`) in an
:class:`~meshtrain.parallel.offload.store.OffloadStore`:

=====================  =========================================================================
fp32 master            always in the store (a copy of the parameter shard, or under
                       ``optimizer+params`` with fp32 parameters the offloaded parameter shard
                       itself); written back into the parameters a chunk at a time
Adam moments           in the store (:class:`~meshtrain.training.optimizer.FlatAdamW`)
gradient shard         ZeRO 2-3 on a CPU device: in the store, each reduced bucket added into it
                       and released; on CUDA it stays on the GPU and the step copies it to the
                       host a chunk at a time. ZeRO-1's full gradient buffer stays where it is
                       (every rank's reduce-scatter works on all of it)
parameter shard        ``optimizer+params`` (ZeRO-3): in the store; each gather copies it to the
                       device (or straight into the gather buffer on the CPU) and releases it
=====================  =========================================================================

Every whole-shard pass (zeroing, the gradient norm, writing masters back) walks the store a chunk
at a time and releases what it read, so an nvme rank's resident memory stays near one chunk per
tensor in use. The values are those of the engine without offload, bit for bit: the same
operations on the same elements, cut where no kernel's result depends on the cut
(:data:`~meshtrain.parallel.offload.store.ALIGN`).
"""

from __future__ import annotations

import torch

from meshtrain.parallel.data.buckets import FlatBucket
from meshtrain.parallel.data.engine import DataParallelEngine
from meshtrain.parallel.data.grad_accounting import NORM_ROW, sum_of_squares
from meshtrain.parallel.offload.store import ALIGN, OffloadStore

assert ALIGN % NORM_ROW == 0  # a chunk holds whole gradient-norm rows


class OffloadedEngine(DataParallelEngine):
    """A :class:`DataParallelEngine` whose shards live in ``offload``."""

    def __init__(self, *args, offload: OffloadStore, **kwargs):
        """``offload``: the rank's store; the rest as :class:`DataParallelEngine`."""
        self.offload = offload
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ storage
    def _new_shard(self, b: FlatBucket, dtype: torch.dtype, role: str) -> torch.Tensor:
        """Parameter shards in the store under ``optimizer+params``; gradient shards when the
        device is the CPU (on CUDA they stay on the GPU)."""
        offloaded = self.offload.params if role == "param" else b.device.type == "cpu"
        if not offloaded:
            return super()._new_shard(b, dtype, role)
        return self.offload.zeros(b.shard_numel, dtype)

    def _master_of(self, b: FlatBucket, source: torch.Tensor) -> torch.Tensor:
        """The offloaded fp32 parameter shard itself, else an fp32 copy in the store."""
        if source.dtype == torch.float32 and self.offload.holds(source):
            return source
        master = self.offload.zeros(source.numel(), torch.float32)
        self.offload.copy(master, source)
        return master

    def _write_master(self, b: FlatBucket, master: torch.Tensor) -> None:
        self.offload.copy(b.master_source, master)

    def _add_to_grad_shard(self, b: FlatBucket, reduced: torch.Tensor) -> None:
        shard = b.grad_shard
        self.offload.populate(shard)
        shard.add_(reduced if reduced.device == shard.device else reduced.to(shard.device))
        self.offload.release(shard)

    def _zero_grad_shard(self, b: FlatBucket) -> None:
        if self.pending is None:  # else the background step zeroes each shard once read
            self.offload.zero(b.grad_shard)

    def _settle(self, tensor: torch.Tensor) -> None:
        self.offload.release(tensor)

    def gather_source(self, b: FlatBucket) -> torch.Tensor:
        """The parameter shard (once a background step has updated it), copied to the
        device when it lives on the host."""
        if self.pending is not None:
            self.pending.wait(b.index)
        shard = b.param_shard
        return shard if shard.device == b.device else shard.to(b.device)

    def gather_done(self, b: FlatBucket) -> None:
        """The gather has read the shard: its pages leave memory (nvme)."""
        self.offload.release(b.param_shard)

    # ------------------------------------------------------------------ passes
    def _sum_of_squares(self, views: list[torch.Tensor], device) -> torch.Tensor:
        """:func:`~meshtrain.parallel.data.grad_accounting.sum_of_squares` on the compute
        device, reading offloaded views a chunk of whole rows at a time (the same row norms,
        summed the same way: the same bits)."""
        device = self.buckets[0].device
        if not any(self.offload.holds(v) for v in views):
            return sum_of_squares(views, device)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for view in views:
            values = view.reshape(-1)
            full = values.numel() - values.numel() % NORM_ROW
            if full:
                rows = torch.empty(full // NORM_ROW, dtype=torch.float32, device=values.device)
                for a, b in self.offload.chunks(0, full):
                    torch.linalg.vector_norm(values[a:b].float().view(-1, NORM_ROW), dim=1,
                                             out=rows[a // NORM_ROW:b // NORM_ROW])
                    self.offload.release(values[a:b])
                total += rows.double().square().sum().to(device)
            if full < values.numel():
                total += torch.linalg.vector_norm(values[full:].float()).double().square().to(
                    device)
                self.offload.release(values[full:])
        return total.float()

    def memory(self) -> dict[str, int]:
        """Parameter and gradient bytes held off the store (on the device or in host memory
        that is not offloaded), and ``offload_bytes``: everything the store holds."""
        def resident(t: torch.Tensor) -> int:
            return 0 if self.offload.holds(t) else t.numel() * t.element_size()

        params = sum(resident(b.param_shard if self.stage == 3 else b.param_buffer)
                     for b in self.buckets)
        grads = sum(resident(b.grad_buffer if self.stage < 2 else b.grad_shard)
                    for b in self.buckets)
        return {"param_bytes": params, "grad_bytes": grads, "offload_bytes": self.offload.nbytes}
