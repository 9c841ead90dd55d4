"""Tensor-parallel layers that replace the plain model's ``nn.Linear`` / ``nn.Embedding``.

Each keeps the replaced module's attribute name and a ``weight`` parameter, so parameter names
(and thus the name-seeded initialisation and checkpoints) are those of the plain model. Each
describes its weight in ``param_shardings`` (local name ->
:class:`~meshtrain.parallel.sharding.ParamSharding`: the full shape, where this rank's piece sits
in it, the split dim), which :func:`~meshtrain.parallel.tensor.apply.apply_tensor_parallel` adds
to the model's sharding table; that is all the initialisation and the checkpoint code need to
know about the layout.

Communication placement follows Megatron-LM: a column-parallel layer does no communication (the
input arrives through the region entry hook, see :mod:`meshtrain.parallel.tensor.apply`); a
row-parallel layer reduces its partial output (all-reduce, or reduce-scatter over the sequence
with sequence parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.model.weight_grad import linear
from meshtrain.parallel.comm import CountedComm
from meshtrain.parallel.sharding import ParamSharding
from meshtrain.parallel.tensor.collectives import (
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)


def tp_split(param: nn.Parameter, full_shape: tuple[int, ...], tp_dim: int,
             start: int) -> ParamSharding:
    """The record of ``param``, this rank's piece of a ``full_shape`` tensor split over tp along
    ``tp_dim``, starting at ``start`` there."""
    offset = tuple(start if d == tp_dim else 0 for d in range(len(full_shape)))
    return ParamSharding.piece(full_shape, param.shape, offset, tp_dim=tp_dim)


def tp_replicated(partial_grad: bool) -> ParamSharding:
    """The record of a parameter identical on every tp rank; ``partial_grad`` when each rank's
    gradient is only its share (sequence-parallel norms, replicated kv heads) and must be summed
    over tp."""
    return ParamSharding(tp_replicated=True, tp_partial_grad=partial_grad)


def _new_param(like: torch.Tensor, shape: tuple[int, ...]) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device))


def _copy_bias(linear: nn.Linear, rows: slice | None = None) -> nn.Parameter | None:
    """A parameter for ``linear``'s bias (its ``rows`` only), or None when it has none."""
    if linear.bias is None:
        return None
    full = linear.bias
    part = full if rows is None else full[rows]
    bias = _new_param(full, tuple(part.shape))
    if not full.is_meta:
        with torch.no_grad():
            bias.copy_(part)
    return bias


class ColumnParallelLinear(nn.Module):
    """``y = x W_r^T + b_r``: this rank's block of output features (rows of W, entries of the
    bias); no communication."""

    def __init__(self, linear: nn.Linear, tp_rank: int, tp_size: int):
        super().__init__()
        out_features, in_features = linear.weight.shape
        if out_features % tp_size:
            raise ValueError(f"{out_features} output features not divisible by tp={tp_size}")
        rows = out_features // tp_size
        lo = tp_rank * rows
        self.weight = _new_param(linear.weight, (rows, in_features))
        self.param_shardings = {"weight": tp_split(self.weight, (out_features, in_features), 0,
                                                   lo)}
        self.bias = _copy_bias(linear, slice(lo, lo + rows))
        if self.bias is not None:
            self.param_shardings["bias"] = tp_split(self.bias, (out_features,), 0, lo)
        self.defer_weight_grads = False  # make_deferrable: a pipeline's W pass
        if not linear.weight.is_meta:
            with torch.no_grad():
                self.weight.copy_(linear.weight[lo:lo + rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local matmul on the already-entered input."""
        matmul = linear if self.defer_weight_grads else F.linear
        return matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = reduce(x_r W_r^T) + b``: this rank's block of input features (columns of W); a
    bias is whole on every rank and added once, after the reduction (with sequence parallelism
    to this rank's chunk of the sequence, so its gradient is then partial over tp)."""

    def __init__(self, linear: nn.Linear, tp_rank: int, tp_size: int, comm: CountedComm,
                 sequence_parallel: bool):
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % tp_size:
            raise ValueError(f"{in_features} input features not divisible by tp={tp_size}")
        cols = in_features // tp_size
        lo = tp_rank * cols
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.weight = _new_param(linear.weight, (out_features, cols))
        self.param_shardings = {"weight": tp_split(self.weight, (out_features, in_features), 1,
                                                   lo)}
        self.bias = _copy_bias(linear)
        if self.bias is not None:
            self.param_shardings["bias"] = tp_replicated(partial_grad=sequence_parallel)
        self.defer_weight_grads = False  # make_deferrable: a pipeline's W pass
        if not linear.weight.is_meta:
            with torch.no_grad():
                self.weight.copy_(linear.weight[:, lo:lo + cols])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Partial product, then all-reduce (or sequence reduce-scatter), then the bias."""
        partial = (linear if self.defer_weight_grads else F.linear)(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_region(partial, self.comm)
        else:
            out = reduce_from_tp_region(partial, self.comm)
        return out if self.bias is None else out + self.bias


class HeadSelectLinear(nn.Module):
    """A key/value projection replicated on every tp rank (n_kv_heads not divisible by tp):
    each rank computes only the kv heads its query heads read. Gradients are partial per rank
    and are summed over tp after backward (the bias's too)."""

    def __init__(self, linear: nn.Linear, head_dim: int, heads: list[int]):
        super().__init__()
        self.weight = _new_param(linear.weight, tuple(linear.weight.shape))
        self.param_shardings = {"weight": tp_replicated(partial_grad=True)}
        self.bias = _copy_bias(linear)
        if self.bias is not None:
            self.param_shardings["bias"] = tp_replicated(partial_grad=True)
        rows = [h * head_dim + i for h in heads for i in range(head_dim)]
        self.register_buffer("rows", torch.tensor(rows, dtype=torch.long,
                                                  device=linear.weight.device), persistent=False)
        self._rows_list = rows
        if not linear.weight.is_meta:
            with torch.no_grad():
                self.weight.copy_(linear.weight)

    def reset_buffers(self) -> None:
        """Rebuild the row index after materialisation from the meta device."""
        self.rows = torch.tensor(self._rows_list, dtype=torch.long, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project to this rank's kv heads only."""
        bias = None if self.bias is None else self.bias.index_select(0, self.rows)
        return F.linear(x, self.weight.index_select(0, self.rows), bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over tp; lookups of other ranks' rows
    give zeros, and the partial results are summed (or reduce-scattered over the sequence)."""

    def __init__(self, embedding: nn.Embedding, tp_rank: int, tp_size: int, comm: CountedComm,
                 sequence_parallel: bool):
        super().__init__()
        vocab, dim = embedding.weight.shape
        if vocab % tp_size:
            raise ValueError(f"vocabulary {vocab} not divisible by tp={tp_size}")
        rows = vocab // tp_size
        self.vocab_start, self.vocab_end = tp_rank * rows, (tp_rank + 1) * rows
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.weight = _new_param(embedding.weight, (rows, dim))
        lo = self.vocab_start
        self.param_shardings = {"weight": tp_split(self.weight, (vocab, dim), 0, lo)}
        if not embedding.weight.is_meta:
            with torch.no_grad():
                self.weight.copy_(embedding.weight[lo:lo + rows])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embed ``tokens`` [B, S]; returns [B, S, dim] (or [B, S/tp, dim] with SP)."""
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.comm)
        return reduce_from_tp_region(out, self.comm)
