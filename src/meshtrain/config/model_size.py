"""A model's size from its config alone: parameter counts and training FLOPs per token.

Pure arithmetic on :class:`~meshtrain.config.model.ModelConfig`, without torch, so the planner
(``meshtrain estimate`` / ``plan``) prices a model without importing the training stack.
"""

from __future__ import annotations

from meshtrain.config.model import ModelConfig


def attention_params(config: ModelConfig) -> int:
    """Projection weights and biases of one attention block (what tensor parallelism splits)."""
    q_width = config.n_heads * config.head_dim
    kv_width = config.kv_heads * config.head_dim
    biases = (q_width + 2 * kv_width if config.qkv_bias else 0) + (
        config.dim if config.wo_bias else 0)
    return 2 * config.dim * q_width + 2 * config.dim * kv_width + biases


def attention_matmul_params(config: ModelConfig) -> int:
    """The projection weights of one attention block (the parameters that do matmuls)."""
    q_width = config.n_heads * config.head_dim
    kv_width = config.kv_heads * config.head_dim
    return 2 * config.dim * q_width + 2 * config.dim * kv_width


def norm_params(config: ModelConfig) -> int:
    """Norm weights of one block: the two pre-norms and, with ``qk_norm``, the two head norms
    (replicated whole under tensor parallelism)."""
    return 2 * config.dim + (2 * config.head_dim if config.qk_norm else 0)


def mlp_params(config: ModelConfig, hidden: int) -> int:
    """Weights of one MLP of width ``hidden`` (SwiGLU: gate, up and down; else up and down)."""
    return (3 if config.mlp == "swiglu" else 2) * config.dim * hidden


def layer_counts(config: ModelConfig, layer: int) -> tuple[int, int, int]:
    """``(total, active, matmul-active)`` parameters of block ``layer``."""
    attention = attention_params(config)
    matmul = attention_matmul_params(config)
    norms = norm_params(config)
    if not config.is_moe_layer(layer):
        mlp = mlp_params(config, config.ffn_dim)
        return attention + norms + mlp, attention + norms + mlp, matmul + mlp
    expert = mlp_params(config, config.expert_ffn_dim)
    router = config.dim * config.moe_experts
    shared = mlp_params(config, config.shared_ffn_dim)
    if config.moe_shared_gate and config.moe_shared_experts:
        shared += config.dim
    total_mlp = router + config.moe_experts * expert + shared
    active_mlp = router + config.moe_top_k * expert + shared
    return attention + norms + total_mlp, attention + norms + active_mlp, matmul + active_mlp


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Parameter counts computed from the config alone (no model is built).

    ``total``: every parameter (a tied head counted once). ``embedding``: the token embedding
    table (``vocab * dim``). ``non_embedding``: ``total - embedding`` (includes an untied head).
    ``active``: parameters a single token touches: ``total`` minus the routed experts it was
    not sent to (router, ``top_k`` routed and all shared experts count).
    """
    embedding = config.vocab_size * config.dim
    head = 0 if config.tie_embeddings else config.vocab_size * config.dim
    total = active = embedding + head + config.dim  # + final norm
    for layer in range(config.n_layers):
        layer_total, layer_active, _ = layer_counts(config, layer)
        total += layer_total
        active += layer_active
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        "active": active,
    }


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the basis of MFU.

    ``6 * N + 12 * n_layers * dim * seq_len`` (PaLM, appendix B): ``N`` is the active matmul
    parameters (attention and MLP projections, router, ``top_k`` routed + shared experts, and the
    LM head, which costs ``vocab * dim`` even when tied) — norms (QK-norm included), biases and
    the embedding lookup do no matmul. The second term counts the attention scores ``QK^T``
    and the weighted sum ``AV`` (2 matmuls x 2 FLOPs x 3 for forward+backward); ``dim`` here is
    ``n_heads * head_dim`` and, by that convention, the causal mask is not credited with halving
    the work.
    """
    matmul = config.vocab_size * config.dim
    for layer in range(config.n_layers):
        matmul += layer_counts(config, layer)[2]
    attention_width = config.n_heads * config.head_dim
    return 6.0 * matmul + 12.0 * config.n_layers * attention_width * seq_len
