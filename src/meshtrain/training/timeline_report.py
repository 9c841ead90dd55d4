"""Measured pipeline timelines: every rank's action start/end times of one step, written as a
Chrome trace and a PNG, with the measured bubble next to the simulator's prediction.

The prediction feeds the simulator the *measured* mean F, B (or I) and W times of each stage and
the same action lists, so the two numbers differ only by what the model leaves out (communication
jitter, scheduling noise, the machine's other load).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.parallel.pipeline import StageTimes, simulate
from meshtrain.parallel.pipeline.executor import PipelineExecutor
from meshtrain.parallel.pipeline.schedule import Action, ActionKind


def measured_bubble(events, pp: int) -> float:
    """Idle time over pp × makespan from measured ``(rank, action, start, end)`` events."""
    start = min(e[2] for e in events)
    end = max(e[3] for e in events)
    busy = sum(e[3] - e[2] for e in events)
    return 1.0 - busy / (pp * (end - start))


def stage_times_from(events, num_stages: int) -> list[StageTimes]:
    """Mean measured F / B-or-I / W duration of each stage: ``b`` is the mean over the stage's
    ``I`` actions and its whole ``B`` actions less ``w`` (the stage's mean ``W``, 0 where none
    ran), as a rank of 1F1B with early gradient sends runs both."""
    per: dict[tuple[int, ActionKind], list[float]] = {}
    for _, action, t0, t1 in events:
        per.setdefault((action.stage, action.kind), []).append(t1 - t0)

    def mean(stage, kind):
        values = per.get((stage, kind))
        return statistics.fmean(values) if values else 0.0

    times = []
    for s in range(num_stages):
        w = mean(s, ActionKind.W)
        backward = per.get((s, ActionKind.I), []) + [d - w for d in per.get((s, ActionKind.B), [])]
        b = statistics.fmean(backward) if backward else 0.0
        times.append(StageTimes(f=mean(s, ActionKind.F), b=max(b, 0.0), w=w))
    return times


def event_to_json(event: tuple) -> list:
    """A measured ``(rank, action, start, end)`` event as JSON-able values (for the gather)."""
    rank, action, start, end = event
    return [rank, [action.kind.value, action.microbatch, action.stage, action.peer], start, end]


def event_from_json(value: list) -> tuple:
    """The event :func:`event_to_json` encoded."""
    rank, (kind, microbatch, stage, peer), start, end = value
    return int(rank), Action(ActionKind(kind), int(microbatch), int(stage), peer), start, end


def write_measured_timeline(executor: PipelineExecutor, mesh: ParallelMesh,
                            run_dir: Path) -> dict | None:
    """Gather this step's events over the pp group; the logging rank writes
    ``timeline.json`` (Chrome trace), ``timeline.png`` and ``timeline_summary.json``."""
    from meshtrain.parallel.timing import events_to_seconds

    # CUDA event stamps become host seconds here, once per step (a sync after the step's work)
    mine = [event_to_json(e) for e in events_to_seconds(executor.events)]
    gathered = mesh.comm("pp").all_gather_json(mine)
    if not mesh.is_logging_rank:
        return None
    from meshtrain.parallel.pipeline.timeline import plot_timeline, write_chrome_trace

    events = [event_from_json(e) for rank_events in gathered for e in rank_events]
    origin = min(e[2] for e in events)
    events = [(r, a, t0 - origin, t1 - origin) for r, a, t0, t1 in events]
    schedule = executor.schedule
    run_dir.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(events, run_dir / "timeline.json")
    plot_timeline(events, schedule.pp, run_dir / "timeline.png",
                  title=f"measured {schedule.name} pp={schedule.pp} m={schedule.microbatches}")
    predicted = simulate(schedule, stage_times_from(events, schedule.num_stages))
    summary = {"schedule": schedule.name, "pp": schedule.pp,
               "microbatches": schedule.microbatches,
               "measured_bubble_fraction": measured_bubble(events, schedule.pp),
               "simulated_bubble_fraction": predicted.bubble_fraction,
               "measured_makespan_s": max(e[3] for e in events),
               "simulated_makespan_s": predicted.makespan}
    (run_dir / "timeline_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
