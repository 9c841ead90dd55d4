"""Pipeline bubble and in-flight micro-batches of each schedule, for the cost model.

When :mod:`meshtrain.parallel.pipeline` (schedules as action lists and their simulator) is
importable, the bubble and each rank's peak in-flight activations come from simulating the real
schedule. Otherwise — and for pipelines too large to simulate quickly — closed forms are used:

============================  ====================================================  ==========
schedule                      bubble time (per rank)                                in flight
============================  ====================================================  ==========
gpipe                         (p-1)(f+b+w)                                          m
1f1b                          (p-1)(f+b+w)  (Narayanan et al. 2021, 2.2)           p - rank
1f1b, early gradient sends    (p-1)(f+b+w-min(w,f))  (exact for w <= f)             p - rank
interleaved-1f1b (v chunks)   (p-1)(f+b+w)/v                                        see below
zb-h1                         (p-1)(f+b-w)  (Qi et al. 2024, "Zero Bubble PP")      p - rank
zb-v                          (p-1)(f+b-2w), at least 0                             p - rank
============================  ====================================================  ==========

The second 1F1B line is meshtrain's runtime (``early_grad_sends``: the cool-down backwards of
every rank but the first run as input gradient, send, weight gradient); a runtime whose trait
``pp_early_grad_sends`` is off (the published stacks) gets the first.

``f``, ``b``, ``w`` are one micro-batch's forward, backward-for-inputs and backward-for-weights
times on one stage (``b + w`` is the whole backward). The interleaved schedule keeps
``(p - rank - 1) * 2 + (v - 1) * p + 1`` chunks in flight on a rank (Megatron-LM's warm-up count),
each ``1/v`` of the stage's layers, so rank 0 holds ``1 + (p-1)/(p v)`` times 1F1B's activations
(Korthikanti et al. 2022, 4.2.3). Memory is counted in *stage-microbatches*: how many
micro-batches' worth of one full stage's activations a rank holds at its peak.
"""

from __future__ import annotations

import dataclasses
import functools

SIMULATE_MAX_ACTIONS = 6_000


@dataclasses.dataclass(frozen=True)
class PipelineEstimate:
    """Bubble fraction of the step, and peak activations held per pipeline rank."""

    bubble_fraction: float
    """Idle share of the pipelined part of the step (0 without pipelining)."""
    makespan_units: float
    """Pipelined time divided by the time of one micro-batch's f+b+w on one stage."""
    peak_inflight: list[float]
    """Per rank, peak activations held, in stage-microbatches (see module doc)."""
    source: str
    """``simulator`` or ``closed-form``."""


def _closed_form_inflight(schedule: str, pp: int, m: int, v: int) -> list[float]:
    if schedule == "gpipe":
        return [float(m)] * pp
    if schedule == "interleaved-1f1b" and v > 1:
        return [min(interleaved_warmup(pp, v, rank) + 1, m * v) / v for rank in range(pp)]
    return [float(min(pp - rank, m)) for rank in range(pp)]


def interleaved_warmup(pp: int, v: int, rank: int) -> int:
    """Chunk forwards ``rank`` runs under interleaved 1F1B before its first backward
    (Megatron-LM's warm-up count), when the step has that many."""
    return (pp - rank - 1) * 2 + (v - 1) * pp


@functools.lru_cache(maxsize=4096)
def interleaved_peak_layers(pp: int, m: int, v: int, rank: int,
                            chunk_layers: tuple[int, ...]) -> int:
    """The most layer-microbatches of activations ``rank`` holds under interleaved 1F1B when
    its chunks have the layer counts ``chunk_layers`` (chunk order; an uneven split such as
    a first chunk holding only the embedding makes them differ).

    Walks the rank's order of work: ``(p - rank - 1) * 2 + (v - 1) * p`` warm-up forwards,
    then one forward and one backward at a time, the cool-down backwards last; forward ``k``
    is of chunk ``(k // p) % v``, backward ``k`` of chunk ``v - 1 - (k // p) % v``
    (Megatron-LM's order, which :mod:`meshtrain.parallel.pipeline` runs too). With equal
    chunks this is the closed form's count times the chunk size."""
    total = m * v
    warmup = min(interleaved_warmup(pp, v, rank), total)
    held = peak = forwards = backwards = 0
    while forwards < total:
        held += chunk_layers[(forwards // pp) % v]
        forwards += 1
        peak = max(peak, held)
        if forwards > warmup:
            held -= chunk_layers[v - 1 - (backwards // pp) % v]
            backwards += 1
    return peak


def _closed_form_bubble_time(schedule: str, pp: int, v: int, f: float, b: float,
                             w: float, early_grad_sends: bool) -> float:
    if schedule == "interleaved-1f1b":
        return (pp - 1) * (f + b + w) / max(v, 1)
    if schedule == "zb-h1":
        return (pp - 1) * max(f + b - w, 0.0)
    if schedule == "zb-v":
        return (pp - 1) * max(f + b - 2 * w, 0.0)
    if schedule == "1f1b" and early_grad_sends:
        return (pp - 1) * (f + b + w - min(w, f))
    return (pp - 1) * (f + b + w)


@functools.lru_cache(maxsize=64)
def _built(schedule: str, pp: int, m: int, v: int, early_grad_sends: bool):
    """The runtime's schedule and its execution plan, built once per shape: a search prices
    the same schedule at many timings."""
    from meshtrain.parallel.pipeline import build_schedule
    from meshtrain.parallel.pipeline.simulator import execution_plan

    sched = build_schedule(schedule, pp, m, v, early_grad_sends)
    return sched, execution_plan(sched)


def _simulate(schedule: str, pp: int, m: int, v: int, f: float, b: float,
              w: float, early_grad_sends: bool) -> PipelineEstimate | None:
    """The real schedule through the runtime's simulator, or ``None`` when unavailable."""
    if pp * m * max(v, 1) * 3 > SIMULATE_MAX_ACTIONS:
        return None
    try:
        from meshtrain.parallel.pipeline import StageTimes, simulate
    except ImportError:
        return None
    try:
        sched, plan = _built(schedule, pp, m, v, early_grad_sends)
        result = simulate(sched, times=StageTimes(f=f / v, b=b / v, w=w / v, comm=0.0),
                          plan=plan)
    except Exception:  # noqa: BLE001 - a schedule the runtime refuses falls back to the formula
        return None
    unit = f + b + w
    inflight = [float(n) / v for n in result.peak_inflight]
    return PipelineEstimate(float(result.bubble_fraction), float(result.makespan) / unit,
                            inflight, "simulator")


def pipeline_estimate(schedule: str, pp: int, m: int, v: int, f: float, b: float,
                      w: float, use_simulator: bool = True,
                      early_grad_sends: bool = True) -> PipelineEstimate:
    """Bubble and peak in-flight activations of ``schedule`` with ``pp`` stages, ``m``
    micro-batches and ``v`` virtual stages per rank (``f, b, w`` per stage, see module doc);
    ``early_grad_sends``: 1F1B as meshtrain runs it (the runtime trait
    ``pp_early_grad_sends``)."""
    v = v if schedule in ("interleaved-1f1b",) else (2 if schedule == "zb-v" else 1)
    unit = f + b + w
    if pp <= 1 or unit <= 0:
        return PipelineEstimate(0.0, float(m), [1.0] * max(pp, 1), "closed-form")
    if use_simulator:
        simulated = _simulate(schedule, pp, m, v, f, b, w, early_grad_sends)
        if simulated is not None:
            return simulated
    busy = m * unit
    bubble = _closed_form_bubble_time(schedule, pp, v, f, b, w, early_grad_sends)
    return PipelineEstimate(bubble / (busy + bubble), (busy + bubble) / unit,
                            _closed_form_inflight(schedule, pp, m, v), "closed-form")


def pipeline_bubble(schedule: str, pp: int, m: int, v: int, f: float, b: float,
                    w: float) -> float:
    """Idle fraction of the pipelined part of a step (see :func:`pipeline_estimate`)."""
    return pipeline_estimate(schedule, pp, m, v, f, b, w).bubble_fraction
