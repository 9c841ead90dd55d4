"""Checks of the ``[model]`` section (shapes, rotary scaling, MoE routing), before any worker
starts; :func:`meshtrain.validation.run_config.validate_config` runs them with the rest. Each
refusal is a :class:`~meshtrain.config.ConfigError` naming the key, the value given and what would
be valid.
"""

from __future__ import annotations

import math

from meshtrain.config import Config, ConfigError
from meshtrain.config.layout_rules import at_least, choice, divisors
from meshtrain.config.model import (
    MLP_KINDS,
    MOE_BALANCE_KINDS,
    MOE_BALANCE_SCOPES,
    MOE_SCORE_KINDS,
    ROPE_SCALING_KEYS,
    ROPE_TYPES,
)

MAX_LAYERS = 100_000  # sanity bound: a larger value is a typo, and splitting it would take minutes


def validate_model(config: Config, tokenizer_vocab: int | None) -> None:
    """Shapes that the model can be built with."""
    m = config.model
    for key in ("dim", "n_layers", "n_heads", "ffn_dim"):
        at_least(getattr(m, key), 1, f"model.{key}")
    if m.n_layers > MAX_LAYERS:
        raise ConfigError(f"model.n_layers = {m.n_layers} is beyond any model meshtrain can "
                          f"build (at most {MAX_LAYERS}).")
    at_least(m.head_width, 0, "model.head_width")
    if m.dim % m.n_heads and not m.head_width:
        valid = [d for d in divisors(m.dim) if (m.dim // d) % 2 == 0]
        hint = (f"valid n_heads for dim {m.dim}: {', '.join(map(str, valid))}" if valid
                else "choose an even dim, a multiple of n_heads")
        raise ConfigError(
            f"model.n_heads = {m.n_heads} does not divide model.dim = {m.dim}; {hint}."
        )
    if m.head_dim % 2:
        what = "model.head_width" if m.head_width else "model.dim / model.n_heads"
        raise ConfigError(
            f"{what} = {m.head_dim} is odd; rotary embeddings need an even "
            f"head width. Choose n_heads so that dim / n_heads is even (or an even head_width)."
        )
    at_least(m.n_kv_heads, 0, "model.n_kv_heads")
    if m.n_heads % m.kv_heads:
        raise ConfigError(
            f"model.n_kv_heads = {m.n_kv_heads} does not divide model.n_heads = {m.n_heads}; "
            f"valid values: {', '.join(map(str, divisors(m.n_heads)))} (or 0 = n_heads)."
        )
    choice(m.mlp, MLP_KINDS, "model.mlp")
    validate_rope_scaling(m.rope_scaling)
    if m.rope_theta <= 0 or m.norm_eps <= 0:
        raise ConfigError("model.rope_theta and model.norm_eps must be positive.")
    at_least(m.vocab_size, 0, "model.vocab_size")
    if tokenizer_vocab is not None and 0 < m.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab}); use 0 (= {tokenizer_vocab}) or any larger value (padding)."
        )
    at_least(m.moe_experts, 0, "model.moe_experts")
    if m.moe_experts:
        if not 1 <= m.moe_top_k <= m.moe_experts:
            raise ConfigError(
                f"model.moe_top_k = {m.moe_top_k} must be between 1 and model.moe_experts = "
                f"{m.moe_experts}."
            )
        at_least(m.moe_shared_experts, 0, "model.moe_shared_experts")
        at_least(m.moe_capacity_factor, 0.0, "model.moe_capacity_factor")
        at_least(m.moe_aux_coef, 0.0, "model.moe_aux_coef")
        at_least(m.moe_bias_rate, 0.0, "model.moe_bias_rate")
        at_least(m.moe_every, 1, "model.moe_every")
        at_least(m.moe_ffn_dim, 0, "model.moe_ffn_dim")
        _check_shared_experts(m)
        choice(m.moe_balance, MOE_BALANCE_KINDS, "model.moe_balance")
        _check_balance_scope(m)
        choice(m.moe_score, MOE_SCORE_KINDS, "model.moe_score")
        _check_capacity_group(m.moe_capacity_group, config.train.seq_len)
        _check_moe_layers_and_groups(m)


def _check_shared_experts(m) -> None:
    """The shared experts' own hidden size and sigmoid gate need shared experts."""
    at_least(m.moe_shared_ffn_dim, 0, "model.moe_shared_ffn_dim")
    if m.moe_shared_experts == 0 and (m.moe_shared_gate or m.moe_shared_ffn_dim):
        option = "moe_shared_gate = true" if m.moe_shared_gate else (
            f"moe_shared_ffn_dim = {m.moe_shared_ffn_dim}")
        raise ConfigError(f"model.{option} needs shared experts: set model.moe_shared_experts "
                          "to 1 or more, or leave it at its default (false / 0).")


def _check_moe_layers_and_groups(m) -> None:
    """Dense first blocks leave at least one MoE block; expert groups split the experts evenly
    and the chosen groups hold at least top_k experts."""
    at_least(m.moe_first_dense, 0, "model.moe_first_dense")
    if m.first_moe_layer < 0:
        raise ConfigError(
            f"model.moe_first_dense = {m.moe_first_dense} with model.moe_every = {m.moe_every} "
            f"leaves no MoE block among the {m.n_layers} layers; use moe_first_dense < "
            f"{m.n_layers} with a later block a multiple of moe_every, or model.moe_experts = 0 "
            f"for a dense model.")
    at_least(m.moe_groups, 0, "model.moe_groups")
    at_least(m.moe_max_groups, 0, "model.moe_max_groups")
    if m.moe_groups and m.moe_experts % m.moe_groups:
        valid = ", ".join(map(str, divisors(m.moe_experts)))
        raise ConfigError(f"model.moe_groups = {m.moe_groups} does not divide model.moe_experts "
                          f"= {m.moe_experts}; valid: 0 (no groups) or {valid}.")
    if m.moe_max_groups and not m.moe_groups:
        raise ConfigError(f"model.moe_max_groups = {m.moe_max_groups} needs expert groups: set "
                          f"model.moe_groups to a divisor of moe_experts = {m.moe_experts} "
                          f"(e.g. parallel.ep), or moe_max_groups = 0.")
    if m.moe_max_groups > m.moe_groups:
        raise ConfigError(f"model.moe_max_groups = {m.moe_max_groups} is more than "
                          f"model.moe_groups = {m.moe_groups}; valid: 0 (every group) to "
                          f"{m.moe_groups}.")
    if m.moe_max_groups and m.moe_max_groups * (m.moe_experts // m.moe_groups) < m.moe_top_k:
        least = -(-m.moe_top_k // (m.moe_experts // m.moe_groups))
        raise ConfigError(
            f"model.moe_max_groups = {m.moe_max_groups} groups of "
            f"{m.moe_experts // m.moe_groups} experts hold fewer than model.moe_top_k = "
            f"{m.moe_top_k} experts; use moe_max_groups >= {least}.")


def _check_balance_scope(m) -> None:
    """A known scope; the sequence-wise one is an auxiliary loss's (the bias update has none)."""
    choice(m.moe_balance_scope, MOE_BALANCE_SCOPES, "model.moe_balance_scope")
    if m.moe_balance_scope == "sequence" and m.moe_balance != "aux-loss":
        raise ConfigError(
            f'model.moe_balance_scope = "sequence" is a scope of the auxiliary loss, but '
            f'model.moe_balance = "{m.moe_balance}" has none (the bias update always uses the '
            f'global batch\'s load); use moe_balance = "aux-loss", or moe_balance_scope = '
            f'"micro-batch" or "global-batch".')


def _check_capacity_group(group: int, seq_len: int) -> None:
    """A routing group is consecutive positions of one sequence: it must divide seq_len."""
    at_least(group, 0, "model.moe_capacity_group")
    if group and seq_len % group:
        valid = ", ".join(map(str, divisors(seq_len)))
        raise ConfigError(
            f"model.moe_capacity_group = {group} does not divide train.seq_len = {seq_len}: a "
            f"routing group is that many consecutive positions of one sequence (a group spanning "
            f"sequences would depend on which sequences share a micro-batch). Valid: 0 (the whole "
            f"sequence) or a divisor of seq_len: {valid}.")


def _rope_number(scaling: dict, name: str, minimum: float, strict: bool) -> None:
    key = f"model.rope_scaling.{name}"
    value = scaling[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} is not a finite number.")
    if value < minimum or (strict and value == minimum):
        raise ConfigError(f"{key} = {value} must be {'>' if strict else '>='} {minimum:g}.")


def validate_rope_scaling(scaling: dict) -> None:
    """``model.rope_scaling``: a known ``rope_type`` with exactly its parameters, in range."""
    scaling = dict(scaling or {})
    if "type" in scaling and "rope_type" in scaling and scaling["type"] != scaling["rope_type"]:
        raise ConfigError(f"model.rope_scaling has both rope_type = {scaling['rope_type']!r} and "
                          f"type = {scaling['type']!r}; keep one (type is an alias).")
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("type", None)
    if kind not in ROPE_TYPES:
        raise ConfigError(f"model.rope_scaling.rope_type = {kind!r} is not supported; choose one "
                          f"of: {', '.join(ROPE_TYPES)}.")
    keys = ROPE_SCALING_KEYS[kind]
    unknown = sorted(set(scaling) - set(keys))
    if unknown:
        raise ConfigError(f"model.rope_scaling.{unknown[0]} is not a parameter of rope_type "
                          f"{kind!r}; its parameters: {', '.join(keys) or 'none'}.")
    missing = [name for name, required in keys.items() if required and name not in scaling]
    if missing:
        raise ConfigError(f"model.rope_scaling (rope_type {kind!r}) lacks "
                          f"{', '.join(missing)}; needed: "
                          f"{', '.join(k for k, r in keys.items() if r)}.")
    if "factor" in scaling:
        _rope_number(scaling, "factor", 1.0 if kind == "llama3" else 0.0, kind != "llama3")
    for name, strict in (("low_freq_factor", True), ("high_freq_factor", True),
                         ("original_max_position_embeddings", True), ("attention_factor", True),
                         ("beta_fast", False), ("beta_slow", False), ("mscale", False),
                         ("mscale_all_dim", False)):  # 0 there means the default, as in HF
        if scaling.get(name) is not None:
            _rope_number(scaling, name, 0.0, strict)
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError("model.rope_scaling.high_freq_factor must be greater than "
                          "low_freq_factor (Llama 3.1 uses 4 and 1).")
    if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
        raise ConfigError(f"model.rope_scaling.truncate = {scaling['truncate']!r} is not a "
                          "boolean; use true or false.")


def validate_shapes(config: Config) -> None:
    """The checks a run's shapes must pass wherever it runs (model, batch, precision), with the
    tokenizer's vocabulary size filled in when ``model.vocab_size`` is 0: what ``estimate``,
    ``plan`` and ``parallel.auto`` need before pricing a model."""
    from meshtrain.config import PRECISIONS

    if config.model.vocab_size == 0:
        from meshtrain.data.tokenizer import tokenizer_vocab_size

        config.model.vocab_size = tokenizer_vocab_size(config.data.tokenizer)
    validate_model(config, None)
    for key in ("seq_len", "global_batch"):
        if getattr(config.train, key) < 1:
            raise ConfigError(f"train.{key} must be at least 1.")
    if config.train.precision not in PRECISIONS:
        raise ConfigError(f'train.precision = "{config.train.precision}"; use '
                          f'{" or ".join(sorted(PRECISIONS))}.')
