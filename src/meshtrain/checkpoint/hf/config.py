"""Map a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE) to and
from :class:`ModelConfig`.

Only what both sides compute identically is converted; anything else is refused with a
:class:`ConfigError` naming the field, rather than converted into a model that silently computes
something different. Supported:

* ``LlamaForCausalLM`` (``model_type = "llama"``) <-> a dense meshtrain model (``mlp = swiglu``);
  ``attention_bias`` sets ``qkv_bias`` and ``wo_bias``.
* ``Qwen2ForCausalLM`` (``"qwen2"``, Qwen2 and Qwen2.5) <-> a dense model with ``qkv_bias``
  (Qwen2 always has q/k/v biases and none on the output projection).
* ``Qwen3ForCausalLM`` (``"qwen3"``) <-> a dense model with ``qk_norm`` (``attention_bias``
  sets both bias options) and its ``head_dim`` (``model.head_width``).
* ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` <-> MoE models;
  their MoE fields (routing, shared expert, dense layers, balance) are mapped in
  :mod:`meshtrain.checkpoint.hf.moe_config`. Qwen3-MoE's attention is Qwen3's, Qwen2-MoE's is
  Qwen2's (``qkv_bias`` may be false there).

RoPE (``rope_parameters`` / ``rope_scaling``: plain, ``linear``, ``llama3``, ``yarn``) maps to
``model.rope_theta`` and ``model.rope_scaling`` in :mod:`meshtrain.checkpoint.hf.rope`.
Export picks the architecture from the options: a dense model with ``qk_norm`` is Qwen3, q/k/v
biases without an output bias are Qwen2, otherwise Llama; an MoE model with shared experts is
Qwen2-MoE, with ``qk_norm`` Qwen3-MoE, otherwise Mixtral.
"""

from __future__ import annotations

from typing import Any

from meshtrain.checkpoint.hf.moe_config import (
    MOE_ARCHITECTURES,
    QWEN_MOE,
    moe_fields_from_hf,
    moe_fields_to_hf,
    moe_model_type,
)
from meshtrain.checkpoint.hf.rope import hf_rope, rope_to_hf
from meshtrain.config import ConfigError, ModelConfig

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", **MOE_ARCHITECTURES}
DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 10000.0, "qwen3": 10000.0, "mixtral": 1000000.0,
                      "qwen2_moe": 10000.0, "qwen3_moe": 10000.0}
DEFAULT_NORM_EPS = {"llama": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6, "mixtral": 1e-5,
                    "qwen2_moe": 1e-6, "qwen3_moe": 1e-6}
_QWEN = ("qwen2", "qwen3", *QWEN_MOE)


def hf_model_type(hf: dict[str, Any], origin: str) -> str:
    """The supported ``model_type`` (a key of :data:`SUPPORTED`) from ``model_type`` /
    ``architectures``; else ConfigError."""
    model_type = hf.get("model_type")
    if model_type is None:
        by_arch = {arch: kind for kind, arch in SUPPORTED.items()}
        model_type = next((by_arch[a] for a in hf.get("architectures") or [] if a in by_arch),
                          None)
    if model_type not in SUPPORTED:
        raise ConfigError(
            f"{origin}: model_type {hf.get('model_type')!r} (architectures "
            f"{hf.get('architectures')}) is not supported; meshtrain converts only "
            f"{', '.join(SUPPORTED.values())} checkpoints."
        )
    return model_type


def _sliding_window(hf: dict[str, Any], model_type: str) -> str | None:
    """The field that turns sliding-window attention on, or None when every layer attends to
    the whole causal prefix."""
    if model_type in _QWEN:  # Qwen keeps a window size that only use_sliding_window enables
        if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
            return (f"use_sliding_window = true with sliding_window = {hf['sliding_window']}")
        kinds = sorted(set(hf.get("layer_types") or []) - {"full_attention"})
        return f"layer_types holds {', '.join(map(repr, kinds))}" if kinds else None
    if hf.get("sliding_window") is not None:
        return f"sliding_window = {hf['sliding_window']}"
    return None


def _refuse_unsupported(hf: dict[str, Any], model_type: str, origin: str) -> None:
    """ConfigError for every feature meshtrain lacks."""
    problems = []
    if model_type == "mixtral" and hf.get("attention_bias"):
        problems.append("attention_bias = true (meshtrain's Mixtral projections have no bias)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias = true (meshtrain's MLPs have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf['hidden_act']!r} (only silu, i.e. SwiGLU, maps)")
    head_dim = hf.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2):
        problems.append(f"head_dim = {head_dim!r} (rotary embeddings need an even width)")
    window = _sliding_window(hf, model_type)
    if window:
        problems.append(f"{window} (meshtrain attends to the whole causal prefix; turn "
                        "sliding-window attention off if that is what you want)")
    if hf.get("quantization_config"):
        problems.append("quantization_config (quantized weights)")
    if problems:
        raise ConfigError(f"{origin}: cannot convert this {SUPPORTED[model_type]}: "
                          f"{'; '.join(problems)}.")


def _head_width(hf: dict[str, Any], model_type: str) -> int:
    """``model.head_width`` for the checkpoint: 0 when its heads are dim / n_heads wide."""
    derived = hf["hidden_size"] // hf["num_attention_heads"]
    default = 128 if model_type == "qwen3" else derived  # Qwen3Config's own default
    head_dim = hf.get("head_dim") or default
    exact = hf["hidden_size"] % hf["num_attention_heads"] == 0
    return 0 if exact and head_dim == derived else head_dim


def _attention_options(hf: dict[str, Any], model_type: str) -> dict[str, bool]:
    bias = bool(hf.get("attention_bias", False))
    if model_type == "qwen2":
        return dict(qkv_bias=True, wo_bias=False, qk_norm=False)
    if model_type == "qwen2_moe":
        return dict(qkv_bias=bool(hf.get("qkv_bias", True)), wo_bias=False, qk_norm=False)
    return dict(qkv_bias=bias, wo_bias=bias, qk_norm=model_type in ("qwen3", "qwen3_moe"))


def hf_to_model_config(hf: dict[str, Any], origin: str = "config.json") -> ModelConfig:
    """The :class:`ModelConfig` equivalent to Hugging Face config dict ``hf``.

    Raises :class:`ConfigError` for other architectures, missing fields, and features meshtrain
    does not implement (RoPE types other than plain, linear, llama3 and yarn, MLP biases,
    sliding-window attention, activations other than SiLU, top-1 renormalised routing, dense
    layers other than the first MoE-step ones), naming the field.
    """
    from meshtrain.validation.model import validate_rope_scaling

    model_type = hf_model_type(hf, origin)
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size")
    missing = [key for key in required if not isinstance(hf.get(key), int)]
    if missing:
        raise ConfigError(f"{origin}: missing or non-integer {', '.join(missing)}.")
    _refuse_unsupported(hf, model_type, origin)
    layers = hf["num_hidden_layers"]
    theta, scaling = hf_rope(hf, DEFAULT_ROPE_THETA[model_type], origin)
    try:
        validate_rope_scaling(scaling)
    except ConfigError as error:
        raise ConfigError(f"{origin}: the RoPE scaling of this checkpoint is not usable: "
                          f"{error}") from None
    config = ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=layers,
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_width=_head_width(hf, model_type),
        ffn_dim=hf["intermediate_size"],
        mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", DEFAULT_NORM_EPS[model_type])),
        **_attention_options(hf, model_type),
    )
    if model_type in MOE_ARCHITECTURES:
        for key, value in moe_fields_from_hf(hf, model_type, origin).items():
            setattr(config, key, value)
    return config


def _dense_model_type(config: ModelConfig) -> tuple[str | None, str]:
    """``(model_type, why not)`` of a dense model: Qwen3 with QK-norm, Qwen2 with q/k/v biases
    only, Llama otherwise."""
    if config.qk_norm:
        if config.qkv_bias != config.wo_bias:
            return None, ("qk_norm with qkv_bias != wo_bias (Qwen3's attention_bias sets all "
                          "four projections' biases)")
        return "qwen3", ""
    if config.qkv_bias and not config.wo_bias:
        return "qwen2", ""
    if config.wo_bias and not config.qkv_bias:
        return None, ("wo_bias without qkv_bias (Llama's attention_bias sets all four "
                      "projections' biases)")
    return "llama", ""


def check_exportable(config: ModelConfig, origin: str = "model") -> str:
    """The Hugging Face ``model_type`` that represents ``config``, or ConfigError saying why none.

    Dense SwiGLU models become Qwen3 (``qk_norm``), Qwen2 (``qkv_bias`` without ``wo_bias``) or
    Llama; MoE models with softmax routing become Qwen2-MoE (gated shared experts), Qwen3-MoE
    (``qk_norm``) or Mixtral (every block MoE, top_k >= 2, renormalised gates, no attention
    biases); see :func:`~meshtrain.checkpoint.hf.moe_config.moe_model_type`. A capacity factor
    is dropped (all three are dropless: identical whenever no token was dropped).
    """
    problems = []
    if config.mlp != "swiglu":
        problems.append(f"mlp = {config.mlp!r} (Llama, Qwen and Mixtral use SwiGLU)")
    if config.vocab_size <= 0:
        problems.append("vocab_size is 0 (resolve it to the tokenizer's size first)")
    if config.moe_experts == 0:
        model_type, why = _dense_model_type(config)
        if why:
            problems.append(why)
        if problems:
            raise ConfigError(f"{origin}: cannot export as LlamaForCausalLM, Qwen2ForCausalLM "
                              f"or Qwen3ForCausalLM: {'; '.join(problems)}.")
        return model_type
    model_type, moe_problems = moe_model_type(config)
    problems += moe_problems
    if problems:
        raise ConfigError(f"{origin}: cannot export as {SUPPORTED[model_type]}: "
                          f"{'; '.join(problems)}. (An MoE model exports as Qwen2-MoE with "
                          "gated shared experts, as Qwen3-MoE with qk_norm, else as Mixtral.)")
    return model_type


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
    for stale in ("rope_scaling", "quantization_config", "_name_or_path", "transformers_version",
                  "partial_rotary_factor"):
        hf.pop(stale, None)
    hf.update(
        architectures=[SUPPORTED[model_type]],
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        **rope_to_hf(config),
        dtype=dtype,
        torch_dtype=dtype,
    )
    if model_type in ("llama", "qwen3"):
        hf.update(attention_bias=config.qkv_bias)
    if model_type == "llama":
        hf.update(mlp_bias=False)
    elif model_type in _QWEN:  # full attention in every layer; a base's inert window stays
        hf.update(use_sliding_window=False)
        if model_type != "qwen3_moe":  # Qwen3-MoE has no per-layer attention kinds
            hf.update(layer_types=["full_attention"] * config.n_layers)
        hf.setdefault("sliding_window", None)
        if model_type != "qwen3_moe":
            hf.setdefault("max_window_layers", config.n_layers)
    if model_type in MOE_ARCHITECTURES:
        moe = moe_fields_to_hf(config, model_type, hf)
        if "num_experts" in moe and "num_local_experts" in hf:  # the base's spelling wins
            moe["num_local_experts"] = moe.pop("num_experts")
        hf.update(moe)
        hf.setdefault("output_router_logits", False)
    if model_type == "mixtral":
        hf.setdefault("router_jitter_noise", 0.0)
    return hf
