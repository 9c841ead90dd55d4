"""Apply tensor (and sequence) parallelism to a plain model from the plan's rules.

The plan's ``tp_rules`` are ``(module-name pattern, style)`` pairs (``fnmatch`` patterns on the
plain model's module names). Styles:

=================  ==========================================================================
``vocab``          ``nn.Embedding`` -> :class:`VocabParallelEmbedding`
``column``         ``nn.Linear`` -> :class:`ColumnParallelLinear` (split output features)
``row``            ``nn.Linear`` -> :class:`RowParallelLinear` (split input features, reduce)
``kv``             column-parallel when tp divides n_kv_heads; otherwise :class:`HeadSelectLinear`
                   (replicated; each rank computes the kv heads its query heads read)
``region``         the module's *input* enters a TP region: ``f`` (identity fwd / all-reduce bwd),
                   or with sequence parallelism an all-gather of the sequence
``region-output``  the module's *output* enters a TP region (the final norm, feeding the head)
``heads``          a module applied alike to every attention head (the QK-norm): whole on every
                   tp rank, but each rank runs it on its own heads only, so its gradient is
                   partial and summed over tp
``replicated``     the module runs whole on every tp rank (the MoE layer: every rank routes the
                   same tokens and ends with the complete output, which is therefore *not*
                   reduced; with ep > 1 its experts are folded over tp inside it,
                   :mod:`meshtrain.parallel.expert.fold`). Without sequence parallelism nothing
                   changes (its input is the full hidden state already, and its input gradient
                   is complete on every rank);
                   with it, the input's sequence is all-gathered (backward: keep this rank's chunk)
                   and the output cut back to this rank's chunk (backward: all-gather)
=================  ==========================================================================

The new layers' records (:class:`~meshtrain.parallel.sharding.ParamSharding`) go into the model's
sharding table, and every parameter that is not split is recorded replicated over tp; with
sequence parallelism the norms see only a slice of the sequence, so their gradients are partial
and summed over tp.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from meshtrain.parallel.comm import CountedComm
from meshtrain.parallel.sharding import ShardingTable
from meshtrain.parallel.tensor.collectives import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_sequence_for_replicated,
    scatter_to_sequence_region,
)
from meshtrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    HeadSelectLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_replicated,
)


def _enter_region(x: torch.Tensor, comm: CountedComm, sequence_parallel: bool) -> torch.Tensor:
    return gather_from_sequence_region(x, comm) if sequence_parallel else copy_to_tp_region(x, comm)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _kv_module(linear: nn.Linear, config, tp_rank: int, tp_size: int) -> nn.Module:
    if config.kv_heads % tp_size == 0:
        return ColumnParallelLinear(linear, tp_rank, tp_size)
    q_per_rank = config.n_heads // tp_size
    group = config.n_heads // config.kv_heads
    first_q = tp_rank * q_per_rank
    heads = sorted({q // group for q in range(first_q, first_q + q_per_rank)})
    return HeadSelectLinear(linear, config.head_dim, heads)


def apply_tensor_parallel(model: nn.Module, comm: CountedComm, tp_rank: int,
                          rules: tuple[tuple[str, str], ...], sequence_parallel: bool,
                          shardings: ShardingTable) -> None:
    """Replace and hook ``model``'s modules per ``rules`` for this tp rank (in place), and
    record every parameter's tp layout in ``shardings`` (the model's table)."""
    tp_size = comm.size
    config = model.config
    names = [name for name, _ in model.named_modules() if name]
    for pattern, style in rules:
        for name in [n for n in names if fnmatch.fnmatchcase(n, pattern)]:
            module = model.get_submodule(name)
            if module is None:
                continue
            if style == "vocab":
                new = VocabParallelEmbedding(module, tp_rank, tp_size, comm, sequence_parallel)
            elif style == "column":
                new = ColumnParallelLinear(module, tp_rank, tp_size)
            elif style == "row":
                new = RowParallelLinear(module, tp_rank, tp_size, comm, sequence_parallel)
            elif style == "kv":
                new = _kv_module(module, config, tp_rank, tp_size)
            elif style == "region":
                module.register_forward_pre_hook(
                    lambda m, args: (_enter_region(args[0], comm, sequence_parallel), *args[1:]))
                continue
            elif style == "region-output":
                module.register_forward_hook(
                    lambda m, args, out: _enter_region(out, comm, sequence_parallel))
                continue
            elif style == "heads":
                shardings.register(name, {local: tp_replicated(partial_grad=True)
                                          for local, _ in module.named_parameters()})
                continue
            elif style == "replicated":
                if sequence_parallel:
                    module.register_forward_pre_hook(
                        lambda m, args: (gather_sequence_for_replicated(args[0], comm),
                                         *args[1:]))
                    module.register_forward_hook(
                        lambda m, args, out: scatter_to_sequence_region(out, comm))
                continue
            else:
                raise ValueError(f"unknown tensor-parallel style {style!r} for {name}")
            _set_submodule(model, name, new)
            shardings.register(name, new.param_shardings)
    for name, _ in model.named_parameters():
        record = shardings.get(name)
        if record.tp_dim is None and not record.tp_replicated:
            is_norm = name.rsplit(".", 2)[-2].endswith("norm")
            shardings.update(name, tp_replicated=True,
                             tp_partial_grad=sequence_parallel and is_norm)


def tp_vocab_start(model: nn.Module) -> int:
    """First vocabulary id of this rank's logits slice (0 without tensor parallelism)."""
    embedding = model.tok_embeddings
    return getattr(embedding, "vocab_start", 0)
