"""Numerical faults: never let a NaN or infinite loss or gradient norm slip into the weights.

After each step's gradients are reduced, the trainer hands the global loss and the global
gradient norm (equal on every rank, so every rank takes the same decision) to
:class:`NonFiniteGuard`, which applies ``train.on_nonfinite``:

- ``skip``: the optimizer step is not applied (the gradients are zeroed as usual), the step is
  counted in ``metrics.jsonl`` (``nonfinite_skips``) and a line is printed; after
  ``train.max_nonfinite_skips`` non-finite steps **in a row** the run stops with exit 1.
- ``stop``: the run stops at once with exit 1 and a message naming the step and, where cheap, the
  first parameter (in model order) whose gradient is not finite on the reporting rank.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from meshtrain.errors import NonFiniteError


def _nonfinite_parts(loss: float, aux: float, grad_norm: float) -> list[str]:
    parts = []
    if not math.isfinite(loss):
        parts.append(f"loss = {loss}")
    if not math.isfinite(aux):
        parts.append(f"MoE aux loss = {aux}")
    if not math.isfinite(grad_norm):
        parts.append(f"gradient norm = {grad_norm}")
    return parts


class NonFiniteGuard:
    """Applies ``train.on_nonfinite`` to each step; counts skipped steps."""

    def __init__(self, policy: str, max_skips: int, verbose: bool = True):
        if policy not in ("skip", "stop"):
            raise ValueError(f"unknown on_nonfinite policy {policy!r}")
        self.policy = policy
        self.max_skips = max_skips
        self.verbose = verbose
        self.in_a_row = 0
        self.total_skipped = 0

    def check(self, step: int, loss: float, aux: float, grad_norm: float,
              find_parameter: Callable[[], str | None] = lambda: None) -> bool:
        """True when step ``step`` (1-based) may apply its update; False to skip it. Raises
        :class:`~meshtrain.errors.NonFiniteError` when the policy says to stop."""
        parts = _nonfinite_parts(loss, aux, grad_norm)
        if not parts:
            self.in_a_row = 0
            return True
        what = " and ".join(parts)
        if self.policy == "stop":
            name = find_parameter()
            where = f"; first non-finite gradient: {name}" if name else ""
            raise NonFiniteError(f"step {step}: non-finite {what}{where}. Stopping "
                                 f'(train.on_nonfinite = "stop"); the update was not applied.')
        self.in_a_row += 1
        self.total_skipped += 1
        if self.in_a_row >= self.max_skips:
            raise NonFiniteError(
                f"step {step}: non-finite {what}; {self.in_a_row} steps in a row were "
                f"non-finite (train.max_nonfinite_skips = {self.max_skips}); stopping. Lower "
                f"train.lr or check the data.")
        if self.verbose:
            print(f"meshtrain: step {step}: non-finite {what}; skipped the optimizer step "
                  f"({self.in_a_row} in a row, at most {self.max_skips - 1})",
                  file=sys.stderr, flush=True)
        return False


@torch.no_grad()
def first_nonfinite_gradient(engine, shards, model: torch.nn.Module) -> str | None:
    """Name of the first parameter (in ``model.named_parameters()`` order) with a non-finite
    gradient element in this rank's optimizer gradients, or None. Only called when stopping."""
    order = {name: index for index, (name, _) in enumerate(model.named_parameters())}
    sharded = getattr(engine, "stage", 0) >= 1
    found: list[tuple[int, str]] = []
    for shard in shards:
        grad = shard.grad()
        for slot, start, length in shard.bucket.segments(sharded=sharded):
            if not bool(torch.isfinite(grad[start:start + length]).all()):
                found.append((order.get(slot.name, len(order)), slot.name))
    return min(found)[1] if found else None
