"""Activation checkpointing applied from outside the model, without renaming any parameter.

``full`` recomputes each transformer block in backward (stores only block inputs). ``selective``
recomputes only the cheap, memory-hungry parts inside each block (the attention core and the MLP
activation function), keeping the matmul outputs, in the spirit of Korthikanti et al. 2022.

The module's ``forward`` is replaced *on the instance*, so ``state_dict`` keys and the name-seeded
initialisation are unchanged (a wrapper module would insert a prefix into every name).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def checkpoint_module(module: torch.nn.Module) -> None:
    """Make ``module`` recompute its forward during backward instead of storing activations."""
    if getattr(module, "_meshtrain_checkpointed", False):
        return
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._meshtrain_checkpointed = True


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Apply ``mode`` (``none``, ``full``, ``selective``); returns how many modules were wrapped."""
    if mode == "none":
        return 0
    wrapped = 0
    for block in model.layers.values():
        if mode == "full":
            checkpoint_module(block)
            wrapped += 1
            continue
        if mode != "selective":
            raise ValueError(f"unknown activation checkpointing mode {mode!r}")
        for _name, sub in block.named_modules():
            if type(sub).__name__ in ("AttentionCore", "MLPActivation"):
                checkpoint_module(sub)
                wrapped += 1
    return wrapped
