"""Pipeline parallelism: schedules as data, their static checker, simulator and timelines.

A :class:`Schedule` holds one ordered list of :class:`Action` per pipeline rank; the same lists
are checked (:func:`check_schedule`), timed (:func:`simulate`), executed by the runtime and drawn
(:mod:`meshtrain.parallel.pipeline.timeline`). See ``docs/pipeline.md``.
"""

from meshtrain.parallel.pipeline.checker import ScheduleError, check_schedule
from meshtrain.parallel.pipeline.schedule import Action, ActionKind, Schedule
from meshtrain.parallel.pipeline.schedules import build_schedule
from meshtrain.parallel.pipeline.simulator import SimulationResult, StageTimes, simulate

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleError", "SimulationResult", "StageTimes",
           "build_schedule", "check_schedule", "simulate"]
