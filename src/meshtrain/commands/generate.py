"""Text generation from saved final weights (``RUN_DIR/final``): greedy or sampled decoding."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from meshtrain.checkpoint.safetensors_io import (
    INDEX_NAME,
    SINGLE_NAME,
    TensorReader,
    current_weights_dir,
    has_weights,
)
from meshtrain.config import ConfigError, config_from_dict


def find_weights_dir(path: str | Path) -> Path:
    """Accept a run directory (containing ``final/``) or the weights directory itself: sharded
    (``model.safetensors.index.json``) or one ``model.safetensors``, with ``config.json``."""
    path = Path(path)
    for candidate in (path, path / "final"):
        candidate = current_weights_dir(candidate)  # a crash mid-swap: the complete old set
        if has_weights(candidate) and (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(f"--checkpoint {path}: no {INDEX_NAME} (or {SINGLE_NAME}) + config.json "
                      f"found there or in {path / 'final'}; pass a run directory of a finished "
                      "`meshtrain train`.")


def load_for_generation(path: str | Path, device: str = "cpu"):
    """Build the model and tokenizer of a saved run; returns ``(model, tokenizer, config)``.

    The weights are read one tensor at a time into the built model (never a second copy)."""
    from safetensors import SafetensorError

    from meshtrain.data.tokenizer import load_tokenizer
    from meshtrain.model import build_model

    weights_dir = find_weights_dir(path)
    try:
        config = config_from_dict(json.loads((weights_dir / "config.json").read_text()),
                                  origin=str(weights_dir / "config.json"))
        model = build_model(config.model, device=device, seed=config.train.seed)
        targets = model.state_dict(keep_vars=True)
        with TensorReader(weights_dir) as reader, torch.no_grad():
            missing = [name for name in targets if name not in reader]
            unexpected = [name for name in reader.keys() if name not in targets]
            if missing or unexpected:
                raise ConfigError(f"--checkpoint {weights_dir}: weights do not match the saved "
                                  f"config (missing {missing[:3]}, unexpected {unexpected[:3]}).")
            for name, target in targets.items():
                value = reader.get(name)
                if value.shape != target.shape:
                    raise ConfigError(f"--checkpoint {weights_dir}: {name} has shape "
                                      f"{tuple(value.shape)}, the saved config implies "
                                      f"{tuple(target.shape)}.")
                target.copy_(value)
    except (json.JSONDecodeError, SafetensorError, OSError) as error:
        raise ConfigError(f"--checkpoint {weights_dir}: the saved weights are unreadable "
                          f"({error}).") from None
    model.eval()
    return model, load_tokenizer(config.data.tokenizer), config


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int = 50, seed: int = 0, context: int = 1024) -> str:
    """Continue ``prompt``; ``temperature = 0`` is greedy. Re-runs the model on the last
    ``context`` tokens each step (no KV cache: the models trained here are small)."""
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id or 0]
    tokens = torch.tensor([ids], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -context:])[0, -1].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            next_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if tokenizer.eos_id is not None and next_id == tokenizer.eos_id:
            break
        tokens = torch.cat([tokens, torch.tensor([[next_id]], device=device)], dim=1)
    return tokenizer.decode(tokens[0, len(ids):].tolist())


def run_generate(args: argparse.Namespace) -> int:
    """``meshtrain generate``."""
    model, tokenizer, _ = load_for_generation(args.checkpoint)
    text = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                    args.top_k, args.seed)
    print(args.prompt + text)
    return 0
