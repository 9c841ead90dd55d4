"""Published Mixture-of-Experts runs: Qwen3-235B-A22B on 256 H100 with Megatron-Bridge.

Source: NVIDIA dgxc-benchmarking, ``qwen3/pretrain/README.md``. Its example output of the timing
parser is one measured run, ``pretrain_qwen3_235b_a22b_bf16_gpus256_tp2_pp8_cp1_vp4_ep32_mbs1_
gbs2048``: 25,532 ms per step (mean of iterations 35-44), 190 TFLOP/s per GPU. That layout is
Megatron-Bridge's H100 BF16 recipe for the model (``scripts/performance/configs/qwen``, the only
GPU with tp 2, pp 8, vp 4, ep 32; the README's H100 table lists it at 256 GPUs): sequence 4,096,
micro-batch 1, global batch 2,048, sequence parallelism, expert tensor parallelism 1, the
all-to-all token dispatcher with ``moe_a2a_overlap``, no tensor-parallel overlap, no activation
recomputation, bf16 gradient reduction (``grad_reduce_in_fp32 = False``), the router forced to
balance the experts (a dropless benchmark) and the embedding and the loss each counted as a
layer in the pipeline split (``account_for_embedding_in_pipeline_split``, ``..._loss_...``): 94
layers + 2 over 32 chunks of 3, so the first chunk holds the embedding and 2 layers and the last
2 layers and the head. Priced with ``megatron-core-2025``; a test row (nothing is fitted on it).
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.runtime import MEGATRON_CORE_2025
from meshtrain.planner.tables.presets import PRESETS
from meshtrain.planner.tables.runs_row import PublishedRow, row

QWEN3_235B_A22B = ModelConfig(**PRESETS["qwen3-235b-a22b"][0])
"""Qwen3-235B-A22B, the ``qwen3-235b-a22b`` preset (Qwen's published config.json): every layer
MoE, 128 experts of width 1,536, 8 routed per token, no shared expert (235.1B parameters, 22.2B
active)."""

QWEN3_SPLIT = ",".join(["2"] + ["3"] * 30 + ["2"])
"""Layers per chunk, in pipeline order (8 ranks × 4 chunks): the embedding and the loss each
take a layer's place."""

BRIDGE_H100_QWEN3 = dataclasses.replace(MEGATRON_CORE_2025, tp_comm_overlap=False,
                                        ep_comm_overlap=True)
"""``megatron-core-2025`` as the H100 recipe configures it: no tensor-parallel communication
overlap, the expert all-to-alls overlapped with another micro-batch's compute
(``moe_a2a_overlap``); bf16 gradient reduction as the stack has it."""


def moe_rows() -> list[PublishedRow]:
    """Qwen3-235B-A22B on 256 H100 (dgxc-benchmarking's measured example), a test row."""
    batch = 2048
    layout = Layout(dp=16, tp=2, pp=8, ep=32, zero=1, sequence_parallel=True,
                    pp_schedule="interleaved-1f1b", virtual_stages=4, pp_split=QWEN3_SPLIT,
                    microbatches=batch // 16, activation_checkpointing="none")
    return [row("Qwen3 235B-A22B 256 H100", "NVIDIA dgxc-benchmarking (Megatron-Bridge)", "test",
                "step_time_s", 25.532, QWEN3_235B_A22B, 4096, batch, layout, "h100-80g",
                "megatron-core-2025", traits=BRIDGE_H100_QWEN3,
                note="bf16 gradient reduction and no tp overlap, as the recipe sets them; the "
                     "expert all-to-alls (ep 32 over 4 nodes) overlapped with another "
                     "micro-batch's compute, as moe_a2a_overlap sets them")]
