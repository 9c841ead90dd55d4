"""Per-step rank timings: which rank is slow, how long the others wait for it, and stop requests.

Every rank splits its step time in two: the time it spent in collectives (blocking calls and
waits on async ones, counted by the comm layer as ``CommLog.wait_s``), and the rest, its
*compute* (``step_time_s - wait_s``). In a synchronous step every rank takes about as long as
the slowest, so a slow rank shows as more compute and the others as more waiting.

At the end of every step the trainer makes **one** small all-gather over the whole world
(:func:`exchange`): three numbers per rank (compute, wait, and the stop signal it received, 0 for
none; :mod:`meshtrain.training.preemption`). Every rank gets the same table, so every rank takes
the same stop decision. From the compute column, :class:`StragglerDetector` names the slowest rank
and its *excess*: its compute minus the median compute of the other ranks, about how long each of
them waited for it this step (``metrics.jsonl`` field ``straggler``). A rank whose compute is
above ``train.straggler_factor`` times the other ranks' median for ``train.straggler_steps``
steps in a row is named in a warning on rank 0's log.

The clock is the host's (``time.perf_counter``): exact on CPU, where gloo's calls block until
the data has arrived. On CUDA a NCCL call returns to the host before it completes, so the waits
show up in whatever synchronises next; there the split is the host's view.
"""

from __future__ import annotations

import statistics
import sys

import torch

COLUMNS = ("compute_s", "wait_s", "stop_signal")


def exchange(mesh, compute_s: float, wait_s: float, stop_signal: int) -> torch.Tensor:
    """All-gather (over the world) each rank's ``(compute_s, wait_s, stop_signal)``; returns a
    ``(world_size, 3)`` float64 CPU tensor, one row per rank (one row without peers)."""
    row = torch.tensor([compute_s, wait_s, float(stop_signal)], dtype=torch.float64)
    comm = mesh.comm("world")
    if not comm.active:
        return row.reshape(1, len(COLUMNS))
    device_row = row.to(mesh.device)
    table = torch.empty(mesh.world_size * len(COLUMNS), dtype=torch.float64, device=mesh.device)
    comm.all_gather_into(table, device_row)
    return table.reshape(mesh.world_size, len(COLUMNS)).cpu()


def stop_signal_of(table: torch.Tensor) -> int:
    """The stop signal any rank received (the largest number; 0 = none)."""
    return int(table[:, 2].max().item())


class StragglerDetector:
    """Names the slowest rank of each step and warns about a rank that stays slow.

    ``factor`` 0 turns the warning off (the ``straggler`` field is still reported); ``verbose``
    is True on the rank that prints (rank 0).
    """

    def __init__(self, factor: float, steps: int, verbose: bool):
        self.factor, self.steps, self.verbose = factor, steps, verbose
        self.streaks: dict[int, int] = {}
        """Consecutive steps each currently slow rank has been above the factor."""
        self.warnings: list[str] = []

    def observe(self, step: int, compute: list[float]) -> dict | None:
        """The ``straggler`` record of ``step`` from every rank's compute seconds (None for one
        rank): ``{"rank", "excess_s", "factor"}``; warns when a rank's streak reaches the limit."""
        if len(compute) < 2:
            return None
        others = [statistics.median(compute[:r] + compute[r + 1:]) for r in range(len(compute))]
        slowest = max(range(len(compute)), key=lambda r: compute[r] - others[r])
        ratios = [c / m if m > 0 else float("inf") for c, m in zip(compute, others, strict=True)]
        if self.factor > 0:
            slow = {r for r, ratio in enumerate(ratios) if ratio > self.factor}
            self.streaks = {r: self.streaks.get(r, 0) + 1 for r in slow}
            for rank, streak in sorted(self.streaks.items()):
                if streak == self.steps:
                    self._warn(step, rank, compute[rank], others[rank], ratios[rank])
        return {"rank": slowest, "excess_s": max(compute[slowest] - others[slowest], 0.0),
                "factor": ratios[slowest]}

    def _warn(self, step: int, rank: int, compute: float, median: float, ratio: float) -> None:
        text = (f"meshtrain: warning: step {step}: rank {rank} is a straggler: its compute took "
                f"{compute:.3f} s, {ratio:.1f} x the other ranks' median {median:.3f} s, for "
                f"{self.steps} steps in a row (train.straggler_factor = {self.factor:g}); the "
                f"others wait about {compute - median:.3f} s per step for it")
        self.warnings.append(text)
        if self.verbose:
            print(text, file=sys.stderr, flush=True)
