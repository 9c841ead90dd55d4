"""The planner: hardware profiles and a cost model (memory, compute, communication, pipeline
bubble) that prices a parallel layout, and a search that ranks layouts for a model and cluster.

See ``docs/planner.md``. Entry points: :func:`meshtrain.planner.cost.estimate.estimate` (one
layout), :func:`meshtrain.planner.search.layouts.plan` (the search),
:mod:`meshtrain.planner.calibrate.measure`,
:func:`meshtrain.replan.auto.choose_layout` (``train --set parallel.auto=true``).
"""

from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.workload import RuntimeTraits, Workload
from meshtrain.planner.hardware.profile import Cluster, HardwareProfile
from meshtrain.planner.search.layouts import plan
from meshtrain.planner.tables.profiles import PROFILES, load_profile

__all__ = ["PROFILES", "Cluster", "HardwareProfile", "Layout", "RuntimeTraits", "Workload",
           "estimate", "load_profile", "plan"]
