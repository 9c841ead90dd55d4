"""Checkpoints that move between layouts (``torch.distributed.checkpoint``), exact resume, and
Hugging Face interop. See ``docs/checkpoints.md``."""

from meshtrain.checkpoint.hf.io import (
    convert_from_hf,
    convert_to_hf,
    iter_weights,
    load_hf,
    save_hf,
    weights_config,
)
from meshtrain.checkpoint.reader import read_checkpoint_tensors

__all__ = [
    "convert_from_hf",
    "convert_to_hf",
    "iter_weights",
    "load_hf",
    "read_checkpoint_tensors",
    "save_hf",
    "weights_config",
]
