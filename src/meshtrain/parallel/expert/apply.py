"""Apply expert parallelism: each MoE layer keeps only its ``E / ep`` local experts.

Ep rank ``r`` (the position of this rank in its expert group: ``ep`` consecutive ranks of the
stage's ``dp × tp`` ranks, see :class:`~meshtrain.parallel.mesh.ParallelMesh`) holds experts
``[r * E/ep, (r + 1) * E/ep)`` of every MoE layer. The layer's ``experts`` module is replaced
by :class:`ExpertParallelExperts`, which keeps the parameter names
(``layers.<i>.moe.experts.w1`` ...) and describes each expert parameter, like a tensor-parallel
shard, by a :class:`~meshtrain.parallel.sharding.ParamSharding` in the model's sharding table:
the full shape and where its slice sits (so the name-seeded initialisation gives the same weights
as one process and checkpoints place the slice), ``ep_dim = 0`` and ``dp_axis = "edp"`` (the
data-parallel engine reduces, and under ZeRO shards, them over the ranks holding the same
experts).

Which expert sits in which slot can change during training (dynamic expert placement,
:mod:`meshtrain.parallel.expert.placement`): the module's :class:`LayerPlacement` (shared with its
parameters' records as ``expert_placement``) maps slots to experts, and :meth:`forward`
reorders its rows into slot order around the all-to-alls. The contiguous split is the identity
placement, which skips the reordering.

The router, the expert bias, the shared experts and everything else stay replicated over ep and
reduce over the whole dp group. Under tensor parallelism the MoE layer is a replicated region
(:mod:`meshtrain.parallel.tensor.apply`, style ``replicated``): every tp rank routes the same
tokens, but the experts are folded over the tp ranks (each holds other experts), so each tp rank
dispatches only its share of the sorted assignments over its expert group and the outputs are
all-gathered over tp (:mod:`meshtrain.parallel.expert.fold`): no assignment is dispatched or
computed twice. Expert gradients are then reduced over ``edp_cp``, which spans tp ranks too.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshtrain.config.layout_rules import check_expert_degree
from meshtrain.model.moe import GroupedExperts, MoE, recomputing_in_backward
from meshtrain.parallel.comm import CountedComm
from meshtrain.parallel.expert.dispatch import combine, dispatch, plan_dispatch
from meshtrain.parallel.expert.fold import gather_rows, row_range, share_counts, split_rows
from meshtrain.parallel.expert.placement import LayerPlacement
from meshtrain.parallel.sharding import ParamSharding, ShardingTable

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class ExpertParallelExperts(GroupedExperts):
    """This rank's slice of a :class:`GroupedExperts`, reached through all-to-all dispatch.

    ``param_shardings``: the record of each expert parameter (local name ->
    :class:`~meshtrain.parallel.sharding.ParamSharding`). ``row_comm`` (the tp group, rank
    ``row_rank`` in it): the ranks that hold the same sorted rows, each of which dispatches only
    its share of them (None, or a group of one: this rank dispatches them all)."""

    def __init__(self, experts: GroupedExperts, comm: CountedComm, ep_rank: int, ep_size: int,
                 row_comm: CountedComm | None = None, row_rank: int = 0):
        total = experts.num_experts
        check_expert_degree(ep_size, experts=total)  # ValueError when they do not split
        local = total // ep_size
        dim, hidden = experts.w1.shape[1], experts.w1.shape[2]
        with torch.device(experts.w1.device):
            super().__init__(local, dim, hidden, experts.act.mlp)
        self.comm = comm
        self.row_comm, self.row_rank = row_comm, row_rank
        self.total_experts = total
        lo = ep_rank * local  # the first expert under the identity (initial) placement
        self.placement = placement = LayerPlacement(total, ep_size, ep_rank)
        self.rows_received = 0
        self.param_shardings: dict[str, ParamSharding] = {}
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name, None)
            if full is None:
                continue
            param = nn.Parameter(torch.empty((local, *full.shape[1:]), dtype=full.dtype,
                                             device=full.device))
            setattr(self, name, param)
            self.param_shardings[name] = ParamSharding.piece(
                full.shape, param.shape, (lo,) + (0,) * (full.ndim - 1), ep_dim=0,
                dp_axis="edp", expert_placement=placement)
            if not full.is_meta:
                with torch.no_grad():
                    param.copy_(full[lo:lo + local])

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [N, dim]: this rank's assignments sorted by global expert (``counts[e]`` rows
        for expert ``e``, all ``E`` of them, a LongTensor on ``x``'s device). Returns their
        expert outputs in the same order (on every rank of ``row_comm``, which each compute
        their share of the rows)."""
        rows = self.row_comm
        if rows is None or not rows.active:
            return self._run_in_slot_order(x, counts)
        total = x.shape[0]
        start, stop = row_range(total, rows.size, self.row_rank)
        share = split_rows(x, rows, self.row_rank)
        out = self._run_in_slot_order(share, share_counts(counts, start, stop))
        return gather_rows(out, rows, self.row_rank, total)

    def _run_in_slot_order(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dispatch rows sorted by expert (``counts``) in slot order, run, return them in expert
        order."""
        if self.placement.identity:
            return self._dispatch_and_run(x, counts)
        # Slot order: slot s takes expert slots[s]'s rows (same rows, same order within it).
        slots = torch.tensor(self.placement.slots, device=x.device)
        per_slot = counts[slots]
        expert_start = torch.cumsum(counts, 0) - counts
        slot_start = torch.cumsum(per_slot, 0) - per_slot
        rows = torch.arange(x.shape[0], device=x.device)
        index = rows + (expert_start[slots] - slot_start).repeat_interleave(
            per_slot, output_size=x.shape[0])
        out = self._dispatch_and_run(x[index], per_slot)
        inverse = torch.empty_like(index)
        inverse[index] = rows
        return out[inverse]

    def _dispatch_and_run(self, x: torch.Tensor, slot_counts: torch.Tensor) -> torch.Tensor:
        """Dispatch rows grouped by slot (``slot_counts``), run the local experts, combine."""
        plan = plan_dispatch(slot_counts, self.comm)
        if not recomputing_in_backward():
            self.rows_received += sum(plan.recv_splits)
        grouped = dispatch(x, plan, self.comm)
        return combine(super().forward(grouped, plan.local_counts), plan, self.comm)

    def pop_rows_received(self) -> int:
        """Rows (token assignments) this rank's experts computed since the last call."""
        rows, self.rows_received = self.rows_received, 0
        return rows


def apply_expert_parallel(model: nn.Module, comm: CountedComm, ep_rank: int,
                          shardings: ShardingTable, row_comm: CountedComm | None = None,
                          row_rank: int = 0) -> int:
    """Replace every MoE layer's experts by this ep rank's slice (in place) and record their
    layout in ``shardings`` (the model's table); returns the number of MoE layers changed.

    ``row_comm``/``row_rank``: the tp group and this rank's place in it, whose ranks each
    dispatch their share of the rows (the folded layout). The expert parameters are then not
    replicated over tp (each tp rank holds other experts, or another share's replica of them,
    reduced over ``edp``), so their records say so."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    for name, moe in layers:
        experts = ExpertParallelExperts(moe.experts, comm, ep_rank, comm.size, row_comm,
                                        row_rank)
        prefix = f"{name}.experts" if name else "experts"
        for local, record in experts.param_shardings.items():
            shardings[f"{prefix}.{local}"] = dataclasses.replace(
                record, tp_replicated=False, tp_partial_grad=False)
        moe.experts = experts
    return len(layers)
