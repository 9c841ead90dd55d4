"""Stream a parallelised model's full, unsharded tensors one at a time (for the final weights).

Each pipeline stage holds its own tensors. Every rank of a stage builds a :class:`StageTensors`
(the same tensor list, in the same order, on every rank of the stage) and then iterates it
together with the stage's other ranks: each step is a collective for one tensor, which

1. under ZeRO-3 is assembled on dp rank 0 from the pieces that the dp ranks' shards hold (each
   piece sent point to point; only ranks whose shard overlaps the tensor send; an expert
   parameter is assembled on every rank of its edp group, each piece broadcast); otherwise every
   rank uses its own copy (a view of its parameter buffer, or the persistent buffer itself);
2. if expert-parallel (its sharding record's ``ep_dim``), is gathered over ``ep`` by the expert
   groups that contain dp rank 0 (edp rank 0, and with experts folded over tp every expert group
   of the dp-rank-0 tp ranks), each slot's rows going to their expert's rows, so
   re-placed experts (the record's ``expert_placement``) come out in canonical expert order;
3. if tensor-parallel (the record's ``tp_dim``), is gathered over ``tp`` by the dp-rank-0 ranks and
   concatenated along that dim (tp-replicated tensors are taken as they are).

With ``grads = True`` the same walk gathers the parameters' accumulated **gradients** instead
(after a step's backward and reduction, before the optimizer step): from the full gradient
buffer at ZeRO stage 0, from each rank's gradient shard at stages 1-3 (assembled like a ZeRO-3
parameter), gathered over ep and tp alike; buffers have none and are left out. ``meshtrain
verify`` compares them parameter by parameter with one process.

Gathers are one in-place broadcast per rank of the group (see :func:`_gather_along`). Afterwards
every dp-rank-0 rank of the stage holds the full tensor, exactly as one process would hold it;
the other ranks get ``None``. Nothing else stays alive: a rank holds the full tensor, its own
piece and at most one more piece beyond its share, provided the caller drops each tensor before
asking for the next.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    """One full tensor of a stage: its name, full shape, and whether tp splits it (then every tp
    rank at dp rank 0 holds it after the gather; otherwise tp rank 0's copy is the reference)."""

    name: str
    shape: tuple[int, ...]
    tp_split: bool

    @property
    def nbytes_fp32(self) -> int:
        """Its size in bytes as float32."""
        return 4 * math.prod(self.shape)


def _gather_along(tensor: torch.Tensor, comm, rank: int, dim: int,
                  rows: list[int] | None = None) -> torch.Tensor:
    """The equal pieces of ``comm``'s ranks (this one is ``rank``) concatenated along ``dim`` in
    rank order, or, with ``rows``, gathered index ``i`` along ``dim`` placed at ``rows[i]``.

    One broadcast per rank, each in place (a dim-0 piece straight into its slice of the result,
    others through one piece-sized buffer), so a rank holds the result, its own piece and at
    most one more piece: never a second full-size buffer (which gloo's all-gather allocates)."""
    if not comm.active and rows is None:
        return tensor
    piece = tensor.contiguous()
    k = piece.shape[dim]
    shape = list(piece.shape)
    shape[dim] *= max(comm.size, 1)
    out = torch.empty(shape, dtype=piece.dtype, device=piece.device)
    for r in range(max(comm.size, 1)):
        if rows is None and dim == 0:  # a contiguous slice: broadcast into it
            chunk = out.narrow(0, r * k, k)
            if r == rank:
                chunk.copy_(piece)
            comm.broadcast(chunk, r)
            continue
        chunk = piece if r == rank else torch.empty_like(piece)
        comm.broadcast(chunk, r)
        if rows is None:
            out.narrow(dim, r * k, k).copy_(chunk)
        else:
            index = torch.tensor(rows[r * k:(r + 1) * k], device=out.device)
            out.index_copy_(dim, index, chunk)
        del chunk
    return out


class StageTensors:
    """The full tensors of this rank's pipeline stage, gathered one at a time (iterate it on
    every rank of the stage together: each step is a collective).

    The tensors are the parameters of the data-parallel engine's buckets and the model's
    persistent buffers (MoE expert biases), in sorted name order; a tied embedding's copy on
    the last stage is left out (the first stage writes it: it is saved once).
    """

    def __init__(self, model: nn.Module, engine, mesh, grads: bool = False):
        """``grads``: gather the parameters' gradients (no buffers) instead of their values."""
        self.mesh, self.engine, self.grads = mesh, engine, grads
        self.shardings = engine.shardings
        self._slots = {s.name: (b, s) for b in engine.buckets for s in b.slots
                       if not self.shardings[s.name].tied_copy}
        persistent = model.state_dict(keep_vars=True)
        self._buffers = {} if grads else {
            name: buffer for name, buffer in model.named_buffers()
            if name in persistent and name not in self._slots}
        names = sorted([*self._slots, *self._buffers])  # equal on every rank of a stage
        self.specs = [self._spec(name) for name in names]

    def _spec(self, name: str) -> TensorSpec:
        if name in self._buffers:
            return TensorSpec(name, tuple(self._buffers[name].shape), False)
        record = self.shardings[name]
        shape = list(self._slots[name][1].shape)
        ep_dim = record.ep_dim
        if ep_dim is not None:
            shape[ep_dim] *= self.mesh.comm("ep").size
        tp_dim = record.tp_dim
        tp = self.mesh.comm("tp")
        if tp_dim is not None:
            shape[tp_dim] *= tp.size
        return TensorSpec(name, tuple(shape), tp_dim is not None and tp.active)

    def __iter__(self) -> Iterator[tuple[TensorSpec, torch.Tensor | None]]:
        """``(spec, full tensor or None)`` for every tensor of the stage, one at a time."""
        offload = getattr(self.engine, "offload", None)
        if offload is not None:
            self.engine.wait_for_step()  # an offloaded step may still be updating the shards
        for spec in self.specs:
            yield spec, self.gather(spec.name)
            if offload is not None:  # offloaded shards read for this tensor leave memory
                offload.release_all()

    @torch.no_grad()
    def gather(self, name: str) -> torch.Tensor | None:
        """The full tensor ``name`` on the stage's dp-rank-0 ranks, None elsewhere (collective
        over the stage's ranks)."""
        mesh = self.mesh
        if name in self._buffers:
            return self._buffers[name].detach() if mesh.dp_cp_rank == 0 else None
        value = self._local(name)
        record = self.shardings[name]
        ep_dim = record.ep_dim
        if ep_dim is not None and (mesh.edp_cp_rank == 0 or mesh.dp_cp_rank == 0):
            placement = record.expert_placement
            moved = placement is not None and not placement.identity
            # Gathered in slot order; slot s holds expert placement.slots[s]: its row.
            value = _gather_along(value, mesh.comm("ep"), mesh.ep_rank, ep_dim,
                                  placement.slots if moved else None)
        if mesh.dp_cp_rank != 0:
            return None
        tp_dim = record.tp_dim
        if tp_dim is not None:
            value = _gather_along(value, mesh.comm("tp"), mesh.tp_rank, tp_dim)
        return value

    def _local(self, name: str) -> torch.Tensor | None:
        """This rank's piece of parameter ``name`` (or of its gradient) whole over data
        parallelism. Under ZeRO-3 (gradients: ZeRO 1-3, which shard them) a
        dense parameter is assembled on dp rank 0 (None on the other ranks); an expert
        parameter on every rank of its ``edp`` group, since with experts folded over more tp
        ranks than ``ep`` (``ep < tp``) several of the dp-rank-0 ranks are in one edp group."""
        bucket, slot = self._slots[name]
        stage = self.engine.stage
        if self.grads:
            if stage == 0:
                return bucket.grad_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
            shard = bucket.shard(bucket.grad_buffer) if stage == 1 else bucket.grad_shard
            return self._assemble(bucket, slot, shard)
        if stage != 3:
            return bucket.param_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
        return self._assemble(bucket, slot, self.engine.gather_source(bucket))  # on the device

    def _assemble(self, bucket, slot, shard: torch.Tensor) -> torch.Tensor | None:
        """``slot``'s parameter put together from the dp ranks' ``shard`` of ``bucket`` (values
        or gradients): on dp rank 0 (None elsewhere), or on every rank of an ``edp`` group."""
        comm = self.engine.comms[bucket.axis]
        me, size = bucket.shard_start // bucket.shard_numel, bucket.shard_numel
        lo, hi = slot.offset, slot.offset + slot.numel
        pieces = [(r, max(lo, r * size), min(hi, (r + 1) * size))
                  for r in range(max(comm.size, 1))]
        pieces = [(r, a, b) for r, a, b in pieces if a < b]  # the ranks holding a part of it
        if bucket.axis == "edp":  # each holder broadcasts its part straight into its place
            out = torch.empty(slot.numel, dtype=shard.dtype, device=shard.device)
            for r, a, b in pieces:
                if r == me:
                    out[a - lo:b - lo].copy_(shard[a - me * size:b - me * size])
                if comm.active:
                    comm.broadcast(out[a - lo:b - lo], r)
            return out.view(slot.shape)
        if me != 0:
            mine = [("send", shard[a - me * size:b - me * size], 0, 0)
                    for r, a, b in pieces if r == me]
            for work in comm.exchange(mine):
                work.wait()
            return None
        out = torch.empty(slot.numel, dtype=shard.dtype, device=shard.device)
        receives = []
        for r, a, b in pieces:
            if r == 0:
                out[a - lo:b - lo].copy_(shard[a:b])
            else:
                receives.append(("recv", out[a - lo:b - lo], r, 0))
        for work in comm.exchange(receives):
            work.wait()
        return out.view(slot.shape)
