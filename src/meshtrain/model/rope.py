"""Rotary-embedding frequencies: plain RoPE and the scaled variants of ``model.rope_scaling``.

Every variant changes only the per-pair inverse frequencies (and, for YaRN, one factor that
multiplies ``cos`` and ``sin``), so the attention code is the same for all of them. The variants
and their parameters are those of Hugging Face's ``rope_scaling`` (the formulas of
``transformers.modeling_rope_utils``); with ``base_j = theta ** (-2j / head_dim)`` for the
pair ``j`` and its wavelength ``w_j = 2 pi / base_j``:

``default``  ``base_j``.
``linear``   ``base_j / factor`` (position interpolation).
``llama3``   with ``L`` = ``original_max_position_embeddings``: unchanged where
             ``w_j < L / high_freq_factor``, divided by ``factor`` where
             ``w_j > L / low_freq_factor``, and in between the blend
             ``(1 - s) base_j / factor + s base_j`` with
             ``s = (L / w_j - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
``yarn``     a ramp over the pairs between the correction dims of ``beta_fast`` (default 32)
             and ``beta_slow`` (default 1) rotations in ``L`` positions (floored / ceiled unless
             ``truncate = false``, clamped to ``[0, head_dim - 1]``) blends ``base_j`` (fast
             pairs) with ``base_j / factor`` (slow pairs); ``cos`` and ``sin`` are multiplied by
             ``attention_factor``, by default ``0.1 ln(factor) + 1`` (or, with ``mscale`` and
             ``mscale_all_dim``, the ratio of those two ``0.1 m ln(factor) + 1``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshtrain.config.model import ROPE_SCALING_KEYS


def normalized_scaling(scaling: dict[str, Any] | None) -> dict[str, Any]:
    """``scaling`` with ``type`` renamed ``rope_type`` and a missing type as ``default``."""
    out = dict(scaling or {})
    kind = out.pop("type", None)
    out.setdefault("rope_type", kind or "default")
    return out


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor YaRN multiplies ``cos`` and ``sin`` by (see the module docstring)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def _llama3(base: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / base
    scaled = torch.where(wavelength > context / low, base / factor, base)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


def _yarn_correction_dim(rotations: float, head_dim: int, theta: float, context: float) -> float:
    """The (fractional) pair index whose frequency turns ``rotations`` times in ``context``."""
    return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn(base: torch.Tensor, head_dim: int, theta: float,
          scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    context = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    low = _yarn_correction_dim(beta_fast, head_dim, theta, context)
    high = _yarn_correction_dim(beta_slow, head_dim, theta, context)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero
    pairs = torch.arange(base.numel(), dtype=torch.float32, device=base.device)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)  # 0: keep base_j, 1: base_j / factor
    keep = 1 - ramp
    return (base / factor) * (1 - keep) + base * keep


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                     device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """``(inverse frequencies [head_dim / 2] in fp32, cos/sin multiplier)`` for ``scaling``
    (a ``model.rope_scaling`` table; empty or None: plain RoPE, multiplier 1)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    base = theta**-exponents
    scaling = normalized_scaling(scaling)
    kind = scaling["rope_type"]
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"unknown rope_type {kind!r}; valid: {', '.join(ROPE_SCALING_KEYS)}")
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    return _yarn(base, head_dim, theta, scaling), yarn_attention_factor(scaling)
