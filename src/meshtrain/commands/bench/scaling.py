"""The ``scaling`` suite: meshtrain's throughput at 1, 2, 4, ... processes on each axis.

Strong scaling: every layout trains the **same global batch** (the bench shape), so the ideal
throughput at ``n`` processes is ``n`` times the one-process run's, and a layout's **efficiency**
is ``tokens/s(n) / (n × tokens/s(1))``. Each axis is measured alone: ``dp`` (ZeRO-0, bucketed
all-reduce), ``tp`` (Megatron layout, no sequence parallelism) and ``pp`` (1F1B over
``parallel.microbatches`` micro-batches; when that is left at 1, ``2 × pp`` of them). The
one-process run is shared by every axis. A layout the shape cannot take (``pp = 4`` of a 2-layer
model, say) is skipped and listed with the reason.

Runs go through the same machinery as the side-by-side suites (fresh processes, one thread each,
warm-up discarded, median step time, median over repeats; the layouts are cycled within each
repeat, so load drift is shared). ``cpu_efficiency`` is the same ratio from CPU seconds per step
(the slowest rank's), which stays meaningful when processes outnumber cores: wall-clock
efficiency is then bounded by ``cores / n`` however good the code is (the JSON has
``cpu_count``).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from typing import Any

from meshtrain.commands.bench.base import (
    BenchOptions,
    Suite,
    bench_config,
    check_requirements,
    run_once,
    shape_of,
    summarise_run,
)
from meshtrain.config import Config, ConfigError

SCALING_AXES = ("dp", "tp", "pp")
"""The axes the suite scales, each alone."""


def scaling_layout(config: Config, axis: str, procs: int) -> None:
    """Set ``config.parallel`` to ``procs`` processes on ``axis`` alone (1: one process)."""
    par = config.parallel
    par.dp, par.tp, par.pp, par.ep, par.zero = 1, 1, 1, 1, 0
    par.sequence_parallel = False
    if procs == 1:
        return
    setattr(par, axis, procs)
    if axis == "pp":
        par.pp_schedule = "1f1b"
        if par.microbatches == 1:
            par.microbatches = 2 * procs


def scaling_points(options: BenchOptions) -> list[tuple[str, int]]:
    """``(axis, procs)`` of every layout measured: the shared one-process run first."""
    counts = sorted({n for n in options.procs if n > 1})
    return [("-", 1)] + [(axis, n) for axis in SCALING_AXES for n in counts]


def point_config(suite: Suite, options: BenchOptions, axis: str, procs: int) -> Config:
    """The validated config of one layout (raises :class:`ConfigError` if impossible)."""
    layout = dataclasses.replace(suite, world_size=procs,
                                 configure=lambda config: scaling_layout(config, axis, procs))
    return bench_config(layout, options.overrides, options.warmup + options.steps)[0]


def check_scaling(suite: Suite, options: BenchOptions) -> None:
    """Refuse a bad ``--set`` (through the one-process layout) and a ``--plot`` path that cannot
    be written; impossible layouts are skipped at run time instead."""
    point_config(suite, options, "-", 1)
    if options.plot:
        folder = os.path.dirname(os.path.abspath(options.plot))
        if not os.path.isdir(folder):
            raise ConfigError(f'--plot "{options.plot}": the folder {folder} does not exist.')
        check_requirements(dataclasses.replace(suite, requires=("matplotlib",)))


def run_scaling(suite: Suite, options: BenchOptions, log: Callable[[str], None]) -> dict:
    """Measure every layout ``options.repeats`` times (cycled) and return the suite's document."""
    configs: dict[tuple[str, int], Config] = {}
    skipped = []
    for axis, procs in scaling_points(options):
        try:
            configs[(axis, procs)] = point_config(suite, options, axis, procs)
        except ConfigError as error:
            skipped.append({"axis": axis, "procs": procs, "reason": str(error)})
            log(f"bench scaling: skipping {axis} = {procs}: {error}")
    runs: dict[tuple[str, int], list[dict]] = {point: [] for point in configs}
    for repeat in range(options.repeats):
        for (axis, procs), config in configs.items():
            # with the malloc settings `meshtrain train` gives its workers
            ranks = run_once(procs, suite.meshtrain_worker, config, options, True)
            run = summarise_run(ranks)
            runs[(axis, procs)].append(run)
            log(f"bench scaling: repeat {repeat + 1}/{options.repeats} {axis} = {procs:<2} "
                f"{run['tokens_per_s']:>10,.0f} tokens/s  (median step {run['step_time_s']:.3f} s)")
    result = scaling_result(configs, runs, options)
    result["skipped"] = skipped
    if options.plot:
        plot_scaling(result, options.plot)
        result["plot"] = options.plot
        log(f"bench scaling: wrote {options.plot}")
    return result


def _point(procs: int, config: Config, rs: list[dict], base: dict | None) -> dict[str, Any]:
    """One layout's entry: medians over its runs and the efficiency against ``base``."""
    par = config.parallel
    point: dict[str, Any] = {
        "procs": procs,
        "layout": {"dp": par.dp, "tp": par.tp, "pp": par.pp, "microbatches": par.microbatches},
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
        "cpu_tokens_per_s": statistics.median(r["cpu_tokens_per_s"] for r in rs),
        "runs_tokens_per_s": [r["tokens_per_s"] for r in rs],
        "peak_bytes_per_rank": [max(r["peak_bytes"][k] for r in rs) for k in range(procs)],
        "first_loss": rs[0]["losses"][0], "last_loss": rs[0]["losses"][-1],
    }
    base = base or point
    point["speedup"] = point["tokens_per_s"] / base["tokens_per_s"]
    point["efficiency"] = point["speedup"] / procs
    point["cpu_efficiency"] = point["cpu_tokens_per_s"] / (procs * base["cpu_tokens_per_s"])
    return point


def scaling_result(configs: dict[tuple[str, int], Config], runs: dict[tuple[str, int], list],
                   options: BenchOptions) -> dict:
    """The JSON document of the ``scaling`` suite (see ``docs/performance.md``)."""
    import torch

    base_config = configs[("-", 1)]
    base = _point(1, base_config, runs[("-", 1)], None)
    axes: dict[str, list[dict]] = {}
    efficiency: dict[str, dict[str, float]] = {}
    for axis in SCALING_AXES:
        points = [base] + [_point(n, configs[(a, n)], runs[(a, n)], base)
                           for (a, n) in configs if a == axis]
        axes[axis] = points
        efficiency[axis] = {str(p["procs"]): p["efficiency"] for p in points[1:]}
    t = base_config.train
    return {
        "suite": "scaling", "world_size": max(n for _, n in configs),
        "peer": "ideal linear scaling of meshtrain's own one-process run",
        "axes": axes, "efficiency": efficiency,
        "cpu_count": os.cpu_count(), "steps": options.steps, "warmup": options.warmup,
        "repeats": options.repeats, "tokens_per_step": t.global_batch * t.seq_len,
        "threads_per_process": max(r["threads"] for rs in runs.values() for r in rs),
        "shape": shape_of(base_config), "torch_version": torch.__version__,
    }


def format_scaling(result: dict) -> str:
    """A plain-text table of the ``scaling`` suite's result."""
    mib = 1024 * 1024
    header = (f"{'axis':<5} {'procs':>5} {'tokens/s':>10} {'speedup':>8} {'efficiency':>10} "
              f"{'cpu eff':>8}  peak MiB per rank")
    lines = ["scaling (same global batch; efficiency = tokens/s / (procs × one-process tokens/s))",
             header, "-" * len(header)]
    for axis, points in result["axes"].items():
        for p in points if axis == SCALING_AXES[0] else points[1:]:
            label = axis if p["procs"] > 1 else "-"
            peaks = ", ".join(f"{b / mib:.0f}" for b in p["peak_bytes_per_rank"])
            lines.append(f"{label:<5} {p['procs']:>5} {p['tokens_per_s']:>10,.0f} "
                         f"{p['speedup']:>8.2f} {p['efficiency']:>10.2f} "
                         f"{p['cpu_efficiency']:>8.2f}  {peaks}")
    for skip in result.get("skipped", []):
        lines.append(f"{skip['axis']:<5} {skip['procs']:>5}  skipped: {skip['reason']}")
    lines.append(f"{result['cpu_count']} CPU core(s), {result['threads_per_process']} thread(s) "
                 f"per process: with more processes than cores, wall efficiency is at most "
                 f"cores / procs")
    return "\n".join(lines)


def plot_scaling(result: dict, path: str) -> None:
    """Write tokens/s against processes, one line per axis and the ideal, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    base = result["axes"][SCALING_AXES[0]][0]
    procs = sorted({p["procs"] for points in result["axes"].values() for p in points})
    ax.plot(procs, [n * base["tokens_per_s"] for n in procs], "k--", lw=1,
            label="ideal (linear)")
    cores = result.get("cpu_count") or 0
    if cores and cores < max(procs):
        ax.plot(procs, [min(n, cores) * base["tokens_per_s"] for n in procs], "k:", lw=1,
                label=f"ideal on {cores} core(s)")
    for axis, points in result["axes"].items():
        ax.plot([p["procs"] for p in points], [p["tokens_per_s"] for p in points], "o-",
                label=axis)
    ax.set_xscale("log", base=2)
    ax.set_xticks(procs, [str(n) for n in procs])
    ax.set_xlabel("processes (one thread each)")
    ax.set_ylabel("tokens/s (global batch, median)")
    s = result["shape"]
    ax.set_title(f"meshtrain scaling: dim {s['dim']} × {s['n_layers']} layers, "
                 f"{s['global_batch']} × {s['seq_len']} tokens/step", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
