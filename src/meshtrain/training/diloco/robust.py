"""Robust outer updates: one bad replica group cannot poison the others (docs/diloco.md).

A DiLoCo round combines the replica groups' pseudo-gradients into one outer gradient. A plain
mean lets one group decide the result: a NaN makes the start weights, masters and momentum of
every group NaN for good, and one huge finite update moves every group's model as far as it
likes. So each round (each fragment's, when streaming) goes in two stages.

**Screening** (:func:`screen`). Every group's pseudo-gradient norm is known to every rank
before anything else is exchanged (the callers sum each rank's shard norm² over its group; see
:meth:`~meshtrain.training.diloco.outer.OuterOptimizer.screen`). A group is left out of the
round when its norm is not finite, or when it exceeds ``parallel.outer_max_norm_ratio`` × the
median of the finite groups' norms. Every rank computes this from the same numbers, so the
decision is the same everywhere. A group left out contributes zeros: its values are replaced,
never multiplied by zero (NaN × 0 is NaN).

**Aggregation** over the groups kept (``parallel.outer_aggregate``, :data:`AGGREGATES`):

- ``mean``: their mean. Set explicitly, ``mean`` is the plain mean of every group present, with
  **no screening** (for groups that trust each other, and to see what the screening prevents);
  the default with two groups is the mean after screening (:func:`screens`);
- ``clipped-mean``: each kept group's pseudo-gradient scaled down to at most the median of the
  kept groups' norms, then their mean (still one all-reduce: each group scales its own);
- ``median``: the coordinate-wise median (the mean of the two middle values for an even count);
- ``trimmed-mean``: coordinate-wise, the mean without each coordinate's largest and smallest
  value (with fewer than 3 groups kept, their mean).

The sum-style aggregates (:data:`SUM_AGGREGATES`) need one all-reduce of each group's
:func:`contribution`; the coordinate-wise ones see every kept group's value of a coordinate in
one place, so they are reduced where the 8-bit mean already is: chunk ``j`` of every group's
tensor goes to rank ``j``, which applies :func:`combine` to its rows, and the results are
all-gathered (:func:`meshtrain.training.diloco.quantized_reduce.exchange_reduce`).

With no group kept the aggregate is all NaN (nothing is exchanged), which the outer step refuses
to apply.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from meshtrain.config.sections import OUTER_AGGREGATES as AGGREGATES

SUM_AGGREGATES = ("mean", "clipped-mean")
"""Aggregates that are a weighted sum of the groups' pseudo-gradients: one all-reduce."""
COORDINATE_AGGREGATES = ("median", "trimmed-mean")
"""Aggregates taken coordinate by coordinate over the kept groups: two exchanges."""


def resolve_aggregate(name: str, groups: int) -> str:
    """``parallel.outer_aggregate`` as run: empty = ``clipped-mean`` with 3 or more groups (a
    median of two norms is their mean, so clipping to it does little), else ``mean``."""
    if not name:
        return "clipped-mean" if groups >= 3 else "mean"
    if name not in AGGREGATES:
        raise ValueError(f"unknown outer aggregate {name!r}; valid: {', '.join(AGGREGATES)}")
    return name


def screens(configured: str) -> bool:
    """Whether rounds are screened under ``parallel.outer_aggregate = configured``: always,
    except for an explicit ``mean`` (the plain mean; a non-finite result is still never
    applied)."""
    return configured != "mean"


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (the mean of the two middle ones for an even count); NaN when
    empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Which groups take part in one round's aggregate, and why the others do not."""

    norms: tuple[float, ...]
    """Each group's pseudo-gradient norm (NaN where not finite or absent)."""
    kept: tuple[bool, ...]
    """Whether each group's pseudo-gradient enters the aggregate."""
    reasons: dict[int, str]
    """The present groups left out, each with the reason (absent groups are not listed)."""
    median: float
    """The median norm of the groups with a finite one: the yardstick of the exclusion."""
    clip: float
    """The median norm of the kept groups: ``clipped-mean``'s bound."""

    @property
    def count(self) -> int:
        """Groups kept."""
        return sum(self.kept)

    @property
    def rejected(self) -> list[int]:
        """The present groups left out, in order."""
        return sorted(self.reasons)

    def weight(self, group: int, aggregate: str) -> float:
        """The factor on ``group``'s pseudo-gradient in a sum-style aggregate: 0 when left out,
        ``min(1, clip / norm)`` under ``clipped-mean``, else 1."""
        if not self.kept[group]:
            return 0.0
        norm = self.norms[group]
        if aggregate == "clipped-mean" and norm > self.clip:
            return self.clip / norm
        return 1.0


def screen(squared_norms: Sequence[float], ratio: float,
           present: Sequence[bool] | None = None, screening: bool = True) -> Verdict:
    """The :class:`Verdict` of one round from every group's squared pseudo-gradient norm (in
    group order) and ``parallel.outer_max_norm_ratio``; ``present``: which groups took part
    (fault-tolerant groups; default all). A present group is left out when its norm is not
    finite or exceeds ``ratio`` × the median of the finite norms; with ``screening`` False (an
    explicit ``mean``, :func:`screens`) no group is left out."""
    present = [True] * len(squared_norms) if present is None else list(present)
    norms = [math.sqrt(s) if here and math.isfinite(s) and s >= 0 else math.nan
             for s, here in zip(squared_norms, present, strict=True)]
    yardstick = median([n for n in norms if not math.isnan(n)])
    reasons: dict[int, str] = {}
    for group, (norm, here) in enumerate(zip(norms, present, strict=True)):
        if not here or not screening:
            continue
        if math.isnan(norm):
            reasons[group] = "its pseudo-gradient (or its norm) is not finite"
        elif norm > ratio * yardstick:
            reasons[group] = (f"its pseudo-gradient norm {norm:.4g} is over {ratio:g} × the "
                              f"median {yardstick:.4g} (parallel.outer_max_norm_ratio)")
    kept = tuple(here and group not in reasons for group, here in enumerate(present))
    clip = median([n for n, k in zip(norms, kept, strict=True) if k])
    return Verdict(tuple(norms), kept, reasons, yardstick, clip)


def contribution(flat: torch.Tensor, verdict: Verdict, group: int,
                 aggregate: str) -> torch.Tensor:
    """What ``group`` sends into the one all-reduce of a sum-style aggregate: zeros when it is
    left out (a new tensor), its pseudo-gradient times :meth:`Verdict.weight` otherwise (scaled
    in place; ``flat`` itself when the weight is 1). The sum over groups divided by
    :attr:`Verdict.count` is the aggregate."""
    weight = verdict.weight(group, aggregate)
    if weight == 0.0:
        return torch.zeros_like(flat)
    return flat if weight == 1.0 else flat.mul_(weight)


def combine(rows: torch.Tensor, verdict: Verdict, aggregate: str) -> torch.Tensor:
    """The aggregate of ``rows`` (fp32, one row per group, every group's raw pseudo-gradient or
    the same chunk of each) over the groups :attr:`Verdict.kept`; the rows of the others are
    never read. All NaN when no group is kept."""
    index = [g for g, kept in enumerate(verdict.kept) if kept]
    if not index:
        return rows.new_full(rows.shape[1:], math.nan)
    kept = rows[index]
    count = len(index)
    if aggregate in SUM_AGGREGATES:
        weights = [verdict.weight(g, aggregate) for g in index]
        if any(w != 1.0 for w in weights):
            kept.mul_(kept.new_tensor(weights).view(-1, *[1] * (kept.dim() - 1)))
        return kept.sum(dim=0) / count
    if aggregate == "trimmed-mean" and count < 3:
        return kept.sum(dim=0) / count
    ordered = kept.sort(dim=0).values
    if aggregate == "trimmed-mean":
        return ordered[1:count - 1].sum(dim=0) / (count - 2)
    middle = count // 2
    if count % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def squared_norm(flat: torch.Tensor) -> float:
    """``flat``'s squared norm (NaN or inf when an element is not finite; 0 when empty)."""
    if not flat.numel():
        return 0.0
    return float(torch.linalg.vector_norm(flat.float(), dtype=torch.float32)) ** 2


def quorum_aggregate(flats: list[torch.Tensor], group: int, groups: int, aggregate: str,
                     ratio: float, dtype: torch.dtype, participants: int,
                     allreduce_mean: Callable[[torch.Tensor], None],
                     inner_sum: Callable[[torch.Tensor], object],
                     device: torch.device | str = "cpu", screening: bool = True
                     ) -> tuple[list[torch.Tensor], list[Verdict]]:
    """The aggregates of one fault-tolerant round (:mod:`.replica_ft`) and their verdicts.

    ``flats``: this rank's pseudo-gradient of each due fragment; ``group`` of ``groups``: this
    group's id; ``participants``: groups in the quorum; ``allreduce_mean``: torchft's in-place
    all-reduce over them, which divides the sum by ``participants`` (the only reduction it
    offers); ``inner_sum``: an in-place sum over this group's own ranks; ``device``: where the
    exchanged tensors live (the collectives' device); ``screening``: as :func:`screen`'s.

    1. Each rank's squared shard norms are summed over its group (``inner_sum``); then one
       all-reduce of a float64 table of ``fragments × groups`` norms and ``groups`` presence
       flags, this group's slots filled, others zero, gives every group's norms (absent or
       healing-without-state groups read as absent).
    2. Sum-style aggregates: one all-reduce of each :func:`contribution`, times
       ``participants / kept``. Coordinate-wise ones: one all-reduce of a ``groups × n`` buffer
       with this group's row filled (zeros when it is left out), so every rank holds every
       group's row and applies :func:`combine`: ``groups`` times the bytes of the mean's
       all-reduce, as torchft has no all-to-all.
    """
    squares = torch.tensor([squared_norm(flat) for flat in flats], dtype=torch.float64,
                           device=device)
    inner_sum(squares)
    fragments = len(flats)
    table = torch.zeros(fragments * groups + groups, dtype=torch.float64, device=device)
    table[group:fragments * groups:groups] = squares
    table[fragments * groups + group] = 1.0
    allreduce_mean(table)
    table.mul_(participants)
    present = (table[fragments * groups:] > 0.5).tolist()
    verdicts = [screen(table[f * groups:(f + 1) * groups].tolist(), ratio, present, screening)
                for f in range(fragments)]
    means = []
    for flat, verdict in zip(flats, verdicts, strict=True):
        if not flat.numel():
            means.append(flat)
        elif verdict.count == 0:  # the same on every rank: nothing is exchanged
            means.append(torch.full_like(flat, math.nan))
        elif aggregate in SUM_AGGREGATES:
            sent = contribution(flat, verdict, group, aggregate).to(dtype)
            allreduce_mean(sent)
            if verdict.count == participants:
                means.append(sent.float())
            else:
                means.append(sent.float().mul_(participants / verdict.count))
        else:
            rows = torch.zeros(groups, flat.numel(), dtype=dtype, device=flat.device)
            if verdict.kept[group]:
                rows[group] = flat
            allreduce_mean(rows)
            means.append(combine(rows.float().mul_(participants), verdict, aggregate))
    return means, verdicts
