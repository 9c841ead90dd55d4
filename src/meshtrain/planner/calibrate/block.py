"""Calibrate the CPU cost model on one reference transformer block.

The kernel rates ``meshtrain calibrate`` measures (square GEMMs, a streaming copy, SDPA) price
each piece of a block; the block as a whole runs at a different rate, for two reasons measured
here rather than guessed:

- **Solo:** a block's GEMMs are thin (``tokens × dim`` times ``dim × width``), interleaved with
  element-wise kernels and the allocator; the cost model, priced from the square-GEMM rate,
  mispredicts a real block's time by a machine-dependent factor. One block of
  :data:`REFERENCE_SHAPE` is timed forward + backward with one process alone, and
  ``matmul_efficiency`` (which scales both the GEMM and the attention rate of the cost model)
  is set so that the model's prediction for that block equals the measurement. The
  element-wise part stays priced by the copy bandwidth.
- **Shared:** with every process busy, each one's GEMM rate can fall by half (on this kind of
  2-vCPU VM the two vCPUs share one core's vector units), but a training step is not all GEMMs,
  and two steps are not in phase, so they slow each other down less than two GEMM loops do. The
  same block timed on every process at once gives the slowdown a training step sees, and the
  profile's concurrent rates (``peak_tflops``, ``hbm_gbps``) become the solo ones divided by it.
  The pure-GEMM figures stay in ``measured`` for reference.

The reference shape is deliberately none of the shapes the planner's CPU check
(:mod:`meshtrain.commands.cpu_check`) compares against.
"""

from __future__ import annotations

import dataclasses

REFERENCE_SHAPE = {"dim": 192, "n_heads": 12, "n_kv_heads": 6, "ffn_dim": 528, "seq_len": 128,
                   "batch": 12}
"""The calibration block: 16-wide heads (as the CPU check's models), SwiGLU 2.75 × dim."""
SMALL_BATCH = 2
"""The same block at this batch (256 tokens) separates the per-kernel cost from the rate."""


def _reference_config(batch: int | None = None):
    from meshtrain.config import load_config

    s = dict(REFERENCE_SHAPE, batch=batch or REFERENCE_SHAPE["batch"])
    return load_config(None, [
        f"model.dim={s['dim']}", "model.n_layers=1", f"model.n_heads={s['n_heads']}",
        f"model.n_kv_heads={s['n_kv_heads']}", f"model.ffn_dim={s['ffn_dim']}",
        "model.vocab_size=264", f"train.seq_len={s['seq_len']}",
        f"train.global_batch={s['batch']}"])


def reference_block_step(batch: int | None = None):
    """A function running one forward + backward of the reference block (fp32, this thread)."""
    import torch

    from meshtrain.model.transformer import TransformerBlock

    config = _reference_config(batch)
    generator = torch.Generator().manual_seed(0)
    block = TransformerBlock(0, config.model)
    with torch.no_grad():
        for param in block.parameters():
            if param.ndim > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    s = REFERENCE_SHAPE
    x = torch.randn(batch or s["batch"], s["seq_len"], s["dim"], generator=generator,
                    requires_grad=True)

    def step() -> None:
        block(x).square().mean().backward()
        block.zero_grad(set_to_none=True)
        x.grad = None

    return step


def predicted_block_seconds(profile, batch: int | None = None) -> float:
    """The cost model's forward + backward seconds of the reference block on one process."""
    from meshtrain.planner.cost.timing import block_cost
    from meshtrain.planner.cost.workload import Workload
    from meshtrain.planner.hardware.profile import Cluster

    config = _reference_config(batch)
    return block_cost(Workload.from_config(config), config.parallel.layout(),
                      Cluster(profile, 1, 1), 0).compute


def _linear_terms(profile, batch: int | None) -> tuple[float, float, float]:
    """The model's block time as ``a / efficiency + b + c · overhead_us`` (evaluated, not
    derived: three predictions at chosen efficiencies and overheads)."""
    base = dataclasses.replace(profile, matmul_efficiency=1.0, kernel_overhead_us=0.0)
    one = predicted_block_seconds(base, batch)
    half = predicted_block_seconds(dataclasses.replace(base, matmul_efficiency=0.5), batch)
    ten = predicted_block_seconds(dataclasses.replace(base, kernel_overhead_us=10.0), batch)
    a = half - one
    return a, one - a, (ten - one) / 10.0


def fit_to_block(profile, solo_s: float, concurrent_s: float, small_s: float | None = None):
    """``profile`` with ``matmul_efficiency`` (and, given the small block's time ``small_s``,
    ``kernel_overhead_us``) fitted to the measured solo block times, and its concurrent rates
    set to the solo ones over the measured block slowdown (module docstring).

    The model's block time is linear in ``1 / efficiency`` and in the per-kernel overhead; the
    two block sizes give two equations for the two unknowns. A kernel inside a training step
    (autograd, module calls) costs more than the tiny no-grad op calibrate times, which the
    small block, with six times fewer FLOPs and the same kernels, exposes. Without ``small_s``,
    or when noise makes the solution meaningless (non-positive efficiency or negative overhead),
    the overhead stays as measured and only the efficiency is fitted to the large block; a
    measurement the fixed part alone exceeds leaves the efficiency at 1.
    """
    overhead = profile.kernel_overhead_us
    a, b, c = _linear_terms(profile, None)
    efficiency = None
    if small_s:
        a2, b2, c2 = _linear_terms(profile, SMALL_BATCH)
        det = a * c2 - a2 * c
        if abs(det) > 1e-12:
            inv = ((solo_s - b) * c2 - (small_s - b2) * c) / det
            fitted = (a * (small_s - b2) - a2 * (solo_s - b)) / det
            if inv > 0 and fitted >= 0:
                efficiency, overhead = 1.0 / inv, fitted
    if efficiency is None:
        rest = b + c * overhead
        efficiency = a / (solo_s - rest) if solo_s > rest and a > 0 else 1.0
    slowdown = max(concurrent_s / solo_s, 1.0) if solo_s > 0 else 1.0
    measured = dict(profile.measured or {})
    measured["reference_block"] = {
        "shape": REFERENCE_SHAPE, "small_batch": SMALL_BATCH, "solo_s": solo_s,
        "small_solo_s": small_s, "concurrent_s": concurrent_s, "slowdown": slowdown,
        "matmul_efficiency": efficiency, "kernel_overhead_us": overhead,
        "tiny_op_overhead_us": profile.kernel_overhead_us,
        "gemm_only_peak_tflops": profile.peak_tflops, "gemm_only_hbm_gbps": profile.hbm_gbps}
    solo_tflops = profile.solo_tflops or profile.peak_tflops
    solo_hbm = profile.solo_hbm_gbps or profile.hbm_gbps
    return dataclasses.replace(
        profile, matmul_efficiency=efficiency, kernel_overhead_us=overhead,
        peak_tflops=solo_tflops / slowdown, hbm_gbps=solo_hbm / slowdown, measured=measured)
