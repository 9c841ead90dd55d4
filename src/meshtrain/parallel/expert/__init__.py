"""Expert parallelism: MoE experts split over ep ranks, tokens moved by all-to-all, and dynamic
expert placement (hot experts re-placed across ep ranks every ``parallel.ep_rebalance_every``
steps)."""

from meshtrain.parallel.expert.apply import ExpertParallelExperts, apply_expert_parallel
from meshtrain.parallel.expert.dispatch import all_to_all, combine, dispatch, plan_dispatch
from meshtrain.parallel.expert.placement import (
    ExpertPlacer,
    LayerPlacement,
    plan_placement,
    rank_loads,
)

__all__ = ["ExpertParallelExperts", "ExpertPlacer", "LayerPlacement", "all_to_all",
           "apply_expert_parallel", "combine", "dispatch", "plan_dispatch", "plan_placement",
           "rank_loads"]
