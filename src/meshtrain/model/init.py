"""Name-seeded weight initialisation, and parameter / FLOP counts from a config.

Every parameter is drawn from its own ``torch.Generator`` seeded by a stable hash (SHA-256) of
``f"{seed}/{name}"``, where ``name`` is the parameter's full name in the unsharded model
(e.g. ``layers.3.attention.wq.weight``). So the value never depends on which modules a rank
built or in what order: a sharded rank calls :func:`init_tensor` for the *full* tensor and keeps
its slice, and every parallel layout starts from the same model as one process.

Init rules (std of a zero-mean normal unless stated):

=====================================================  ==========================
norms (``attention_norm``, ``ffn_norm``, ``norm``)      ones
``tok_embeddings``                                      0.02
input projections ``wq wk wv w1 w3``, ``router``        0.02
output projections ``wo``, ``w2`` (dense and experts)   0.02 / sqrt(2 * n_layers)
the LM head ``output``                                  dim ** -0.5
=====================================================  ==========================
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshtrain.config import ModelConfig

if TYPE_CHECKING:
    from meshtrain.parallel.sharding import ParamSharding, ShardingTable

# Wrapper prefixes that activation checkpointing / torch.compile insert into parameter names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
_INPUT_PROJECTIONS = ("wq", "wk", "wv", "w1", "w3", "router")
_OUTPUT_PROJECTIONS = ("wo", "w2")


def canonical_name(name: str) -> str:
    """``name`` with wrapper components (checkpoint / compile wrappers) removed."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit generator seed for parameter ``name`` (independent of Python's hash())."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std(name: str, config: ModelConfig) -> float | None:
    """The init std for parameter ``name``, or ``None`` for a norm weight (initialised to 1)."""
    parts = canonical_name(name).split(".")
    leaf = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
    if leaf.endswith("norm"):
        return None
    if leaf == "tok_embeddings":
        return 0.02
    if parts == ["output", "weight"]:
        return config.dim**-0.5
    if leaf in _OUTPUT_PROJECTIONS:
        return 0.02 / math.sqrt(2 * config.n_layers)
    if leaf in _INPUT_PROJECTIONS:
        return 0.02
    raise ValueError(f"no init rule for parameter {name!r}; add one to meshtrain.model.init")


def init_tensor(name: str, shape: Sequence[int], seed: int, config: ModelConfig) -> torch.Tensor:
    """The full initial value (fp32, CPU) of parameter ``name`` with ``shape``.

    Depends only on ``(seed, name, shape, config)``; see the module docstring for the rules.
    """
    std = init_std(name, config)
    if std is None:
        return torch.ones(tuple(shape), dtype=torch.float32)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(name_seed(seed, canonical_name(name)))
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * std


def initial_value(name: str, param: torch.Tensor, seed: int, config: ModelConfig,
                  sharding: ParamSharding | None = None) -> torch.Tensor:
    """The initial value (fp32, CPU) of this rank's piece of parameter ``name``.

    A parallel layout may have replaced a parameter by this rank's piece; its sharding record
    (``sharding``, :class:`~meshtrain.parallel.sharding.ParamSharding`) then gives the full shape
    and cuts the piece, so the values match the unsplit model's. Only one full tensor exists at
    a time.
    """
    if sharding is None or not sharding.is_piece:
        return init_tensor(name, param.shape, seed, config)
    return sharding.local_piece(init_tensor(name, sharding.full_shape, seed, config))


def reset_buffers(model: nn.Module) -> None:
    """Reset every module's buffers through its ``reset_buffers()`` (MoE ``expert_bias`` to
    zeros, RoPE caches cleared)."""
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, shardings: ShardingTable | None = None) -> None:
    """Fill every parameter of ``model`` with :func:`initial_value` and reset its buffers.

    ``model`` must carry its ``ModelConfig`` as ``model.config``; ``shardings``: the sharding
    records of a parallelised model's parameters (None: every parameter is whole).
    """
    config = model.config
    for name, param in model.named_parameters():
        value = initial_value(name, param, seed, config,
                              shardings[name] if shardings is not None else None)
        param.copy_(value.to(device=param.device, dtype=param.dtype))
    reset_buffers(model)


def _attention_params(config: ModelConfig) -> int:
    q_width = config.n_heads * config.head_dim
    kv_width = config.kv_heads * config.head_dim
    return 2 * config.dim * q_width + 2 * config.dim * kv_width


def _mlp_params(config: ModelConfig, hidden: int) -> int:
    return (3 if config.mlp == "swiglu" else 2) * config.dim * hidden


def _layer_counts(config: ModelConfig, layer: int) -> tuple[int, int, int]:
    """``(total, active, matmul-active)`` parameters of block ``layer``."""
    attention = _attention_params(config)
    norms = 2 * config.dim
    if not config.is_moe_layer(layer):
        mlp = _mlp_params(config, config.ffn_dim)
        return attention + norms + mlp, attention + norms + mlp, attention + mlp
    expert = _mlp_params(config, config.expert_ffn_dim)
    router = config.dim * config.moe_experts
    shared = config.moe_shared_experts * expert
    total_mlp = router + config.moe_experts * expert + shared
    active_mlp = router + config.moe_top_k * expert + shared
    return attention + norms + total_mlp, attention + norms + active_mlp, attention + active_mlp


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
        layer_total, layer_active, _ = _layer_counts(config, layer)
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
    LM head, which costs ``vocab * dim`` even when tied) — norms and the embedding lookup do no
    matmul. The second term counts the attention scores ``QK^T`` and the weighted sum ``AV``
    (2 matmuls x 2 FLOPs x 3 for forward+backward); ``dim`` here is ``n_heads * head_dim`` and,
    by that convention, the causal mask is not credited with halving the work.
    """
    matmul = config.vocab_size * config.dim
    for layer in range(config.n_layers):
        matmul += _layer_counts(config, layer)[2]
    attention_width = config.n_heads * config.head_dim
    return 6.0 * matmul + 12.0 * config.n_layers * attention_width * seq_len
