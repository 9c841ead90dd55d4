"""Published H100 throughput of OLMo-core's training scripts (allenai/OLMo-core README).

Source: the OLMo-core README's throughput table (commit ``a7de3f65``; the same 7B and 13B
figures in every version of the table): tokens per second per device "measured on a cluster with
NVIDIA H100 GPUs", BF16, context 4,096, the OLMo-1124 (OLMo 2) architecture: 7B at 10,000 and
13B at 4,600 tokens/s (another version gives 9.7-10K and 4.4-4.6K, MFU 47-48 % and 41-42 %).
The scripts (``src/scripts/train/OLMo-7B.py``, ``OLMo-13B.py``) train with FSDP2 (bf16
parameters, fp32 reduction), ``torch.compile``, no activation checkpointing, a fused AdamW, a
global batch of 1,024 (7B) and 2,048 (13B) sequences and 2 (7B) and 1 (13B) sequences per rank
and micro-batch. The models: OLMo 2's 7B (d 4,096, 32 layers, 32 heads, MLP 11,008) and 13B
(d 5,120, 40 layers, 40 heads, MLP 13,824), multi-head attention with QK-norm, the dolma2
vocabulary (100,278 padded to 100,352), untied embeddings. The GPU count is not stated: priced
at 8, one node (the scripts' launch default); per-device throughput under FSDP barely moves with
it in the cost model (7B: 10,611 tokens/s at 8, 10,572 at 64). Priced with ``torchtitan-2025``
(FSDP2 with compile); test rows.
"""

from __future__ import annotations

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.tables.runs_row import PublishedRow, row

OLMO2_7B = ModelConfig(vocab_size=100352, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                       ffn_dim=11008, mlp="swiglu", qk_norm=True, rope_theta=500000.0)
OLMO2_13B = ModelConfig(vocab_size=100352, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                        ffn_dim=13824, mlp="swiglu", qk_norm=True, rope_theta=500000.0)

GPUS = 8
"""Not stated by the source: one node, the scripts' launch default."""


def olmo_rows() -> list[PublishedRow]:
    """OLMo-core's 7B and 13B BF16 throughput on H100, as test rows."""
    rows = []
    for name, model, batch, micro, tokens in (("OLMo 2 7B", OLMO2_7B, 1024, 2, 10000),
                                              ("OLMo 2 13B", OLMO2_13B, 2048, 1, 4600)):
        layout = Layout(dp=GPUS, zero=3, microbatches=batch // GPUS // micro,
                        activation_checkpointing="none")
        rows.append(row(f"{name} FSDP {GPUS} H100", "OLMo-core README", "test",
                        "tokens_per_s", tokens * GPUS, model, 4096, batch, layout, "h100-80g",
                        "torchtitan-2025",
                        note="GPU count not stated: priced at 8 (one node)"))
    return rows
