"""What every bench suite shares: the suite record and its registry, the bench options and
config, one run of one side, and a run's summary.

:mod:`meshtrain.commands.bench.suites` registers the built-in suites here,
:mod:`meshtrain.commands.bench.scaling`
builds on it, and :mod:`meshtrain.commands.bench.runner` runs them; this module imports none of
them.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshtrain.config import Config, ConfigError, parse_override, set_key
from meshtrain.host.allocator import allocator_environment, glibc_default_environment
from meshtrain.validation.run_config import validate_config

BENCH_DEFAULTS: dict[str, Any] = {
    "model.vocab_size": 512, "model.dim": 256, "model.n_layers": 4, "model.n_heads": 8,
    "model.n_kv_heads": 4, "model.ffn_dim": 704, "model.mlp": "swiglu",
    "model.tie_embeddings": False, "train.seq_len": 256, "train.global_batch": 8,
    "train.precision": "fp32", "train.device": "cpu", "data.source": "builtin",
    "data.tokenizer": "bytes", "data.max_bytes": 1_000_000,
}
"""The shape every suite benchmarks unless ``--set`` changes it (the project's performance
baseline): dim 256 × 4 layers × 8 query / 4 key-value heads, SwiGLU FFN 704, vocabulary 512 (the
264 byte ids, padded), seq_len 256, 8 sequences a step, fp32, CPU."""

THREADS_PER_PROCESS = 1
"""Intra-op threads of every benchmark process (``torch.set_num_threads``)."""

SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "mlp",
              "tie_embeddings")

Worker = Callable[[dict, int, int], dict]
"""``worker(config_dict, warmup, steps) -> rank result``; runs on every rank of a run (see
:func:`meshtrain.commands.bench.workers.timed_run` for the result's fields). Must be
module-level."""


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
    devices: tuple[str, ...] = ("cpu",)
    """``train.device`` values both sides run (gloo between processes, so multi-process suites
    stay on the CPU; the one-process Hugging Face suites also run on ``cuda``)."""
    precisions: tuple[str, ...] = ("fp32",)
    """``train.precision`` values the suite compares. ``bf16``: meshtrain's bf16 training (bf16
    weights and activations, fp32 master weights and Adam state) against the peer's usual
    mixed precision, ``torch.autocast`` to bf16 over fp32 weights."""
    peer_allocator: bool | None = None
    """Whether the peer's processes start with meshtrain's ``malloc`` settings: None = as
    :attr:`BenchOptions.same_allocator` says; False = never (the ``allocator`` suite, whose peer
    is meshtrain itself under glibc's defaults)."""


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
    same_allocator: bool = True
    """Start the peer's processes with meshtrain's ``malloc`` settings too
    (:mod:`meshtrain.host.allocator`), so the ratios compare the frameworks' own work under the
    same allocator; what the settings themselves gain is the ``allocator`` suite's line.
    ``--no-same-allocator`` runs the peer with glibc's defaults, as a plain PyTorch script."""


def peer_is_tuned(suite: Suite, options: BenchOptions) -> bool:
    """Whether ``suite``'s peer runs with meshtrain's ``malloc`` settings under ``options``."""
    return options.same_allocator if suite.peer_allocator is None else suite.peer_allocator


def bench_config(suite: Suite, overrides: list[str], total_steps: int) -> tuple[Config, int]:
    """The validated config of ``suite``: :data:`BENCH_DEFAULTS`, then ``overrides``, then the
    suite's layout. Returns it with the world size."""
    config = Config()
    for key, value in BENCH_DEFAULTS.items():
        set_key(config, key, value, origin="bench defaults")
    for text in overrides:
        key, value = parse_override(text)
        if key.startswith("diloco."):
            raise ConfigError(f"--set {key}: a setting of --suite diloco alone; run that suite "
                              f"by itself (--suite diloco) to use it, not with {suite.name}.")
        set_key(config, key, value)
    config.train.steps = total_steps
    m, t, p = config.model, config.train, config.parallel
    check_device_and_precision(suite, t.device, t.precision)
    if m.moe_experts or p.activation_checkpointing != "none":
        raise ConfigError("meshtrain bench compares dense models without activation "
                          "checkpointing for now; valid: model.moe_experts = 0, "
                          'parallel.activation_checkpointing = "none".')
    suite.configure(config)
    world = validate_config(config, suite.world_size)
    if m.vocab_size == 0:
        from meshtrain.data.tokenizer import load_tokenizer

        m.vocab_size = load_tokenizer(config.data.tokenizer).vocab_size
    return config, world


def check_device_and_precision(suite: Suite, device: str, precision: str) -> None:
    """Refuse a ``train.device`` or ``train.precision`` the suite's two sides do not both run
    (:attr:`Suite.devices`, :attr:`Suite.precisions`), or a CUDA device torch cannot see."""
    if device not in suite.devices:
        valid = " or ".join(f'"{d}"' for d in suite.devices)
        gpu = [s.name for s in SUITES.values() if "cuda" in s.devices]
        raise ConfigError(f'train.device = "{device}": the {suite.name} suite runs on '
                          f"{', '.join(suite.devices)} only; valid: train.device = {valid} "
                          f"(on a GPU: --suite {','.join(gpu)}).")
    if precision not in suite.precisions:
        valid = " or ".join(f'"{p}"' for p in suite.precisions)
        raise ConfigError(f'train.precision = "{precision}": the {suite.name} suite compares '
                          f"{', '.join(suite.precisions)} training only; valid: "
                          f"train.precision = {valid}.")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError('train.device = "cuda" but torch sees no CUDA device here (CPU '
                              'build, or no GPU visible); valid here: train.device = "cpu".')


def check_requirements(suite: Suite) -> None:
    """Raise :class:`ConfigError` (exit 2) naming the install command of a missing peer module."""
    missing = [mod for mod in suite.requires if importlib.util.find_spec(mod) is None]
    if missing:
        raise ConfigError(f'bench suite "{suite.name}" compares against {suite.peer}, which needs '
                          f"{', '.join(missing)}: install it with `{suite.install}`.")


def run_once(world: int, worker: Worker, config: Config, options: BenchOptions,
             tuned_allocator: bool) -> list[dict]:
    """One run: ``worker`` on ``world`` fresh processes (one thread each), started with
    meshtrain's ``malloc`` settings when ``tuned_allocator``, else with glibc's defaults (even
    when this process's environment has the settings); returns each rank's result, whose
    ``peak_bytes`` (CPU) is the worker's ``VmHWM`` read from outside, by this process."""
    from meshtrain.host.local_processes import run_distributed

    peaks: list[int] = []
    with allocator_environment() if tuned_allocator else glibc_default_environment():
        ranks = run_distributed(world, worker, config.to_dict(), options.warmup, options.steps,
                                timeout=options.timeout_s, threads=THREADS_PER_PROCESS,
                                peaks=peaks)
    for rank, peak in zip(ranks, peaks, strict=True):
        # The kernel's high-water mark read from this process (CPU); a worker's own report
        # stays where none could be read (off Linux) and on a GPU (the CUDA allocator's peak).
        if peak and config.train.device != "cuda":
            rank["peak_bytes"] = peak
    return ranks


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


def shape_of(config: Config) -> dict:
    """The benchmarked shape as the JSON reports it."""
    m, t = config.model, config.train
    return {**{k: getattr(m, k) for k in SHAPE_KEYS}, "seq_len": t.seq_len,
            "global_batch": t.global_batch, "microbatches": config.parallel.microbatches,
            "precision": t.precision, "device": t.device, "moe_experts": m.moe_experts,
            "moe_top_k": m.moe_top_k}
