"""The Mixture-of-Experts part of the Hugging Face config mapping: Mixtral, Qwen2-MoE, Qwen3-MoE.

:mod:`meshtrain.checkpoint.hf.config` maps what every family shares (attention, RoPE, norms);
this module maps the MoE fields and refuses what meshtrain cannot compute identically.

* ``MixtralForCausalLM``: an MoE block in every layer, no shared experts, top-k >= 2,
  renormalised gates.
* ``Qwen3MoeForCausalLM`` (``qwen3_moe``): QK-norm attention; ``decoder_sparse_step`` is
  ``model.moe_every``; the dense blocks of ``mlp_only_layers`` become ``model.moe_first_dense``
  (they must be the first MoE-step layers: meshtrain cannot make a later block dense alone);
  dense blocks use ``intermediate_size`` (``model.ffn_dim``), experts ``moe_intermediate_size``
  (``model.moe_ffn_dim``); ``norm_topk_prob`` is ``model.moe_norm_topk``.
* ``Qwen2MoeForCausalLM`` (``qwen2_moe``): as Qwen3-MoE without QK-norm, with ``qkv_bias``,
  and one shared expert of ``shared_expert_intermediate_size`` (``model.moe_shared_ffn_dim``)
  whose output is scaled by ``sigmoid(shared_expert_gate(x))`` (``model.moe_shared_gate``).

Routing: all three take the softmax over every expert, then the top-k; Mixtral always
renormalises the chosen probabilities, Qwen only with ``norm_topk_prob``, which is meshtrain's
``moe_norm_topk``. With top-1 and renormalisation Hugging Face's gate is 1 while meshtrain keeps
the raw probability (Switch Transformer), hence the refusal of that one combination.

Balance: Hugging Face computes one Switch-style loss over the assignments of all MoE layers
pooled, worth ``router_aux_loss_coef * top_k`` at perfect balance; meshtrain sums one loss per
MoE layer worth ``moe_aux_coef`` each at balance, so ``moe_aux_coef = coef * top_k / (MoE
layers)`` makes the two equal at balance (their gradients differ slightly away from it). Export
inverts it. ``moe_capacity_factor`` becomes 0 (all three are dropless).
"""

from __future__ import annotations

from typing import Any

from meshtrain.config import ConfigError, ModelConfig

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM"}
QWEN_MOE = ("qwen2_moe", "qwen3_moe")


def _round(value: float) -> float:
    """Drop the last bits of float noise so that import then export gives back the same number."""
    return float(f"{value:.12g}")


def hf_num_experts(hf: dict[str, Any], model_type: str) -> int:
    """Routed experts per MoE layer: ``num_local_experts`` (Mixtral, and Qwen3-MoE as
    transformers 5 saves it) or ``num_experts`` (published Qwen checkpoints)."""
    if model_type == "mixtral":
        return hf.get("num_local_experts", 8)
    default = 60 if model_type == "qwen2_moe" else 128
    return hf.get("num_experts", hf.get("num_local_experts", default))


def _first_dense(hf: dict[str, Any], step: int, layers: int, origin: str) -> int:
    """``model.moe_first_dense`` equivalent to Qwen's ``mlp_only_layers``, or ConfigError."""
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             for i in only):
        raise ConfigError(f"{origin}: mlp_only_layers = {only!r} is not a list of layer indices.")
    outside = sorted(i for i in only if not 0 <= i < layers)
    if outside:
        raise ConfigError(f"{origin}: mlp_only_layers names layer(s) {outside}, outside the "
                          f"{layers} layers (valid indices 0 to {layers - 1}).")
    sparse = [i for i in range(layers) if (i + 1) % step == 0]
    dense = sorted(i for i in set(only) if i in sparse)
    if dense != sparse[:len(dense)]:
        longest = len(sparse) - 1  # at least one MoE layer must remain
        prefixes = ", ".join(str(sparse[:n]) for n in range(min(longest, 3) + 1))
        more = ", ..." if longest > 3 else ""
        before = sparse[:sparse.index(dense[-1]) + 1]
        raise ConfigError(
            f"{origin}: mlp_only_layers = {sorted(only)} makes MoE-step layer(s) {dense} dense "
            f"but not all the MoE-step layers up to them ({before} with decoder_sparse_step = "
            f"{step}); meshtrain makes only the first k MoE-step layers dense "
            f"(model.moe_first_dense), so mlp_only_layers must list a prefix of them: valid "
            f"here {prefixes}{more} (layers decoder_sparse_step skips may be listed too).")
    return dense[-1] + 1 if dense else 0


def moe_fields_from_hf(hf: dict[str, Any], model_type: str, origin: str) -> dict[str, Any]:
    """The ``ModelConfig`` MoE fields of an MoE checkpoint's config, or ConfigError for what
    meshtrain cannot express (top-1 renormalised gates, mlp_only_layers that are not the first
    MoE layers, no MoE layer at all)."""
    layers = hf["num_hidden_layers"]
    experts = hf_num_experts(hf, model_type)
    default_k = 2 if model_type == "mixtral" else (4 if model_type == "qwen2_moe" else 8)
    top_k = hf.get("num_experts_per_tok", default_k)
    norm_topk = True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False))
    name = MOE_ARCHITECTURES[model_type]
    if not isinstance(experts, int) or experts < 1:
        raise ConfigError(f"{origin}: {name} with {experts!r} experts is a dense model; convert "
                          "it as its dense family (Qwen2/Qwen3) instead.")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"{origin}: num_experts_per_tok = {top_k!r} must be between 1 and the "
                          f"{experts} experts.")
    if top_k == 1 and norm_topk:
        field = "num_experts_per_tok = 1" + ("" if model_type == "mixtral"
                                             else " with norm_topk_prob = true")
        raise ConfigError(f"{origin}: cannot convert this {name}: {field} (its gate is then 1, "
                          "meshtrain's top-1 softmax gate is the raw probability).")
    fields: dict[str, Any] = dict(
        moe_experts=experts, moe_top_k=top_k, moe_norm_topk=norm_topk, moe_shared_experts=0,
        moe_capacity_factor=0.0, moe_score="softmax", moe_balance="aux-loss", moe_every=1,
        moe_first_dense=0, moe_ffn_dim=hf["intermediate_size"])
    if model_type in QWEN_MOE:
        step = hf.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ConfigError(f"{origin}: decoder_sparse_step = {step!r} must be a positive "
                              "integer.")
        first_dense = _first_dense(hf, step, layers, origin)
        moe_ffn = hf.get("moe_intermediate_size", 1408 if model_type == "qwen2_moe" else 768)
        fields.update(moe_every=step, moe_first_dense=first_dense, moe_ffn_dim=moe_ffn)
        if not any((i + 1) % step == 0 for i in range(first_dense, layers)):
            raise ConfigError(f"{origin}: decoder_sparse_step = {step} and mlp_only_layers leave "
                              f"no MoE layer among the {layers}; convert it as a dense model.")
    if model_type == "qwen2_moe":
        shared = hf.get("shared_expert_intermediate_size", 5632)
        if not isinstance(shared, int) or shared < 1:
            raise ConfigError(f"{origin}: shared_expert_intermediate_size = {shared!r}; "
                              "meshtrain needs a positive shared-expert width.")
        fields.update(moe_shared_experts=1, moe_shared_ffn_dim=shared, moe_shared_gate=True)
    probe = ModelConfig(n_layers=layers, **fields)
    moe_layers = sum(probe.is_moe_layer(i) for i in range(layers))
    fields["moe_aux_coef"] = _round(hf.get("router_aux_loss_coef", 0.001) * top_k / moe_layers)
    return fields


def _routing_problems(config: ModelConfig, name: str) -> list[str]:
    problems = []
    if config.moe_max_groups:
        problems.append(f"moe_max_groups > 0 ({name} routes over every expert)")
    if config.moe_score != "softmax":
        problems.append(f"moe_score = {config.moe_score!r} ({name} routes by softmax)")
    return problems


def moe_model_type(config: ModelConfig) -> tuple[str, list[str]]:
    """``(model_type, problems)`` for an MoE ``config``: Qwen2-MoE when it has shared experts,
    Qwen3-MoE with QK-norm, Mixtral otherwise; ``problems`` lists what that family cannot hold
    (empty when exportable)."""
    if config.moe_shared_experts:
        problems = _routing_problems(config, "Qwen2-MoE")
        if config.moe_shared_experts and not config.moe_shared_gate:
            problems.append("shared experts without moe_shared_gate (Qwen2-MoE's shared expert "
                            "is always gated by sigmoid(shared_expert_gate(x)))")
        if config.qk_norm or config.wo_bias:
            problems.append("qk_norm or wo_bias (Qwen2-MoE has q/k/v biases only)")
        return "qwen2_moe", problems
    if config.qk_norm:
        problems = _routing_problems(config, "Qwen3-MoE")
        if config.qkv_bias != config.wo_bias:
            problems.append("qkv_bias != wo_bias (Qwen3-MoE's attention_bias sets all four "
                            "projections' biases)")
        return "qwen3_moe", problems
    problems = _routing_problems(config, "Mixtral")
    if config.moe_every != 1:
        problems.append(f"moe_every = {config.moe_every} (Mixtral has an MoE block in every "
                        "layer; Qwen-MoE's decoder_sparse_step needs qk_norm or shared experts)")
    if config.moe_first_dense:
        problems.append(f"moe_first_dense = {config.moe_first_dense} (Mixtral has no dense "
                        "blocks)")
    if config.moe_top_k < 2:
        problems.append("moe_top_k = 1 (Mixtral renormalises the top-1 gate to 1)")
    if not config.moe_norm_topk:
        problems.append("moe_norm_topk = false (Mixtral renormalises its gates)")
    if config.qkv_bias or config.wo_bias:
        problems.append("attention biases (Mixtral has none)")
    return "mixtral", problems


def moe_fields_to_hf(config: ModelConfig, model_type: str, base: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face MoE fields of ``config`` exported as ``model_type``; ``base`` is the
    config being written (a base's equivalent ``mlp_only_layers`` is kept)."""
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    coef = _round(config.moe_aux_coef * moe_layers / config.moe_top_k)
    if model_type == "mixtral":
        return dict(intermediate_size=config.expert_ffn_dim, num_local_experts=config.moe_experts,
                    num_experts_per_tok=config.moe_top_k, router_aux_loss_coef=coef,
                    sliding_window=None)
    only = list(range(config.moe_first_dense))
    kept = base.get("mlp_only_layers")
    if isinstance(kept, list) and kept != only:
        try:
            same = _first_dense(base | {"mlp_only_layers": kept}, config.moe_every,
                                config.n_layers, "") == config.moe_first_dense
        except ConfigError:
            same = False
        only = kept if same else only
    fields = dict(
        intermediate_size=config.ffn_dim, moe_intermediate_size=config.expert_ffn_dim,
        num_experts=config.moe_experts, num_experts_per_tok=config.moe_top_k,
        norm_topk_prob=config.moe_norm_topk and config.moe_top_k > 1,
        decoder_sparse_step=config.moe_every, mlp_only_layers=only, router_aux_loss_coef=coef,
    )
    if model_type == "qwen2_moe":
        fields.update(shared_expert_intermediate_size=config.shared_ffn_dim,
                      qkv_bias=config.qkv_bias)
    else:
        fields.update(attention_bias=config.qkv_bias)
    return fields
