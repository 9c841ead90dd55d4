"""Tensor names and layouts between meshtrain and Hugging Face Llama / Qwen2 / Qwen3 / Mixtral /
Qwen2-MoE / Qwen3-MoE checkpoints.

Both sides store ``nn.Linear`` weights as [out, in] and use the same rotate-half RoPE layout, so
attention, dense MLP, norms, embedding and head map one to one by name:

=======================================  =================================================
meshtrain                                Hugging Face (``model.layers.<i>.`` prefix inside)
=======================================  =================================================
``tok_embeddings.weight``                ``model.embed_tokens.weight``
``layers.<i>.attention.w{q,k,v,o}``      ``self_attn.{q,k,v,o}_proj`` (weight and bias)
``layers.<i>.attention.{q,k}_norm``      ``self_attn.{q,k}_norm`` (Qwen3)
``layers.<i>.attention_norm``            ``input_layernorm``
``layers.<i>.ffn_norm``                  ``post_attention_layernorm``
``layers.<i>.feed_forward.w1/w3/w2``     ``mlp.gate_proj / up_proj / down_proj``
``layers.<i>.moe.router``                ``block_sparse_moe.gate`` (Qwen, fused: ``mlp.gate``)
``layers.<i>.moe.shared_experts.w1/w3``  ``mlp.shared_expert.gate_proj / up_proj`` (Qwen2-MoE)
``layers.<i>.moe.shared_experts.w2``     ``mlp.shared_expert.down_proj`` (Qwen2-MoE)
``layers.<i>.moe.shared_gate``           ``mlp.shared_expert_gate`` (Qwen2-MoE)
``norm.weight`` / ``output.weight``      ``model.norm.weight`` / ``lm_head.weight``
=======================================  =================================================

Experts differ in layout. meshtrain keeps ``experts.w1``/``w3`` as [E, dim, hidden] and
``experts.w2`` as [E, hidden, dim] (``x @ w``). Mixtral checkpoints (what transformers saves, also
in 5.x) hold one ``nn.Linear`` per expert: ``block_sparse_moe.experts.<j>.w1/w3.weight``
[hidden, dim] and ``w2.weight`` [dim, hidden], i.e. the transposes of expert ``j``'s slices.
transformers 5.x models hold them fused in memory, and such checkpoints are read too:
``mlp.experts.gate_up_proj`` [E, 2*hidden, dim] (gate rows first) and ``mlp.experts.down_proj``
[E, dim, hidden]. Qwen-MoE checkpoints name the per-expert layers ``mlp.experts.<j>.gate_proj``,
``up_proj`` and ``down_proj`` (meshtrain's ``w1``, ``w3``, ``w2``), fused in memory alike. Export
always writes the per-expert layout, which every version loads.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from meshtrain.config import ConfigError, ModelConfig

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.weight": "block_sparse_moe.gate.weight",
}
_QWEN_MOE_LAYER = {
    "moe.router.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
_EXPERT_LEAVES = {"mixtral": ("block_sparse_moe.experts", {"w1": "w1", "w3": "w3", "w2": "w2"}),
                  "qwen": ("mlp.experts", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})}
_FUSED_ROUTER = "mlp.gate.weight"
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
# Tensors some Hugging Face checkpoints carry that hold no weights (recomputed on load).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def _split_layer(name: str) -> tuple[int, str] | None:
    match = _LAYER_NAME.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def _expert_names(model_type: str, prefix: str, rest: str, experts: int) -> list[str]:
    """The per-expert Hugging Face names of stacked expert weight ``rest`` (``moe.experts.w1``)."""
    folder, leaves = _EXPERT_LEAVES["mixtral" if model_type == "mixtral" else "qwen"]
    leaf = leaves[rest.rsplit(".", 1)[1]]
    return [f"{prefix}{folder}.{j}.{leaf}.weight" for j in range(experts)]


def _layer_name(rest: str, model_type: str) -> str | None:
    if model_type != "mixtral" and rest in _QWEN_MOE_LAYER:
        return _QWEN_MOE_LAYER[rest]
    return _LAYER.get(rest) if not rest.startswith("moe.shared") else None


def to_hf(name: str, tensor: torch.Tensor, config: ModelConfig,
          model_type: str = "mixtral") -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors that meshtrain tensor ``name`` becomes (views, not copies), in
    the naming of ``model_type`` (the exported family; its MoE names differ).

    A stacked expert weight becomes one tensor per expert; a zero MoE ``expert_bias`` becomes
    nothing (these families have no selection bias, so a non-zero one is refused).
    """
    if name in _TOP:
        return [(_TOP[name], tensor)]
    parts = _split_layer(name)
    if parts is None:
        raise ConfigError(f"no Hugging Face name for meshtrain tensor {name}.")
    layer, rest = parts
    prefix = f"model.layers.{layer}."
    hf_name = _layer_name(rest, model_type)
    if hf_name is not None:
        return [(prefix + hf_name, tensor)]
    if rest == "moe.expert_bias":
        if not tensor.is_meta and bool(tensor.ne(0).any()):
            raise ConfigError(f"{name} is non-zero (moe_balance = 'bias' steered routing); "
                              "Hugging Face's MoE families have no selection bias, so their "
                              "routing would differ.")
        return []
    if rest in ("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"):
        names = _expert_names(model_type, prefix, rest, tensor.shape[0])
        return [(hf_name, tensor[j].t()) for j, hf_name in enumerate(names)]
    raise ConfigError(f"meshtrain tensor {name} has no Hugging Face {model_type} equivalent "
                      "(e.g. shared experts outside Qwen2-MoE, or a GELU MLP).")


def is_fused_moe(keys: list[str]) -> bool:
    """Whether an MoE checkpoint stores experts fused (transformers 5.x in-memory layout)."""
    return any(key.endswith(_FUSED_GATE_UP) for key in keys)


def from_hf(
    name: str, read: Callable[[str], torch.Tensor], config: ModelConfig, fused: bool,
    model_type: str = "mixtral",
) -> torch.Tensor:
    """The meshtrain tensor ``name``, assembled from Hugging Face tensors fetched by ``read``.

    ``fused`` selects the fused expert layout (see the module docstring); ``model_type`` the
    source family's MoE names. Raises ConfigError when the tensor has no Hugging Face
    counterpart.
    """
    if name in _TOP:
        return read(_TOP[name])
    parts = _split_layer(name)
    if parts is None:
        raise ConfigError(f"no Hugging Face source for meshtrain tensor {name}.")
    layer, rest = parts
    prefix = f"model.layers.{layer}."
    if rest == "moe.router.weight" and fused:
        return read(prefix + _FUSED_ROUTER)
    hf_name = _layer_name(rest, model_type)
    if hf_name is not None:
        return read(prefix + hf_name)
    if rest == "moe.expert_bias":
        return torch.zeros(config.moe_experts, dtype=torch.float32)
    hidden = config.expert_ffn_dim
    if fused and rest in ("moe.experts.w1", "moe.experts.w3"):
        gate_up = read(prefix + _FUSED_GATE_UP)
        half = gate_up[:, :hidden] if rest.endswith("w1") else gate_up[:, hidden:]
        return half.transpose(1, 2).contiguous()
    if fused and rest == "moe.experts.w2":
        return read(prefix + _FUSED_DOWN).transpose(1, 2).contiguous()
    if rest in ("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"):
        names = _expert_names(model_type, prefix, rest, config.moe_experts)
        return torch.stack([read(hf_name).t() for hf_name in names])
    raise ConfigError(f"meshtrain tensor {name} has no Hugging Face Llama/Qwen/Mixtral source.")
