"""RoPE fields of a Hugging Face ``config.json`` to and from ``model.rope_theta`` /
``model.rope_scaling``.

transformers 5 writes one ``rope_parameters`` table (``rope_type``, ``rope_theta`` and the
type's parameters); older checkpoints (every published Llama 3.1 / Qwen2.5 one) have
``rope_theta`` beside a ``rope_scaling`` table whose type may be spelled ``type``. Both are read;
``rope_parameters`` is written (with ``rope_theta`` beside it, which every version reads). The
defaults Hugging Face fills in are filled in here too: ``original_max_position_embeddings`` of
llama3 / yarn is ``max_position_embeddings`` when absent, and a yarn ``factor`` left out is
``max_position_embeddings / original_max_position_embeddings``.
"""

from __future__ import annotations

from typing import Any

from meshtrain.config import ConfigError
from meshtrain.config.model import ROPE_SCALING_KEYS, ModelConfig

_NOT_SCALING = ("rope_theta", "rope_type", "type", "partial_rotary_factor")


def _rope_table(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(field name, table)`` of the checkpoint's RoPE parameters (empty when plain)."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    for name, table in (("rope_parameters", params), ("rope_scaling", scaling)):
        if table is not None and not isinstance(table, dict):
            raise ConfigError(f"{name} = {table!r} is not a table.")
    if params and scaling:
        merged = {**scaling, **params}
        kinds = {t.get("rope_type", t.get("type", "default")) for t in (params, scaling)}
        if len(kinds) > 1:
            raise ConfigError(f"rope_parameters and rope_scaling name different rope types "
                              f"({', '.join(sorted(map(str, kinds)))}).")
        return "rope_parameters", merged
    if params:
        return "rope_parameters", dict(params)
    return "rope_scaling", dict(scaling or {})


def hf_rope(hf: dict[str, Any], default_theta: float,
            origin: str) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, rope_scaling)`` of Hugging Face config ``hf``; ConfigError naming the
    field for a RoPE meshtrain does not implement (``dynamic``, ``longrope``, partial rotary)."""
    try:
        name, table = _rope_table(hf)
    except ConfigError as error:
        raise ConfigError(f"{origin}: {error}") from None
    theta = table.get("rope_theta", hf.get("rope_theta"))
    theta = float(theta if theta is not None else default_theta)
    partial = table.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{origin}: partial_rotary_factor = {partial} (meshtrain rotates every "
                          "dimension of a head), so this model cannot be converted faithfully.")
    kind = table.get("rope_type", table.get("type", "default"))
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(
            f"{origin}: {name}.rope_type = {kind!r} is not implemented; meshtrain implements "
            f"rope_type {', '.join(repr(k) for k in ROPE_SCALING_KEYS)}, so this model cannot be "
            "converted faithfully.")
    if kind == "default":
        return theta, {}
    scaling = {key: value for key, value in table.items() if key not in _NOT_SCALING}
    allowed = ROPE_SCALING_KEYS[kind]
    unknown = sorted(key for key in scaling if key not in allowed)
    if unknown:
        raise ConfigError(f"{origin}: {name}.{unknown[0]} is not a parameter meshtrain implements "
                          f"for rope_type {kind!r} (it knows {', '.join(allowed)}).")
    context = hf.get("max_position_embeddings")
    if "original_max_position_embeddings" in allowed and context is not None:
        scaling.setdefault("original_max_position_embeddings", context)
    if kind == "yarn" and scaling.get("factor") is None and context is not None \
            and scaling.get("original_max_position_embeddings"):
        scaling["factor"] = context / scaling["original_max_position_embeddings"]
    scaling = {key: value for key, value in scaling.items()
               if value is not None or ROPE_SCALING_KEYS[kind].get(key, True)}
    return theta, {"rope_type": kind, **scaling}


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The ``rope_theta`` / ``rope_parameters`` fields of a Hugging Face config for ``config``."""
    scaling = {key: value for key, value in (config.rope_scaling or {}).items()
               if key not in ("rope_type", "type")}
    params = {"rope_type": config.rope_type, "rope_theta": config.rope_theta, **scaling}
    return {"rope_theta": config.rope_theta, "rope_parameters": params}
