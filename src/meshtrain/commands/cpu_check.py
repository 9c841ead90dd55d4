"""Predicted vs measured step times on this CPU, for a calibrated profile.

``python -m meshtrain.commands.cpu_check [--profile profile.json] [--dim 128 ...]`` calibrates
(unless given a profile), trains a small model for a few steps with one process, dp2, tp2 and pp2
(1F1B, 4 micro-batches) in fresh processes (one intra-op thread each), and prints a markdown
table of the planner's prediction (:func:`estimate`), the median measured step time after a
warm-up step, and the error. ``tests/integration/
test_planner_calibration.py`` runs the same comparison with generous bounds; the table in
``docs/planner.md`` came from this command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from meshtrain.config import Config, load_config
from meshtrain.planner.hardware.profile import Cluster, HardwareProfile
from meshtrain.validation.run_config import validate_config

LAYOUTS: dict[str, tuple[list[str], int]] = {
    "1 process": ([], 1),
    "dp2": ([], 2),
    "tp2": (["parallel.tp=2"], 2),
    "pp2 1f1b": (["parallel.pp=2", "parallel.microbatches=4"], 2),
}
"""The compared layouts: extra ``--set`` overrides and process count."""


def small_config(extra: list[str], world: int, dim: int = 128, layers: int = 4, seq: int = 128,
                 batch: int = 8, run_dir: str | None = None) -> Config:
    """A validated fp32 Llama-style config: ``dim / 16``-wide heads (8 query, 4 kv for dim
    128), SwiGLU hidden ``2.75 dim``, byte vocabulary, one thread per process."""
    heads = max(dim // 16, 2)
    config = load_config(None, [
        f"model.dim={dim}", f"model.n_layers={layers}", f"model.n_heads={heads}",
        f"model.n_kv_heads={heads // 2}", f"model.ffn_dim={dim * 11 // 4}",
        "model.vocab_size=264", f"train.seq_len={seq}", f"train.global_batch={batch}",
        "train.warmup_steps=0", "train.threads_per_worker=1", "data.max_bytes=200000",
        f"train.run_dir={run_dir or os.path.join(tempfile.gettempdir(), 'meshtrain-cpu-check')}",
        *extra])
    validate_config(config, world)
    return config


def measure(config: Config, world: int, steps: int, warmup: int = 1) -> list[float]:
    """Step times (s) of ``steps`` steps after ``warmup`` discarded ones, one thread/process.

    Every layout, one process included, runs in fresh processes started the way ``meshtrain
    train`` starts its workers (:mod:`meshtrain.host.allocator`'s ``malloc`` settings), the same
    way :func:`meshtrain.planner.calibrate.measure.calibrate` measured the machine.
    """
    from meshtrain.commands.verify import run_layout
    from meshtrain.host.allocator import allocator_environment

    with allocator_environment():
        records = run_layout(config, world, warmup + steps, spawn_single=True)
    return [r["step_time_s"] for r in records[warmup:]]


def predict(config: Config, world: int, profile: HardwareProfile) -> dict:
    """The planner's estimate of ``config``'s layout on ``world`` one-thread processes."""
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.planner.cost.workload import Workload

    return estimate(Workload.from_config(config), config.parallel.layout(),
                    Cluster(profile, world, max(world, 1)))


def compare(profile: HardwareProfile | Callable[[], HardwareProfile], steps: int = 4,
            rounds: int = 1, **shape) -> list[dict]:
    """One row per layout: ``layout, predicted_s, measured_s, error, times, breakdown``.

    With ``rounds > 1`` the layouts run in turn ``rounds`` times (``A B C D A B C D ...``) and
    ``measured_s`` is the median of the rounds' medians: this VM's speed drifts by ±25 % over
    tens of seconds, so a single run per layout mostly measures when it ran. ``profile`` may be
    a function (e.g. ``lambda: calibrate(2)``): it is then called at the start of every round
    and ``predicted_s`` is the median of the rounds' predictions, so calibration samples the
    machine as often, and at the same moments, as the measurement does.
    """
    configs = {name: (small_config(extra, world, **shape), world)
               for name, (extra, world) in LAYOUTS.items()}
    times: dict[str, list[list[float]]] = {name: [] for name in configs}
    predictions: dict[str, list[dict]] = {name: [] for name in configs}
    fixed = None if callable(profile) else profile
    for _ in range(max(rounds, 1)):
        current = fixed or profile()
        for name, (config, world) in configs.items():
            predictions[name].append(predict(config, world, current))
            times[name].append(measure(config, world, steps))
    rows = []
    for name in configs:
        ranked = sorted(predictions[name], key=lambda p: p["step_time_s"])
        predicted = ranked[(len(ranked) - 1) // 2]  # the median round's prediction
        measured = statistics.median(statistics.median(t) for t in times[name])
        rows.append({"layout": name, "predicted_s": predicted["step_time_s"],
                     "measured_s": measured, "error": predicted["step_time_s"] / measured - 1,
                     "times": [t for run in times[name] for t in run],
                     "breakdown": predicted["breakdown"]})
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown: layout, predicted, measured, error."""
    lines = ["| layout | predicted s/step | measured s/step (median) | error |",
             "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                     f"{r['error']:+.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Calibrate (or load ``--profile``), compare, print the table."""
    from meshtrain.planner.calibrate.measure import calibrate
    from meshtrain.planner.tables.profiles import load_profile

    parser = argparse.ArgumentParser(prog="python -m meshtrain.commands.cpu_check")
    parser.add_argument("--profile", help="a calibrate JSON (default: calibrate at the start of "
                                           "every round)")
    parser.add_argument("--save-profile", help="write the calibrated profile JSON here")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per layout run")
    parser.add_argument("--rounds", type=int, default=5,
                        help="runs of every layout, in turn (the median over rounds is kept)")
    for key, default in (("dim", 128), ("layers", 4), ("seq", 128), ("batch", 8)):
        parser.add_argument(f"--{key}", type=int, default=default)
    args = parser.parse_args(argv)
    profiles: list[HardwareProfile] = []

    def calibrate_now() -> HardwareProfile:
        profiles.append(calibrate(2))
        return profiles[-1]

    profile = load_profile(args.profile) if args.profile else calibrate_now
    rows = compare(profile, args.steps, args.rounds, dim=args.dim, layers=args.layers, seq=args.seq,
                   batch=args.batch)
    if args.save_profile and profiles:  # the last round's calibration
        Path(args.save_profile).write_text(json.dumps(profiles[-1].to_dict(), indent=2) + "\n")
    print(format_table(rows))
    for r in rows:
        print(r["layout"], [round(t, 4) for t in r["times"]],
              {k: round(v, 4) for k, v in r["breakdown"].items() if v}, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
