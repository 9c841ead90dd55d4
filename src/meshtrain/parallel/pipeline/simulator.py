"""Time a pipeline :class:`~.schedule.Schedule` under given per-stage costs.

Each rank runs its list in order under the checker's semantics (:mod:`.checker`). A compute
action starts when its rank is free and its inputs are ready; ``F`` costs ``f``, ``I`` costs
``b``, ``W`` costs ``w`` and a full ``B`` costs ``b + w``. A send is posted at once (zero cost);
a recv holds its rank until the data has arrived: the send's post time plus the sending stage's
``comm`` latency. Hand-overs between two stages on the same rank are free.

``peak_inflight`` per rank is the activation-memory measure: the largest number of
(micro-batch, stage) pairs whose ``F`` has started and whose ``I`` (or ``B``) has not finished.
A deferred ``W`` is not counted: after ``I`` only the weight-gradient inputs remain (the layer
inputs and output gradients of the linear layers), a fraction of the stage's activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshtrain.config import ConfigError
from meshtrain.parallel.pipeline.checker import dependencies, execution_order, produced_key
from meshtrain.parallel.pipeline.schedule import Action, ActionKind, Schedule

K = ActionKind

Event = tuple[int, Action, float, float]


@dataclass(frozen=True)
class StageTimes:
    """Costs of one micro-batch on one stage: forward ``f``, backward-input ``b``,
    backward-weight ``w`` (a full ``B`` costs ``b + w``), and ``comm``, the latency of sending
    this stage's output (or input gradient) to another rank."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0

    def cost(self, kind: ActionKind) -> float:
        """Compute time of one action of ``kind`` (0 for communication)."""
        if kind is K.F:
            return self.f
        if kind is K.B:
            return self.b + self.w
        if kind is K.I:
            return self.b
        if kind is K.W:
            return self.w
        return 0.0


@dataclass
class SimulationResult:
    """What :func:`simulate` measured.

    ``events`` holds every action as ``(rank, action, start, end)``; for a recv, ``end - start``
    is the time its rank waited for the data. ``bubble_fraction`` is idle time over
    ``pp × makespan``.
    """

    makespan: float
    bubble_fraction: float
    peak_inflight: list[int]
    events: list[Event] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)

    def compute_events(self) -> list[Event]:
        """The F/B/I/W events only."""
        return [e for e in self.events if e[1].kind.is_compute]


def _per_stage(schedule: Schedule, times: StageTimes | Sequence[StageTimes]) -> list[StageTimes]:
    if isinstance(times, StageTimes):
        per_stage = [times] * schedule.num_stages
    else:
        per_stage = list(times)
        if len(per_stage) != schedule.num_stages:
            raise ConfigError(f"got {len(per_stage)} stage times for {schedule.num_stages} "
                              f"stages (pp × virtual_stages = {schedule.pp} × "
                              f"{schedule.virtual_stages}); give one StageTimes per global "
                              "stage, or a single one for all")
    for s, t in enumerate(per_stage):
        if not isinstance(t, StageTimes):
            raise ConfigError(f"stage {s} times must be a StageTimes, got {type(t).__name__}")
        if min(t.f, t.b, t.w, t.comm) < 0:
            raise ConfigError(f"stage {s} times must be >= 0, got {t}")
    return per_stage


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, stage) activations held at once (see the module doc)."""
    peaks = []
    for acts in schedule.actions:
        live = peak = 0
        for a in acts:
            if a.kind is K.F:
                live += 1
                peak = max(peak, live)
            elif a.kind in (K.B, K.I):
                live -= 1
        peaks.append(peak)
    return peaks


def simulate(schedule: Schedule,
             times: StageTimes | Sequence[StageTimes] = StageTimes()) -> SimulationResult:
    """Time ``schedule``; ``times`` is one :class:`StageTimes` for all stages or one per stage.

    Raises :class:`~.checker.ScheduleError` if the lists deadlock. Run
    :func:`~.checker.check_schedule` first for the full static checks.
    """
    per_stage = _per_stage(schedule, times)
    free = [0.0] * schedule.pp
    busy = [0.0] * schedule.pp
    ready: dict[tuple[str, int, int], float] = {}
    events: list[Event] = []
    for rank, act in execution_order(schedule):
        deps = dependencies(schedule, rank, act)
        start = free[rank]
        if act.kind.is_recv:
            (dep,) = deps
            end = max(start, ready[dep] + per_stage[dep[2]].comm)
        else:
            start = max([start, *(ready[d] for d in deps)])
            cost = per_stage[act.stage].cost(act.kind)
            end = start + cost
            busy[rank] += cost
        free[rank] = end
        ready[produced_key(act)] = end
        events.append((rank, act, start, end))
    makespan = max(free) if free else 0.0
    total = schedule.pp * makespan
    bubble = (total - sum(busy)) / total if total > 0 else 0.0
    return SimulationResult(makespan=makespan, bubble_fraction=bubble,
                            peak_inflight=peak_inflight(schedule), events=events, busy=busy)
