"""Published H100 runs of NeMo 2.0's performance summary (NeMo 24.12): FP8, dense models.

Source: the NeMo Framework user guide 24.12, *Performance Benchmarks* (``performance_summary``),
its pre-training table: tokens per second per GPU on DGX H100 "at FP8 precision" with each row's
GPU count, global and micro-batch, sequence length and tp / pp / cp / virtual stages. The runs
are NeMo 2.0's performance scripts (``scripts/llm/performance``), which train FP8 with
``bf16_with_fp8_mixed`` (FP8 linear layers, the weights held in FP8 by ``fp8_param_gather``)
and set ``grad_reduce_in_fp32 = False`` for FP8 (bf16 gradient reduction). The models are NeMo's
configs of the names: GPT-3 5B, 20B and 175B (GELU with biases, the GPT-2 vocabulary padded),
Llama 2 7B, 13B and 70B, Llama 3 8B and 70B, Nemotron-3 8B and 22B (multi-head attention,
squared ReLU priced as GELU: two matmuls) and Nemotron-4 340B. Sequence parallelism wherever
tp > 1; the page states no recomputation and none is priced. Priced with ``megatron-core-2024``
(the stack of NeMo 24.09's runs, whose FP8 efficiency is fitted on dgxc-benchmarking's Llama 3.1
8B) with ``fp8_linear``, ``fp8_params`` and ``grad_reduce_bytes=2``. All are test rows.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.planner.cost.runtime import MEGATRON_CORE_2024
from meshtrain.planner.tables.presets import PRESETS
from meshtrain.planner.tables.runs_megatron import GPT3_175B_NEMO, NEMOTRON4_340B
from meshtrain.planner.tables.runs_row import (
    LLAMA2_13B,
    LLAMA3_8B,
    LLAMA3_70B,
    PublishedRow,
    gpt,
    megatron_layout,
    row,
)

SOURCE = "NeMo 24.12 performance summary"

NEMO2_FP8 = dataclasses.replace(MEGATRON_CORE_2024, fp8_linear=True, fp8_params=True,
                                grad_reduce_bytes=2)
"""``megatron-core-2024`` as NeMo 2.0's FP8 performance scripts run it."""

LLAMA2_7B = ModelConfig(**PRESETS["llama2-7b"][0])
LLAMA2_70B = ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         ffn_dim=28672, mlp="swiglu")
GPT3_5B = gpt(4096, 24, 32, vocab=50304, qkv_bias=True, wo_bias=True)
GPT3_20B = gpt(6144, 44, 48, vocab=50432, qkv_bias=True, wo_bias=True)
NEMOTRON3_8B = ModelConfig(vocab_size=256000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                           ffn_dim=16384, mlp="gelu")
NEMOTRON3_22B = ModelConfig(vocab_size=256000, dim=6144, n_layers=40, n_heads=48,
                            n_kv_heads=48, ffn_dim=24576, mlp="gelu")

NEMO_2412_H100_FP8 = (
    # name, model, sequence, GPUs, global batch, micro-batch, tp, pp, cp, virtual stages,
    # tokens/s per GPU
    ("GPT-3 5B", GPT3_5B, 2048, 64, 2048, 4, 1, 1, 1, 1, 23406),
    ("GPT-3 20B", GPT3_20B, 2048, 64, 256, 2, 2, 1, 1, 1, 5851),
    ("GPT-3 175B", GPT3_175B_NEMO, 2048, 128, 256, 1, 4, 8, 1, 6, 716),
    ("GPT-3 175B", GPT3_175B_NEMO, 2048, 512, 2048, 2, 4, 8, 1, 6, 825),
    ("Llama 2 7B", LLAMA2_7B, 4096, 8, 128, 1, 1, 1, 1, 1, 16934),
    ("Llama 2 13B", LLAMA2_13B, 4096, 16, 128, 1, 1, 4, 1, 10, 8715),
    ("Llama 2 70B", LLAMA2_70B, 4096, 64, 128, 1, 4, 4, 1, 20, 1728),
    ("Nemotron-3 8B", NEMOTRON3_8B, 4096, 64, 256, 4, 2, 1, 1, 1, 12507),
    ("Nemotron-3 22B", NEMOTRON3_22B, 4096, 64, 256, 2, 2, 4, 1, 10, 4312),
    ("Nemotron-4 340B", NEMOTRON4_340B, 4096, 128, 32, 1, 8, 8, 1, 12, 326),
    ("Llama 3 8B", LLAMA3_8B, 8192, 8, 128, 1, 1, 1, 2, 1, 12273),
    ("Llama 3 70B", LLAMA3_70B, 8192, 64, 128, 1, 4, 4, 2, 5, 1524),
)
"""NeMo 24.12's pre-training table, every row (DGX H100, FP8)."""


def nemo_rows() -> list[PublishedRow]:
    """Every row of NeMo 24.12's H100 FP8 pre-training table, as test rows."""
    rows = []
    for (name, model, seq, gpus, batch, micro, tp, pp, cp, chunks,
         tokens) in NEMO_2412_H100_FP8:
        layout = megatron_layout(gpus, tp, pp, cp, chunks, batch, micro)
        rows.append(row(f"{name} FP8 {gpus} H100 (NeMo 24.12)", SOURCE, "test", "tokens_per_s",
                        tokens * gpus, model, seq, batch, layout, "h100-80g",
                        "megatron-core-2024", traits=NEMO2_FP8))
    return rows
