"""Which share of each gradient a data-parallel rank holds, for the optimizer's step.

:class:`GradientAccounting` is the part of the data-parallel engine
(:class:`~meshtrain.parallel.data.engine.DataParallelEngine`) that looks past data parallelism
to the other axes once a step's gradients are reduced over dp: the gradient norm counts every
parameter exactly once across all ranks (dp shards under ZeRO, tp pieces, tp-replicated copies,
tied embeddings, each expert once), and the gradients a rank holds only a share of (a tied
embedding's two stages, sequence-parallel norms and replicated kv heads over tp) are summed
before the step. It reads the engine's buckets, shardings and comms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshtrain.parallel.data.buckets import FlatBucket, ParamSlot

if TYPE_CHECKING:
    from meshtrain.parallel.data.engine import OptimizerShard


NORM_ROW = 1 << 12
"""Elements per row of :func:`sum_of_squares`: each row's norm is reduced on its own."""


def sum_of_squares(views: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """The sum of the squares of every element of the 1-D ``views`` (fp32 scalar on
    ``device``), accurate to fp32 rounding of the result whatever the views' lengths.

    Torch's CPU norm kernel accumulates a long vector in a few fp32 running sums, so its
    rounding error grows with the length: measured 2e-7 relative at 1e5 elements, 1e-5 at
    1e6, 8e-5 at 4e6. A gradient norm taken that way over a bucket's contiguous runs depends on
    how long the runs are, i.e. on the layout (one process holds every parameter in a few long
    runs; expert-parallel and tensor-parallel ranks hold shorter pieces), which made an exact
    layout's gradient norm look up to 1.5e-4 relative away from one process's. Here each view is
    cut into rows of :data:`NORM_ROW` elements, each row's norm is one short reduction (2e-10
    relative over 4e6 elements, as fast as one norm of the whole), and the rows' squares are
    summed in fp64; the result no longer depends on the layout. Two kernels per view."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for view in views:
        values = view.reshape(-1).float()
        full = values.numel() - values.numel() % NORM_ROW
        if full:
            rows = torch.linalg.vector_norm(values[:full].view(-1, NORM_ROW), dim=1)
            total += rows.double().square().sum()
        if full < values.numel():
            total += torch.linalg.vector_norm(values[full:]).double().square()
    return total.float()


class GradientAccounting:
    """Gradient-norm and partial-gradient bookkeeping over the engine's buckets (a mixin of
    :class:`~meshtrain.parallel.data.engine.DataParallelEngine`, which sets the attributes)."""

    _sum_of_squares = staticmethod(sum_of_squares)
    """How :meth:`grad_sq_norm` sums the squares of its views (offloaded gradients: a chunk
    at a time, :class:`~meshtrain.parallel.data.offloaded.OffloadedEngine`)."""

    def _counts_in_norm(self, slot: ParamSlot) -> bool:
        """Each parameter counts once in the gradient norm: a copy replicated over tp counts on
        tp rank 0 only (a tp-split parameter counts on every rank: each holds another piece), a
        tied embedding on the first stage only."""
        record = self.shardings[slot.name]
        return (self.tp_rank == 0 or not record.tp_replicated) and not record.tied_copy

    def _has_partial_grad(self, slot: ParamSlot) -> bool:
        return self.shardings[slot.name].tp_partial_grad

    def _runs(self, b: FlatBucket, keep) -> list[tuple[int, int]]:
        """Contiguous ``(start, length)`` runs of this rank's optimizer gradient of bucket ``b``
        (full buffer at stage 0, shard otherwise) covering the parameters ``keep`` accepts."""
        runs: list[tuple[int, int]] = []
        for slot, start, length in b.segments(sharded=self.stage >= 1):
            if not keep(slot):
                continue
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((start, length))
        return runs

    @torch.no_grad()
    def reduce_partial_grads(self, shards: list[OptimizerShard]) -> None:
        """Sum the gradients that this rank holds only a share of, once the step's gradients are
        reduced over dp: a tied embedding's over the first and last pipeline stage (the optimizer
        gradient of its own bucket, laid out and ZeRO-sharded alike on both, so the two copies
        take the same step), and over tp those of sequence-parallel norms and replicated kv
        heads (one all-reduce for all of them)."""
        if self.tied_comm.active:
            for index in self._tied_buckets:
                self.tied_comm.all_reduce(shards[index].grad())
        if not self.tp_comm.active:
            return
        views = [shard.grad()[start:start + length]
                 for shard, runs in zip(shards, self._partial_runs, strict=True)
                 for start, length in runs]
        if not views:
            return
        flat = torch.cat([v.float() for v in views])
        self.tp_comm.all_reduce(flat)
        offset = 0
        for view in views:
            view.copy_(flat[offset:offset + view.numel()])
            offset += view.numel()

    def grad_sq_norm(self, shards: list[OptimizerShard]) -> torch.Tensor:
        """Sum of squared gradient entries, each parameter counted exactly once across every
        rank (dp shards under ZeRO, tp pieces, tp-replicated copies once, each expert once).

        Under ZeRO (stage >= 1) the dp ranks' shards are all distinct, expert buckets included
        (edp shards of different experts on each ep rank), so one sum over dp counts everything
        once. At stage 0 dense gradients are replicated over dp and expert gradients over edp:
        with expert buckets, dense terms count on dp rank 0 and expert terms on edp rank 0 of
        each expert group before the sum over dp."""
        dense, expert = [], []
        for shard, runs in zip(shards, self._norm_runs, strict=True):
            target = expert if shard.bucket.axis == "edp" else dense
            target += [shard.grad()[start:start + length] for start, length in runs]
        device = shards[0].master.device if shards else None
        sq_dense, sq_expert = (self._sum_of_squares(dense, device),
                               self._sum_of_squares(expert, device))
        if self.stage >= 1:
            sq = sq_dense + sq_expert
            self.comm.all_reduce(sq)
        elif self.has_expert_buckets:
            sq = sq_dense * float(self.dp_rank == 0) + sq_expert * float(self.edp_rank == 0)
            self.comm.all_reduce(sq)
        else:
            sq = sq_dense
        self.tp_comm.all_reduce(sq)
        self.pp_comm.all_reduce(sq)  # each pipeline stage holds different parameters
        return sq
