"""Map a Hugging Face ``config.json`` (Llama, Mixtral) to and from :class:`ModelConfig`.

Only what both sides compute identically is converted; anything else is refused with a
:class:`ConfigError` naming the field, rather than converted into a model that silently computes
something different. Supported:

* ``LlamaForCausalLM`` (``model_type = "llama"``) <-> a dense meshtrain model (``mlp = swiglu``).
* ``MixtralForCausalLM`` (``model_type = "mixtral"``) <-> an MoE model with an MoE block in every
  layer (``moe_every = 1``), softmax scores, no shared experts and ``moe_top_k >= 2``.

Routing: Mixtral takes the softmax over all experts, picks the top-k probabilities and renormalises
them to sum to 1; meshtrain's ``softmax`` router does the same for ``top_k > 1`` (with a zero
``expert_bias``), so the logits match. With ``top_k = 1`` meshtrain keeps the raw probability
(Switch Transformer) while Mixtral's gate is 1, hence the refusal.

Balance: an imported Mixtral gets ``moe_balance = "aux-loss"`` with
``moe_aux_coef = router_aux_loss_coef * top_k / n_layers``. Hugging Face computes one
Switch-style loss over the assignments of all layers pooled, whose value at perfect balance is
``coef * top_k``; meshtrain sums a per-layer loss worth ``moe_aux_coef`` each at balance, so this
choice makes the two equal at balance (their gradients differ slightly away from it). Export
inverts it. ``moe_capacity_factor`` becomes 0 (Mixtral is dropless).
"""

from __future__ import annotations

from typing import Any

from meshtrain.config import ConfigError, ModelConfig

SUPPORTED = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
DEFAULT_ROPE_THETA = {"llama": 10000.0, "mixtral": 1000000.0}
DEFAULT_NORM_EPS = {"llama": 1e-6, "mixtral": 1e-5}


def hf_model_type(hf: dict[str, Any], origin: str) -> str:
    """``"llama"`` or ``"mixtral"`` from ``model_type`` / ``architectures``; else ConfigError."""
    model_type = hf.get("model_type")
    if model_type is None:
        by_arch = {arch: kind for kind, arch in SUPPORTED.items()}
        model_type = next((by_arch[a] for a in hf.get("architectures") or [] if a in by_arch),
                          None)
    if model_type not in SUPPORTED:
        raise ConfigError(
            f"{origin}: model_type {hf.get('model_type')!r} (architectures "
            f"{hf.get('architectures')}) is not supported; meshtrain converts only "
            f"{' and '.join(SUPPORTED.values())} checkpoints."
        )
    return model_type


def _rope_theta(hf: dict[str, Any], model_type: str, origin: str) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta``; refuse scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for name, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind not in ("default", None):
            raise ConfigError(
                f"{origin}: {name} uses rope_type {kind!r}; meshtrain implements only plain "
                "RoPE (rope_type 'default'), so this model cannot be converted faithfully."
            )
    theta = params.get("rope_theta", hf.get("rope_theta"))
    return float(theta if theta is not None else DEFAULT_ROPE_THETA[model_type])


def _refuse_unsupported(hf: dict[str, Any], model_type: str, origin: str) -> None:
    """ConfigError for every feature meshtrain lacks."""
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias = true (meshtrain's projections have no bias)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias = true (meshtrain's MLPs have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf['hidden_act']!r} (only silu, i.e. SwiGLU, maps)")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads != hf["hidden_size"]:
        problems.append(f"head_dim = {head_dim} != hidden_size / num_attention_heads = "
                        f"{hf['hidden_size'] / heads:g} (meshtrain derives head_dim from dim)")
    if hf.get("sliding_window") is not None:
        problems.append(f"sliding_window = {hf['sliding_window']} (meshtrain attends to the "
                        "whole causal prefix; set it to null if that is what you want)")
    if hf.get("quantization_config"):
        problems.append("quantization_config (quantized weights)")
    if model_type == "mixtral" and hf.get("num_experts_per_tok", 2) < 2:
        problems.append("num_experts_per_tok = 1 (Mixtral's gate is then 1, meshtrain's top-1 "
                        "softmax gate is the raw probability)")
    if problems:
        raise ConfigError(f"{origin}: cannot convert this {SUPPORTED[model_type]}: "
                          f"{'; '.join(problems)}.")


def hf_to_model_config(hf: dict[str, Any], origin: str = "config.json") -> ModelConfig:
    """The :class:`ModelConfig` equivalent to Hugging Face config dict ``hf``.

    Raises :class:`ConfigError` for other architectures, missing fields, and features meshtrain
    does not implement (RoPE scaling, biases, a head_dim that is not dim / heads, sliding-window
    attention, activations other than SiLU, top-1 Mixtral routing).
    """
    model_type = hf_model_type(hf, origin)
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size")
    missing = [key for key in required if not isinstance(hf.get(key), int)]
    if missing:
        raise ConfigError(f"{origin}: missing or non-integer {', '.join(missing)}.")
    _refuse_unsupported(hf, model_type, origin)
    layers = hf["num_hidden_layers"]
    config = ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=layers,
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_dim=hf["intermediate_size"],
        mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=_rope_theta(hf, model_type, origin),
        norm_eps=float(hf.get("rms_norm_eps", DEFAULT_NORM_EPS[model_type])),
    )
    if model_type == "mixtral":
        top_k = hf.get("num_experts_per_tok", 2)
        config.moe_experts = hf.get("num_local_experts", 8)
        config.moe_top_k = top_k
        config.moe_shared_experts = 0
        config.moe_capacity_factor = 0.0
        config.moe_score = "softmax"
        config.moe_balance = "aux-loss"
        config.moe_aux_coef = _round(hf.get("router_aux_loss_coef", 0.001) * top_k / layers)
        config.moe_every = 1
        config.moe_ffn_dim = hf["intermediate_size"]
    return config


def _round(value: float) -> float:
    """Drop the last bits of float noise so that import then export gives back the same number."""
    return float(f"{value:.12g}")


def check_exportable(config: ModelConfig, origin: str = "model") -> str:
    """The Hugging Face ``model_type`` that represents ``config``, or ConfigError saying why none.

    Dense SwiGLU models become Llama; MoE models become Mixtral when every block is MoE, the score
    is softmax, top_k >= 2 and there are no shared experts. A capacity factor is dropped (Mixtral
    is dropless: identical whenever no token was dropped).
    """
    problems = []
    if config.mlp != "swiglu":
        problems.append(f"mlp = {config.mlp!r} (Llama and Mixtral use SwiGLU)")
    if config.vocab_size <= 0:
        problems.append("vocab_size is 0 (resolve it to the tokenizer's size first)")
    if config.moe_experts == 0:
        if problems:
            raise ConfigError(f"{origin}: cannot export as LlamaForCausalLM: "
                              f"{'; '.join(problems)}.")
        return "llama"
    if config.moe_every != 1:
        problems.append(f"moe_every = {config.moe_every} (Mixtral has an MoE block in every "
                        "layer)")
    if config.moe_shared_experts:
        problems.append("moe_shared_experts > 0 (Mixtral has no shared experts)")
    if config.moe_score != "softmax":
        problems.append(f"moe_score = {config.moe_score!r} (Mixtral routes by softmax)")
    if config.moe_top_k < 2:
        problems.append("moe_top_k = 1 (Mixtral renormalises the top-1 gate to 1)")
    if problems:
        raise ConfigError(f"{origin}: cannot export as MixtralForCausalLM: "
                          f"{'; '.join(problems)}.")
    return "mixtral"


def model_config_to_hf(
    config: ModelConfig,
    dtype: str = "float32",
    base: dict[str, Any] | None = None,
    max_positions: int = 4096,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict for ``config`` (see :func:`check_exportable`).

    ``base``: a Hugging Face config to start from (e.g. the one an imported model came with), so
    fields meshtrain does not track (token ids, max_position_embeddings, ...) survive a round trip;
    only used when its model_type matches. ``dtype`` is the torch dtype name of the weights.
    """
    model_type = check_exportable(config)
    hf: dict[str, Any] = {}
    if base and base.get("model_type") == model_type:
        hf.update(base)
    else:
        hf.update(max_position_embeddings=max_positions, initializer_range=0.02,
                  bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None,
                  use_cache=True, attention_dropout=0.0)
    for stale in ("rope_scaling", "quantization_config", "_name_or_path", "transformers_version"):
        hf.pop(stale, None)
    hf.update(
        architectures=[SUPPORTED[model_type]],
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.expert_ffn_dim if model_type == "mixtral" else config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_theta=config.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        dtype=dtype,
        torch_dtype=dtype,
    )
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    else:
        hf.update(
            num_local_experts=config.moe_experts,
            num_experts_per_tok=config.moe_top_k,
            router_aux_loss_coef=_round(config.moe_aux_coef * config.n_layers / config.moe_top_k),
            sliding_window=None,
        )
        hf.setdefault("router_jitter_noise", 0.0)
        hf.setdefault("output_router_logits", False)
    return hf
