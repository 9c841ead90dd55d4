"""``train.energy_schedule``: run each pipeline action at the GPU clock its energy schedule gives.

The planner's energy schedule (:mod:`meshtrain.planner.energy.schedule`) gives every compute
action of a pipeline step a clock: full clock on the critical path, lower ones where an action
has slack, so the step stays within 1 % of the full-clock step. The stage times come from
``meshtrain estimate`` of this run's own config on the GPU's profile (``parallel.auto_profile``
when set, else the data-sheet profile matching the GPU's name). Before each compute action the
executor calls :class:`ClockSetter`, which locks the GPU's clocks through NVML when the action's
clock differs from the current one.

Limits: locking clocks needs NVML and administrator rights; without them the run says why and
goes on unchanged. The clock changes when the host issues an action; with CUDA's asynchronous
launches the previous action's kernels may still be running, so an action can start at its
predecessor's clock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshtrain.config import Config
from meshtrain.parallel.pipeline.schedule import Action

MAX_SLOWDOWN = 0.01
"""The step may take this much longer than at full clock."""


def action_clocks(config: Config, profile, pp_rank: int, gpus_per_node: int = 8
                  ) -> dict[Action, float]:
    """The clock (MHz) of each compute action of pipeline rank ``pp_rank`` for ``config``'s
    layout on ``profile``."""
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.planner.cost.workload import Workload
    from meshtrain.planner.energy.schedule import layout_energy_schedule
    from meshtrain.planner.hardware.profile import Cluster

    layout = config.parallel.layout()
    gpus = layout.world_size
    cluster = Cluster(profile, gpus, min(gpus_per_node, gpus))
    result = estimate(Workload.from_config(config), layout, cluster)
    scheduled, _ = layout_energy_schedule(result, layout, profile, MAX_SLOWDOWN)
    return {act: clock for (rank, act), clock in zip(scheduled.graph.nodes, scheduled.clocks,
                                                     strict=True)
            if rank == pp_rank and act.kind.is_compute}


class ClockSetter:
    """``before_compute`` hook: set the action's clock when it changes; after the first
    failure, stop trying and keep the reason."""

    def __init__(self, clocks: dict[Action, float], set_clock: Callable[[float], str]):
        self.clocks, self.set_clock = clocks, set_clock
        self.current: float | None = None
        self.failure: str | None = None

    def __call__(self, action: Action) -> None:
        """Set ``action``'s clock (if known and different from the current one)."""
        clock = self.clocks.get(action)
        if self.failure is not None or clock is None or clock == self.current:
            return
        note = self.set_clock(clock)
        if note.startswith("applied"):
            self.current = clock
        else:
            self.failure = note


def install_energy_schedule(config: Config, device: torch.device, pp_rank: int,
                            executor) -> str:
    """Install the energy schedule's clocks on this rank's pipeline ``executor``; returns what
    happened (installed, or why not, in which case nothing changed)."""
    if device.type != "cuda":
        return (f"not applied: the {device.type} device has no GPU clocks to set; the run goes "
                "on unchanged")
    from meshtrain.planner.tables.profiles import PROFILES, load_profile, profile_for_gpu
    from meshtrain.training.energy import apply_clock_limit

    given = config.parallel.auto_profile
    name = given or profile_for_gpu(torch.cuda.get_device_name(device))
    if name is None:
        return (f"not applied: no built-in profile for the GPU "
                f"{torch.cuda.get_device_name(device)!r}; set parallel.auto_profile to one of "
                f"{', '.join(PROFILES)} or a calibrate JSON; the run goes on unchanged")
    profile, source = load_profile(name), f"profile {name}"
    clocks = action_clocks(config, profile, pp_rank)
    executor.before_compute = ClockSetter(clocks, lambda mhz: apply_clock_limit(device, mhz))
    return (f"clocks of {min(clocks.values(), default=0):.0f}-"
            f"{max(clocks.values(), default=0):.0f} MHz per action ({source}); a failure to set "
            "them is reported at the end of the run")


def clock_failure(executor) -> str | None:
    """Why the executor's energy-schedule clocks could not be set (None: set, or not used)."""
    hook = None if executor is None else executor.before_compute
    return hook.failure if isinstance(hook, ClockSetter) else None
