"""``meshtrain simulate``: build, check and time a pipeline schedule, optionally with an energy
schedule, and draw or trace its timeline."""

from __future__ import annotations

import argparse


def run_simulate(args: argparse.Namespace) -> int:
    """``meshtrain simulate``: build, check and time a pipeline schedule."""
    import json

    from meshtrain.parallel.pipeline.schedules import default_virtual_stages
    from meshtrain.parallel.pipeline.simulator import format_report, parse_times, simulate_named
    from meshtrain.parallel.pipeline.timeline import plot_timeline, write_chrome_trace

    v = args.virtual_stages if args.virtual_stages is not None else \
        default_virtual_stages(args.schedule)
    from meshtrain.parallel.pipeline.simulator import StageTimes, simulate
    from meshtrain.planner.energy.schedule import format_energy_schedule, simulate_energy

    schedule, result, report = simulate_named(args.schedule, args.pp, args.microbatches, v,
                                              parse_times(args.times), args.comm)
    times, energy, events = simulate_energy(
        schedule, StageTimes(**report["stage_times"]), args.slow_stage, args.hardware,
        args.max_slowdown, args.energy_schedule, args.steady_state)
    if args.slow_stage:
        result = simulate(schedule, times)
        report.update(slow_stage=args.slow_stage, makespan=result.makespan,
                      bubble_fraction=result.bubble_fraction, closed_form_bubble=None)
    title = (f"{args.schedule} pp={args.pp} m={args.microbatches} v={v}: bubble "
             f"{result.bubble_fraction:.3f}")
    if energy is not None:
        report["energy_schedule"] = energy
        title += f"; energy schedule saves {energy['saving']:.1%} ({energy['slowdown']:+.2%})"
    if args.plot:
        plot_timeline(events or result.events, args.pp, args.plot, title)
    if args.trace:
        write_chrome_trace(events or result.events, args.trace)
    text = format_report(report)
    if energy is not None:
        text += "\n" + format_energy_schedule(energy)
    print(json.dumps(report, indent=2) if args.json else text)
    return 0
