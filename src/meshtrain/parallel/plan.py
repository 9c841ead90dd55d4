"""``ParallelPlan``: the one contract between the planner (or a user) and the runtime.

A plan is data. Hand-written, read from a config, or produced by the planner, it goes through the
same :func:`meshtrain.parallel.parallelize`. It holds the degrees of every axis, how the step is
scheduled, and the tensor-parallel sharding rules as (module-name pattern -> style) pairs, so the
plain model never needs to know it is being split.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import Config

# How each module of the plain model is split under tensor parallelism (Megatron-LM's layout):
# a TP region is entered once per sub-layer (attention, MLP, head), the first matmul of each pair
# is split by columns (output features), the second by rows (input features) and reduced, so each
# sub-layer costs one reduction forward and one backward. MoE layers are replicated over tp
# (experts are split by expert parallelism instead). Styles: meshtrain.parallel.tensor.apply.
DEFAULT_TP_RULES: tuple[tuple[str, str], ...] = (
    ("tok_embeddings", "vocab"),
    ("layers.*.attention", "region"),
    ("layers.*.attention.wq", "column"),
    ("layers.*.attention.wk", "kv"),
    ("layers.*.attention.wv", "kv"),
    ("layers.*.attention.wo", "row"),
    ("layers.*.feed_forward", "region"),
    ("layers.*.feed_forward.w1", "column"),
    ("layers.*.feed_forward.w3", "column"),
    ("layers.*.feed_forward.w2", "row"),
    ("layers.*.moe", "replicated"),
    ("norm", "region-output"),
    ("output", "column"),
)


@dataclasses.dataclass
class ParallelPlan:
    """Degrees, schedule and sharding rules for one run."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    pp_split: str = ""
    activation_checkpointing: str = "none"
    dp_bucket_mb: float = 25.0
    dp_shared_memory: bool = True
    tp_rules: tuple[tuple[str, str], ...] = DEFAULT_TP_RULES
    init_seed: int = 0
    """Seed of the name-seeded initialisation, for a model built on the meta device."""
    param_dtype: str = "fp32"
    """dtype the parameters are materialised in (``fp32`` or ``bf16``)."""
    grad_dtype: str = "fp32"
    """dtype gradients are accumulated and reduced in (``parallel.grad_reduce_dtype``)."""
    compile_blocks: bool = False
    """``torch.compile`` each block's forward (``train.compile``)."""

    @classmethod
    def from_config(cls, config: Config) -> ParallelPlan:
        """The plan a config's ``[parallel]`` section describes (dp must already be resolved)."""
        par = config.parallel
        return cls(dp=max(par.dp, 1), tp=par.tp, pp=par.pp, ep=par.ep, zero=par.zero,
                   sequence_parallel=par.sequence_parallel, pp_schedule=par.pp_schedule,
                   virtual_stages=par.virtual_stages, microbatches=par.microbatches,
                   pp_split=par.pp_split,
                   activation_checkpointing=par.activation_checkpointing,
                   dp_bucket_mb=par.dp_bucket_mb, dp_shared_memory=par.dp_shared_memory,
                   init_seed=config.train.seed,
                   param_dtype=config.train.precision,
                   grad_dtype=config.parallel.grad_reduce_dtype,
                   compile_blocks=config.train.compile)

    @property
    def world_size(self) -> int:
        """Processes the plan needs: dp × tp × pp."""
        return self.dp * self.tp * self.pp
