"""Published runs of Meta's own training runtime: Llama 3 405B on up to 16,384 H100.

Source: Llama Team 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783). Table 4 gives, for
405B pre-training on H100 80 GB at 16M tokens per batch, the layouts and the achieved BF16
TFLOP/s per GPU: 8,192 GPUs at tp 8 × pp 16 × dp 64, sequence 8,192, 430 TFLOP/s; 16,384 GPUs
at tp 8 × pp 16 × dp 128, sequence 8,192, 400 TFLOP/s; 16,384 GPUs at tp 8 × cp 16 × pp 16 ×
dp 8, sequence 131,072, 380 TFLOP/s. Section 3.3.2 gives the runtime (the ``llama3-2024`` stack,
:data:`meshtrain.planner.cost.runtime.LLAMA3_2024`) and the pipeline split: the first and the
last stage hold one layer fewer, so with 126 layers on 16 ranks of 8 chunks every chunk holds
one layer but the first (the embedding alone) and the last (the head alone); the 8K runs train
without activation checkpointing. The 8K rows are test rows (nothing is fitted on them). The
128K run is not a row: how its FLOPs count causal attention, which is most of its work, is not
stated (docs/planner.md, *Known limits*, gives its memory verdict).
"""

from __future__ import annotations

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.tables.presets import PRESETS
from meshtrain.planner.tables.runs_row import PublishedRow, row

LLAMA3_405B = ModelConfig(**PRESETS["llama3-405b"][0])
"""Llama 3 405B (Llama Team 2024, Table 3): the ``llama3-405b`` preset's model."""

LLAMA3_TABLE_4_8K = ((8192, 430.0), (16384, 400.0))
"""Llama Team 2024, Table 4, sequence 8,192: (GPUs, TFLOP/s per GPU) at tp 8 × pp 16."""

LLAMA3_SPLIT = ",".join(["0"] + ["1"] * 126 + ["0"])
"""Layers per chunk, in pipeline order: 16 ranks × 8 chunks, the first only the embedding and
the last only the head (3.3.2: one layer fewer on the first and the last stage)."""


def llama3_rows() -> list[PublishedRow]:
    """Llama 3 405B at 8K on 8,192 and 16,384 H100 (Table 4), priced with ``llama3-2024``."""
    batch = 16 * 2**20 // 8192  # 16M tokens per step
    rows = []
    for gpus, tflops in LLAMA3_TABLE_4_8K:
        dp = gpus // (8 * 16)
        rows.append(row(
            f"Llama 3 405B {gpus} H100 (8K)", "Llama Team 2024 Table 4", "test",
            "model_tflops_per_gpu", tflops, LLAMA3_405B, 8192, batch,
            Layout(dp=dp, tp=8, pp=16, zero=2, sequence_parallel=True,
                   pp_schedule="interleaved-1f1b", virtual_stages=8, pp_split=LLAMA3_SPLIT,
                   microbatches=batch // dp, activation_checkpointing="none"),
            "h100-80g", "llama3-2024",
            note="model FLOPs with attention counted without the causal mask's halving "
                 "(meshtrain's MFU); if the paper credits the mask, its runs did 4 % more "
                 "tokens per second than this compares"))
    return rows
