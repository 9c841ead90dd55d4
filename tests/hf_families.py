"""Tiny random Hugging Face models of the families meshtrain converts: Llama 3.1 (llama3 RoPE
scaling), Qwen2.5 (q/k/v biases, YaRN) and Qwen3 (QK-norm, head_dim != hidden / heads, linear
RoPE scaling), plus a Llama with ``attention_bias`` (biases on all four projections), and the MoE
families Qwen3-MoE (QK-norm, head_dim 32, renormalised top-2 of 4 experts, layer 0 dense through
``mlp_only_layers``, experts narrower than the dense MLP) and Qwen2-MoE (q/k/v biases, raw
top-2 gates, a sigmoid-gated shared expert of its own width, YaRN).

Each is built from its ``transformers`` config (nothing is downloaded), every parameter redrawn
(biases and norm weights too, so that a wrong mapping cannot hide behind zeros and ones), saved
with ``save_pretrained``, and its ``config.json`` rewritten the way the published checkpoints of
the family spell RoPE (``rope_theta`` beside a ``rope_scaling`` table) where they do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 264  # the byte tokenizer's size, divisible by tp = 2
CONTEXT = 64  # every family's original_max_position_embeddings
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)

# family: (config class, model class, config fields, hub-style rope_scaling or None)
FAMILIES = {
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM",
                 dict(max_position_embeddings=4 * CONTEXT, rms_norm_eps=1e-5),
                 ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": CONTEXT},
                  500000.0)),
    "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM",
                dict(max_position_embeddings=4 * CONTEXT, sliding_window=131072,
                     use_sliding_window=False, max_window_layers=2),
                ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT},
                 1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=32, max_position_embeddings=CONTEXT,
                   rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0,
                                    "factor": 2.0}),
              None),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM",
                   dict(attention_bias=True, max_position_embeddings=CONTEXT),
                   None),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, max_position_embeddings=CONTEXT, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[0]),
                  None),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(max_position_embeddings=4 * CONTEXT, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=48, shared_expert_intermediate_size=80,
                       norm_topk_prob=False),
                  ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT},
                   1000000.0)),
}
MOE_FAMILIES = ("qwen3-moe", "qwen2-moe")
TRAINED = ("llama3.1", "qwen2.5", "qwen3")
"""The families of the issue's acceptance test (trained at tp2 x pp2)."""


def make_hf_model(family: str, path: Path, seed: int = 0) -> Path:
    """Save a tiny random ``family`` model to ``path`` (see the module docstring)."""
    import transformers

    config_cls, model_cls, fields, hub_rope = FAMILIES[family]
    config = getattr(transformers, config_cls)(**SHAPE, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    if hub_rope is not None:
        scaling, theta = hub_rope
        doc = json.loads((path / "config.json").read_text())
        doc.pop("rope_parameters", None)
        doc.update(rope_scaling=scaling, rope_theta=theta)
        (path / "config.json").write_text(json.dumps(doc, indent=2))
    return path


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the Hugging Face model saved at ``path`` (loaded by ``transformers``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(tokens).logits
