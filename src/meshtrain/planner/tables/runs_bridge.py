"""Published H100 runs of Megatron-Bridge's performance summary: FP8, dense and Mixture-of-Experts.

Source: Megatron-Bridge ``docs/performance-summary.md`` and ``performance-summary-archive.md``
(NeMo containers 25.11 and 26.02, system DGX-H100): tokens per second per GPU of the
performance recipes (``scripts/performance``) at the layout each row states, all FP8 with
current scaling (``bf16_with_fp8_current_scaling_mixed``: FP8 linear layers, the weights held in
FP8 by ``fp8_param_gather``, every layer in FP8 in the performance configs), bf16 gradient
reduction (``grad_reduce_in_fp32 = False`` in each model's common settings), MoE routing forced
to balance and dropless. What the rows and the recipes give:

- Llama 3 70B on 64 H100: tp 4, pp 8, 5 virtual stages, sequence 8,192, micro-batch 1, global
  batch 128 (25.11) and 256 (26.02), no recomputation.
- Llama 3.1 405B on 1,024 H100: tp 8, pp 8, cp 2, 8 virtual stages, global batch 512 (25.11) and
  1,536 (26.02), no recomputation; the embedding and the loss each take a layer's place in the
  split (126 + 2 layers over 64 chunks of 2).
- Qwen3-235B-A22B on 256 H100: tp 2, pp 8, 4 virtual stages, ep 32, global batch 2,048 (25.11)
  and 8,192 (26.02), the expert all-to-alls overlapped (``moe_a2a_overlap``), the split of
  :data:`meshtrain.planner.tables.runs_moe.QWEN3_SPLIT`.
- Qwen3-30B-A3B on 16 H100: pp 2, ep 8; 24 virtual stages, micro-batch 2, global batch 512
  (25.11) and 12 virtual stages, micro-batch 1, global batch 1,024 (26.02). Whether these runs
  overlapped the all-to-alls is not stated (the stack prices them exposed).

Priced with ``megatron-core-2025`` plus ``fp8_linear`` and ``fp8_params``. Qwen3-30B-A3B at
26.02 is the train row of the stack's per-expert overhead (:data:`EXPERTS_TRAIN_ROW`); the other
seven are test rows.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.runtime import MEGATRON_CORE_2025
from meshtrain.planner.tables.presets import PRESETS
from meshtrain.planner.tables.runs_moe import BRIDGE_H100_QWEN3, QWEN3_235B_A22B, QWEN3_SPLIT
from meshtrain.planner.tables.runs_row import LLAMA3_70B, PublishedRow, megatron_layout, row

SOURCE = "Megatron-Bridge performance summary"

BRIDGE_FP8 = dataclasses.replace(MEGATRON_CORE_2025, fp8_linear=True, fp8_params=True)
"""``megatron-core-2025`` as the FP8 current-scaling performance recipes run it."""

LLAMA31_405B = ModelConfig(**PRESETS["llama3.1-405b"][0])
QWEN3_30B_A3B = ModelConfig(**PRESETS["qwen3-30b-a3b"][0])

LLAMA31_405B_SPLIT = ",".join(["1"] + ["2"] * 62 + ["1"])
"""Layers per chunk (8 ranks × 8 chunks): the embedding and the loss each take a layer's place."""


EXPERTS_TRAIN_ROW = "Qwen3 30B-A3B FP8 16 H100 (26.02)"
"""The one train row: ``megatron-core-2025``'s per-expert overhead on H100 is fitted on it (the
run where that work is the largest part of the step, so it determines the constant best)."""


def _per_gpu(name: str, tokens_per_gpu: float, model: ModelConfig, seq_len: int,
             global_batch: int, layout: Layout, traits, note: str = "") -> PublishedRow:
    train = name == EXPERTS_TRAIN_ROW
    return row(name, SOURCE, "train" if train else "test", "tokens_per_s",
               tokens_per_gpu * layout.world_size, model, seq_len, global_batch, layout,
               "h100-80g", "megatron-core-2025",
               fits="megatron-core-2025 h100 experts" if train else "", traits=traits,
               note=note)


def bridge_rows() -> list[PublishedRow]:
    """The DGX-H100 rows of NeMo 25.11 and 26.02 that meshtrain's layouts express."""
    rows = []
    for release, batch, tokens in (("25.11", 128, 1602), ("26.02", 256, 1621)):
        rows.append(_per_gpu(
            f"Llama 3 70B FP8 64 H100 ({release})", tokens, LLAMA3_70B, 8192, batch,
            megatron_layout(64, 4, 8, 1, 5, batch, 1), BRIDGE_FP8))
    for release, batch, tokens in (("25.11", 512, 292), ("26.02", 1536, 311)):
        dp = 8
        rows.append(_per_gpu(
            f"Llama 3.1 405B FP8 1024 H100 ({release})", tokens, LLAMA31_405B, 8192, batch,
            Layout(dp=dp, tp=8, pp=8, cp=2, zero=1, sequence_parallel=True,
                   pp_schedule="interleaved-1f1b", virtual_stages=8,
                   pp_split=LLAMA31_405B_SPLIT, microbatches=batch // dp,
                   activation_checkpointing="none"), BRIDGE_FP8))
    qwen3_235b = dataclasses.replace(BRIDGE_H100_QWEN3, fp8_linear=True, fp8_params=True)
    for release, batch, tokens in (("25.11", 2048, 1575), ("26.02", 8192, 1633)):
        dp = 16
        rows.append(_per_gpu(
            f"Qwen3 235B-A22B FP8 256 H100 ({release})", tokens, QWEN3_235B_A22B, 4096, batch,
            Layout(dp=dp, tp=2, pp=8, ep=32, zero=1, sequence_parallel=True,
                   pp_schedule="interleaved-1f1b", virtual_stages=4, pp_split=QWEN3_SPLIT,
                   microbatches=batch // dp, activation_checkpointing="none"), qwen3_235b,
            note="the expert all-to-alls overlapped (moe_a2a_overlap), as the recipe sets it"))
    for release, batch, micro, chunks, tokens in (("25.11", 512, 2, 24, 5275),
                                                  ("26.02", 1024, 1, 12, 5113)):
        dp = 8
        rows.append(_per_gpu(
            f"Qwen3 30B-A3B FP8 16 H100 ({release})", tokens, QWEN3_30B_A3B, 4096, batch,
            Layout(dp=dp, pp=2, ep=8, zero=1, pp_schedule="interleaved-1f1b",
                   virtual_stages=chunks, microbatches=batch // dp // micro,
                   activation_checkpointing="none"), BRIDGE_FP8,
            note="all-to-all overlap not stated: priced exposed"))
    return rows
