"""Token dispatch and combine for expert parallelism: variable-size all-to-alls with autograd.

The MoE layer (:meth:`meshtrain.model.moe.MoE.compute_experts`) hands its expert module the
assignments of this rank's tokens already **sorted by global expert** and capped at capacity,
with ``counts[e]`` rows for expert ``e``. Experts are laid out contiguously over the ep ranks
(rank ``r`` holds experts ``[r * E/ep, (r + 1) * E/ep)``), so the sorted rows are also grouped by
destination rank. (With dynamic expert placement, :mod:`meshtrain.parallel.expert.placement`,
the experts module first reorders the rows by *slot*, and "expert" below means slot.)
One step of expert parallelism is then:

1. **counts exchange**: an all-to-all of the ``E`` per-expert counts (int64, equal splits of
   ``E/ep``) tells every rank how many rows it will receive for each local expert from each peer;
2. **dispatch**: an all-to-all of the rows (variable splits); received rows arrive grouped by
   (source rank, local expert) and are permuted to be grouped by local expert, so each local
   expert is one matmul;
3. the local experts run;
4. **combine**: the inverse permutation and the reverse all-to-all return each row to the rank
   (and the sorted position) it came from, where the MoE layer applies the gates and sums.

Backward mirrors it: the gradient of combine is an all-to-all with the splits swapped (rows go
back to the experts' ranks), and the gradient of dispatch another (back to the tokens' ranks).

Communication per MoE layer per micro-batch, counted on the ``ep`` axis by the comm layer's
``(n - 1)/n × input bytes`` convention: forward = dispatch + combine, backward = their two mirror
images, i.e. **four all-to-alls of ``rows × dim`` elements** (``rows = tokens × top_k`` minus
dropped assignments, in the activation dtype), ``4 × (ep - 1)/ep × rows × dim × bytes`` in all
averaged over the ep ranks (a rank that receives more rows than it sends moves more), plus the
counts exchange, ``(ep - 1)/ep × E × 8`` bytes, once per forward.
"""

from __future__ import annotations

import dataclasses

import torch

from meshtrain.parallel.comm import CountedComm


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows with variable splits; backward is the all-to-all with splits swapped."""

    @staticmethod
    def forward(ctx, x, comm, output_splits, input_splits):
        ctx.comm, ctx.output_splits, ctx.input_splits = comm, output_splits, input_splits
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_single(out, grad.contiguous(), ctx.input_splits, ctx.output_splits)
        return out, None, None, None


def all_to_all(x: torch.Tensor, comm: CountedComm, output_splits: list[int],
               input_splits: list[int]) -> torch.Tensor:
    """Send ``input_splits[r]`` consecutive rows of ``x`` to ep rank ``r`` and receive
    ``output_splits[r]`` rows from it (differentiable)."""
    if not comm.active:
        return x
    return _AllToAll.apply(x, comm, output_splits, input_splits)


@dataclasses.dataclass
class DispatchPlan:
    """How rows move for one forward: splits of both all-to-alls and the regrouping order."""

    send_splits: list[int]
    """Rows this rank sends to each ep rank (= receives back in combine)."""
    recv_splits: list[int]
    """Rows this rank receives from each ep rank."""
    local_counts: torch.Tensor
    """Rows per local expert after regrouping (LongTensor, on the device)."""
    order: torch.Tensor
    """Received row indices, grouped by local expert (stable: source rank order within one)."""
    restore: torch.Tensor
    """The inverse permutation of ``order``."""


def plan_dispatch(counts: torch.Tensor, comm: CountedComm) -> DispatchPlan:
    """Exchange the per-expert ``counts`` [E] of this rank's sorted rows and plan the moves.

    The one read to the host of a MoE layer's dispatch is here: the all-to-alls of the rows
    take their split sizes as Python ints (NCCL and gloo size their messages on the host), so
    after the counts' own all-to-all, the rows this rank sends to and receives from each ep
    rank are read once, together. The per-expert counts stay on the device (the grouped GEMM's
    offsets)."""
    ep = max(comm.size, 1)
    num_local = counts.numel() // ep
    received = torch.empty_like(counts)
    comm.all_to_all_single(received, counts.contiguous())  # equal splits of E/ep
    received = received.view(ep, num_local)  # [source rank, local expert]
    splits = torch.cat([counts.view(ep, num_local).sum(dim=1), received.sum(dim=1)]).tolist()
    send_splits, recv_splits = splits[:ep], splits[ep:]
    local_counts = received.sum(dim=0)
    expert_of_row = torch.arange(num_local, device=counts.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1),
                                                    output_size=sum(recv_splits))
    order = torch.argsort(expert_of_row, stable=True)
    restore = torch.argsort(order)
    return DispatchPlan(send_splits, recv_splits, local_counts, order, restore)


def dispatch(rows: torch.Tensor, plan: DispatchPlan, comm: CountedComm) -> torch.Tensor:
    """Send sorted rows to their experts' ranks; returns the received rows grouped by local
    expert (``plan.local_counts`` rows each)."""
    received = all_to_all(rows, comm, plan.recv_splits, plan.send_splits)
    return received[plan.order]


def combine(expert_out: torch.Tensor, plan: DispatchPlan, comm: CountedComm) -> torch.Tensor:
    """Return expert outputs (grouped by local expert) to the ranks and sorted positions their
    rows came from."""
    return all_to_all(expert_out[plan.restore], comm, plan.send_splits, plan.recv_splits)
