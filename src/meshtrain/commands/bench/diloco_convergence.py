"""The ``diloco`` suite: DiLoCo replica groups against synchronous data parallelism.

Not a speed comparison: both runs train the same model from the same initialisation on the same
sequences at every step (``replicas × dp`` = the dp run's ranks, the same ``global_batch``), and
the suite reports what DiLoCo trades: the loss each reaches and the bytes each moves between its
groups (``comm_bytes.replica``) or ranks (``comm_bytes.dp``), summed over the run, per rank, as
bus bytes. ``--plot`` draws loss against tokens and against those bytes.

The shape is :data:`DILOCO_DEFAULTS` (what ``docs/diloco.md`` measures), changed by ``--set``;
``train.steps`` is the length of both runs, ``parallel.replicas`` (default 4) the number of groups
and ``parallel.sync_every`` (default 20) the rounds' length. ``--set diloco.warm_start_steps=W``
(:mod:`meshtrain.commands.bench.diloco_warm_start`) first trains dp alone for ``W`` steps and
starts both runs from its weights; their tokens and bytes are counted from there. The final
training loss is the mean of the last :data:`FINAL_WINDOW` steps' losses (a single step's is one
noisy batch); the held-out loss is the last ``eval_loss``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from meshtrain.commands.bench.base import BenchOptions, Suite, check_requirements
from meshtrain.commands.bench.diloco_warm_start import side_steps, split_settings
from meshtrain.config import Config, ConfigError, parse_override, set_key
from meshtrain.validation.run_config import validate_config

DILOCO_DEFAULTS: dict[str, Any] = {
    "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
    "model.ffn_dim": 176, "train.seq_len": 64, "train.global_batch": 32, "train.steps": 800,
    "train.lr": 3e-3, "train.warmup_steps": 10, "train.eval_every": 100, "train.eval_batches": 4,
    "data.valid_fraction": 0.05, "data.max_bytes": 1_000_000, "train.threads_per_worker": 1,
    "train.device": "cpu", "train.log_every": 100, "parallel.replicas": 4,
    "parallel.sync_every": 20,
}
"""The suite's shape unless ``--set`` changes it: a 2-layer dim-64 model, 32 × 64 tokens a step,
800 steps of each side (after the warm start's 200,
:data:`~meshtrain.commands.bench.diloco_warm_start.SUITE_SETTINGS`), 4 groups of H = 20."""

FINAL_WINDOW = 20
"""Steps whose mean training loss is a run's final training loss."""


def diloco_configs(overrides: list[str]) -> tuple[Config, Config, int]:
    """The validated ``(synchronous dp, DiLoCo)`` configs and the warm start's steps ``W``
    (``--set diloco.warm_start_steps``): the same shape and data, dp over ``replicas`` ranks
    against ``replicas`` groups of one rank each; both configs' ``train.steps`` is ``W`` plus the
    sides' own steps, the schedule's length (raises ConfigError)."""
    settings, overrides = split_settings(overrides)
    warm = settings["diloco.warm_start_steps"]
    configs = []
    for synchronous in (True, False):
        config = Config()
        for key, value in DILOCO_DEFAULTS.items():
            set_key(config, key, value, origin="diloco bench defaults")
        for text in overrides:
            set_key(config, *parse_override(text))
        every = config.parallel.sync_every
        if warm % every:
            raise ConfigError(f"diloco.warm_start_steps = {warm} (--set "
                              "diloco.warm_start_steps=N; 0 = none): a multiple of "
                              f"parallel.sync_every = {every}, so every round has {every} "
                              f"steps; e.g. {(warm // every + 1) * every}.")
        config.train.steps += warm
        par = config.parallel
        if par.replicas < 2:
            raise ConfigError(f"parallel.replicas = {par.replicas}: the diloco suite compares "
                              "replica groups with dp over as many ranks; valid: 2 or more.")
        groups = par.replicas
        par.dp, par.tp, par.pp, par.cp, par.ep = (groups if synchronous else 1), 1, 1, 1, 1
        if synchronous:
            par.replicas, par.sync_fragments = 1, 1
        validate_config(config, groups)
        configs.append(config)
    return configs[0], configs[1], warm


def check_diloco(suite: Suite, options: BenchOptions) -> None:
    """Refuse a bad ``--set`` and an unwritable ``--plot`` before anything runs."""
    diloco_configs(options.overrides)  # raises on a bad --set
    if options.plot:
        folder = os.path.dirname(os.path.abspath(diloco_plot_path(options)))
        if not os.path.isdir(folder):
            raise ConfigError(f'--plot "{options.plot}": the folder {folder} does not exist.')
        from dataclasses import replace

        check_requirements(replace(suite, requires=("matplotlib",)))


def diloco_plot_path(options: BenchOptions) -> str:
    """``--plot`` itself when diloco is the only suite that plots, else ``STEM-diloco.png``
    beside it (the scaling suite draws ``--plot``)."""
    if options.suites and all(name == "diloco" for name in _names(options)):
        return options.plot
    stem, ext = os.path.splitext(options.plot)
    return f"{stem}-diloco{ext or '.png'}"


def _names(options: BenchOptions) -> list[str]:
    return [n.strip() for text in options.suites for n in text.split(",") if n.strip()]


def curve(records: list[dict], axis: str) -> dict[str, list]:
    """A run's per-step loss, cumulative tokens and cumulative ``comm_bytes[axis]``, and its
    held-out evaluations ``[(step, eval_loss)]``."""
    tokens, moved, out = 0, 0, {"step": [], "loss": [], "tokens": [], "bytes": [], "eval": []}
    for record in records:
        tokens += record["tokens"]
        moved += record["comm_bytes"].get(axis, 0)
        out["step"].append(record["step"])
        out["loss"].append(record["loss"])
        out["tokens"].append(tokens)
        out["bytes"].append(moved)
        if "eval_loss" in record:
            out["eval"].append([record["step"], record["eval_loss"]])
    return out


def _summary(run: dict[str, list]) -> dict[str, Any]:
    window = run["loss"][-FINAL_WINDOW:]
    return {"final_train_loss": sum(window) / len(window),
            "final_eval_loss": run["eval"][-1][1] if run["eval"] else None,
            "tokens": run["tokens"][-1], "bytes": run["bytes"][-1]}


def _train(config: Config, steps: int, start: int, init_from: str, timeout: float,
           save_final: bool = False) -> list[dict]:
    from meshtrain.config.layout_rules import world_size
    from meshtrain.host.local_processes import run_distributed

    world = world_size(config.parallel.dp, replicas=config.parallel.replicas)
    return run_distributed(world, side_steps, config.to_dict(), steps, start, init_from,
                           save_final, timeout=timeout,
                           threads=max(config.train.threads_per_worker, 1))[0]


def run_diloco(suite: Suite, options: BenchOptions, log: Callable[[str], None]) -> dict:
    """Train both runs once (they are deterministic), after the shared warm start if asked,
    and return the suite's document."""
    import tempfile

    import torch

    sync, diloco, warm = diloco_configs(options.overrides)
    groups, steps = diloco.parallel.replicas, diloco.train.steps - warm
    with tempfile.TemporaryDirectory(prefix="meshtrain-diloco-") as scratch:
        for config in (sync, diloco):
            config.train.run_dir = scratch
        init_from, warm_run = "", None
        if warm:
            log(f"bench diloco: warm start, dp {groups} (synchronous), {warm} steps")
            warm_run = curve(_train(sync, warm, 0, "", options.timeout_s, save_final=True),
                             "dp")
            init_from = os.path.join(scratch, "final")
        log(f"bench diloco: dp {groups} (synchronous), {steps} steps")
        sync_run = curve(_train(sync, steps, warm, init_from, options.timeout_s), "dp")
        log(f"bench diloco: replicas {groups} x dp 1, H = {diloco.parallel.sync_every}, "
            f"{steps} steps")
        diloco_run = curve(_train(diloco, steps, warm, init_from, options.timeout_s),
                           "replica")
    a, b = _summary(sync_run), _summary(diloco_run)
    result: dict[str, Any] = {
        "suite": "diloco", "world_size": groups,
        "peer": f"synchronous data parallelism over {groups} ranks (meshtrain dp)",
        "replicas": groups, "sync_every": diloco.parallel.sync_every,
        "sync_fragments": diloco.parallel.sync_fragments,
        "outer_lr": diloco.train.outer_lr, "outer_momentum": diloco.train.outer_momentum,
        "outer_grad_dtype": diloco.parallel.outer_grad_dtype, "steps": steps,
        "warm_start_steps": warm,
        "warm_start": None if warm_run is None else {**_summary(warm_run), "curve": warm_run},
        "synchronous": {**a, "curve": sync_run}, "diloco": {**b, "curve": diloco_run},
        "train_loss_gap": b["final_train_loss"] / a["final_train_loss"] - 1,
        "eval_loss_gap": (b["final_eval_loss"] / a["final_eval_loss"] - 1
                          if a["final_eval_loss"] and b["final_eval_loss"] else None),
        "bytes_ratio": b["bytes"] / a["bytes"] if a["bytes"] else None,
        "torch_version": torch.__version__,
    }
    if options.plot:
        path = diloco_plot_path(options)
        plot_diloco(result, path)
        result["plot"] = path
        log(f"bench diloco: wrote {path}")
    return result


def format_diloco(result: dict) -> str:
    """A plain-text summary of the ``diloco`` suite's result."""
    mb = 1e6
    lines = [f"diloco: replicas {result['replicas']} x dp 1, H = {result['sync_every']}, "
             f"F = {result['sync_fragments']}, outer lr {result['outer_lr']} / momentum "
             f"{result['outer_momentum']}, {result['outer_grad_dtype']} pseudo-gradients; "
             f"{result['steps']} steps"
             + (f" after a warm start of {result['warm_start_steps']} dp steps"
                if result.get("warm_start_steps") else ""),
             f"{'run':<12} {'train loss':>10} {'eval loss':>10} {'MB moved':>10}"]
    for name in ("synchronous", "diloco"):
        r = result[name]
        shown = f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None else "-"
        lines.append(f"{name:<12} {r['final_train_loss']:>10.4f} {shown:>10} "
                     f"{r['bytes'] / mb:>10.1f}")
    gap = result["eval_loss_gap"]
    ratio = result["bytes_ratio"]
    lines.append(f"train loss {result['train_loss_gap']:+.1%}, eval loss "
                 f"{'-' if gap is None else f'{gap:+.1%}'}, bytes "
                 f"{'-' if not ratio else f'1/{1 / ratio:.1f}'} of synchronous dp "
                 f"(final train loss = mean of the last {FINAL_WINDOW} steps)")
    return "\n".join(lines)


def _trailing_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_diloco(result: dict, path: str) -> None:
    """Write loss against tokens and against bytes moved, both runs, as a PNG: each step's
    training loss faint, its mean over the last :data:`FINAL_WINDOW` steps solid, held-out
    evaluations as dots; after a warm start, the warm start in grey and the loss axis cut to the
    sides' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    offset, top = 0, None
    if result.get("warm_start"):
        warm = result["warm_start"]["curve"]
        offset = warm["tokens"][-1]
        by_tokens.plot(warm["tokens"], _trailing_mean(warm["loss"], FINAL_WINDOW), lw=1,
                       color="grey", label=f"warm start: dp {result['replicas']}, "
                                           f"{result['warm_start_steps']} steps")
        top = 1.1 * max(max(result[n]["curve"]["loss"][:FINAL_WINDOW])
                        for n in ("synchronous", "diloco"))
    labels = {"synchronous": (f"dp {result['replicas']} (synchronous)", "tab:blue"),
              "diloco": (f"DiLoCo {result['replicas']} groups, H = {result['sync_every']}",
                         "tab:orange")}
    for name, (label, color) in labels.items():
        run = result[name]["curve"]
        tokens = [t + offset for t in run["tokens"]]
        smooth = _trailing_mean(run["loss"], FINAL_WINDOW)
        moved = [max(b, 1) for b in run["bytes"]]
        for ax, xs in ((by_tokens, tokens), (by_bytes, moved)):
            ax.plot(xs, run["loss"], lw=0.5, alpha=0.25, color=color)
            ax.plot(xs, smooth, lw=1.2, color=color,
                    label=f"{label}, train (mean of {FINAL_WINDOW} steps)")
        if run["eval"]:
            steps = {s: i for i, s in enumerate(run["step"])}
            by_tokens.plot([tokens[steps[s]] for s, _ in run["eval"]],
                           [v for _, v in run["eval"]], "o--", ms=3, lw=0.8, color=color,
                           label=f"{label}, held-out")
    by_tokens.set_xlabel("tokens trained" + (" (the warm start's included)" if offset else ""))
    by_bytes.set_xlabel("bytes moved between groups or dp ranks, per rank"
                        + (" (after the warm start)" if offset else ""))
    by_bytes.set_xscale("log")
    for ax in (by_tokens, by_bytes):
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
        if top is not None:
            ax.set_ylim(top=top)
    fig.suptitle("meshtrain: DiLoCo replica groups vs synchronous data parallelism",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
