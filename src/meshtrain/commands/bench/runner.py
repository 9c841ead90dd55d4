"""The bench runner: alternating runs of each suite and their summary.

A **suite** (:class:`~meshtrain.commands.bench.base.Suite`) compares one meshtrain layout with one
PyTorch-native *peer* that does the same work (same model shape, same data, same optimizer
settings, same number of processes). The runner starts every run in fresh processes through
:func:`meshtrain.host.local_processes.run_distributed` (one intra-op thread each, gloo), alternating
``meshtrain, peer, meshtrain, peer, ...`` so that drift in the machine's load is shared by both
sides. Each side gets the settings its users would pick for speed: the peers train with
``torch.optim.AdamW(fused=True)``, and both sides' processes start with the ``malloc`` settings
meshtrain's launcher gives every training process (:mod:`meshtrain.host.allocator`), so the ratio
compares the frameworks' own work; what those settings gain is measured on its own line, the
``allocator`` suite (meshtrain with them against meshtrain without). ``--no-same-allocator``
starts the peers with glibc's defaults instead. Inside a run the first ``warmup`` steps are
discarded; the run's throughput is a step's tokens over the run's median step time, and a suite
reports the **median over repeats** of each side, their ratio ``meshtrain / peer`` and the peak
memory of each rank.

Adding a suite is one :func:`~meshtrain.commands.bench.base.register_suite` call in
:mod:`meshtrain.commands.bench.suites`. A suite that is not a meshtrain/peer pair (``scaling``)
brings its own ``run``.
"""

from __future__ import annotations

import difflib
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import meshtrain.commands.bench.suites  # noqa: F401 - registers the built-in suites
from meshtrain.commands.bench.base import (
    SUITES,
    THREADS_PER_PROCESS,
    BenchOptions,
    Suite,
    bench_config,
    check_requirements,
    peer_is_tuned,
    run_once,
    shape_of,
    summarise_run,
)
from meshtrain.commands.bench.diloco_convergence import format_diloco
from meshtrain.commands.bench.roofline import add_roofline, measure_gemm_roofline
from meshtrain.commands.bench.scaling import format_scaling
from meshtrain.config import Config, ConfigError
from meshtrain.config.model_size import flops_per_token
from meshtrain.host.allocator import allocator_env

SUITE_GROUPS: dict[str, tuple[str, ...]] = {"peers": ("single", "dp", "zero3", "tp", "pp")}
"""Names that stand for several suites: ``peers`` is every dense layout against its
PyTorch-native peer, the table of ``docs/performance.md``."""


def resolve_suites(names: list[str]) -> list[Suite]:
    """The :class:`Suite` objects for ``names`` (comma-separated allowed; a
    :data:`SUITE_GROUPS` name stands for its suites; empty = all), each once, in order."""
    wanted = [n.strip() for name in names for n in name.split(",") if n.strip()]
    if not wanted:
        return list(SUITES.values())
    suites: list[Suite] = []
    for name in wanted:
        if name not in SUITES and name not in SUITE_GROUPS:
            valid = [*SUITES, *SUITE_GROUPS]
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f' Did you mean "{close[0]}"?' if close else ""
            raise ConfigError(f'--suite "{name}" is not a bench suite.{hint} Valid suites: '
                              f"{', '.join(valid)}.")
        for member in SUITE_GROUPS.get(name, (name,)):
            if SUITES[member] not in suites:
                suites.append(SUITES[member])
    return suites


def check_options(options: BenchOptions) -> None:
    """Refuse impossible step, warm-up and repeat counts."""
    for key, minimum in (("steps", 1), ("warmup", 0), ("repeats", 1)):
        value = getattr(options, key)
        if value < minimum:
            raise ConfigError(f"--{key} = {value} is too small; it must be at least {minimum}.")
    if not options.procs or min(options.procs) < 1:
        raise ConfigError(f"--procs = {','.join(map(str, options.procs))}: give process counts "
                          "of at least 1, e.g. --procs 1,2,4.")


def run_suite(suite: Suite, options: BenchOptions,
              log: Callable[[str], None] = lambda line: None) -> dict:
    """Run ``suite`` ``repeats`` times per side, alternating, and return its result document."""
    check_requirements(suite)
    config, world = bench_config(suite, options.overrides, options.warmup + options.steps)
    sides = {"meshtrain": suite.meshtrain_worker, "peer": suite.peer_worker}
    tuned = {"meshtrain": True, "peer": peer_is_tuned(suite, options)}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for repeat in range(options.repeats):
        for side, worker in sides.items():
            ranks = run_once(world, worker, config, options, tuned[side])
            run = summarise_run(ranks)
            runs[side].append(run)
            log(f"bench {suite.name}: repeat {repeat + 1}/{options.repeats} {side:<9} "
                f"{run['tokens_per_s']:>10,.0f} tokens/s  (median step {run['step_time_s']:.3f} s; "
                f"{run['cpu_tokens_per_s']:,.0f} tokens per CPU-second)")
    return suite_result(suite, config, world, options, runs)


def suite_result(suite: Suite, config: Config, world: int, options: BenchOptions,
                 runs: dict[str, list[dict]]) -> dict:
    """The JSON document of one suite (see ``docs/performance.md`` for the fields)."""
    import torch

    medians = {side: statistics.median(r["tokens_per_s"] for r in rs) for side, rs in runs.items()}
    result: dict[str, Any] = {"suite": suite.name, "world_size": world, "peer": suite.peer}
    added = allocator_env()  # what the runs of a tuned side had added to their environment
    result["meshtrain_allocator_env"] = added
    result["peer_allocator_env"] = added if peer_is_tuned(suite, options) else {}
    for side in ("meshtrain", "peer"):
        rs = runs[side]
        result[f"{side}_tokens_per_s"] = medians[side]
        result[f"{side}_peak_bytes"] = max(max(r["peak_bytes"]) for r in rs)
        result[f"{side}_peak_bytes_per_rank"] = [max(r["peak_bytes"][k] for r in rs)
                                                 for k in range(world)]
        result[f"{side}_train_bytes"] = max(max(r["train_bytes"]) for r in rs)
        result[f"{side}_runs_tokens_per_s"] = [r["tokens_per_s"] for r in rs]
        result[f"{side}_runs_mean_tokens_per_s"] = [r["mean_tokens_per_s"] for r in rs]
        result[f"{side}_cpu_tokens_per_s"] = statistics.median(r["cpu_tokens_per_s"] for r in rs)
        result[f"{side}_first_loss"] = rs[0]["losses"][0]
        result[f"{side}_last_loss"] = rs[0]["losses"][-1]
    result["ratio"] = medians["meshtrain"] / medians["peer"]
    # Below 1: meshtrain's largest worker peaked lower than the peer's (VmHWM read from outside).
    result["memory_ratio"] = result["meshtrain_peak_bytes"] / result["peer_peak_bytes"]
    result["cpu_ratio"] = result["meshtrain_cpu_tokens_per_s"] / result["peer_cpu_tokens_per_s"]
    # Run i of each side ran back to back, so their quotient shares the machine's state then.
    paired = [a["tokens_per_s"] / b["tokens_per_s"]
              for a, b in zip(runs["meshtrain"], runs["peer"], strict=True)]
    result["paired_ratio"] = statistics.median(paired)
    low, high, confidence = median_interval(paired)
    result["paired_ratio_interval"] = [low, high]
    result["paired_ratio_confidence"] = confidence
    t = config.train
    result.update(
        steps=options.steps, warmup=options.warmup, repeats=options.repeats,
        tokens_per_step=t.global_batch * t.seq_len,
        threads_per_process=max(r["threads"] for rs in runs.values() for r in rs),
        shape=shape_of(config), torch_version=torch.__version__)
    return result


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free interval for the median of what ``values`` sample, and its coverage.

    With ``n`` values sorted, ``[x_k, x_(n+1-k)]`` holds the true median unless at least
    ``n + 1 - k`` of the values fall on one side of it, which happens with probability
    ``2 P(Binomial(n, 1/2) <= k - 1)``. Returns the narrowest such interval whose coverage is at
    least ``confidence``, or, with too few values for that, the whole range and what it covers
    (5 values: their range, 94 %; 3: 75 %; 1: 0 %)."""
    ordered = sorted(values)
    n = len(ordered)

    def coverage(k: int) -> float:
        tail = sum(math.comb(n, i) for i in range(k)) / 2 ** n
        return max(1.0 - 2.0 * tail, 0.0)

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def run_bench(options: BenchOptions, log: Callable[[str], None] | None = None) -> list[dict]:
    """Validate ``options`` (every suite's config too) and run each selected suite in turn."""
    if log is None:
        def log(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    check_options(options)
    suites = resolve_suites(options.suites)
    if options.plot and not any(suite.run is not None for suite in suites):
        raise ConfigError("--plot draws the scaling and diloco suites; add --suite scaling or "
                          "--suite diloco.")
    for suite in suites:  # refuse a bad --set or a missing peer before any run starts
        check_requirements(suite)
        if suite.check is not None:
            suite.check(suite, options)
        else:
            bench_config(suite, options.overrides, options.warmup + options.steps)
    results = [suite.run(suite, options, log) if suite.run is not None
               else run_suite(suite, options, log) for suite in suites]
    for result in results:
        if result.get("suite") == "single" and result["shape"]["device"] == "cpu":
            roofline = measure_gemm_roofline(options.timeout_s, THREADS_PER_PROCESS)
            config, _ = bench_config(SUITES["single"], options.overrides, 1)
            add_roofline(result, roofline, flops_per_token(config.model, config.train.seq_len))
            log(f"bench single: fp32 GEMM roofline {roofline['gemm_flops_per_s'] / 1e9:.1f} "
                f"GFLOP/s (n = {roofline['gemm_size']}); meshtrain's step at "
                f"{result['meshtrain_roofline_fraction']:.0%} of it")
    return results


def format_table(results: list[dict]) -> str:
    """A plain-text table of suite results, for a terminal (``scaling`` gets its own table)."""
    pairs = [r for r in results if "ratio" in r]
    blocks = [format_pairs(pairs)] if pairs else []
    blocks += [format_scaling(r) for r in results if r.get("suite") == "scaling"]
    blocks += [format_diloco(r) for r in results if r.get("suite") == "diloco"]
    return "\n\n".join(blocks)


def format_pairs(results: list[dict]) -> str:
    """The table of the meshtrain-vs-peer suites."""
    mib = 1024 * 1024
    header = (f"{'suite':<9} {'procs':>5} {'meshtrain tok/s':>16} {'peer tok/s':>11} "
              f"{'ratio':>6} {'paired':>6} {'paired interval':>15} {'cpu ratio':>9} "
              f"{'peak MiB mt/peer':>17} "
              f"{'mem ratio':>9}  peer")
    lines = [header, "-" * len(header)]
    for r in results:
        peaks = f"{r['meshtrain_peak_bytes'] / mib:.0f}/{r['peer_peak_bytes'] / mib:.0f}"
        memory = r['meshtrain_peak_bytes'] / r['peer_peak_bytes']
        low, high = r.get("paired_ratio_interval", (float("nan"), float("nan")))
        interval = f"{low:.3f}-{high:.3f} {r.get('paired_ratio_confidence', 0.0):.0%}"
        lines.append(f"{r['suite']:<9} {r['world_size']:>5} {r['meshtrain_tokens_per_s']:>16,.0f} "
                     f"{r['peer_tokens_per_s']:>11,.0f} {r['ratio']:>6.3f} "
                     f"{r.get('paired_ratio', float('nan')):>6.3f} {interval:>15} "
                     f"{r.get('cpu_ratio', float('nan')):>9.3f} {peaks:>17} {memory:>9.3f}  "
                     f"{r['peer']}")
    r = results[0]
    lines.append(f"median of {r['repeats']} alternating runs per side, {r['steps']} measured "
                 f"steps after {r['warmup']} warm-up, {r['threads_per_process']} thread(s) "
                 f"per process; ratio = meshtrain / peer (> 1: meshtrain faster); paired: "
                 f"median of run-by-run ratios, with the range of them that holds their "
                 f"median at the stated confidence (order statistics, no assumption on the "
                 f"noise); cpu ratio: the same per CPU-second used; "
                 f"peak: each side's largest worker's VmHWM, read from outside; mem ratio = "
                 f"meshtrain / peer (< 1: meshtrain holds less)")
    for r in results:
        if "gemm_flops_per_s" in r:
            lines.append(f"{r['suite']}: this CPU's fp32 GEMM roofline (one thread, best "
                         f"n x n product, n = {r['gemm_size']}) {r['gemm_flops_per_s'] / 1e9:.1f} "
                         f"GFLOP/s; model FLOPs delivered: meshtrain "
                         f"{r['meshtrain_roofline_fraction']:.0%}, peer "
                         f"{r['peer_roofline_fraction']:.0%} of it")
    if any(r["shape"]["precision"] == "bf16" for r in results if "shape" in r):
        lines.append("bf16: meshtrain trains bf16 weights and activations with fp32 master "
                     "weights and Adam state; the peers run torch.autocast(bf16) over fp32 "
                     "weights")
    compared = [r for r in results if r["suite"] != "allocator"]
    if compared:
        same = all(r.get("peer_allocator_env") == r.get("meshtrain_allocator_env")
                   for r in compared)
        lines.append("peers started with the same malloc settings as meshtrain" if same else
                     "peers started with glibc's default malloc settings, meshtrain with its own "
                     "(--no-same-allocator)")
    if any(r["suite"] == "allocator" for r in results):
        lines.append("allocator: meshtrain with its malloc settings / meshtrain with glibc's "
                     "defaults (what the settings gain)")
    return "\n".join(lines)
