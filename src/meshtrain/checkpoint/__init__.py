"""Checkpoints that move between layouts (``torch.distributed.checkpoint``), exact resume, and
Hugging Face interop. See ``docs/checkpoints.md``."""

from meshtrain.checkpoint.hf import (
    convert_from_hf,
    convert_to_hf,
    iter_weights,
    load_hf,
    save_hf,
    weights_config,
)

__all__ = [
    "convert_from_hf",
    "convert_to_hf",
    "iter_weights",
    "load_hf",
    "save_hf",
    "weights_config",
]
