"""The bench runner: the suite registry, the bench config, alternating runs and their summary.

A **suite** compares one meshtrain layout with one PyTorch-native *peer* that does the same work
(same model shape, same data, same optimizer settings, same number of processes). The runner
starts every run in fresh processes through :func:`meshtrain.distributed_run.run_distributed`
(one intra-op thread each, gloo), alternating ``meshtrain, peer, meshtrain, peer, ...`` so that
drift in the machine's load is shared by both sides. Each side starts as its users would start it:
meshtrain's processes with the ``malloc`` settings its launcher gives every training process
(:mod:`meshtrain.host_allocator`), the peer's as a plain PyTorch script (``--same-allocator`` gives
the peer those settings too, to compare the frameworks' own work). Inside a run the first
``warmup`` steps are discarded; the run's throughput is a step's tokens over the run's median
step time, and a suite reports the **median over repeats** of each side, their ratio
``meshtrain / peer`` and the peak memory of each rank.

Adding a suite is one :func:`register_suite` call in :mod:`meshtrain.bench.suites`; see
:class:`Suite`. A suite that is not a meshtrain/peer pair (``scaling``) brings its own ``run``.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import statistics
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from meshtrain.config import Config, ConfigError, parse_override, set_key
from meshtrain.host_allocator import allocator_env, allocator_environment
from meshtrain.validation import validate_config

BENCH_DEFAULTS: dict[str, Any] = {
    "model.vocab_size": 512, "model.dim": 256, "model.n_layers": 4, "model.n_heads": 8,
    "model.n_kv_heads": 4, "model.ffn_dim": 704, "model.mlp": "swiglu",
    "model.tie_embeddings": False, "train.seq_len": 256, "train.global_batch": 8,
    "train.precision": "fp32", "train.device": "cpu", "data.source": "builtin",
    "data.tokenizer": "bytes", "data.max_bytes": 1_000_000,
}
"""The shape every suite benchmarks unless ``--set`` changes it (the project's perf baseline, the
shape of issue 10): dim 256 × 4 layers × 8 query / 4 key-value heads, SwiGLU FFN 704, vocabulary
512 (the 264 byte ids, padded), seq_len 256, 8 sequences a step, fp32, CPU."""

THREADS_PER_PROCESS = 1
"""Intra-op threads of every benchmark process (``torch.set_num_threads``)."""

SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "mlp",
              "tie_embeddings")

Worker = Callable[[dict, int, int], dict]
"""``worker(config_dict, warmup, steps) -> rank result``; runs on every rank of a run (see
:func:`meshtrain.bench.workers.timed_run` for the result's fields). Must be module-level."""


@dataclass(frozen=True)
class Suite:
    """One side-by-side comparison.

    ``configure(config)`` sets the parallel layout of the meshtrain side (e.g. ``parallel.dp``)
    and raises :class:`ConfigError` for a shape the peer cannot run; ``world_size`` processes then
    run ``meshtrain_worker`` and ``peer_worker`` (module-level functions: workers are spawned).
    ``requires`` lists modules the peer imports; a missing one is a usage error with ``install``.
    """

    name: str
    world_size: int
    peer: str
    description: str
    peer_worker: Worker | None
    meshtrain_worker: Worker
    configure: Callable[[Config], None] = lambda config: None
    requires: tuple[str, ...] = ()
    install: str = "pip install -e '.[bench]'"
    run: Callable[[Suite, BenchOptions, Callable[[str], None]], dict] | None = None
    """A suite that is not one meshtrain/peer pair (``scaling``) runs itself: ``run(suite,
    options, log)`` returns its result document (then ``peer_worker`` may be None)."""
    check: Callable[[Suite, BenchOptions], None] | None = None
    """With ``run``: refuse impossible options before anything starts (raise ConfigError)."""


SUITES: dict[str, Suite] = {}
"""Every registered suite by name, in registration order (the default ``--suite`` runs all)."""


def register_suite(suite: Suite) -> Suite:
    """Add ``suite`` to :data:`SUITES` (a name may be registered once)."""
    if suite.name in SUITES:
        raise ValueError(f"bench suite {suite.name!r} is already registered")
    SUITES[suite.name] = suite
    return suite


@dataclass
class BenchOptions:
    """What ``meshtrain bench`` was asked to do."""

    suites: list[str] = field(default_factory=list)
    """Suite names; empty = every registered suite."""
    steps: int = 10
    """Measured steps per run (after the warm-up)."""
    warmup: int = 2
    """Steps run and discarded at the start of every run."""
    repeats: int = 5
    """Runs of each side; the reported throughput is their median. More, shorter runs beat
    fewer, longer ones on a shared machine: its slow spells last seconds to minutes, so they
    shift whole runs, and the median over runs is what discards them."""
    overrides: list[str] = field(default_factory=list)
    """``--set section.key=value`` changes to :data:`BENCH_DEFAULTS`."""
    timeout_s: float = 900.0
    """Per-run limit before the run's workers are killed."""
    procs: tuple[int, ...] = (1, 2, 4)
    """Process counts the ``scaling`` suite measures on every axis."""
    plot: str = ""
    """PNG path for the ``scaling`` suite's plot (empty: no plot)."""
    same_allocator: bool = False
    """Start the peer's processes with meshtrain's ``malloc`` settings too
    (:mod:`meshtrain.host_allocator`). Off by default: the peer runs as a plain PyTorch script
    would, and meshtrain as ``meshtrain train`` would, settings included."""


def resolve_suites(names: list[str]) -> list[Suite]:
    """The :class:`Suite` objects for ``names`` (comma-separated allowed; empty = all)."""
    wanted = [n.strip() for name in names for n in name.split(",") if n.strip()]
    if not wanted:
        return list(SUITES.values())
    suites = []
    for name in wanted:
        if name not in SUITES:
            close = difflib.get_close_matches(name, list(SUITES), n=1)
            hint = f' Did you mean "{close[0]}"?' if close else ""
            raise ConfigError(f'--suite "{name}" is not a bench suite.{hint} Valid suites: '
                              f"{', '.join(SUITES)}.")
        suites.append(SUITES[name])
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


def bench_config(suite: Suite, overrides: list[str], total_steps: int) -> tuple[Config, int]:
    """The validated config of ``suite``: :data:`BENCH_DEFAULTS`, then ``overrides``, then the
    suite's layout. Returns it with the world size."""
    config = Config()
    for key, value in BENCH_DEFAULTS.items():
        set_key(config, key, value, origin="bench defaults")
    for text in overrides:
        set_key(config, *parse_override(text))
    config.train.steps = total_steps
    m, t, p = config.model, config.train, config.parallel
    if t.device != "cpu":
        raise ConfigError(f'train.device = "{t.device}": meshtrain bench runs on CPU (gloo) for '
                          'now; valid: train.device = "cpu".')
    if t.precision != "fp32":
        raise ConfigError(f'train.precision = "{t.precision}": the bench peers train in fp32 only '
                          'for now; valid: train.precision = "fp32".')
    if m.moe_experts or p.activation_checkpointing != "none":
        raise ConfigError("meshtrain bench compares dense models without activation "
                          "checkpointing for now; valid: model.moe_experts = 0, "
                          'parallel.activation_checkpointing = "none".')
    suite.configure(config)
    world = validate_config(config, suite.world_size)
    if m.vocab_size == 0:
        from meshtrain.training.tokenizer import load_tokenizer

        m.vocab_size = load_tokenizer(config.data.tokenizer).vocab_size
    return config, world


def check_requirements(suite: Suite) -> None:
    """Raise :class:`ConfigError` (exit 2) naming the install command of a missing peer module."""
    missing = [mod for mod in suite.requires if importlib.util.find_spec(mod) is None]
    if missing:
        raise ConfigError(f'bench suite "{suite.name}" compares against {suite.peer}, which needs '
                          f"{', '.join(missing)}: install it with `{suite.install}`.")


def summarise_run(ranks: list[dict]) -> dict:
    """One run's throughput and memory from its ranks' results.

    A step takes as long as its slowest rank; the run's throughput is the global tokens of a step
    over the **median** step time, which a burst of load from other processes on the machine
    shifts far less than the mean would.
    """
    step_times = [max(times) for times in zip(*(r["step_times"] for r in ranks), strict=True)]
    step_time = statistics.median(step_times)
    cpu_time = max(statistics.median(r["step_cpu_times"]) for r in ranks)
    return {"tokens_per_s": ranks[0]["tokens_per_step"] / step_time,
            "cpu_tokens_per_s": ranks[0]["tokens_per_step"] / cpu_time,
            "step_time_s": step_time,
            "mean_tokens_per_s": ranks[0]["tokens_per_step"] * len(step_times) / sum(step_times),
            "peak_bytes": [r["peak_bytes"] for r in ranks],
            "train_bytes": [r["peak_bytes"] - r["base_bytes"] for r in ranks],
            "losses": ranks[0]["losses"], "threads": max(r["threads"] for r in ranks)}


def run_suite(suite: Suite, options: BenchOptions,
              log: Callable[[str], None] = lambda line: None) -> dict:
    """Run ``suite`` ``repeats`` times per side, alternating, and return its result document."""
    from meshtrain.distributed_run import run_distributed

    check_requirements(suite)
    config, world = bench_config(suite, options.overrides, options.warmup + options.steps)
    sides = {"meshtrain": suite.meshtrain_worker, "peer": suite.peer_worker}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for repeat in range(options.repeats):
        for side, worker in sides.items():
            tuned = side == "meshtrain" or options.same_allocator
            with allocator_environment() if tuned else nullcontext():
                ranks = run_distributed(world, worker, config.to_dict(), options.warmup,
                                        options.steps, timeout=options.timeout_s,
                                        threads=THREADS_PER_PROCESS)
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
    result["peer_allocator_env"] = added if options.same_allocator else {}
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
    result["cpu_ratio"] = result["meshtrain_cpu_tokens_per_s"] / result["peer_cpu_tokens_per_s"]
    # Run i of each side ran back to back, so their quotient shares the machine's state then.
    result["paired_ratio"] = statistics.median(
        a["tokens_per_s"] / b["tokens_per_s"]
        for a, b in zip(runs["meshtrain"], runs["peer"], strict=True))
    t = config.train
    result.update(
        steps=options.steps, warmup=options.warmup, repeats=options.repeats,
        tokens_per_step=t.global_batch * t.seq_len,
        threads_per_process=max(r["threads"] for rs in runs.values() for r in rs),
        shape=shape_of(config), torch_version=torch.__version__)
    return result


def shape_of(config: Config) -> dict:
    """The benchmarked shape as the JSON reports it."""
    m, t = config.model, config.train
    return {**{k: getattr(m, k) for k in SHAPE_KEYS}, "seq_len": t.seq_len,
            "global_batch": t.global_batch, "microbatches": config.parallel.microbatches,
            "precision": t.precision}


def run_bench(options: BenchOptions, log: Callable[[str], None] | None = None) -> list[dict]:
    """Validate ``options`` (every suite's config too) and run each selected suite in turn."""
    import meshtrain.bench.suites  # noqa: F401 - registers the built-in suites

    if log is None:
        def log(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    check_options(options)
    if os.environ.get("MESHTRAIN_REUSE_WORKERS") == "1":
        log("bench: MESHTRAIN_REUSE_WORKERS=1 (the test suite's worker pool): runs reuse "
            "processes, so peak memory and warm-up are not per run; unset it to measure")
    suites = resolve_suites(options.suites)
    if options.plot and not any(suite.run is not None for suite in suites):
        raise ConfigError("--plot draws the scaling suite; add --suite scaling.")
    for suite in suites:  # refuse a bad --set or a missing peer before any run starts
        check_requirements(suite)
        if suite.check is not None:
            suite.check(suite, options)
        else:
            bench_config(suite, options.overrides, options.warmup + options.steps)
    return [suite.run(suite, options, log) if suite.run is not None
            else run_suite(suite, options, log) for suite in suites]


def format_table(results: list[dict]) -> str:
    """A plain-text table of suite results, for a terminal (``scaling`` gets its own table)."""
    from meshtrain.bench.scaling import format_scaling

    pairs = [r for r in results if "ratio" in r]
    blocks = [format_pairs(pairs)] if pairs else []
    blocks += [format_scaling(r) for r in results if r.get("suite") == "scaling"]
    return "\n\n".join(blocks)


def format_pairs(results: list[dict]) -> str:
    """The table of the meshtrain-vs-peer suites."""
    mib = 1024 * 1024
    header = (f"{'suite':<8} {'procs':>5} {'meshtrain tok/s':>16} {'peer tok/s':>11} "
              f"{'ratio':>6} {'paired':>6} {'cpu ratio':>9} {'peak MiB mt/peer':>17}  peer")
    lines = [header, "-" * len(header)]
    for r in results:
        peaks = f"{r['meshtrain_peak_bytes'] / mib:.0f}/{r['peer_peak_bytes'] / mib:.0f}"
        lines.append(f"{r['suite']:<8} {r['world_size']:>5} {r['meshtrain_tokens_per_s']:>16,.0f} "
                     f"{r['peer_tokens_per_s']:>11,.0f} {r['ratio']:>6.3f} "
                     f"{r.get('paired_ratio', float('nan')):>6.3f} "
                     f"{r.get('cpu_ratio', float('nan')):>9.3f} {peaks:>17}  "
                     f"{r['peer']}")
    r = results[0]
    lines.append(f"median of {r['repeats']} alternating runs per side, {r['steps']} measured "
                 f"steps after {r['warmup']} warm-up, {r['threads_per_process']} thread(s) "
                 f"per process; ratio = meshtrain / peer (> 1: meshtrain faster); paired: "
                 f"median of run-by-run ratios; cpu ratio: the same per CPU-second used")
    return "\n".join(lines)
