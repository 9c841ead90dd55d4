"""Well-known model shapes with their published sequence length and global batch.

Shapes are from each model's paper or released config; the batch is the published one where the
paper states it (GPT-3: Brown et al. 2020, Table 2.1, 3.2M tokens; Llama 3 405B: Llama Team 2024,
§3.4.1, 16M tokens at 8K context), otherwise 4M tokens (Llama 2's batch) at the model's context.
"""

from __future__ import annotations

from meshtrain.config import Config, ConfigError, ModelConfig

# name: (model fields, seq_len, global_batch in sequences, source)
PRESETS: dict[str, tuple[dict, int, int, str]] = {
    "llama2-7b": (dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
                  4096, 1024, "Touvron et al. 2023 (Llama 2), 4M-token batch"),
    "llama3-8b": (dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                       ffn_dim=14336, rope_theta=500000.0),
                  8192, 512, "Llama 3 config; 4M-token batch assumed"),
    "llama3-70b": (dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        ffn_dim=28672, rope_theta=500000.0),
                   8192, 512, "Llama 3 config; 4M-token batch assumed"),
    "llama3-405b": (dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                         ffn_dim=53248, rope_theta=500000.0),
                    8192, 2048, "Llama Team 2024, Table 3 and §3.4.1 (16M-token batch)"),
    "gpt3-175b": (dict(vocab_size=50257, dim=12288, n_layers=96, n_heads=96, ffn_dim=49152,
                       mlp="gelu"),
                  2048, 1536, "Brown et al. 2020, Table 2.1 (3.2M-token batch)"),
    "gpt3-13b": (dict(vocab_size=50257, dim=5120, n_layers=40, n_heads=40, ffn_dim=20480,
                      mlp="gelu"),
                 2048, 1024, "Brown et al. 2020, Table 2.1 (2M-token batch)"),
    "mixtral-8x7b": (dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          ffn_dim=14336, moe_experts=8, moe_top_k=2, rope_theta=1e6),
                     4096, 1024, "Jiang et al. 2024 (Mixtral) config; 4M-token batch assumed"),
}


def preset_config(name: str) -> Config:
    """A run config holding preset ``name``'s model, sequence length and global batch (bf16)."""
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f'--model "{name}" is neither a preset nor a config file; presets: '
                          f"{', '.join(PRESETS)}.")
    fields, seq_len, batch, _ = PRESETS[key]
    config = Config()
    config.model = ModelConfig(**fields)
    config.train.seq_len = seq_len
    config.train.global_batch = batch
    config.train.precision = "bf16"
    return config
