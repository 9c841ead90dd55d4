"""Well-known model shapes with their published sequence length and global batch.

Shapes are from each model's paper or released config (Llama 3.1 / 3.2 and Qwen2.5 / Qwen3:
their published ``config.json``, RoPE scaling, biases and QK-norm included, which the
parameter counts and the planner then count); Qwen's batches assume 4M tokens at the 4K
context of their first pre-training stage; the batch is the published one where the
paper states it (GPT-3: Brown et al. 2020, Table 2.1, 3.2M tokens; Llama 3 405B: Llama Team 2024,
3.4.1, 16M tokens at 8K context), otherwise 4M tokens (Llama 2's batch) at the model's context.
"""

from __future__ import annotations

import copy

from meshtrain.config import Config, ConfigError, ModelConfig

_LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)
_LLAMA3 = dict(vocab_size=128256, n_kv_heads=8, rope_theta=500000.0)
_QWEN25 = dict(vocab_size=152064, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True)
_QWEN3 = dict(vocab_size=151936, n_kv_heads=8, head_width=128, rope_theta=1e6, norm_eps=1e-6,
              qk_norm=True)

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
                    8192, 2048, "Llama Team 2024, Table 3 and 3.4.1 (16M-token batch)"),
    "gpt3-175b": (dict(vocab_size=50257, dim=12288, n_layers=96, n_heads=96, ffn_dim=49152,
                       mlp="gelu"),
                  2048, 1536, "Brown et al. 2020, Table 2.1 (3.2M-token batch)"),
    "gpt3-13b": (dict(vocab_size=50257, dim=5120, n_layers=40, n_heads=40, ffn_dim=20480,
                      mlp="gelu"),
                 2048, 1024, "Brown et al. 2020, Table 2.1 (2M-token batch)"),
    "mixtral-8x7b": (dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          ffn_dim=14336, moe_experts=8, moe_top_k=2, rope_theta=1e6),
                     4096, 1024, "Jiang et al. 2024 (Mixtral) config; 4M-token batch assumed"),
    "llama3.1-8b": (dict(_LLAMA3, dim=4096, n_layers=32, n_heads=32, ffn_dim=14336,
                         rope_scaling=_LLAMA31_ROPE),
                    8192, 512, "Meta's published config.json for Llama-3.1-8B; 4M-token batch "
                    "assumed"),
    "llama3.1-70b": (dict(_LLAMA3, dim=8192, n_layers=80, n_heads=64, ffn_dim=28672,
                          rope_scaling=_LLAMA31_ROPE),
                     8192, 512, "Meta's published config.json for Llama-3.1-70B; 4M-token batch "
                     "assumed"),
    "llama3.1-405b": (dict(_LLAMA3, dim=16384, n_layers=126, n_heads=128, ffn_dim=53248,
                           rope_scaling=_LLAMA31_ROPE),
                      8192, 2048, "Meta's published config.json for Llama-3.1-405B; batch: "
                      "Llama Team 2024, 3.4.1 (16M tokens)"),
    "llama3.2-1b": (dict(_LLAMA3, dim=2048, n_layers=16, n_heads=32, ffn_dim=8192,
                         tie_embeddings=True, rope_scaling=_LLAMA32_ROPE),
                    8192, 512, "Meta's published config.json for Llama-3.2-1B; 4M-token batch "
                    "assumed"),
    "llama3.2-3b": (dict(_LLAMA3, dim=3072, n_layers=28, n_heads=24, ffn_dim=8192,
                         tie_embeddings=True, rope_scaling=_LLAMA32_ROPE),
                    8192, 512, "Meta's published config.json for Llama-3.2-3B; 4M-token batch "
                    "assumed"),
    "qwen2.5-7b": (dict(_QWEN25, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                        ffn_dim=18944),
                   4096, 1024, "Qwen's published config.json for Qwen2.5-7B; 4M-token batch "
                   "assumed"),
    "qwen2.5-72b": (dict(_QWEN25, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         ffn_dim=29568),
                    4096, 1024, "Qwen's published config.json for Qwen2.5-72B; 4M-token batch "
                    "assumed"),
    "qwen3-8b": (dict(_QWEN3, dim=4096, n_layers=36, n_heads=32, ffn_dim=12288),
                 4096, 1024, "Qwen's published config.json for Qwen3-8B; 4M-token batch assumed"),
    "qwen3-32b": (dict(_QWEN3, dim=5120, n_layers=64, n_heads=64, ffn_dim=25600),
                  4096, 1024, "Qwen's published config.json for Qwen3-32B; 4M-token batch "
                  "assumed"),
    "qwen3-30b-a3b": (dict(_QWEN3, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                           ffn_dim=6144, moe_experts=128, moe_top_k=8, moe_ffn_dim=768),
                      4096, 1024, "Qwen's published config.json for Qwen3-30B-A3B (every layer "
                      "MoE); 4M-token batch assumed"),
    "qwen3-235b-a22b": (dict(_QWEN3, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                             ffn_dim=12288, moe_experts=128, moe_top_k=8, moe_ffn_dim=1536),
                        4096, 2048, "Qwen's published config.json for Qwen3-235B-A22B (every "
                        "layer MoE); batch: Megatron-Bridge's H100 recipe (8M tokens)"),
}


def preset_config(name: str) -> Config:
    """A run config holding preset ``name``'s model, sequence length and global batch (bf16)."""
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f'--model "{name}" is neither a preset nor a config file; presets: '
                          f"{', '.join(PRESETS)}.")
    fields, seq_len, batch, _ = PRESETS[key]
    config = Config()
    config.model = ModelConfig(**copy.deepcopy(fields))
    config.train.seq_len = seq_len
    config.train.global_batch = batch
    config.train.precision = "bf16"
    return config
