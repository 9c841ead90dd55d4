"""The fitted constants of the cost model, re-derived from the rows marked train, and only them.

Each routine here takes published rows and refuses any that is not marked ``train``
(:func:`require_train`), so a test row's numbers can never reach a constant. The constants the
code uses are written in :mod:`meshtrain.planner.tables.stacks` (GEMM efficiencies, the
per-expert overhead) and :mod:`meshtrain.planner.tables.profiles` (the allocator reserve, the MFU
caps);
``python -m meshtrain.planner.tables.published --fit`` prints what these routines give, and the
tests check that the written constants are what they give.
"""

from __future__ import annotations

import dataclasses

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


def _uncapped(row: PublishedRow):
    """The row's profile without its MFU cap (a fit must not be bent by a cap it sets)."""
    return dataclasses.replace(PROFILES[row.profile], max_mfu=0.0)


def speed_error(row: PublishedRow, result: dict) -> float:
    """How much faster than published ``result`` prices ``row``: predicted / published - 1 for
    a rate, published / predicted - 1 for a step time (positive: predicted too fast)."""
    predicted = result[row.metric]
    if row.metric == "step_time_s":
        return row.published / predicted - 1
    return predicted / row.published - 1


def _mean_speed_error(rows: list[PublishedRow], value: float, field: str) -> float:
    errors = [speed_error(r, priced(with_stack_efficiency(r, value, field), _uncapped(r)))
              for r in rows]
    return sum(errors) / len(errors)


def _bisect(rows: list[PublishedRow], field: str, low: float, high: float, tolerance: float,
            slower_upward: bool = False) -> float:
    """The value of ``field`` in ``[low, high]`` at which ``rows`` are on average neither faster
    nor slower than published (``slower_upward``: a larger value prices the rows slower, as an
    overhead does; else faster, as an efficiency does)."""
    require_train(rows)
    while high - low > tolerance:
        middle = (low + high) / 2
        too_slow = _mean_speed_error(rows, middle, field) < 0
        if too_slow != slower_upward:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def fit_gemm_efficiency(rows: list[PublishedRow], tolerance: float = 5e-4,
                        field: str = "gemm") -> float:
    """The GEMM efficiency (``field``: ``gemm``, or ``fp8_gemm`` for FP8 linear layers) at which
    ``rows`` (train rows of one stack on one GPU generation, priced without an MFU cap) are on
    average neither faster nor slower than published (mean :func:`speed_error` zero), by
    bisection."""
    return _bisect(rows, field, 0.3, 1.0, tolerance)


def fit_expert_overhead(rows: list[PublishedRow], tolerance: float = 0.05) -> float:
    """The per-expert overhead (``StackEfficiency.expert_overhead_ns``: nanoseconds per routed
    token per local expert per MoE layer) at which ``rows`` (train rows of MoE runs of one stack
    on one GPU generation) are on average neither faster nor slower than published, by
    bisection between 0 and 10 µs."""
    return _bisect(rows, "expert_overhead_ns", 0.0, 10000.0, tolerance, slower_upward=True)


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
    throughput row on it)."""
    groups: dict[str, list[PublishedRow]] = {}
    for r in rows:
        if r.split != "train":
            continue
        groups.setdefault(r.fits, []).append(r)
        # The MFU caps are bf16 figures: FP8 rows fit only their FP8 efficiency.
        if r.metric != "memory_gb_per_gpu" and not r.workload.traits.fp8_linear:
            groups.setdefault(f"mfu cap {PROFILES[r.profile].family}", []).append(r)
    return groups


def refit(rows: list[PublishedRow]) -> dict[str, float]:
    """Every fitted constant from the train rows among ``rows`` (test rows are never read)."""
    out = {}
    for name, group in fit_groups(rows).items():
        if name == "allocator reserve":
            out[name] = fit_allocator_reserve(group)
        elif name.startswith("mfu cap"):
            out[name] = fit_mfu_cap(group)
        elif name.endswith(" fp8"):
            out[name] = fit_gemm_efficiency(group, field="fp8_gemm")
        elif name.endswith(" experts"):
            out[name] = fit_expert_overhead(group)
        else:
            out[name] = fit_gemm_efficiency(group)
    return out
