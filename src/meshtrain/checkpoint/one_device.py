"""A one-device model from any saved weights: a run's final weights, a meshtrain weights directory
(``meshtrain convert --from-hf``) or a training checkpoint saved at any layout.

What ``meshtrain eval`` and the task scores during training (``train.eval_tasks``) load. Final
weights are read one tensor at a time (:class:`~meshtrain.checkpoint.safetensors_io.TensorReader`);
a checkpoint's full tensors are assembled from whatever pieces its ranks wrote
(:func:`~meshtrain.checkpoint.reader.read_checkpoint_tensors`), so a checkpoint of dp 2 × tp 2 or
pp 2 loads as the same one-device model.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from meshtrain.checkpoint import manager
from meshtrain.checkpoint.hf.io import HF_CONFIG_COPY
from meshtrain.checkpoint.safetensors_io import (
    INDEX_NAME,
    TensorReader,
    current_weights_dir,
    has_weights,
)
from meshtrain.config import Config, ConfigError, config_from_dict
from meshtrain.model import build_model
from meshtrain.model.init import canonical_name


def weights_directory(path: Path) -> Path | None:
    """The weights directory ``path`` is or holds (``path/final``), or None."""
    for candidate in (path, path / "final"):
        candidate = current_weights_dir(candidate)  # a crash mid-swap: the complete old set
        if has_weights(candidate) and (candidate / "config.json").is_file():
            return candidate
    return None


def checkpoint_directory(path: Path) -> Path | None:
    """The checkpoint ``path`` names: a ``step_N`` directory, a checkpoint root (its newest
    valid checkpoint is read) or a run directory with ``checkpoints/``; None when none."""
    for candidate in (path, path / "checkpoints"):
        if (candidate / manager.MANIFEST).is_file():
            return candidate
        if candidate.is_dir() and manager.newest_valid(candidate, warn=False) is not None:
            return candidate
    return None


def context_length(directory: Path | None, config: Config) -> int:
    """The context the weights were published or trained with: ``max_position_embeddings`` of
    the Hugging Face config a converted model keeps beside its weights, else
    ``train.seq_len`` (what ``meshtrain convert --to-hf`` writes as that field)."""
    if directory is not None and (directory / HF_CONFIG_COPY).is_file():
        try:
            value = json.loads((directory / HF_CONFIG_COPY).read_text()).get(
                "max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            value = None
        if isinstance(value, int) and value > 0:
            return value
    return config.train.seq_len


def fill_model(config: Config, tensors: Iterable[tuple[str, torch.Tensor]], device, origin: str):
    """A model of ``config.model`` on ``device`` holding ``tensors`` (float32); every parameter
    and buffer must be among them, with its shape."""
    model = build_model(config.model, device=device, seed=config.train.seed)
    targets = model.state_dict(keep_vars=True)
    filled, unexpected = set(), []
    with torch.no_grad():
        for name, value in tensors:
            target = targets.get(canonical_name(name))
            if target is None:
                unexpected.append(name)
                continue
            if tuple(value.shape) != tuple(target.shape):
                raise ConfigError(f"{origin}: {name} has shape {tuple(value.shape)}, its config "
                                  f"implies {tuple(target.shape)}.")
            target.copy_(value)
            filled.add(target.data_ptr())
    missing = [name for name, target in targets.items() if target.data_ptr() not in filled]
    if missing or unexpected:
        raise ConfigError(f"{origin}: the weights do not match their config (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]}).")
    return model.eval()


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """``(model, config, context length)`` of the weights at ``path``: a run directory (its
    ``final/``, else its newest checkpoint), a weights directory, or a training checkpoint (a
    ``step_N`` directory or a checkpoint root). Raises :class:`ConfigError` when ``path`` holds
    none of them or they do not load."""
    from safetensors import SafetensorError

    path = Path(path)
    directory = weights_directory(path)
    if directory is not None:
        try:
            config = config_from_dict(json.loads((directory / "config.json").read_text()),
                                      origin=str(directory / "config.json"))
            _vocab_from_tokenizer(config)
            with TensorReader(directory) as reader:
                model = fill_model(config, ((name, reader.get(name)) for name in reader.keys()),
                                   device, str(directory))
        except (json.JSONDecodeError, SafetensorError, OSError) as error:
            raise ConfigError(f"{directory}: the saved weights are unreadable ({error}).") \
                from None
        return model, config, context_length(directory, config)
    checkpoint = checkpoint_directory(path)
    if checkpoint is None:
        raise ConfigError(f"{path} holds no weights: neither final weights ({INDEX_NAME} + "
                          "config.json, in it or in its final/), nor a training checkpoint (a "
                          "step_N directory, a checkpoint directory or a run directory with "
                          "checkpoints/).")
    from meshtrain.checkpoint.reader import read_checkpoint_tensors

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        config, tensors = read_checkpoint_tensors(checkpoint)
        _vocab_from_tokenizer(config)
        model = fill_model(config, tensors, device, str(checkpoint))
    return model, config, context_length(None, config)


def _vocab_from_tokenizer(config: Config) -> None:
    if config.model.vocab_size <= 0:
        from meshtrain.data.tokenizer import tokenizer_vocab_size

        config.model.vocab_size = tokenizer_vocab_size(config.data.tokenizer)
