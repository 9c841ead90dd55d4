"""Name-seeded weight initialisation, and parameter / FLOP counts from a config.

Every parameter's values, flattened in row-major order, are drawn in fixed-size blocks of
:data:`INIT_BLOCK` elements; block ``k`` comes from its own ``torch.Generator`` seeded by a
stable hash (SHA-256) of ``f"{seed}/{name}/{k}"`` (``f"{seed}/{name}"`` for block 0, so a
parameter of one block keeps the value of a whole-tensor draw), where ``name`` is the
parameter's full name in the unsharded model (e.g. ``layers.3.attention.wq.weight``). So the
value never depends on which modules a rank built or in what order, and any part of a parameter
can be generated alone: a range (:func:`init_range`: a ZeRO-3 rank's shard, a dim-0 piece) or a
box (:func:`init_box`: a tensor-parallel piece along any dim, an expert-parallel rank's experts;
:mod:`meshtrain.parallel.initial_values` draws a parallel layout's pieces with them),
drawing one block at a time. Every parallel layout starts from the same model as one process,
and no rank draws a full tensor it does not hold.

Init rules (std of a zero-mean normal unless stated):

=====================================================  ==========================
norms (``attention_norm``, ``ffn_norm``, ``norm``,     ones
``q_norm``, ``k_norm``)
biases (``wq wk wv wo`` with ``qkv_bias``/``wo_bias``)  zeros
``tok_embeddings``                                      0.02
input projections ``wq wk wv w1 w3``, ``router``        0.02
the shared-expert gate ``shared_gate``                  0.02
output projections ``wo``, ``w2`` (dense and experts)   0.02 / sqrt(2 * n_layers)
the LM head ``output``                                  dim ** -0.5
=====================================================  ==========================
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import nn

from meshtrain.config import ModelConfig

# Wrapper prefixes that activation checkpointing / torch.compile insert into parameter names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
_INPUT_PROJECTIONS = ("wq", "wk", "wv", "w1", "w3", "router", "shared_gate")
_OUTPUT_PROJECTIONS = ("wo", "w2")


def canonical_name(name: str) -> str:
    """``name`` with wrapper components (checkpoint / compile wrappers) removed."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


INIT_BLOCK = 1 << 20
"""Elements per independently seeded block of a parameter's initial values."""


def name_seed(seed: int, name: str, block: int = 0) -> int:
    """A stable 63-bit generator seed for block ``block`` of parameter ``name`` (independent of
    Python's hash()). Block 0 keeps the seed of the whole-tensor draw, so a parameter of at most
    :data:`INIT_BLOCK` elements has the same initial value as when parameters were drawn whole."""
    key = f"{seed}/{name}" if block == 0 else f"{seed}/{name}/{block}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std(name: str, config: ModelConfig) -> float | None:
    """The init std for parameter ``name``: ``None`` for a norm weight (initialised to 1),
    ``0.0`` for a bias (zeros)."""
    parts = canonical_name(name).split(".")
    if parts[-1] == "bias":
        return 0.0
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


def init_range(name: str, shape: Sequence[int], start: int, stop: int, seed: int,
               config: ModelConfig) -> torch.Tensor:
    """Elements ``[start, stop)`` (fp32, CPU, 1-D) of the flattened full initial value of
    parameter ``name`` with ``shape``: only the blocks of :data:`INIT_BLOCK` covering the range
    are drawn, each bit-identical to its part of :func:`init_tensor`."""
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) outside {name!r} of {numel} elements")
    std = init_std(name, config)
    if std is None:
        return torch.ones(stop - start, dtype=torch.float32)
    if std == 0.0:  # biases: exact zeros (a scaled draw would give -0.0 for negative values)
        return torch.zeros(stop - start, dtype=torch.float32)
    out = torch.empty(stop - start, dtype=torch.float32)
    generator = torch.Generator(device="cpu")
    canonical = canonical_name(name)
    for block in range(start // INIT_BLOCK, -(-stop // INIT_BLOCK)):
        lo, hi = block * INIT_BLOCK, min((block + 1) * INIT_BLOCK, numel)
        generator.manual_seed(name_seed(seed, canonical, block))
        values = torch.randn(hi - lo, generator=generator, dtype=torch.float32)
        a, b = max(lo, start), min(hi, stop)
        out[a - start:b - start] = values[a - lo:b - lo]
    return out.mul_(std)


def init_box(name: str, full_shape: Sequence[int], offset: Sequence[int], size: Sequence[int],
             seed: int, config: ModelConfig) -> torch.Tensor:
    """The box ``[offset, offset + size)`` (per dim; fp32, CPU, shape ``size``) of the full
    initial value of parameter ``name`` with ``full_shape``, drawn block by block: never more
    than one block of :data:`INIT_BLOCK` elements beyond the box, bit-identical to cutting it
    from :func:`init_tensor`."""
    full, offset, size = tuple(full_shape), tuple(offset), tuple(size)
    std = init_std(name, config)
    if std is None or std == 0.0:
        return (torch.ones if std is None else torch.zeros)(size, dtype=torch.float32)
    out = torch.empty(math.prod(size), dtype=torch.float32)
    if out.numel() == 0:
        return out.view(size)
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    box_strides = [math.prod(size[d + 1:]) for d in range(len(size))]
    first = sum(o * s for o, s in zip(offset, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offset, size, strides, strict=True)) + 1
    generator = torch.Generator(device="cpu")
    canonical = canonical_name(name)
    numel = math.prod(full)
    for block in range(first // INIT_BLOCK, -(-last // INIT_BLOCK)):
        lo, hi = block * INIT_BLOCK, min((block + 1) * INIT_BLOCK, numel)
        generator.manual_seed(name_seed(seed, canonical, block))
        values = torch.randn(hi - lo, generator=generator, dtype=torch.float32)
        index = torch.arange(max(lo, first), min(hi, last))
        inside = torch.ones(index.shape, dtype=torch.bool)
        position = torch.zeros_like(index)
        for dim in range(len(full)):
            coord = (index // strides[dim]) % full[dim] - offset[dim]
            inside &= (coord >= 0) & (coord < size[dim])
            position += coord * box_strides[dim]
        out[position[inside]] = values[index[inside] - lo]
    return out.mul_(std).view(size)


def init_tensor(name: str, shape: Sequence[int], seed: int, config: ModelConfig) -> torch.Tensor:
    """The full initial value (fp32, CPU) of parameter ``name`` with ``shape``.

    Depends only on ``(seed, name, shape, config)``; see the module docstring for the rules.
    """
    return init_range(name, shape, 0, math.prod(shape), seed, config).view(tuple(shape))


def reset_buffers(model: nn.Module) -> None:
    """Reset every module's buffers through its ``reset_buffers()`` (MoE ``expert_bias`` to
    zeros, RoPE caches cleared)."""
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every (whole) parameter of ``model`` with :func:`init_tensor` and reset its buffers.

    ``model`` must carry its ``ModelConfig`` as ``model.config``. A parallelised model's pieces
    are initialised by :func:`meshtrain.parallel.initial_values.initial_value`.
    """
    config = model.config
    for name, param in model.named_parameters():
        value = init_tensor(name, param.shape, seed, config)
        param.copy_(value.to(device=param.device, dtype=param.dtype))
    reset_buffers(model)
