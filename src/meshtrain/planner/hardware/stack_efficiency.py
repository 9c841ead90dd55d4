"""Kernel efficiencies a software stack reaches on a GPU generation.

A hardware profile (:mod:`meshtrain.planner.hardware.profile`) says what the chip can do: its peak
and, as ``matmul_efficiency`` / ``attention_efficiency``, the default fraction of peak its kernels
reach. What a training runtime gets out of the same chip depends on the runtime: its cuBLAS and
PyTorch versions, fused or eager kernels, launch overheads hidden or not. A stack
(:class:`meshtrain.planner.cost.workload.RuntimeTraits`) therefore carries its own figures per GPU
generation, ``RuntimeTraits.kernel_efficiency``: ``(family, StackEfficiency)`` pairs keyed by a
profile's ``family`` (``a100``, ``h100``, ...). :func:`kernel_efficiency` resolves the figures
one estimate uses:

- the stack's entry for the profile's family, when it has one;
- otherwise the profile's own ``matmul_efficiency`` and ``attention_efficiency`` (each profile
  states where its default comes from);
- a measured profile (``meshtrain calibrate``: ``measured`` set, no family) always keeps its
  measured figures: a stack entry describes a GPU generation, not the machine measured.

Every entry states its source: the rows of :mod:`meshtrain.planner.tables.published` marked
train for it, which it was fitted on (:mod:`meshtrain.planner.tables.fitting`).

There is no separate size dependence here: a GEMM's time is ``flops / (peak × gemm) +
kernel_overhead_us`` (:class:`meshtrain.planner.cost.timing.GemmClock`), so small per-GPU GEMMs
already run below the large-GEMM efficiency through the profile's per-kernel overhead; a second,
size-dependent efficiency would count the same effect twice, and no train row separates the two.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - types only
    from meshtrain.planner.hardware.profile import HardwareProfile


@dataclasses.dataclass(frozen=True)
class StackEfficiency:
    """One stack's kernel figures on one GPU generation, with where they come from."""

    gemm: float
    """Fraction of the profile's ``peak_tflops`` the stack's large bf16 GEMMs reach inside a
    training step (replaces the profile's ``matmul_efficiency``)."""
    source: str
    """A cited published figure, or the train rows it was fitted on."""
    attention: float | None = None
    """Fused attention throughput relative to the GEMM rate; None: the profile's
    ``attention_efficiency`` (no source gives the stack's own)."""
    fp8_gemm: float | None = None
    """Fraction of the FP8 peak (the profile's ``peak_tflops * fp8_rate``) the stack's linear
    layers reach when a run computes them in FP8 (``RuntimeTraits.fp8_linear``), the casts to
    FP8 and the scaling bookkeeping included; None: the profile's ``fp8_matmul_efficiency``."""
    expert_overhead_ns: float = 0.0
    """Nanoseconds a rank spends per token it routes, per local expert, per MoE layer, beyond
    what the experts' GEMMs take at the GEMM rate (forward and backward together): the work a
    runtime does expert by expert over the tokens (permutation and un-permutation chunk by
    expert, a grouped GEMM run as one GEMM per expert, FP8 casts per expert, the dropless
    dispatcher's bookkeeping). 0: none priced."""


@dataclasses.dataclass(frozen=True)
class KernelEfficiency:
    """The kernel figures one estimate uses (:func:`kernel_efficiency`)."""

    gemm: float
    """Fraction of peak large GEMMs reach."""
    attention: float | None
    """Fused attention relative to the GEMM rate; None: the profile's, by head width for a
    calibrated profile
    (:meth:`~meshtrain.planner.hardware.profile.HardwareProfile.attention_figures`)."""
    family: str
    """The stack entry used (a profile family), or "" when the profile's figures are used."""
    source: str
    fp8_gemm: float = 0.0
    """Fraction of the FP8 peak FP8 linear layers reach (0: the profile has no FP8 figure)."""
    expert_overhead_s: float = 0.0
    """Seconds per routed token per local expert per MoE layer (``StackEfficiency.
    expert_overhead_ns``); 0 without a stack entry."""

    def to_dict(self, profile: HardwareProfile) -> dict:
        """The JSON form an estimate on ``profile`` reports under ``kernel_efficiency``:
        ``attention`` is the stack's, else the profile's (None for a profile that measured it
        by head width)."""
        attention = self.attention
        if attention is None and not profile.attention_by_head_dim:
            attention = profile.attention_efficiency
        return {"gemm": self.gemm, "attention": attention, "fp8_gemm": self.fp8_gemm,
                "expert_overhead_ns": round(self.expert_overhead_s * 1e9, 3),
                "from": f"stack entry {self.family}" if self.family else "hardware profile",
                "source": self.source}


def kernel_efficiency(entries: tuple[tuple[str, StackEfficiency], ...],
                      profile: HardwareProfile) -> KernelEfficiency:
    """The kernel figures a stack with ``entries`` (``RuntimeTraits.kernel_efficiency``) gets on
    ``profile``: its entry for the profile's family, else the profile's own (module docstring)."""
    if profile.family and not profile.measured:
        for family, entry in entries:
            if family == profile.family:
                fp8 = entry.fp8_gemm if entry.fp8_gemm is not None else \
                    profile.fp8_matmul_efficiency
                return KernelEfficiency(entry.gemm, entry.attention, family, entry.source, fp8,
                                        entry.expert_overhead_ns * 1e-9)
    why = ("measured (calibrated) profile" if profile.measured else
           f"no {profile.family or profile.name} entry for this stack")
    return KernelEfficiency(profile.matmul_efficiency, None, "",
                            f"profile {profile.name} ({why}): {profile.efficiency_source}",
                            profile.fp8_matmul_efficiency)
