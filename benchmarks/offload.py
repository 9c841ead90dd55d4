"""Peak memory and step time of a training run with and without offload (docs/offload.md).

``python benchmarks/offload.py [--layers 4] [--dim 1024] [--ffn 8192] [--steps 3]
[--settings none,nvme-params,...]`` runs ``meshtrain train --nproc 2`` at dp 2 ZeRO-3 on the
CPU for a wide MLP-heavy model (fp32, one 16-token sequence per rank, so the model states
dominate memory) once per setting, and prints one JSON line each: every worker's peak resident
memory (``VmHWM`` read from ``/proc`` from outside the run,
:mod:`meshtrain.commands.bench.memory_peak`), the median step time of the steps after the first
(from ``metrics.jsonl``), the last loss and the wall time. Settings:

- ``none``: no offload;
- ``nvme-params`` / ``nvme-optimizer``: ``parallel.offload = optimizer+params`` /
  ``optimizer`` with ``offload_device = nvme`` (files under the run directory);
- ``nvme-params-overlap``: ``nvme-params`` with ``parallel.offload_overlap``;
- ``host-params``: ``optimizer+params`` in host memory (on a CPU-only machine the same memory the
  state would use anyway: what it shows is the cost of the streamed step).

``--step-only`` instead builds one process's trainer (ZeRO-1 over dp 1, ``offload = optimizer``
for ``host`` and ``nvme``) and times the optimizer step alone, ``--repeats`` times after one
training step, for ``none``, ``host`` and ``nvme``: one JSON line each with the median seconds
and the state bytes the step streams per second (fp32 master, two moments and gradient read,
the first three written: 28 bytes per parameter).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from meshtrain.commands.bench.memory_peak import measure_train_peaks

SETTINGS = {
    "none": [],
    "nvme-params": ["parallel.offload=optimizer+params", "parallel.offload_device=nvme"],
    "nvme-optimizer": ["parallel.offload=optimizer", "parallel.offload_device=nvme"],
    "nvme-params-overlap": ["parallel.offload=optimizer+params", "parallel.offload_device=nvme",
                            "parallel.offload_overlap=true"],
    "host-params": ["parallel.offload=optimizer+params", "parallel.offload_device=host"],
}


def run(setting: str, layers: int, dim: int, ffn: int, steps: int) -> dict:
    """One run of ``setting``; its per-rank peaks (MiB), step time and last loss."""
    overrides = [f"model.dim={dim}", f"model.n_layers={layers}", "model.n_heads=8",
                 "model.n_kv_heads=0", f"model.ffn_dim={ffn}", f"train.steps={steps}",
                 "train.global_batch=2", "train.seq_len=16", "train.precision=fp32",
                 "train.warmup_steps=0", "train.log_every=1", "checkpoint.every=0",
                 "train.device=cpu", "data.max_bytes=200000", "parallel.dp=2",
                 "parallel.zero=3", *SETTINGS[setting]]
    with tempfile.TemporaryDirectory() as work:
        result = measure_train_peaks(overrides, 2, Path(work), timeout_s=1800)
        records = [json.loads(line) for line in
                   (Path(work) / "run" / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    return {"setting": setting, "vmhwm_mib": [round(p / 2**20) for p in result["peaks"]],
            "step_time_s": round(statistics.median(times), 3),
            "loss": records[-1]["loss"], "wall_s": round(result["wall_s"], 1)}


def time_step(device: str, layers: int, dim: int, ffn: int, repeats: int) -> dict:
    """Median seconds of one optimizer step in one process, state offloaded to ``device``
    (``none``, ``host`` or ``nvme``)."""
    from meshtrain.config import load_config
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as work:
        offload = [] if device == "none" else ["parallel.offload=optimizer",
                                               f"parallel.offload_device={device}"]
        config = load_config(None, [
            f"model.dim={dim}", f"model.n_layers={layers}", "model.n_heads=8",
            "model.n_kv_heads=0", f"model.ffn_dim={ffn}", "train.global_batch=1",
            "train.seq_len=16", "train.device=cpu", "data.max_bytes=200000",
            f"train.run_dir={work}", "parallel.dp=1", "parallel.zero=1", *offload])
        trainer = Trainer(config, build_mesh(config))
        trainer.train_step()
        params = sum(s.master.numel() for s in trainer.optimizer.shards)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            trainer.optimizer.step(1e-4)
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"step_only": device, "params": params, "step_s": round(seconds, 4),
            "state_gb_per_s": round(28 * params / seconds / 1e9, 2)}


def main(argv: list[str] | None = None) -> int:
    """Run each setting named by ``--settings`` and print its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated, from: {', '.join(SETTINGS)}")
    parser.add_argument("--step-only", action="store_true",
                        help="time the optimizer step alone in one process (none, host, nvme)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.step_only:
        for device in ("none", "host", "nvme"):
            print(json.dumps(time_step(device, args.layers, args.dim, args.ffn, args.repeats)),
                  flush=True)
        return 0
    names = [name for name in args.settings.split(",") if name]
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    for name in names:
        print(json.dumps(run(name, args.layers, args.dim, args.ffn, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
