"""What went wrong with an MoE checkpoint's tensors, said in terms of its config.

An import that found a tensor missing, a tensor left over or a shape that does not match would
otherwise only name the tensor. For experts the cause is nearly always a config that disagrees
with the weights about how many experts a layer has or which layers are MoE, and the fix is in
``config.json``; these helpers append that explanation (an empty string when there is none).
"""

from __future__ import annotations

import re

from meshtrain.config import ModelConfig

_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
_MOE_PART = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                       r"(experts|gate\.|shared_expert)")
_DENSE_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.")


def _moe_layers(config: ModelConfig) -> list[int]:
    return [i for i in range(config.n_layers) if config.is_moe_layer(i)]


def _layer_rule(config: ModelConfig) -> str:
    return (f"MoE layers {_moe_layers(config)} of {config.n_layers} (every "
            f"{config.moe_every}-th layer after the first {config.moe_first_dense} dense ones: "
            "decoder_sparse_step and mlp_only_layers)")


def explain_missing(key: str, config: ModelConfig) -> str:
    """Why tensor ``key``, which the config implies, may be absent from the checkpoint."""
    expert = _EXPERT.match(key)
    if expert:
        layer, index = int(expert.group(1)), int(expert.group(2))
        return (f": config.json declares {config.moe_experts} experts per MoE layer (ids 0 to "
                f"{config.moe_experts - 1}), so layer {layer} needs expert {index}; fix "
                "num_experts (num_local_experts) to the number of experts the weights hold")
    if _MOE_PART.match(key):
        return (f": config.json makes layer {key.split('.')[2]} an MoE layer ("
                f"{_layer_rule(config)}); if the checkpoint holds a dense MLP there, list the "
                "layer in mlp_only_layers")
    dense = _DENSE_MLP.match(key)
    if dense and config.moe_experts:
        return (f": config.json makes layer {dense.group(1)} dense ({_layer_rule(config)}); if "
                "the checkpoint holds experts there, it is an MoE layer in the weights")
    return ""


def explain_extra(keys: list[str], config: ModelConfig) -> str:
    """Why tensors ``keys`` of the checkpoint have no place in the model the config describes."""
    for key in keys:
        expert = _EXPERT.match(key)
        if expert and config.moe_experts and int(expert.group(2)) >= config.moe_experts:
            return (f" (expert {expert.group(2)} of layer {expert.group(1)}, but config.json "
                    f"declares {config.moe_experts} experts: valid ids 0 to "
                    f"{config.moe_experts - 1}; fix num_experts / num_local_experts)")
        part = _MOE_PART.match(key)
        if part and part.group(2) == "shared_expert" and not config.moe_shared_experts:
            return " (shared-expert tensors, which this family's config has none of)"
        if part and config.moe_experts and not config.is_moe_layer(int(part.group(1))):
            return (f" (MoE tensors in layer {part.group(1)}, which config.json makes dense: "
                    f"{_layer_rule(config)})")
        if part and not config.moe_experts:
            return " (MoE tensors, but config.json describes a dense model)"
    return ""


def explain_shape(name: str, shape: tuple[int, ...], config: ModelConfig) -> str:
    """The config fields behind the shape of meshtrain MoE tensor ``name``, which the weights
    would give ``shape``."""
    if ".moe." not in name:
        return ""
    stacked = name.endswith("moe.router.weight") or ".moe.experts." in name
    if stacked and shape and shape[0] != config.moe_experts:
        return (f" (the weights hold {shape[0]} experts in this layer but config.json declares "
                f"{config.moe_experts}: set num_experts / num_local_experts to {shape[0]}, or "
                "supply the missing experts)")
    return (f" (config.json: {config.moe_experts} experts of width {config.expert_ffn_dim}"
            + (f", shared expert width {config.shared_ffn_dim}" if config.moe_shared_experts
               else "") + "; the weights hold another number or width)")
