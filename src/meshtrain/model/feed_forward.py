"""The dense feed-forward of a block, shared by dense blocks and MoE shared experts.

:class:`MLPActivation` is the parameter-free middle (``silu(gate) * up`` or ``gelu``);
:class:`FeedForward` wraps it in its projections. Both :mod:`meshtrain.model.transformer` (dense
blocks) and :mod:`meshtrain.model.moe` (experts and shared experts) build on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.config.model import MLP_KINDS


class MLPActivation(nn.Module):
    """The parameter-free middle of an MLP: ``silu(gate) * up`` (swiglu) or ``gelu(h)``.

    Its own module so selective activation checkpointing can wrap just this cheap part.
    """

    def __init__(self, mlp: str):
        super().__init__()
        if mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {mlp!r}; valid: {', '.join(MLP_KINDS)}")
        self.mlp = mlp

    def forward(self, h: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(h) * up`` for swiglu, ``gelu(h)`` for gelu."""
        if self.mlp == "swiglu":
            return F.silu(h) * up
        return F.gelu(h)


class FeedForward(nn.Module):
    """Dense MLP: swiglu has ``w1`` (gate), ``w3`` (up), ``w2`` (down); gelu has ``w1``, ``w2``."""

    def __init__(self, dim: int, hidden: int, mlp: str = "swiglu"):
        super().__init__()
        self.act = MLPActivation(mlp)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        if mlp == "swiglu":
            self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` [..., dim]."""
        if self.act.mlp == "swiglu":
            return self.w2(self.act(self.w1(x), self.w3(x)))
        return self.w2(self.act(self.w1(x)))
