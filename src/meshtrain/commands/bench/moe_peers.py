"""The Mixture-of-Experts suites' peers and shape.

- ``moe``: one process, meshtrain's MoE model against ``transformers``' ``MixtralForCausalLM``
  holding the same weights (meshtrain's own Hugging Face export, loaded by
  ``from_pretrained``), trained on the same sequences by the plain loop of
  :func:`meshtrain.commands.bench.peers.make_step`. The peer runs its fastest experts path for the
  device and precision (``experts_implementation``, :func:`_best_experts_implementation`), SDPA
  attention and ``AdamW(fused=True)``.
- ``moe-ep``: two processes, meshtrain ep 2 against meshtrain dp 2 of the same model (experts
  split over the two ranks and tokens dispatched by all-to-all, against every rank holding every
  expert).

Both sides are dropless and unbalanced (``moe_balance = "none"``): the same loss, which the
first-step losses check.
"""

from __future__ import annotations

import tempfile

import torch

from meshtrain.commands.bench.peers import hf_causal_lm_worker
from meshtrain.commands.bench.workers import load_bench_config, meshtrain_worker
from meshtrain.config import Config, ConfigError

MOE_EXPERTS = 8
MOE_TOP_K = 2


def configure_moe_shape(config: Config) -> None:
    """Every block a Mixtral MoE block: 8 experts, top-2, each expert the bench's FFN width,
    dropless, no balancing term; one process or pure data parallelism."""
    m, par = config.model, config.parallel
    m.moe_experts = m.moe_experts or MOE_EXPERTS
    m.moe_top_k = m.moe_top_k if m.moe_experts != MOE_EXPERTS else MOE_TOP_K
    m.moe_every, m.moe_first_dense, m.moe_shared_experts = 1, 0, 0
    m.moe_capacity_factor, m.moe_balance, m.moe_score = 0.0, "none", "softmax"
    if m.moe_top_k < 2:
        raise ConfigError(f"model.moe_top_k = {m.moe_top_k}: the MoE suites' Mixtral gate is "
                          "the renormalised top-k; valid: moe_top_k >= 2.")
    if m.mlp != "swiglu":
        raise ConfigError(f'model.mlp = "{m.mlp}": Mixtral experts are SwiGLU; valid: "swiglu".')
    par.tp, par.pp, par.cp, par.zero, par.sequence_parallel = 1, 1, 1, 0, False


def configure_moe(config: Config) -> None:
    """One process (the ``moe`` suite)."""
    configure_moe_shape(config)
    config.parallel.dp, config.parallel.ep = 1, 1


def configure_moe_ep(config: Config) -> None:
    """dp 2 with the experts split over ep 2 (the ``moe-ep`` suite's meshtrain side)."""
    configure_moe_shape(config)
    config.parallel.dp, config.parallel.ep = 2, 2


def _best_experts_implementation(config: Config) -> str | None:
    """The peer's fastest experts path for the suite's device and precision.

    fp32: ``grouped_mm`` where torch has the grouped kernel, else None (the model's default).
    bf16 (``torch.autocast`` over fp32 weights): ``eager``, one ``F.linear`` per expert, which
    autocast runs in bf16; transformers casts ``grouped_mm``'s input to the weights' dtype
    (the kernel is not autocast-aware), so under autocast its experts run in fp32 (on the
    bench shape on CPU: 1.03 s a step against eager's 0.76 s, 2026-12-03).
    """
    from meshtrain.model.grouped_gemm import grouped_mm_available

    if config.train.precision == "bf16":
        return "eager"
    return ("grouped_mm" if grouped_mm_available(torch.device(config.train.device).type,
                                                 torch.float32) else None)


def build_hf_mixtral(config: Config) -> torch.nn.Module:
    """``MixtralForCausalLM`` holding meshtrain's name-seeded initial weights."""
    from transformers import MixtralForCausalLM

    from meshtrain.checkpoint.hf.io import save_hf
    from meshtrain.model import build_model

    source = build_model(config.model, seed=config.train.seed)
    options = {"attn_implementation": "sdpa", "dtype": torch.float32}
    implementation = _best_experts_implementation(config)
    if implementation:
        options["experts_implementation"] = implementation
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-mixtral-") as tmp:
        save_hf(source, tmp, dtype=torch.float32)
        model = MixtralForCausalLM.from_pretrained(tmp, **options)
    model.config.use_cache = False
    return model.train()


def hf_mixtral_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The ``moe`` suite's peer: plain PyTorch training of ``transformers``' Mixtral."""
    return hf_causal_lm_worker(config_dict, warmup, steps, build_hf_mixtral)


def meshtrain_dp_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The ``moe-ep`` suite's peer: the same meshtrain run with every expert on every rank
    (ep 1, dp 2)."""
    config = load_bench_config(config_dict)
    config.parallel.ep = 1
    return meshtrain_worker(config.to_dict(), warmup, steps)
