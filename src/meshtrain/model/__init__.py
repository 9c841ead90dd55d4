"""The single-device model: a Llama-style decoder, dense or Mixture-of-Experts.

Nothing here imports ``torch.distributed``; parallelism is applied from outside by
``meshtrain.parallel.parallelize``, which wraps or replaces the named submodules.
"""

from __future__ import annotations

import torch

from meshtrain.config import ModelConfig
from meshtrain.config.model_size import count_parameters, flops_per_token
from meshtrain.model.init import init_tensor, init_weights
from meshtrain.model.moe import MoE, moe_layers
from meshtrain.model.transformer import Transformer


def meta_model(config: ModelConfig) -> Transformer:
    """The plain model on the meta device: shapes only, no memory, no initialisation."""
    with torch.device("meta"):
        return Transformer(config)


def build_model(
    config: ModelConfig,
    device: str | torch.device = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """Build a :class:`Transformer` with the name-seeded init, on ``device`` in ``dtype``.

    Constructed under ``torch.device("meta")`` (no memory, no wasted default init), materialised
    with ``to_empty``, filled by :func:`init_weights`, then cast. MoE ``expert_bias`` buffers stay
    fp32 whatever ``dtype`` is, since the bias update needs the precision.
    """
    model = meta_model(config)
    model.to_empty(device=device)
    init_weights(model, seed)
    model.to(dtype)
    for moe in moe_layers(model):
        moe.expert_bias = moe.expert_bias.float()
    return model


__all__ = [
    "MoE",
    "Transformer",
    "build_model",
    "count_parameters",
    "flops_per_token",
    "init_tensor",
    "init_weights",
    "meta_model",
    "moe_layers",
]
