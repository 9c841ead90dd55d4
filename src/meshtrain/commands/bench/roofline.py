"""The CPU's fp32 matrix-product roofline, and how close a one-process training step comes to it.

A training step at the bench shape is matrix products plus everything else (element-wise work,
attention, the optimizer, Python). How fast a product can run on this CPU is measured, not taken
from a data sheet: :func:`gemm_worker` times square fp32 ``torch.mm`` products of a few sizes on
one fresh process with one intra-op thread (as every bench worker has) and keeps the fastest
rate, FLOP/s = ``2 n^3 / seconds``. The step's useful work is the model FLOPs of
:func:`meshtrain.config.model_size.flops_per_token` (6 × matmul parameters + the attention
products, PaLM's convention: the causal mask is not credited), so

``roofline_fraction = flops_per_token × tokens/s / gemm FLOP/s``

is the share of the machine's best product rate that the whole step delivers as model FLOPs.
"""

from __future__ import annotations

import time

GEMM_SIZES = (256, 512, 1024, 2048)
"""Square product sizes timed; the fastest rate over them is the roofline."""


def gemm_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """Best fp32 ``torch.mm`` FLOP/s on this process's thread(s), over :data:`GEMM_SIZES`
    (each size: one untimed product, then the best of repeats filling ~0.3 s)."""
    import torch

    best, best_size = 0.0, 0
    for n in GEMM_SIZES:
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)
        flops = 2.0 * n ** 3
        fastest, spent = float("inf"), 0.0
        while spent < 0.3 or fastest == float("inf"):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            elapsed = time.perf_counter() - start
            fastest, spent = min(fastest, elapsed), spent + elapsed
        if flops / fastest > best:
            best, best_size = flops / fastest, n
    return {"gemm_flops_per_s": best, "gemm_size": best_size,
            "threads": torch.get_num_threads()}


def measure_gemm_roofline(timeout_s: float, threads: int) -> dict:
    """:func:`gemm_worker` on one fresh process (meshtrain's ``malloc`` settings, ``threads``
    intra-op threads)."""
    from meshtrain.host.allocator import allocator_environment
    from meshtrain.host.local_processes import run_distributed

    with allocator_environment():
        return run_distributed(1, gemm_worker, {}, 0, 0, timeout=timeout_s, threads=threads)[0]


def add_roofline(result: dict, roofline: dict, flops_per_token: float) -> None:
    """Put the roofline and each side's fraction of it into a one-process suite's ``result``."""
    rate = roofline["gemm_flops_per_s"]
    result["gemm_flops_per_s"] = rate
    result["gemm_size"] = roofline["gemm_size"]
    result["model_flops_per_token"] = flops_per_token
    for side in ("meshtrain", "peer"):
        delivered = flops_per_token * result[f"{side}_tokens_per_s"]
        result[f"{side}_roofline_fraction"] = delivered / rate
