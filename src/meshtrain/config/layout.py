"""``Layout``: the degrees of every parallel axis and how one optimizer step is scheduled.

One dataclass describes a layout wherever one appears: the ``[parallel]`` section of a run config
(:class:`meshtrain.config.ParallelConfig` adds the runtime's tuning options to it), the plan the
runtime applies (:class:`meshtrain.parallel.plan.ParallelPlan` adds the sharding rules, seed and
dtypes) and each candidate the planner prices (:mod:`meshtrain.planner`). It depends on nothing
else in meshtrain, so any of them can use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
ACTIVATION_CHECKPOINTING_KINDS = ("none", "full", "selective")


@dataclass
class Layout:
    """Degrees of each parallel axis and how the step is scheduled."""

    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree (Megatron-LM's column/row split of every block's matmuls)."""
    pp: int = 1
    """Pipeline-parallel degree: ranks the layers are split over."""
    cp: int = 1
    """Context-parallel degree: ranks each sequence is split over (load-balanced causal chunks;
    they share the gradient reduction with dp)."""
    ep: int = 1
    """Expert-parallel degree: ranks each MoE layer's experts are split over (within dp)."""
    zero: int = 0
    """ZeRO stage over the data-parallel ranks: 0 none, 1 optimizer state, 2 + gradients,
    3 + parameters sharded."""
    sequence_parallel: bool = False
    """Split the norms' and residuals' activations along the sequence over the tp ranks."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule, one of :data:`PP_SCHEDULES`."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved-1f1b: at least 2; zb-v: 2)."""
    pp_split: str = ""
    """Layers per pipeline stage as a comma list (e.g. "3,3,2"); empty = balanced by cost."""
    microbatches: int = 1
    """Micro-batches per data-parallel rank per step (gradient accumulation and pipeline
    micro-batches are one notion)."""
    activation_checkpointing: str = "none"
    """Recompute in backward: one of :data:`ACTIVATION_CHECKPOINTING_KINDS`."""

    @property
    def world_size(self) -> int:
        """Processes the layout needs: dp × cp × tp × pp."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank holds (virtual stages; 2 for zb-v)."""
        if self.pp_schedule == "interleaved-1f1b":
            return self.virtual_stages
        return 2 if self.pp_schedule == "zb-v" else 1

    def micro_batch_size(self, global_batch: int) -> int:
        """Sequences per micro-batch on one data-parallel rank for ``global_batch`` sequences
        per step."""
        return global_batch // (self.dp * self.microbatches)

    def layout(self) -> Layout:
        """Only the layout's own fields, as a plain :class:`Layout` (from a subclass such as a
        config section or a runtime plan)."""
        return Layout(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Layout)})
