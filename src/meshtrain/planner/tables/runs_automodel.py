"""Published runs of NeMo AutoModel (PyTorch-native: FSDP2, Transformer Engine, DeepEP) on H100.

Source: NeMo AutoModel's performance summary (``docs/performance-summary``, "Pre-Training
Performance", System: DGX-H100, Precision: BF16): each row's GPUs, global, micro- and local
batch, sequence length, tp / pp / cp / ep and FSDP degree, step time and tokens per second per
GPU, on mock data of full-length sequences (no packing, no padding) and, for the MoE models, a
"fake balanced gate" (every expert gets the same number of tokens). The settings the table does
not give are read from the benchmark recipes it links (``examples/llm_benchmark``): both rows
below checkpoint every decoder block (Llama's per sub-module: the same recomputation, priced as
full checkpointing). Priced with ``automodel-2026``; both are test rows.

- Qwen3 MoE 30B (Qwen3-30B-A3B) on 8 H100: ep 8 over the 8 GPUs, the dense weights FSDP-sharded
  8 ways, the experts held whole by their ep rank; micro-batches of 4 sequences of 4,096,
  16 per step (global batch 512); ``torch.optim.Adam`` on the bf16 parameters (bf16 moments:
  ``optimizer_state_bytes=4``) and the loss on bf16 logits (``fp32_upcast: false``:
  ``loss_bytes_per_logit=6``); 21.77 s a step, 12,040 tokens/s per GPU.
- Llama 3 70B on 64 H100: FSDP 32 × cp 2, micro-batches of one 8,192-token sequence, 4 per step
  (global batch 128), ``torch.compile`` on each layer, Transformer Engine's ``FusedAdam`` and
  the fp32-upcast loss (the stack's defaults); 18.90 s a step, 866.77 tokens/s per GPU.

The table's other H100 rows are not priced: DeepSeek V3, Kimi K2 and Nemotron V3 Ultra use
latent attention or a latent MoE, GPT-OSS alternates sliding-window attention and Nemotron V3
mixes Mamba layers, which the cost model does not price (docs/planner.md, *Known limits*).
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.runtime import AUTOMODEL_2026
from meshtrain.planner.tables.presets import PRESETS
from meshtrain.planner.tables.runs_row import LLAMA3_70B, PublishedRow, row

SOURCE = "NeMo AutoModel performance summary (H100 BF16)"

QWEN3_30B_A3B = ModelConfig(**PRESETS["qwen3-30b-a3b"][0])
"""Qwen3-30B-A3B: the ``qwen3-30b-a3b`` preset's model (48 layers, 128 experts, top 8)."""

QWEN3_TRAITS = dataclasses.replace(AUTOMODEL_2026, optimizer_state_bytes=4.0,
                                   loss_bytes_per_logit=6.0)
"""``automodel-2026`` as the Qwen3 recipe sets it: bf16 Adam moments, the loss on bf16 logits."""


def automodel_rows() -> list[PublishedRow]:
    """NeMo AutoModel's Qwen3 MoE 30B (8 H100) and Llama 3 70B (64 H100) BF16 rows."""
    qwen3 = row("Qwen3 MoE 30B FSDP 8 EP 8 H100 (AutoModel)", SOURCE, "test", "tokens_per_s",
                12040 * 8, QWEN3_30B_A3B, 4096, 512,
                Layout(dp=8, ep=8, zero=3, microbatches=16, activation_checkpointing="full"),
                "h100-80g", "automodel-2026", traits=QWEN3_TRAITS,
                note="a fake balanced gate: the experts' loads are equal, as priced")
    llama = row("Llama 3 70B FSDP 32 CP 2 H100 (AutoModel)", SOURCE, "test", "tokens_per_s",
                866.77 * 64, LLAMA3_70B, 8192, 128,
                Layout(dp=32, cp=2, zero=3, microbatches=4, activation_checkpointing="full"),
                "h100-80g", "automodel-2026",
                note="checkpointed per sub-module (attention, MLP, both norms): the recompute of "
                     "full checkpointing")
    return [qwen3, llama]
