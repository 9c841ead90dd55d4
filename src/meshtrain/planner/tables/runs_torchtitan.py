"""Published runs of torchtitan (PyTorch-native: FSDP2, SDPA, per-op selective checkpointing).

Sources:

- torchtitan ``docs/performance.md`` as of its 2024 A100 tables ("Llama 3 performance numbers",
  "Llama 2 performance numbers"): FSDP2 (ZeRO-3) on 64 A100 80 GB, tokens/s per GPU ("WPS"),
  Llama 3 at seq 8192, Llama 2 at 4096, per-op selective ("selective op"), full or no
  checkpointing. The Llama 2 13B run without checkpointing (61.1 % MFU) is train (the
  torchtitan-2024 A100 GEMM efficiency and the A100 MFU cap); the other five are test.
- torchtitan ``docs/performance.md`` as of its December 2024 runs (torch and torchtitan of
  2024-12-26) on Grand Teton H100s (96 GB HBM2e at 2.4 TB/s, 500 W power limit): Llama 3.1 8B,
  local batch 2, seq 8192, selective checkpointing, tokens/s per GPU and memory (GiB, the
  allocator's ``max_memory_reserved``). Table 1 (8 GPUs) and Table 3 (128 GPUs), each "FSDP"
  (the 2024 stack) and "FSDP + torch.compile" (the 2025 stack). Train: Table 1's FSDP memory
  (the allocator reserve) and Table 1's compile throughput (the torchtitan-2025 H100 GEMM
  efficiency); the rest test, the "+ Float8" rows among them (FP8 linear layers). Table 4
  (test): Llama 3.1 70B with FSDP 32 × TP 8, Float8 and compile, with and without AsyncTP.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config.layout import Layout
from meshtrain.planner.cost.workload import STACKS
from meshtrain.planner.tables.runs_row import (
    LLAMA2_13B,
    LLAMA2_70B,
    LLAMA3_8B,
    LLAMA3_70B,
    PublishedRow,
    row,
)

GIB = 2**30 / 1e9
"""GB per GiB."""

# (model, shape, seq, local batch, checkpointing, tokens/s per GPU): FSDP2 on 64 A100 80 GB
TORCHTITAN_A100 = (
    ("Llama 3 8B", LLAMA3_8B, 8192, 1, "selective", 2973),
    ("Llama 3 70B", LLAMA3_70B, 8192, 1, "full", 331),
    ("Llama 2 13B", LLAMA2_13B, 4096, 2, "none", 2162),
    ("Llama 2 13B", LLAMA2_13B, 4096, 2, "selective", 1904),
    ("Llama 2 70B", LLAMA2_70B, 4096, 1, "selective", 355),
    ("Llama 2 70B", LLAMA2_70B, 4096, 2, "full", 353),
)

# (table, GPUs, stack, Float8, tokens/s per GPU, memory GiB, throughput split, memory split)
TORCHTITAN_H100 = (
    ("Table 1", 8, "torchtitan-2024", False, 5762, 82.4, "test", "train"),
    ("Table 1", 8, "torchtitan-2025", False, 6667, 77.0, "train", "test"),
    ("Table 1", 8, "torchtitan-2025", True, 8532, 76.8, "test", "test"),
    ("Table 3", 128, "torchtitan-2024", False, 5605, 67.0, "test", "test"),
    ("Table 3", 128, "torchtitan-2025", False, 6514, 62.0, "test", "test"),
    ("Table 3", 128, "torchtitan-2025", True, 8380, 61.8, "test", "test"),
)
"""torchtitan docs/performance.md (December 2024), Llama 3.1 8B with FSDP, local batch 2,
selective checkpointing on Grand Teton H100: "FSDP" (torchtitan-2024), "FSDP + torch.compile"
(torchtitan-2025) and "FSDP + torch.compile + Float8" (torchtitan-2025 with FP8 linear layers,
``--trait fp8_linear=true``; torchtitan has no FP8 train row, so the profile's FP8 efficiency,
megatron-core-2024's fit, prices them: a test of that figure on another stack)."""


# (technique, async tensor parallelism, tokens/s per GPU, memory GiB)
TORCHTITAN_H100_2D = (("2D", False, 829, 71.9), ("2D + AsyncTP", True, 876, 67.6))
"""torchtitan docs/performance.md (December 2024) Table 4: Llama 3.1 70B on 256 Grand Teton
H100, FSDP 32 × TP 8, torch.compile and Float8, local batch 16 (global 512), full activation
checkpointing. Its TP plan shards the norms' sequence (``SequenceParallel``): priced with
sequence parallelism, one micro-batch of 16 sequences; AsyncTP as tensor-parallel overlap
(``tp_comm_overlap``). Test rows."""


def _a100() -> list[PublishedRow]:
    rows = []
    for name, model, seq, local, mode, per_gpu in TORCHTITAN_A100:
        fit = name == "Llama 2 13B" and mode == "none"
        rows.append(row(f"{name} FSDP 64 A100 {mode}", "torchtitan docs/performance.md (A100)",
                        "train" if fit else "test", "tokens_per_s", per_gpu * 64, model, seq,
                        64 * local, Layout(dp=64, zero=3, activation_checkpointing=mode),
                        "a100-80g", "torchtitan-2024", "torchtitan-2024 a100" if fit else ""))
    return rows


def _h100() -> list[PublishedRow]:
    rows = []
    for table, gpus, stack, float8, per_gpu, gib, tps_split, memory_split in TORCHTITAN_H100:
        compiled = " compile" if stack == "torchtitan-2025" else ""
        name = f"Llama 3.1 8B FSDP {gpus}{compiled}{' Float8' if float8 else ''}"
        layout = Layout(dp=gpus, zero=3, activation_checkpointing="selective")
        source = f"torchtitan docs/performance.md {table}"
        common = (LLAMA3_8B, 8192, 2 * gpus, layout, "h100-96g-hbm2e-500w", stack)
        traits = dataclasses.replace(STACKS[stack], fp8_linear=True) if float8 else None
        rows.append(row(f"{name} memory", source, memory_split, "memory_gb_per_gpu",
                        gib * GIB, *common,
                        "allocator reserve" if memory_split == "train" else "", traits=traits))
        rows.append(row(f"{name} TPS", source, tps_split, "tokens_per_s", per_gpu * gpus,
                        *common, "torchtitan-2025 h100" if tps_split == "train" else "",
                        traits=traits))
    return rows


def _h100_2d() -> list[PublishedRow]:
    rows = []
    layout = Layout(dp=32, tp=8, zero=3, sequence_parallel=True,
                    activation_checkpointing="full")
    for technique, async_tp, per_gpu, gib in TORCHTITAN_H100_2D:
        traits = dataclasses.replace(STACKS["torchtitan-2025"], fp8_linear=True,
                                     tp_comm_overlap=async_tp)
        name = f"Llama 3.1 70B FSDP 32 TP 8 Float8{' AsyncTP' if async_tp else ''}"
        common = (LLAMA3_70B, 8192, 512, layout, "h100-96g-hbm2e-500w", "torchtitan-2025")
        source = "torchtitan docs/performance.md Table 4"
        rows.append(row(f"{name} memory", source, "test", "memory_gb_per_gpu", gib * GIB,
                        *common, traits=traits, note=f"'{technique}'"))
        rows.append(row(f"{name} TPS", source, "test", "tokens_per_s", per_gpu * 256, *common,
                        traits=traits, note=f"'{technique}'"))
    return rows


def torchtitan_rows() -> list[PublishedRow]:
    """Every torchtitan row: the A100 tables, then the H100 ones."""
    return _a100() + _h100() + _h100_2d()
