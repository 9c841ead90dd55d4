"""The fitted constants of the cost model, re-derived from the rows marked train, and only them.

Each routine here takes published rows and refuses any that is not marked ``train``
(:func:`require_train`), so a test row's numbers can never reach a constant. The constants the
code uses are written in :mod:`meshtrain.planner.tables.stacks` (GEMM efficiencies, the
per-expert overhead) and :mod:`meshtrain.planner.tables.profiles` (the allocator reserve, the MFU
caps, the overlap contention); ``python -m meshtrain.planner.tables.published --fit`` prints
what these routines give, and the tests check that the written constants are what they give.
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.hardware.stack_efficiency import StackEfficiency
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.planner.tables.runs_row import PublishedRow


class NotATrainRow(ValueError):
    """A fitting routine was handed a row that is not marked train."""


def require_train(rows: list[PublishedRow]) -> list[PublishedRow]:
    """``rows``, refused (:class:`NotATrainRow`) unless every one is marked train and there is
    at least one."""
    bad = [r.name for r in rows if r.split != "train"]
    if bad or not rows:
        raise NotATrainRow(f"fitting needs train rows only; got {bad or 'none'}")
    return rows


def _cluster(row: PublishedRow, profile=None) -> Cluster:
    return Cluster(profile or PROFILES[row.profile], row.gpus, 8)


def priced(row: PublishedRow, profile=None) -> dict:
    """The estimate of ``row``'s layout (on ``profile``, default the row's own)."""
    return estimate(row.workload, row.layout, _cluster(row, profile))


def with_stack_efficiency(row: PublishedRow, value: float, field: str = "gemm") -> PublishedRow:
    """``row`` priced with one figure of its stack's entry for the row's GPU set to ``value``
    (``field``: ``gemm``, a fresh entry; or another :class:`StackEfficiency` field, the rest of
    the entry kept: ``fp8_gemm`` for the FP8 efficiency, ``expert_overhead_ns``)."""
    family = PROFILES[row.profile].family
    traits = row.workload.traits
    current = dict(traits.kernel_efficiency).get(family)
    entries = tuple((f, e) for f, e in traits.kernel_efficiency if f != family)
    if field == "gemm":
        trial = StackEfficiency(gemm=value, source="trial")
    elif current is None:
        raise ValueError(f"{row.name}: no {family} entry in its stack to give {field} to")
    else:
        trial = dataclasses.replace(current, **{field: value}, source="trial")
    traits = dataclasses.replace(traits, kernel_efficiency=((family, trial), *entries))
    return dataclasses.replace(row, workload=dataclasses.replace(row.workload, traits=traits))


def _uncapped(row: PublishedRow, contention: float | None = None):
    """The row's profile without its MFU cap (a fit must not be bent by a cap it sets), with
    ``contention`` as its ``overlap_contention`` when given."""
    profile = dataclasses.replace(PROFILES[row.profile], max_mfu=0.0)
    if contention is not None and profile.family:
        profile = dataclasses.replace(profile, overlap_contention=contention)
    return profile


def speed_error(row: PublishedRow, result: dict) -> float:
    """How much faster than published ``result`` prices ``row``: predicted / published - 1 for
    a rate, published / predicted - 1 for a step time (positive: predicted too fast)."""
    predicted = result[row.metric]
    if row.metric == "step_time_s":
        return row.published / predicted - 1
    return predicted / row.published - 1


def _speed_errors(rows: list[PublishedRow], value: float, field: str,
                  contention: float | None = None) -> list[float]:
    return [speed_error(r, priced(with_stack_efficiency(r, value, field),
                                  _uncapped(r, contention))) for r in rows]


def _crossing(rows: list[PublishedRow], field: str, low: float, high: float, tolerance: float,
              slower_upward: bool = False, contention: float | None = None) -> float:
    """The value of ``field`` in ``[low, high]`` at which ``rows`` are on average neither faster
    nor slower than published (``slower_upward``: a larger value prices the rows slower, as an
    overhead does; else faster, as an efficiency does), to within ``tolerance``; an end of the
    range when the crossing lies beyond it.

    The bracket is narrowed by regula falsi with the Illinois correction (the mean error is
    smooth in the value, so a few estimates of every row suffice where halving takes a dozen),
    each trial kept ``tolerance / 2`` inside the bracket so that it always closes."""
    require_train(rows)
    sign = -1.0 if slower_upward else 1.0

    def error(value: float) -> float:  # rises with value
        return sign * sum(_speed_errors(rows, value, field, contention)) / len(rows)

    low_error, high_error = error(low), error(high)
    if low_error >= 0:
        return low
    if high_error <= 0:
        return high
    kept = 0  # which end the last trial replaced: -1 low, 1 high
    while high - low > tolerance:
        trial = (low * high_error - high * low_error) / (high_error - low_error)
        trial = min(max(trial, low + tolerance / 2), high - tolerance / 2)
        trial_error = error(trial)
        if trial_error == 0:
            return trial
        if trial_error < 0:
            low, low_error = trial, trial_error
            if kept == -1:
                high_error /= 2
            kept = -1
        else:
            high, high_error = trial, trial_error
            if kept == 1:
                low_error /= 2
            kept = 1
    return (low + high) / 2


def fit_gemm_efficiency(rows: list[PublishedRow], tolerance: float = 5e-4,
                        field: str = "gemm", contention: float | None = None) -> float:
    """The GEMM efficiency (``field``: ``gemm``, or ``fp8_gemm`` for FP8 linear layers) at which
    ``rows`` (train rows of one stack on one GPU generation, priced without an MFU cap) are on
    average neither faster nor slower than published (mean :func:`speed_error` zero), by a
    bracketing search (:func:`_crossing`); ``contention``: price them with that
    ``overlap_contention`` instead of their profiles'."""
    return _crossing(rows, field, 0.3, 1.0, tolerance, contention=contention)


def fit_expert_overhead(rows: list[PublishedRow], tolerance: float = 0.05,
                        contention: float | None = None) -> float:
    """The per-expert overhead (``StackEfficiency.expert_overhead_ns``: nanoseconds per routed
    token per local expert per MoE layer) at which ``rows`` (train rows of MoE runs of one stack
    on one GPU generation) are on average neither faster nor slower than published, by a
    bracketing search between 0 and 10 µs."""
    return _crossing(rows, "expert_overhead_ns", 0.0, 10000.0, tolerance, slower_upward=True,
                     contention=contention)


def _speed_field(group: str) -> str:
    """The :class:`StackEfficiency` field a speed group's train rows fit."""
    if group.endswith(" fp8"):
        return "fp8_gemm"
    return "expert_overhead_ns" if group.endswith(" experts") else "gemm"


def _fit_speed(rows: list[PublishedRow], field: str, contention: float | None = None) -> float:
    """``field`` fitted on ``rows`` (:func:`fit_expert_overhead` or :func:`fit_gemm_efficiency`)."""
    if field == "expert_overhead_ns":
        return fit_expert_overhead(rows, contention=contention)
    return fit_gemm_efficiency(rows, field=field, contention=contention)


def contention_spread(groups: dict[str, list[PublishedRow]], contention: float) -> float:
    """Root mean square of the train rows' speed errors when every GPU profile charges
    ``contention`` of the time of hidden communication (``HardwareProfile.overlap_contention``)
    and each group's constant is fitted again at it: what is left once every constant has
    taken out its group's mean error (over the groups of two rows or more: one row alone is
    priced exactly at any contention)."""
    errors = []
    for name, rows in groups.items():
        if len(rows) < 2:  # fitted exactly at any contention: it cannot tell one from another
            continue
        field = _speed_field(name)
        value = _fit_speed(rows, field, contention)
        errors += _speed_errors(rows, value, field, contention)
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


def fit_overlap_contention(groups: dict[str, list[PublishedRow]],
                           tolerance: float = 0.002) -> float:
    """The ``HardwareProfile.overlap_contention`` in [0, 1] at which the train rows' speed
    errors are smallest (:func:`contention_spread`, by golden-section search), with every
    stack constant fitted again at each trial value: the one fitted figure set by how a
    stack's rows differ from each other (how much of their traffic hides behind compute), not
    by their mean. ``groups``: the speed groups of :func:`speed_groups`."""
    for rows in groups.values():
        require_train(rows)
    ratio = (math.sqrt(5) - 1) / 2
    low, high = 0.0, 1.0
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    spread_a, spread_b = contention_spread(groups, a), contention_spread(groups, b)
    while high - low > tolerance:
        if spread_a <= spread_b:
            high, b, spread_b = b, a, spread_a
            a = high - ratio * (high - low)
            spread_a = contention_spread(groups, a)
        else:
            low, a, spread_a = a, b, spread_b
            b = low + ratio * (high - low)
            spread_b = contention_spread(groups, b)
    return (low + high) / 2


def fit_allocator_reserve(rows: list[PublishedRow]) -> float:
    """The caching allocator's reserve (fraction of the live tensors) that makes the predicted
    peak of the train memory rows equal what they reserved, on average; never below 0."""
    require_train(rows)
    ratios = []
    for r in rows:
        profile = dataclasses.replace(PROFILES[r.profile], allocator_reserve=0.0)
        result = priced(r, profile)
        ratios.append(r.published / result["memory_gb_per_gpu"])
    return max(sum(ratios) / len(ratios) - 1, 0.0)


def published_mfu(row: PublishedRow) -> float:
    """The MFU ``row``'s published figure amounts to, with the cost model's FLOPs per token
    (``6N + 12 L h s``) and the row's profile's peak."""
    result = priced(row, _uncapped(row))
    if row.metric == "memory_gb_per_gpu":
        raise ValueError(f"{row.name}: a memory row has no MFU")
    scale = (result[row.metric] / row.published if row.metric == "step_time_s"
             else row.published / result[row.metric])
    return result["mfu"] * scale


def fit_mfu_cap(rows: list[PublishedRow]) -> float:
    """The best MFU among ``rows`` (train rows on one GPU generation): the cap no estimate on
    that generation exceeds."""
    return max(published_mfu(r) for r in require_train(rows))


def fit_groups(rows: list[PublishedRow]) -> dict[str, list[PublishedRow]]:
    """The train rows behind each fitted constant, by its name (``PublishedRow.fits``), and
    the rows each GPU generation's MFU cap is the best of (``mfu cap FAMILY``: every train
    throughput row on it), and the rows the overlap contention is fitted on (``overlap
    contention``: every train row of a speed constant, :func:`fit_overlap_contention`)."""
    groups: dict[str, list[PublishedRow]] = {}
    for r in rows:
        if r.split != "train":
            continue
        groups.setdefault(r.fits, []).append(r)
        if r.fits != "allocator reserve":
            groups.setdefault("overlap contention", []).append(r)
        # The MFU caps are bf16 figures: FP8 rows fit only their FP8 efficiency.
        if r.metric != "memory_gb_per_gpu" and not r.workload.traits.fp8_linear:
            groups.setdefault(f"mfu cap {PROFILES[r.profile].family}", []).append(r)
    return groups


def speed_groups(rows: list[PublishedRow]) -> dict[str, list[PublishedRow]]:
    """The groups of :func:`fit_groups` whose constant sets a stack's speed (a GEMM efficiency,
    an FP8 efficiency, a per-expert overhead)."""
    return {name: group for name, group in fit_groups(rows).items()
            if name not in ("allocator reserve", "overlap contention")
            and not name.startswith("mfu cap")}


def refit(rows: list[PublishedRow]) -> dict[str, float]:
    """Every fitted constant from the train rows among ``rows`` (test rows are never read)."""
    out = {}
    for name, group in fit_groups(rows).items():
        if name == "overlap contention":
            out[name] = fit_overlap_contention(speed_groups(rows))
        elif name == "allocator reserve":
            out[name] = fit_allocator_reserve(group)
        elif name.startswith("mfu cap"):
            out[name] = fit_mfu_cap(group)
        else:
            out[name] = _fit_speed(group, _speed_field(name))
    return out
