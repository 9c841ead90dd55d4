"""Expert parallelism: MoE experts split over ep ranks, tokens moved by all-to-all."""

from meshtrain.parallel.expert.apply import ExpertParallelExperts, apply_expert_parallel
from meshtrain.parallel.expert.dispatch import all_to_all, combine, dispatch, plan_dispatch

__all__ = ["ExpertParallelExperts", "all_to_all", "apply_expert_parallel", "combine", "dispatch",
           "plan_dispatch"]
