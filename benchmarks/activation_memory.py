"""Activation memory of each layout measured from outside, beside the planner's estimate.

For each case below, ``meshtrain train`` runs a small model (dim 256, 4 layers, 8 query / 2
key-value heads, ffn 512, fp32) for two steps at a long sequence (4,096 tokens) and again at a
short one (512), every worker's ``VmHWM`` read from ``/proc``
(:func:`meshtrain.commands.bench.memory_peak.measure_peaks`). The difference of the two runs of
the same layout is what the long sequence costs each rank: its activations (and whatever else
grows with the tokens: pipeline messages, MoE dispatch buffers, the loss's logits), with the
weights, optimizer state, interpreter and libraries cancelled out. Beside it, the same difference
of the planner's per-rank memory (:func:`planned_difference`, ``meshtrain estimate``'s figures
without a GPU allocator's reserve) for the same config.

The cases cover what the planner's activation accounting distinguishes: the three
checkpointing modes, a pipeline's micro-batches in flight under 1F1B, GPipe and interleaved
1F1B (and the logits GPipe's last stage keeps for every micro-batch), tensor parallelism with
and without sequence parallelism, and an MoE model under expert parallelism (over dp, and
folded over tp with and without sequence parallelism). The workers map
blocks of 1 MiB and more (``MALLOC_MMAP_THRESHOLD_=1048576``), so ``VmHWM`` follows the
tensors alive at the peak.

``python benchmarks/activation_memory.py [CASE ...]`` prints one JSON line per case (MiB per
rank, measured and planned); no names: every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from meshtrain.commands.bench.memory_peak import measure_peaks
from meshtrain.config import load_config
from meshtrain.data.tokenizer import tokenizer_vocab_size
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.profiles import PROFILES

MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=2",
         "model.ffn_dim=512"]
RUN = ["train.steps=2", "train.precision=fp32", "train.warmup_steps=0", "train.log_every=1",
       "train.device=cpu", "data.max_bytes=400000"]
LONG_SEQ, SHORT_SEQ = 4096, 512
MIB = 2**20
LIVE_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=512"]

# name: (processes, overrides). One sequence per micro-batch; a pipeline runs 4 micro-batches.
CASES = {
    "none": (1, ["train.global_batch=1", "parallel.activation_checkpointing=none"]),
    "selective": (1, ["train.global_batch=1", "parallel.activation_checkpointing=selective"]),
    "full": (1, ["train.global_batch=1", "parallel.activation_checkpointing=full"]),
    "pp2-1f1b": (2, ["train.global_batch=4", "parallel.pp=2", "parallel.microbatches=4",
                     "parallel.pp_schedule=1f1b"]),
    "pp2-gpipe": (2, ["train.global_batch=4", "parallel.pp=2", "parallel.microbatches=4",
                      "parallel.pp_schedule=gpipe"]),
    # A vocabulary of 8,192: each micro-batch's logits (128 MiB in fp32 at 4,096 tokens)
    # stay on the last stage until its backward, all four of them under GPipe.
    "pp2-gpipe-vocab": (2, ["train.global_batch=4", "parallel.pp=2", "parallel.microbatches=4",
                            "parallel.pp_schedule=gpipe", "model.vocab_size=8192"]),
    "pp2-interleaved": (2, ["train.global_batch=4", "parallel.pp=2", "parallel.microbatches=4",
                            "parallel.pp_schedule=interleaved-1f1b",
                            "parallel.virtual_stages=2"]),
    "tp2": (2, ["train.global_batch=1", "parallel.tp=2"]),
    "tp2-sp": (2, ["train.global_batch=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "moe-ep2": (2, ["train.global_batch=2", *MOE, "parallel.dp=2", "parallel.ep=2"]),
    # Without ep the MoE layer is replicated over tp: every tp rank computes every assignment.
    "moe-tp2": (2, ["train.global_batch=1", *MOE, "parallel.tp=2"]),
    # Experts folded over the tp ranks: each computes its share of the assignments.
    "moe-tp2-ep2": (2, ["train.global_batch=1", *MOE, "parallel.tp=2", "parallel.ep=2"]),
    "moe-tp2-sp-ep2": (2, ["train.global_batch=1", *MOE, "parallel.tp=2", "parallel.ep=2",
                           "parallel.sequence_parallel=true"]),
}


def _config(overrides: list[str], seq: int):
    config = load_config(None, [*MODEL, *RUN, *overrides, f"train.seq_len={seq}"])
    config.model.vocab_size = config.model.vocab_size or tokenizer_vocab_size(
        config.data.tokenizer)
    return config


def _ranks_by_stage(config, nproc: int) -> list[int]:
    """The pipeline stage of each rank (pp is the outermost mesh dimension)."""
    per_stage = nproc // config.parallel.pp
    return [rank // per_stage for rank in range(nproc)]


def planned_difference(name: str) -> list[float]:
    """The planner's per-rank memory at the long sequence minus at the short one (bytes), as
    ``meshtrain estimate`` prices the case's config, without a GPU allocator's reserve."""
    nproc, overrides = CASES[name]
    cpu = dataclasses.replace(PROFILES["h100-80g"], allocator_reserve=0.0)
    totals = []
    for seq in (LONG_SEQ, SHORT_SEQ):
        config = _config(overrides, seq)
        per_rank = estimate(Workload.from_config(config), config.parallel.layout(),
                            Cluster(cpu, nproc, nproc))["per_rank"]
        totals.append([per_rank[stage]["total_bytes"]
                       for stage in _ranks_by_stage(config, nproc)])
    return [a - b for a, b in zip(*totals, strict=True)]


def measure(name: str, work: Path) -> dict:
    """Per-rank VmHWM at the long sequence minus at the short one (bytes), and the planner's
    figure for the same difference."""
    nproc, overrides = CASES[name]
    runs = [measure_peaks([*MODEL, *RUN, *overrides, f"train.seq_len={seq}"], nproc,
                          work / f"{name}-{seq}", LIVE_ALLOCATOR)
            for seq in (LONG_SEQ, SHORT_SEQ)]
    measured = [a - b for a, b in zip(runs[0]["peaks"], runs[1]["peaks"], strict=True)]
    return {"case": name, "measured": measured, "planned": planned_difference(name),
            "wall_s": sum(r["wall_s"] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line per case: measured and planned MiB per rank, and planned / measured."""
    parser = argparse.ArgumentParser(prog="python benchmarks/activation_memory.py")
    parser.add_argument("cases", nargs="*", help=f"any of {', '.join(CASES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}; known: {', '.join(CASES)}")
    for name in args.cases or list(CASES):
        with tempfile.TemporaryDirectory() as work:
            r = measure(name, Path(work))
        print(json.dumps({"case": name,
                          "measured_mib": [round(b / MIB) for b in r["measured"]],
                          "planned_mib": [round(b / MIB) for b in r["planned"]],
                          "planned_over_measured": [round(p / m, 2) for p, m in
                                                    zip(r["planned"], r["measured"],
                                                        strict=True)],
                          "wall_s": round(r["wall_s"], 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
