"""Failures during a run that carry a message meant for the user.

The CLI prints such a failure's message (no traceback) and exits with status 1; a worker started
by the launcher records it for the launcher's summary instead of dumping a traceback.
"""

from __future__ import annotations


class RunFailure(RuntimeError):
    """A failure during the run, explained by its message (exit status 1)."""


class NonFiniteError(RunFailure):
    """The loss or the gradient norm was NaN or infinite and ``train.on_nonfinite`` stopped the
    run (or too many steps in a row were skipped)."""


class CollectiveMismatchError(RunFailure):
    """``train.debug_collectives``: the ranks of a group called different collectives."""
