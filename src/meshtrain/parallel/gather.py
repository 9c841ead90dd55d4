"""Gather a parallelised model's full, unsharded weights onto rank 0 (for the final weights file).

Every rank calls :func:`gather_full_state_dict`; rank 0 gets every parameter and persistent buffer
of the *plain* model under its usual name, exactly as one process would hold them:

1. ``engine.full_state_dict()``: this rank's parameters in full over data parallelism (under ZeRO
   the shards are all-gathered; a collective over dp);
2. expert-parallel slices (``_meshtrain_ep_dim``) are all-gathered over ``ep`` (by the ranks of
   each expert group that contains dp rank 0), in ep-rank order = expert order;
3. tensor-parallel pieces (``_meshtrain_tp_dim``) are all-gathered over ``tp`` by the dp-rank-0
   ranks and concatenated along that dim (tp-replicated tensors are taken as they are);
4. the pipeline stages' dictionaries (held by the ranks at dp rank 0, tp rank 0) are collected on
   rank 0 with one object all-gather over ``pp``.
"""

from __future__ import annotations

import torch
from torch import nn


def _gather_along(tensor: torch.Tensor, comm, dim: int) -> torch.Tensor:
    """All-gather equal pieces over ``comm`` and concatenate them along ``dim`` (rank order)."""
    if not comm.active:
        return tensor
    piece = tensor.contiguous()
    out = torch.empty((comm.size * piece.numel(),), dtype=piece.dtype, device=piece.device)
    comm.all_gather_into(out, piece.reshape(-1))
    return torch.cat(list(out.view(comm.size, *piece.shape).unbind(0)), dim=dim)


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, engine, mesh) -> dict[str, torch.Tensor] | None:
    """The full model state (parameters + persistent buffers, CPU) on rank 0; None elsewhere.

    A collective: every rank of the job must call it.
    """
    values = engine.full_state_dict()  # collective over dp under ZeRO-3
    params = dict(model.named_parameters())
    persistent = model.state_dict(keep_vars=True)
    for name, buffer in model.named_buffers():
        if name in persistent and name not in values:
            values[name] = buffer.detach().clone()
    names = sorted(values)  # the same order on every rank of a tp / ep group
    if mesh.edp_rank == 0:
        for name in names:
            dim = getattr(params.get(name), "_meshtrain_ep_dim", None)
            if dim is not None:
                values[name] = _gather_along(values[name], mesh.comm("ep"), dim)
                placement = getattr(params[name], "_meshtrain_expert_placement", None)
                if placement is not None and not placement.identity:
                    slot_of = torch.argsort(torch.tensor(placement.slots))
                    values[name] = values[name].index_select(dim, slot_of.to(values[name].device))
    if mesh.dp_rank != 0:
        return None
    for name in names:
        dim = getattr(params.get(name), "_meshtrain_tp_dim", None)
        if dim is not None:
            values[name] = _gather_along(values[name], mesh.comm("tp"), dim)
    if mesh.tp_rank != 0:
        return None
    state = {name: value.detach().cpu() for name, value in values.items()}
    pp = mesh.comm("pp")
    if pp.active:
        merged: dict[str, torch.Tensor] = {}
        for stage_state in pp.all_gather_object(state):
            merged.update(stage_state)
        state = merged
    return state if mesh.is_logging_rank else None
