"""The layout change of this start, from :mod:`meshtrain.replan.elastic` to the trainer's first
record.

``parallel.elastic`` decides the layout before the trainer exists, in the same process (a
torchrun or srun task); the trainer writes the change as ``metrics.jsonl``'s ``layout`` field on
the first step after it. This module holds that one record between the two, so that the trainer
does not import the planner.
"""

from __future__ import annotations

_pending: dict | None = None


def remember_change(change: dict) -> None:
    """Keep ``change`` (from, to, reason, ...) for :func:`take_change`."""
    global _pending
    _pending = change


def take_change() -> dict | None:
    """The layout change of this start, once; None when there was none."""
    global _pending
    change, _pending = _pending, None
    return change
