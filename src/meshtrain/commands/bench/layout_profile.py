"""Where each side's step goes, layout by layout: rank 0 under ``torch.profiler``, grouped.

``python benchmarks/layout_profile.py [--suite peers] [--steps 4] [--warmup 2] [--set KEY=VALUE]``
(this module's :func:`main`; it lives in the package so that spawned workers can import it)
runs each named ``meshtrain bench`` suite's two sides (meshtrain, then its peer) once each, in
fresh processes started as the bench starts them (one thread each, meshtrain's ``malloc``
settings), with the suite's own worker functions, except that their timed loop runs under the
profiler. It prints one JSON line per suite and side: milliseconds per step of rank 0 by
category of the operators' self CPU time (:data:`CATEGORIES`: matmul, attention, element-wise,
copies, collectives, optimizer, other ops) and ``waits and framework``, the step's wall time
minus every operator's (waiting for another rank outside an operator, Python, and the
profiler's own cost), with ``step_ms`` and the ten costliest operators.

The two sides run one after the other, not alternating: differences in the matmul column between
them are the machine's drift (both sides run the same products). ``meshtrain bench`` measures
speed; this says where it goes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("collectives", ("c10d::", "gloo:", "record_param_comms", "nccl", "all_reduce", "all_gather",
                     "reduce_scatter", "broadcast", "allreduce", "send", "recv", "barrier",
                     "wait")),
    ("copies", ("aten::copy_", "aten::cat", "aten::clone", "aten::contiguous", "aten::index",
                "aten::embedding", "aten::_to_copy", "aten::roll", "aten::zero_", "aten::fill_",
                "aten::zeros", "aten::empty")),
    ("optimizer", ("_fused_adamw", "adamw", "Optimizer", "linalg_vector_norm", "_foreach")),
    ("element-wise", ("aten::mul", "aten::add", "aten::silu", "aten::sub", "aten::div",
                      "aten::pow", "aten::rsqrt", "aten::mean", "aten::sum", "aten::neg",
                      "softmax", "aten::exp", "aten::where", "aten::rms_norm", "aten::nll_loss",
                      "aten::logsumexp", "aten::gather", "aten::scatter", "aten::sigmoid",
                      "aten::sqrt", "aten::clamp", "aten::max", "aten::ne", "aten::eq",
                      "aten::masked_fill", "aten::lerp", "aten::addcmul", "aten::addcdiv",
                      "_backward")),
)
"""Operator-name fragments of each category, first match wins (anything else: ``other ops``)."""

WAITS = "waits and framework"


def categorise(events, steps: int, wall_s: float) -> dict:
    """Milliseconds per step by category of ``events`` (``key_averages()`` rows over ``steps``
    steps that took ``wall_s`` seconds in all)."""
    totals = {name: 0.0 for name, _ in CATEGORIES} | {"other ops": 0.0}
    for event in events:
        name = event.key
        category = next((c for c, fragments in CATEGORIES
                         if any(f in name for f in fragments)), "other ops")
        totals[category] += event.self_cpu_time_total / 1000.0
    out = {name: round(ms / steps, 1) for name, ms in totals.items()}
    step_ms = wall_s * 1000.0 / steps
    out[WAITS] = round(step_ms - sum(totals.values()) / steps, 1)
    out["step_ms"] = round(step_ms, 1)
    return out


def _profiled_run(step, warmup: int, steps: int, *args, **kwargs) -> dict:
    """Stands in for :func:`meshtrain.commands.bench.workers.timed_run` inside a worker."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    for i in range(warmup):
        step(i)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for i in range(warmup, warmup + steps):
            step(i)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    out = categorise(events, steps, wall)
    out["top"] = [[e.key, round(e.self_cpu_time_total / 1000.0 / steps, 2)]
                  for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]]
    return out


def profiled_worker(target: str, config_dict: dict, warmup: int, steps: int) -> dict:
    """Run the bench worker ``module:function`` with its timed loop profiled."""
    import meshtrain.commands.bench.parallel_peers as parallel_peers
    import meshtrain.commands.bench.peers as peers
    import meshtrain.commands.bench.workers as workers

    modules = (workers, peers, parallel_peers)
    originals = [module.timed_run for module in modules]
    for module in modules:
        module.timed_run = _profiled_run
    try:  # a reused worker process (the test suite's pool) gets the originals back after
        module_name, name = target.rsplit(":", 1)
        return getattr(importlib.import_module(module_name), name)(config_dict, warmup, steps)
    finally:
        for module, original in zip(modules, originals, strict=True):
            module.timed_run = original


def profile_suites(names: list[str], overrides: list[str], warmup: int, steps: int):
    """Yield ``(suite, side, rank 0's categories)`` for each suite in ``names`` (bench names,
    ``peers`` included) and side."""
    from meshtrain.commands.bench.base import THREADS_PER_PROCESS, bench_config
    from meshtrain.commands.bench.runner import resolve_suites
    from meshtrain.host.allocator import allocator_environment
    from meshtrain.host.local_processes import run_distributed

    for suite in resolve_suites(names):
        if suite.peer_worker is None:
            continue  # scaling, diloco: not a meshtrain/peer pair
        config, world = bench_config(suite, overrides, warmup + steps)
        for side, worker in (("meshtrain", suite.meshtrain_worker), ("peer", suite.peer_worker)):
            target = f"{worker.__module__}:{worker.__name__}"
            with allocator_environment():
                ranks = run_distributed(world, profiled_worker, target, config.to_dict(),
                                        warmup, steps, timeout=900, threads=THREADS_PER_PROCESS)
            yield suite.name, side, ranks[0]


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per suite and side."""
    parser = argparse.ArgumentParser(prog="python benchmarks/layout_profile.py")
    parser.add_argument("--suite", dest="suites", action="append", default=[],
                        help="bench suite(s) to profile (default: peers)")
    parser.add_argument("--steps", type=int, default=4, help="profiled steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="unprofiled steps first")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override the benchmarked shape")
    args = parser.parse_args(argv)
    for suite, side, result in profile_suites(args.suites or ["peers"], args.overrides,
                                              args.warmup, args.steps):
        print(json.dumps({"suite": suite, "side": side, **result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
