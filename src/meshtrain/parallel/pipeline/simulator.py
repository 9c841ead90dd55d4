"""Time a pipeline :class:`~.schedule.Schedule` under given per-stage costs.

Each rank runs its list in order under the checker's semantics (:mod:`.checker`). A compute
action starts when its rank is free and its inputs are ready; ``F`` costs ``f``, ``I`` costs
``b``, ``W`` costs ``w`` and a full ``B`` costs ``b + w``. Sends and receives are posted at once
(zero cost, as the executor posts them without blocking); the data of a receive arrives at the
send's post time plus the sending stage's ``comm`` latency, and the compute that consumes it
waits for that. Hand-overs between two stages on the same rank are free.

``peak_inflight`` per rank is the activation-memory measure: the largest number of
(micro-batch, stage) pairs whose ``F`` has started and whose ``I`` (or ``B``) has not finished.
A deferred ``W`` is not counted: after ``I`` only the weight-gradient inputs remain (the layer
inputs and output gradients of the linear layers), a fraction of the stage's activations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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

    ``events`` holds every action as ``(rank, action, start, end)``; for a recv, ``start`` is
    when it is posted and ``end`` when its data arrives. ``bubble_fraction`` is idle time over
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


PlanStep = tuple[int, Action, tuple, tuple]
"""One action of an :func:`execution_plan`: ``(rank, action, its dependencies' keys, the key it
produces)``."""


def execution_plan(schedule: Schedule) -> tuple[PlanStep, ...]:
    """``schedule``'s actions in an order every rank's list allows, each with the keys it waits
    for and the key it produces: what :func:`simulate` walks, independent of the times (so one
    plan serves every timing of the same schedule). Raises on deadlock."""
    return tuple((rank, act, tuple(dependencies(schedule, rank, act)), produced_key(act))
                 for rank, act in execution_order(schedule))


def simulate(schedule: Schedule,
             times: StageTimes | Sequence[StageTimes] = StageTimes(),
             durations: Mapping[tuple[int, Action], float] | None = None,
             plan: tuple[PlanStep, ...] | None = None) -> SimulationResult:
    """Time ``schedule``; ``times`` is one :class:`StageTimes` for all stages or one per stage.
    ``durations`` overrides the cost of single compute actions, keyed by ``(rank, action)``
    (e.g. actions slowed by an energy schedule); ``plan``: the schedule's
    :func:`execution_plan`, when the caller keeps it to time the same schedule again.

    Raises :class:`~.checker.ScheduleError` if the lists deadlock. Run
    :func:`~.checker.check_schedule` first for the full static checks.
    """
    per_stage = _per_stage(schedule, times)
    free = [0.0] * schedule.pp
    busy = [0.0] * schedule.pp
    ready: dict[tuple[str, int, int], float] = {}
    events: list[Event] = []
    for rank, act, deps, produced in plan or execution_plan(schedule):
        start = free[rank]
        if act.kind.is_recv:
            (dep,) = deps
            end = max(start, ready[dep] + per_stage[dep[2]].comm)
        else:
            start = max([start, *(ready[d] for d in deps)])
            cost = per_stage[act.stage].cost(act.kind)
            if durations is not None:
                cost = durations.get((rank, act), cost)
            end = start + cost
            busy[rank] += cost
            free[rank] = end
        ready[produced] = end
        events.append((rank, act, start, end))
    makespan = max(free) if free else 0.0
    total = schedule.pp * makespan
    bubble = (total - sum(busy)) / total if total > 0 else 0.0
    return SimulationResult(makespan=makespan, bubble_fraction=bubble,
                            peak_inflight=peak_inflight(schedule), events=events, busy=busy)


def closed_form_bubble(name: str, pp: int, microbatches: int, virtual_stages: int,
                       times: StageTimes = StageTimes()) -> float | None:
    """The papers' bubble fraction for uniform stage ``times``, or ``None`` where none applies.

    GPipe: ``(p-1)/(m+p-1)``. 1F1B with its early gradient sends (for ``w <= f``): idle
    ``(p-1)(f+b)`` per rank over the makespan ``m(f+b+w) + (p-1)(f+b)``, i.e. ``(p-1)/(m+p-1)``
    with ``w = 0`` and ``2(p-1)/(3m+2(p-1))`` when ``f = b = w``. Interleaved 1F1B:
    ``(p-1)/(v·m+p-1)`` (Narayanan et al. 2021). ZB-H1 (for ``m >= p`` and
    ``w <= min(f, b)``): idle ``(p-1)(f+b-w)`` per rank over the makespan, i.e.
    ``(p-1)/(3m+p-1)`` when ``f = b = w`` (Qi et al. 2024). Only without communication
    latency. ZB-V has no closed form here; for ``f = b = w`` its lower bound is
    ``(p-1)/(6m+p-1)``.
    """
    p, m, v = pp, microbatches, virtual_stages
    if times.comm != 0:
        return None
    if name == "gpipe":
        return (p - 1) / (m + p - 1)
    if name == "1f1b":
        if times.w > times.f:
            return None
        idle = (p - 1) * (times.f + times.b)
        total = m * (times.f + times.b + times.w) + idle
        return idle / total if total > 0 else None
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1" and m >= p and times.w <= min(times.f, times.b):
        idle = (p - 1) * (times.f + times.b - times.w)
        total = m * (times.f + times.b + times.w) + idle
        return idle / total if total > 0 else None
    return None


def parse_times(text: str) -> tuple[float, float, float]:
    """Parse ``"F,B,W"`` (three non-negative numbers) for ``meshtrain simulate --times``."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 0:
        raise ConfigError(f"--times takes three non-negative numbers F,B,W (forward, "
                          f"backward-input, backward-weight), e.g. 1,1,1; got {text!r}")
    return values  # type: ignore[return-value]


def simulate_named(name: str, pp: int, microbatches: int, virtual_stages: int,
                   rank_times: tuple[float, float, float] = (1.0, 1.0, 1.0),
                   comm: float = 0.0) -> tuple[Schedule, SimulationResult, dict]:
    """Build, check and simulate a named schedule; return it, the result and a JSON report.

    ``rank_times`` are the F, B, W costs of one micro-batch through one rank's share of the
    layers, so makespans compare across schedules: each of a rank's ``virtual_stages`` chunks
    costs ``1/virtual_stages`` of them. ``comm`` is the latency of every cross-rank transfer.
    """
    from meshtrain.parallel.pipeline.checker import check_schedule
    from meshtrain.parallel.pipeline.schedules import build_schedule

    if comm < 0:
        raise ConfigError(f"--comm must be >= 0, got {comm}")
    schedule = build_schedule(name, pp, microbatches, virtual_stages)
    check_schedule(schedule)
    f, b, w = (x / virtual_stages for x in rank_times)
    stage_times = StageTimes(f=f, b=b, w=w, comm=comm)
    result = simulate(schedule, stage_times)
    report = {
        "schedule": name, "pp": pp, "microbatches": microbatches,
        "virtual_stages": virtual_stages,
        "times": {"f": rank_times[0], "b": rank_times[1], "w": rank_times[2], "comm": comm},
        "stage_times": {"f": f, "b": b, "w": w, "comm": comm},
        "makespan": result.makespan, "bubble_fraction": result.bubble_fraction,
        "peak_inflight": result.peak_inflight,
        "closed_form_bubble": closed_form_bubble(name, pp, microbatches, virtual_stages,
                                                 stage_times),
    }
    return schedule, result, report


def format_report(report: dict) -> str:
    """A small text table of :func:`simulate_named`'s report."""
    t = report["times"]
    closed = report["closed_form_bubble"]
    rows = [
        ("schedule", f"{report['schedule']} (pp={report['pp']}, microbatches="
                     f"{report['microbatches']}, virtual_stages={report['virtual_stages']})"),
        ("times per rank", f"f={t['f']:g} b={t['b']:g} w={t['w']:g} comm={t['comm']:g}"),
        ("makespan", f"{report['makespan']:.4g}"),
        ("bubble_fraction", f"{report['bubble_fraction']:.4f}"),
        ("closed form", "n/a" if closed is None else f"{closed:.4f}"),
        ("peak in-flight", " ".join(f"r{r}={n}" for r, n in enumerate(report["peak_inflight"]))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
