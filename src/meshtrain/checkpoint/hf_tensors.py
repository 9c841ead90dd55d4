"""Tensor names and layouts between meshtrain and Hugging Face Llama / Qwen2 / Qwen3 / Mixtral
checkpoints.

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
``layers.<i>.moe.router``                ``block_sparse_moe.gate`` (fused: ``mlp.gate``)
``norm.weight`` / ``output.weight``      ``model.norm.weight`` / ``lm_head.weight``
=======================================  =================================================

Experts differ in layout. meshtrain keeps ``experts.w1``/``w3`` as [E, dim, hidden] and
``experts.w2`` as [E, hidden, dim] (``x @ w``). Mixtral checkpoints (what transformers saves, also
in 5.x) hold one ``nn.Linear`` per expert: ``block_sparse_moe.experts.<j>.w1/w3.weight``
[hidden, dim] and ``w2.weight`` [dim, hidden], i.e. the transposes of expert ``j``'s slices.
transformers 5.x models hold them fused in memory, and such checkpoints are read too:
``mlp.experts.gate_up_proj`` [E, 2*hidden, dim] (gate rows first) and ``mlp.experts.down_proj``
[E, dim, hidden]. Export always writes the per-expert layout, which every version loads.
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
_FUSED_ROUTER = "mlp.gate.weight"
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
# Tensors some Hugging Face checkpoints carry that hold no weights (recomputed on load).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def _split_layer(name: str) -> tuple[int, str] | None:
    match = _LAYER_NAME.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def to_hf(name: str, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors that meshtrain tensor ``name`` becomes (views, not copies).

    A stacked expert weight becomes one tensor per expert; a zero MoE ``expert_bias`` becomes
    nothing (Mixtral has no selection bias, so a non-zero one is refused).
    """
    if name in _TOP:
        return [(_TOP[name], tensor)]
    parts = _split_layer(name)
    if parts is None:
        raise ConfigError(f"no Hugging Face name for meshtrain tensor {name}.")
    layer, rest = parts
    prefix = f"model.layers.{layer}."
    if rest in _LAYER:
        return [(prefix + _LAYER[rest], tensor)]
    if rest == "moe.expert_bias":
        if not tensor.is_meta and bool(tensor.ne(0).any()):
            raise ConfigError(f"{name} is non-zero (moe_balance = 'bias' steered routing); "
                              "Mixtral has no selection bias, so its routing would differ.")
        return []
    if rest in ("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"):
        leaf = rest.rsplit(".", 1)[1]
        return [(f"{prefix}block_sparse_moe.experts.{j}.{leaf}.weight", tensor[j].t())
                for j in range(tensor.shape[0])]
    raise ConfigError(f"meshtrain tensor {name} has no Hugging Face Llama/Qwen/Mixtral equivalent "
                      "(e.g. shared experts or a GELU MLP).")


def is_fused_moe(keys: list[str]) -> bool:
    """Whether a Mixtral checkpoint stores experts fused (transformers 5.x in-memory layout)."""
    return any(key.endswith(_FUSED_GATE_UP) for key in keys)


def from_hf(
    name: str, read: Callable[[str], torch.Tensor], config: ModelConfig, fused: bool
) -> torch.Tensor:
    """The meshtrain tensor ``name``, assembled from Hugging Face tensors fetched by ``read``.

    ``fused`` selects the fused expert layout (see the module docstring). Raises ConfigError when
    the tensor has no Hugging Face counterpart.
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
    if rest in _LAYER:
        return read(prefix + _LAYER[rest])
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
        leaf = rest.rsplit(".", 1)[1]
        return torch.stack([read(f"{prefix}block_sparse_moe.experts.{j}.{leaf}.weight").t()
                            for j in range(config.moe_experts)])
    raise ConfigError(f"meshtrain tensor {name} has no Hugging Face Llama/Qwen/Mixtral source.")
