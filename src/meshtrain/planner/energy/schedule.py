"""Energy schedule of a pipeline: run the actions off the critical path at lower clocks.

A pipeline step's length is its critical path: the chain of actions (same-rank order plus the
cross-rank send/recv hand-overs) with no slack. Every other action may finish later than it
does at full clock without delaying the step: bubbles, waits for a slower neighbour and
imbalanced stages all show up as slack. Following Perseus (Chung et al., SOSP 2024), each such
action is given a lower clock so that it finishes just in time, and the saving is what the
lower dynamic power buys.

The model (:class:`PowerCurve`, docs/energy.md): at clock ``c`` of a maximum ``C`` an action
takes ``t · C / c`` (compute-bound work) and the accelerator draws
``P_static + P_dynamic · (c / C)^3`` (dynamic power ``∝ f V²`` with the voltage roughly linear in
the clock over the DVFS range); a waiting accelerator draws ``P_static``.

The graph has the semantics of :func:`meshtrain.parallel.pipeline.simulator.simulate`: a compute
or send starts when its rank's previous compute/send has finished and its inputs are ready; a
receive completes at the later of its post time and the send's time plus the sending stage's
``comm`` latency. The earliest times of the unmodified graph are the simulator's.

The assignment is one pass in execution order: each action starts as early as its (possibly
slowed) predecessors allow and takes the lowest clock that still lets it finish by its latest
finish time (computed backwards from the target step time at full clock). Actions with zero
slack at the original step time are never slowed; the others may also use ``max_slowdown`` of
extra step time (both targets are tried: a longer step costs every rank static power). An
action that finishes by its latest finish time lets its successors start by theirs, so the step
ends by the target. A clock floor spreads slack over the actions of a chain
(the cubic makes two half-slowed actions cheaper than one fully slowed one); the pass is run for
every floor and the lowest-energy result kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from meshtrain.config import ConfigError
from meshtrain.parallel.pipeline.checker import dependencies, execution_order, produced_key
from meshtrain.parallel.pipeline.schedule import Action, Schedule
from meshtrain.parallel.pipeline.simulator import StageTimes, _per_stage
from meshtrain.planner.hardware.profile import HardwareProfile

EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class PowerCurve:
    """Clock–power–speed model of one accelerator (see the module doc)."""

    tdp_w: float
    max_clock_mhz: float
    min_clock_mhz: float
    step_mhz: float = 15.0
    static_fraction: float = 0.3

    @property
    def static_w(self) -> float:
        """Power that does not scale with the clock; what a waiting accelerator draws."""
        return self.static_fraction * self.tdp_w

    def busy_power(self, clock_mhz: float) -> float:
        """Watts while computing at ``clock_mhz``."""
        r = clock_mhz / self.max_clock_mhz
        return self.static_w + (self.tdp_w - self.static_w) * r ** 3

    def clocks(self) -> list[float]:
        """Settable clocks, highest first, from the maximum down in ``step_mhz`` steps."""
        n = int(math.floor((self.max_clock_mhz - self.min_clock_mhz) / self.step_mhz + EPS))
        return [self.max_clock_mhz - i * self.step_mhz for i in range(n + 1)]

    def lowest_clock_for(self, stretch: float, floor_mhz: float) -> float:
        """The lowest settable clock (>= ``floor_mhz``) at which an action may take ``stretch``
        times its full-clock time; the maximum clock when ``stretch <= 1``."""
        if stretch <= 1.0 + EPS:
            return self.max_clock_mhz
        needed = max(self.max_clock_mhz / stretch, floor_mhz, self.min_clock_mhz)
        steps = math.floor((self.max_clock_mhz - needed) / self.step_mhz + EPS)
        return self.max_clock_mhz - steps * self.step_mhz


def power_curve(profile: HardwareProfile) -> PowerCurve:
    """The profile's :class:`PowerCurve`; a :class:`ConfigError` if it has no clock data."""
    if profile.gpu_tdp_w <= 0 or profile.max_clock_mhz <= 0 or profile.min_clock_mhz <= 0:
        raise ConfigError(f"hardware profile {profile.name} has no clock/power curve "
                          "(gpu_tdp_w, max_clock_mhz, min_clock_mhz); the energy schedule needs "
                          "one (the named GPU profiles have it).")
    return PowerCurve(profile.gpu_tdp_w, profile.max_clock_mhz, profile.min_clock_mhz,
                      profile.clock_step_mhz, profile.static_power_fraction)


@dataclasses.dataclass
class ActionGraph:
    """Every action of a schedule as a node: ``preds[n]`` holds ``(node, lag)`` pairs (node
    ``n`` starts at or after the predecessor's end plus ``lag``); ``duration`` at full clock."""

    nodes: list[tuple[int, Action]]
    preds: list[list[tuple[int, float]]]
    duration: list[float]

    def earliest(self, duration: Sequence[float] | None = None) -> tuple[list[float],
                                                                         list[float]]:
        """(start, end) of every node when each starts as early as it can."""
        duration = self.duration if duration is None else duration
        start, end = [], []
        for n, preds in enumerate(self.preds):
            s = max((end[p] + lag for p, lag in preds), default=0.0)
            start.append(s)
            end.append(s + duration[n])
        return start, end

    def latest_finish(self, target: float,
                      rank_target: Sequence[float] | None = None) -> list[float]:
        """The latest end of every node (full-clock durations) for the step to end by
        ``target``, and each rank's nodes by ``rank_target[rank]`` when given."""
        latest = [target if rank_target is None else min(target, rank_target[r])
                  for r, _ in self.nodes]
        for n in range(len(self.nodes) - 1, -1, -1):
            begin = latest[n] - self.duration[n]
            for p, lag in self.preds[n]:
                latest[p] = min(latest[p], begin - lag)
        return latest


def action_graph(schedule: Schedule, times: StageTimes | Sequence[StageTimes]) -> ActionGraph:
    """The dependency graph of ``schedule``'s actions under per-stage ``times``."""
    per_stage = _per_stage(schedule, times)
    nodes: list[tuple[int, Action]] = []
    preds: list[list[tuple[int, float]]] = []
    duration: list[float] = []
    last: dict[int, int] = {}  # rank -> its latest compute/send node
    producer: dict[tuple, int] = {}
    for rank, act in execution_order(schedule):
        n = len(nodes)
        edges = [(last[rank], 0.0)] if rank in last else []
        deps = dependencies(schedule, rank, act)
        if act.kind.is_recv:
            edges += [(producer[d], per_stage[d[2]].comm) for d in deps]
            duration.append(0.0)
        else:
            edges += [(producer[d], 0.0) for d in deps]
            duration.append(per_stage[act.stage].cost(act.kind))
            last[rank] = n
        producer[produced_key(act)] = n
        nodes.append((rank, act))
        preds.append(edges)
    return ActionGraph(nodes, preds, duration)


@dataclasses.dataclass
class EnergySchedule:
    """A clock per action and what it saves. Energies are per step for the pipeline's ranks
    (one replica: ``pp`` accelerators), accelerator only unless named ``node``."""

    clocks: list[float]
    """Per node of :attr:`graph` (communication nodes keep the maximum clock)."""
    graph: ActionGraph
    start: list[float]
    end: list[float]
    baseline_makespan: float
    makespan: float
    baseline_energy_j: float
    energy_j: float
    server_w: float
    """Power per accelerator of the rest of the server (``power_w - gpu_tdp_w``), constant."""

    @property
    def slowdown(self) -> float:
        """Step time over the full-clock step time, minus one."""
        return self.makespan / self.baseline_makespan - 1 if self.baseline_makespan else 0.0

    @property
    def saving(self) -> float:
        """Fraction of accelerator energy saved per step."""
        return 1 - self.energy_j / self.baseline_energy_j if self.baseline_energy_j else 0.0

    def node_saving(self, pp: int) -> float:
        """Fraction saved counting the server's share too (it draws for the whole step)."""
        base = self.baseline_energy_j + self.server_w * pp * self.baseline_makespan
        now = self.energy_j + self.server_w * pp * self.makespan
        return 1 - now / base if base else 0.0

    def events(self) -> list[tuple[int, Action, float, float]]:
        """``(rank, action, start, end)`` of the scheduled step (draw with
        :func:`meshtrain.parallel.pipeline.timeline.plot_timeline`)."""
        timed = zip(self.graph.nodes, self.start, self.end, strict=True)
        return [(r, a, s, e) for (r, a), s, e in timed]

    def rank_plan(self, pp: int, max_clock: float) -> list[dict]:
        """Per rank: the time-weighted mean clock of its compute and how much of its compute
        time (at full clock) runs below the maximum clock."""
        plan = []
        for rank in range(pp):
            ids = [n for n, (r, a) in enumerate(self.graph.nodes)
                   if r == rank and a.kind.is_compute]
            busy = sum(self.graph.duration[n] for n in ids)
            slowed = sum(self.graph.duration[n] for n in ids if self.clocks[n] < max_clock)
            mean = (sum(self.clocks[n] * self.graph.duration[n] for n in ids) / busy
                    if busy else max_clock)
            plan.append({"rank": rank, "mean_clock_mhz": mean,
                         "min_clock_mhz": min((self.clocks[n] for n in ids), default=max_clock),
                         "slowed_share": slowed / busy if busy else 0.0})
        return plan


def step_energy(graph: ActionGraph, clocks: Sequence[float], end: Sequence[float],
                pp: int, curve: PowerCurve) -> tuple[float, float]:
    """(makespan, accelerator joules) of a step: each action at its clock's busy power for its
    stretched time, every rank at the static power for the rest of the step."""
    makespan = max(end, default=0.0)
    busy = [0.0] * pp
    energy = 0.0
    for n, (rank, act) in enumerate(graph.nodes):
        if act.kind.is_compute and graph.duration[n] > 0:
            t = graph.duration[n] * curve.max_clock_mhz / clocks[n]
            busy[rank] += t
            energy += curve.busy_power(clocks[n]) * t
    energy += sum(curve.static_w * (makespan - b) for b in busy)
    return makespan, energy


def _assign(graph: ActionGraph, curve: PowerCurve, latest: list[float], frozen: list[bool],
            floor_mhz: float) -> tuple[list[float], list[float], list[float]]:
    clocks, start, end = [], [], []
    for n, preds in enumerate(graph.preds):
        s = max((end[p] + lag for p, lag in preds), default=0.0)
        d = graph.duration[n]
        clock = curve.max_clock_mhz
        if not frozen[n] and d > 0:
            clock = curve.lowest_clock_for((latest[n] - s) / d, floor_mhz)
        clocks.append(clock)
        start.append(s)
        end.append(s + d * curve.max_clock_mhz / clock)
    return clocks, start, end


def energy_schedule(schedule: Schedule, times: StageTimes | Sequence[StageTimes],
                    curve: PowerCurve, max_slowdown: float = 0.01,
                    server_w: float = 0.0, steady_state: bool = False) -> EnergySchedule:
    """Clocks for ``schedule``'s actions that cut energy at no more than ``max_slowdown``
    longer steps, never slowing an action on the critical path (see the module doc).

    ``steady_state``: steps follow one another without a flush, the next step's warm-up
    filling this one's drain (as zero-bubble schedules run with the optimizer step validated
    after the fact, Qi et al. 2024 4): each rank's actions must then end by its own last
    end at full clock (plus the allowance), so only idle time inside a rank's busy span is
    slack. meshtrain's steps flush (each ends with the optimizer step on every rank), so the
    runtime's schedule uses the fill and drain idle as well (the default)."""
    if max_slowdown < 0:
        raise ConfigError(f"--max-slowdown must be >= 0, got {max_slowdown}")
    graph = action_graph(schedule, times)
    pp = schedule.pp
    start0, end0 = graph.earliest()
    base = max(end0, default=0.0)
    rank_end = None
    if steady_state:
        rank_end = [0.0] * pp
        for (rank, _), end in zip(graph.nodes, end0, strict=True):
            rank_end[rank] = max(rank_end[rank], end)
    full = [curve.max_clock_mhz] * len(graph.nodes)
    _, base_energy = step_energy(graph, full, end0, pp, curve)
    tolerance = EPS * max(base, 1.0)
    critical = [latest - end <= tolerance
                for latest, end in zip(graph.latest_finish(base, rank_end), end0, strict=True)]
    best = EnergySchedule(full, graph, start0, end0, base, base, base_energy, base_energy,
                          server_w)
    # A longer step costs every rank static power, so the allowance is not always worth using.
    for target in sorted({base, base * (1 + max_slowdown)}):
        latest = graph.latest_finish(
            target, None if rank_end is None else [e + target - base for e in rank_end])
        for floor in curve.clocks():
            clocks, start, end = _assign(graph, curve, latest, critical, floor)
            makespan, energy = step_energy(graph, clocks, end, pp, curve)
            if energy < best.energy_j - tolerance:
                best = EnergySchedule(clocks, graph, start, end, base, makespan, base_energy,
                                      energy, server_w)
    return best


def energy_schedule_report(result: EnergySchedule, pp: int, curve: PowerCurve) -> dict:
    """JSON-ready summary: saving, slowdown, energies per step and the per-rank clock plan."""
    return {"baseline_step": result.baseline_makespan, "step": result.makespan,
            "slowdown": result.slowdown, "baseline_energy_j": result.baseline_energy_j,
            "energy_j": result.energy_j, "saving": result.saving,
            "saving_with_server": result.node_saving(pp),
            "max_clock_mhz": curve.max_clock_mhz,
            "ranks": result.rank_plan(pp, curve.max_clock_mhz)}


def layout_energy_schedule(result: dict, layout, profile: HardwareProfile,
                           max_slowdown: float = 0.01) -> tuple[EnergySchedule, PowerCurve]:
    """The :class:`EnergySchedule` of an estimate's pipeline (its per-rank stage times, split
    evenly over each rank's virtual stages) and the profile's power curve."""
    from meshtrain.parallel.pipeline.schedules import build_schedule

    curve = power_curve(profile)
    v = layout.virtual_stages
    schedule = build_schedule(layout.pp_schedule, layout.pp, layout.microbatches, v)
    times = [StageTimes(*(x / v for x in result["stage_times_s"][schedule.rank_of(s)]))
             for s in range(schedule.num_stages)]
    return energy_schedule(schedule, times, curve, max_slowdown,
                           max(profile.power_w - profile.gpu_tdp_w, 0.0)), curve


def layout_schedule(result: dict, layout, profile: HardwareProfile,
                    max_slowdown: float = 0.01) -> dict:
    """The energy schedule of an :func:`~meshtrain.planner.cost.estimate.estimate` result's pipeline
    (its per-rank stage times), as :func:`energy_schedule_report`; ``cluster_saving_j`` scales
    one pipeline's saving to every GPU of the layout."""
    if layout.pp < 2:
        raise ConfigError("--energy-schedule needs a pipeline (parallel.pp > 1): without one "
                          "every rank is on the critical path.")
    scheduled, curve = layout_energy_schedule(result, layout, profile, max_slowdown)
    report = energy_schedule_report(scheduled, layout.pp, curve)
    report["cluster_saving_j"] = ((report["baseline_energy_j"] - report["energy_j"])
                                  * layout.world_size / layout.pp)
    return report


def parse_slow_stage(text: str) -> tuple[int, float]:
    """``"S:FACTOR"`` for ``meshtrain simulate --slow-stage``: stage S takes FACTOR times as
    long (an imbalanced pipeline)."""
    try:
        stage, factor = text.split(":")
        value = (int(stage), float(factor))
    except ValueError:
        value = (-1, 0.0)
    if value[0] < 0 or value[1] <= 0:
        raise ConfigError(f"--slow-stage takes STAGE:FACTOR, e.g. 3:1.2; got {text!r}")
    return value


def simulate_energy(schedule: Schedule, base: StageTimes, slow_stage: str | None,
                    hardware: str, max_slowdown: float, with_schedule: bool,
                    steady_state: bool = False
                    ) -> tuple[list[StageTimes], dict | None, list | None]:
    """For ``meshtrain simulate``: per-stage times (one stage slowed by ``slow_stage``), and
    with ``with_schedule`` the energy schedule's report and its events (to draw);
    ``steady_state`` as in :func:`energy_schedule`."""
    from meshtrain.planner.tables.profiles import load_profile

    times = [base] * schedule.num_stages
    if slow_stage:
        stage, factor = parse_slow_stage(slow_stage)
        if stage >= schedule.num_stages:
            raise ConfigError(f"--slow-stage {slow_stage}: there are {schedule.num_stages} "
                              "stages (0-based)")
        times[stage] = StageTimes(base.f * factor, base.b * factor, base.w * factor, base.comm)
    if not with_schedule:
        return times, None, None
    profile = load_profile(hardware)
    curve = power_curve(profile)
    result = energy_schedule(schedule, times, curve, max_slowdown,
                             max(profile.power_w - profile.gpu_tdp_w, 0.0), steady_state)
    report = energy_schedule_report(result, schedule.pp, curve)
    report["hardware"] = profile.name
    report["steady_state"] = steady_state
    return times, report, result.events()


def format_energy_schedule(report: dict, unit: str = "") -> str:
    """A few lines of :func:`energy_schedule_report`'s report."""
    lines = [f"energy schedule: {report['saving']:.1%} less accelerator energy per step "
             f"({report['saving_with_server']:.1%} with the server's share), "
             f"{report['baseline_energy_j']:.4g} -> {report['energy_j']:.4g} J{unit}, "
             f"step {report['baseline_step']:.4g} -> {report['step']:.4g} "
             f"({report['slowdown']:+.2%})",
             "rank  mean clock MHz  lowest MHz  compute slowed"]
    for r in report["ranks"]:
        lines.append(f"{r['rank']:>4}  {r['mean_clock_mhz']:>14.0f}  {r['min_clock_mhz']:>10.0f}"
                     f"  {r['slowed_share']:>14.0%}")
    return "\n".join(lines)
