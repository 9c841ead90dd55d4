"""Grouped GEMM for the experts of a MoE layer: every expert's rows in one call.

The rows of ``x`` [N, in] are grouped by expert (``counts[e]`` consecutive rows for expert
``e``); expert ``e`` multiplies its rows by ``w[e]`` [in, out]. :class:`ExpertGroups` holds the
grouping as ``offsets`` (the running end of each group, int32, on the device), which is all
``torch._grouped_mm`` needs: one kernel launch per product and no read of the counts on the
host.

Where the build's grouped GEMM does not take the inputs (an older torch, a dtype or device it
lacks, bf16 strides that are not multiples of 16 bytes), the products run as one matmul per
expert, and the counts are read to the host once per layer
(:attr:`ExpertGroups.host_counts`), shared by every product of that layer's forward and
backward. Both paths compute each expert's product as its own matmul over its rows, so they
agree (bit for bit on the CPU, where the grouped kernel loops over the groups).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def grouped_mm_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and both backward products here (probed once
    per device type and dtype on a tiny aligned problem, with an empty group)."""
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is None:
        return False
    try:
        x = torch.ones(8, 16, dtype=dtype, device=device_type)
        w = torch.ones(2, 16, 8, dtype=dtype, device=device_type)
        offsets = torch.tensor([0, 8], dtype=torch.int32, device=device_type)
        out = grouped(x, w, offs=offsets)
        grouped(out, w.transpose(-2, -1), offs=offsets)
        grouped(x.t(), out, offs=offsets)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return True


#: Run every product as one matmul per expert (for comparing the two paths; tests set it).
FORCE_PER_EXPERT = False


def _aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The grouped kernels need every stride but the unit one to be a multiple of 16 bytes."""
    return all(stride * t.element_size() % 16 == 0
               for t in (a, b) for stride in t.stride() if stride != 1)


class ExpertGroups:
    """How the rows of one MoE layer's expert input are grouped by expert.

    ``counts`` [E] (long, on the device) rows per expert, in expert order. ``offsets`` is
    their running sum (int32). ``host_counts`` is read from the device on first use only (the
    per-expert fallback needs Python ints to split the rows)."""

    def __init__(self, counts: torch.Tensor):
        self.counts = counts
        self.offsets = torch.cumsum(counts, 0).to(torch.int32)
        self._host: list[int] | None = None

    @property
    def host_counts(self) -> list[int]:
        """The counts as Python ints (one device-to-host read, cached)."""
        if self._host is None:
            self._host = self.counts.tolist()
        return self._host

    def use_grouped(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether ``a @ b`` per group may go through ``torch._grouped_mm``."""
        return (not FORCE_PER_EXPERT and grouped_mm_available(a.device.type, a.dtype)
                and _aligned(a, b))


def _grouped(a: torch.Tensor, b: torch.Tensor, groups: ExpertGroups) -> torch.Tensor | None:
    """``torch._grouped_mm(a, b)`` over ``groups``, or None where it does not take them (a
    layout the probe did not cover): the caller then runs one matmul per expert."""
    if not groups.use_grouped(a, b):
        return None
    try:
        return torch._grouped_mm(a, b, offs=groups.offsets)
    except RuntimeError:
        return None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """Rows of ``x`` [N, in] times their expert's ``w[e]`` [in, out]: [N, out]."""
    out = _grouped(x, w, groups)
    if out is not None:
        return out
    parts = torch.split(x, groups.host_counts, dim=0)
    return torch.cat([part @ w[e] for e, part in enumerate(parts)], dim=0)


def grouped_input_grad(go: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """Gradient of :func:`grouped_matmul` w.r.t. ``x``: ``go[rows of e] @ w[e]^T``."""
    wt = w.transpose(-2, -1)
    out = _grouped(go, wt, groups)
    if out is not None:
        return out
    parts = torch.split(go, groups.host_counts, dim=0)
    return torch.cat([part @ wt[e] for e, part in enumerate(parts)], dim=0)


def grouped_weight_grad(x: torch.Tensor, go: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """Gradient of :func:`grouped_matmul` w.r.t. ``w``: ``x[rows of e]^T @ go[rows of e]`` per
    expert, [E, in, out] (zero for an expert without rows)."""
    out = _grouped(x.t(), go, groups)
    if out is not None:
        return out
    counts = groups.host_counts
    xs, gos = torch.split(x, counts, dim=0), torch.split(go, counts, dim=0)
    return torch.stack([a.t() @ b for a, b in zip(xs, gos, strict=True)])
