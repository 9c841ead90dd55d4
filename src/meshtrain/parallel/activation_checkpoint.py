"""Activation checkpointing applied from outside the model, without renaming any parameter.

``full`` recomputes each transformer block in backward (stores only block inputs). ``selective``
recomputes only the cheap, memory-hungry parts inside each block (the attention core and the MLP
activation function, :data:`RECOMPUTED_UNDER_SELECTIVE`), keeping the matmul outputs, in the
spirit of Korthikanti et al. 2022.

The module's ``forward`` is replaced *on the instance*, so ``state_dict`` keys and the name-seeded
initialisation are unchanged (a wrapper module would insert a prefix into every name).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from meshtrain.parallel.state import attach_parallel_state

RECOMPUTED_UNDER_SELECTIVE = ("AttentionCore", "ContextParallelAttention", "MLPActivation")
"""The module types ``selective`` recomputes: the attention core (also context parallelism's,
which then gathers the keys and values again) and the MLP activation function."""


def checkpoint_module(module: torch.nn.Module) -> None:
    """Make ``module`` recompute its forward during backward instead of storing activations."""
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Apply ``mode`` (``none``, ``full``, ``selective``) to ``model``, each module once (the
    model's :class:`~meshtrain.parallel.state.ParallelState` lists the wrapped ones); returns
    how many modules were wrapped now."""
    if mode == "none":
        return 0
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    done = attach_parallel_state(model).checkpointed
    targets = []
    for key, block in model.layers.items():
        if mode == "full":
            targets.append((f"layers.{key}", block))
            continue
        targets += [(f"layers.{key}.{name}", sub) for name, sub in block.named_modules()
                    if type(sub).__name__ in RECOMPUTED_UNDER_SELECTIVE]
    wrapped = 0
    for name, module in targets:
        if name not in done:
            checkpoint_module(module)
            done.add(name)
            wrapped += 1
    return wrapped
