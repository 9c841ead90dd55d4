"""The planner: hardware profiles and a cost model (memory, compute, communication, pipeline
bubble) that prices a parallel layout, and a search that ranks layouts for a model and cluster.

See ``docs/planner.md``. Entry points: :func:`meshtrain.planner.estimate.estimate` (one layout),
:func:`meshtrain.planner.search.plan` (the search), :mod:`meshtrain.planner.calibrate`,
:func:`meshtrain.planner.auto.choose_layout` (``train --set parallel.auto=true``).
"""

from meshtrain.layout import Layout
from meshtrain.planner.estimate import estimate
from meshtrain.planner.hardware import PROFILES, Cluster, HardwareProfile, load_profile
from meshtrain.planner.search import plan
from meshtrain.planner.workload import RuntimeTraits, Workload

__all__ = ["PROFILES", "Cluster", "HardwareProfile", "Layout", "RuntimeTraits", "Workload",
           "estimate", "load_profile", "plan"]
