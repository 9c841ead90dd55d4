"""``ParallelPlan``: the one contract between the planner (or a user) and the runtime.

A plan is data. Hand-written, read from a config, or produced by the planner, it goes through the
same :func:`meshtrain.parallel.parallelize`. It is a :class:`~meshtrain.config.layout.Layout` (the
degrees of every axis and how the step is scheduled) with the tensor-parallel sharding rules as
(module-name pattern -> style) pairs, so the plain model never needs to know it is being split.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from meshtrain.config import Config
from meshtrain.config.layout import Layout

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
    ("layers.*.attention.q_norm", "heads"),
    ("layers.*.attention.k_norm", "heads"),
    ("layers.*.feed_forward", "region"),
    ("layers.*.feed_forward.w1", "column"),
    ("layers.*.feed_forward.w3", "column"),
    ("layers.*.feed_forward.w2", "row"),
    ("layers.*.moe", "replicated"),
    ("norm", "region-output"),
    ("output", "column"),
)


@dataclasses.dataclass
class ParallelPlan(Layout):
    """A :class:`~meshtrain.config.layout.Layout` (degrees and schedule) with what the runtime
    needs to
    apply it: the sharding rules, bucket options, seed and dtypes."""

    dp_bucket_mb: float = 25.0
    dp_shared_memory: bool = True
    zero3_prefetch: int = 1
    """ZeRO-3 units gathered ahead of the running one (``parallel.zero3_prefetch``)."""
    tp_rules: tuple[tuple[str, str], ...] = DEFAULT_TP_RULES
    init_seed: int = 0
    """Seed of the name-seeded initialisation, for a model built on the meta device."""
    param_dtype: str = "fp32"
    """dtype the parameters are materialised in (``fp32`` or ``bf16``)."""
    grad_dtype: str = "fp32"
    """dtype gradients are accumulated and reduced in (``parallel.grad_reduce_dtype``)."""
    compile_blocks: bool = False
    """``torch.compile`` each block's forward (``train.compile``)."""
    offload: str = "none"
    """What of this rank's ZeRO shard lives off the device (``parallel.offload``)."""
    offload_device: str = "host"
    """``host`` or ``nvme`` (``parallel.offload_device``)."""
    offload_dir: str = ""
    """Where nvme offload's files go (``parallel.offload_dir``, default ``RUN_DIR/offload``)."""
    offload_chunk_mb: float = 16.0
    """MiB of a state tensor each pass over offloaded state handles at a time."""
    offload_overlap: bool = False
    """Run the offloaded ZeRO-3 step in the background (``parallel.offload_overlap``)."""

    @classmethod
    def from_config(cls, config: Config) -> ParallelPlan:
        """The plan a config describes: the layout of its ``[parallel]`` section (dp must already
        be resolved) and the runtime settings of ``[parallel]`` and ``[train]``."""
        par = config.parallel
        return cls(**dataclasses.asdict(par.layout()),
                   dp_bucket_mb=par.dp_bucket_mb, dp_shared_memory=par.dp_shared_memory,
                   zero3_prefetch=par.zero3_prefetch, init_seed=config.train.seed,
                   param_dtype=config.train.precision,
                   grad_dtype=par.grad_reduce_dtype,
                   compile_blocks=config.train.compile,
                   offload=par.offload, offload_device=par.offload_device,
                   offload_dir=par.offload_dir or str(Path(config.train.run_dir) / "offload"),
                   offload_chunk_mb=par.offload_chunk_mb,
                   offload_overlap=par.offload_overlap)
