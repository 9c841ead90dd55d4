"""Small configs shared by tests: tiny shapes so every test runs in seconds on 2 cores."""

from __future__ import annotations

from meshtrain.config import Config, load_config


def tiny_config(*overrides: str, nproc: int | None = None, run_dir: str | None = None) -> Config:
    """A validated 2-layer dim-32 config on a 200 kB slice of the built-in corpus."""
    base = [
        "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=64", "train.seq_len=16", "train.global_batch=8", "train.steps=4",
        "train.warmup_steps=0", "data.max_bytes=200000", "train.lr=1e-2",
    ]
    if run_dir is not None:
        base.append(f"train.run_dir={run_dir}")
    config = load_config(None, base + list(overrides))
    config.validate(nproc)
    return config
