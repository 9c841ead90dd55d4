"""Long sequences under context parallelism: peak memory per rank measured from outside.

For each cp degree, ``meshtrain train --nproc cp --set parallel.cp=cp`` trains a small model
(dim 256, 4 layers, 8 query / 2 key-value heads, fp32) on one sequence per step at a long
``seq_len`` (8,192 by default), and again at a short one (512). Every worker's ``VmHWM`` is read
from ``/proc`` (:func:`meshtrain.commands.bench.memory_peak.measure_train_peaks`); the difference
between the two runs of the same layout is what the long sequence costs a rank, its **activation
memory**, with the weights, optimizer state, interpreter and libraries cancelled out. Splitting
the sequence over cp ranks should divide it by about cp (each rank also keeps the whole
sequence's keys and values for backward, ``2 × seq × n_kv_heads × head_dim`` elements a layer).
Throughput is each run's own ``tokens_per_s`` of its last step, reported, never asserted.

The workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (blocks of 1 MiB and more mapped, and
unmapped when freed), so ``VmHWM`` follows the tensors alive at the peak; under meshtrain's
default host allocator settings the heap also keeps freed blocks, which adds a cp-independent
amount (``--default-allocator`` measures that way).

``python benchmarks/long_context.py [--seq 8192] [--cp 1 2 4]`` prints one JSON line per cp.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from meshtrain.commands.bench.memory_peak import measure_peaks

MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=2",
         "model.ffn_dim=512"]
RUN = ["train.steps=2", "train.global_batch=1", "train.precision=fp32", "train.warmup_steps=0",
       "train.log_every=1", "train.device=cpu", "data.max_bytes=400000"]
SHORT_SEQ = 512
MIB = 2**20
LIVE_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def _last_tokens_per_s(run_dir: Path) -> float | None:
    path = run_dir / "run" / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "tokens_per_s" in r]
    return steps[-1]["tokens_per_s"] if steps else None


def measure(cp: int, seq: int, work: Path, live_allocator: bool = True) -> dict:
    """Per-rank activation memory (long run's VmHWM minus the short run's) at ``cp``, and the
    long run's throughput; ``live_allocator``: map 1 MiB+ blocks (see the module docstring)."""
    layout = [f"parallel.cp={cp}"]
    env = LIVE_ALLOCATOR if live_allocator else {}
    long_run = measure_peaks([*MODEL, *RUN, *layout, f"train.seq_len={seq}"], cp,
                             work / f"cp{cp}-long", env)
    short_run = measure_peaks([*MODEL, *RUN, *layout, f"train.seq_len={SHORT_SEQ}"], cp,
                              work / f"cp{cp}-short", env)
    excess = [a - b for a, b in zip(long_run["peaks"], short_run["peaks"], strict=True)]
    return {"cp": cp, "seq_len": seq, "activation_bytes": excess,
            "long_peaks": long_run["peaks"], "short_peaks": short_run["peaks"],
            "tokens_per_s": _last_tokens_per_s(work / f"cp{cp}-long"),
            "wall_s": long_run["wall_s"] + short_run["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per cp degree (MiB, and the ratio to cp 1's activation memory)."""
    parser = argparse.ArgumentParser(prog="python benchmarks/long_context.py")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--default-allocator", action="store_true",
                        help="keep meshtrain's host allocator settings (freed heap kept)")
    args = parser.parse_args(argv)
    base = None
    for cp in args.cp:
        with tempfile.TemporaryDirectory() as work:
            r = measure(cp, args.seq, Path(work), not args.default_allocator)
        worst = max(r["activation_bytes"])
        base = worst if cp == 1 else base
        print(json.dumps({"cp": cp, "seq_len": args.seq,
                          "activation_mib": [round(b / MIB) for b in r["activation_bytes"]],
                          "ratio_to_cp1": None if base is None else round(worst / base, 3),
                          "tokens_per_s": r["tokens_per_s"] and round(r["tokens_per_s"]),
                          "wall_s": round(r["wall_s"], 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
