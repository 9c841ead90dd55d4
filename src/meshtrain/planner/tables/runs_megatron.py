"""Published runs of the Megatron family: Megatron-LM 2021 and 2022 (A100), Megatron-DeepSpeed
(MT-NLG and BLOOM, A100), Megatron-Core in NeMo 24.09 (H100) and the Nemotron-4 340B report (H100).

Sources (each row names its own):

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21, arXiv:2104.04473), Table 1 (train: the megatron-2021 A100 GEMM
  efficiency) and Table 2's PTD-P rows (test). Micro-batch, schedule and DDP of Table 1 are the
  paper's reproduction script's (NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh``).
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), Table 5 (test), layouts of its Table 3.
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B"
  (arXiv:2201.11990), 2.4: iteration times 60.1, 50.2 and 44.4 s for global batch 1920 on 280,
  350 and 420 DGX A100 nodes, tp 8 × pp 35 (the 280-node run train, the others test).
- BigScience, BLOOM-176B training page (with Le Scao et al. 2022, arXiv:2211.05100, for the
  model): about 150 TFLOPs per GPU on 384 A100 80GB at tp 4 × pp 12 × dp 8 (test).
- NVIDIA dgxc-benchmarking (``llama3.1/README_8b.md``, ``README_70b.md``, ``README_405b.md``,
  ``nemotron/README_15b.md``, ``README_340b.md``, ``nemo_megatron/README_175b.md``): NeMo 24.09
  BF16 step times on DGX H100 with the layouts each README states; recompute, fusions and the
  gradient dtype from the NeMo-Framework-Launcher configs each recipe starts from
  (``conf/training/gpt3/175b.yaml``: selective recompute; ``llama/llama3_1_70b.yaml``,
  ``llama3_1_405b.yaml``, ``nemotron/nemotron_15b.yaml``, ``nemotron_340b.yaml``: none;
  ``nemotron_340b.yaml``: bf16 gradient reduction). GPT-3 175B and Llama 3.1 8B are train (the
  megatron-core-2024 H100 GEMM efficiency and the H100 MFU cap), the rest test.
- NVIDIA 2024, "Nemotron-4 340B Technical Report" (arXiv:2406.11704), Table 2: 1,536, 3,072 and
  6,144 H100 at tp 8 × pp 12, batch 768, 1536 and 2304, iteration times 10.3, 10.3 and 8.0 s
  (test).
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.workload import MEGATRON_CORE_2024
from meshtrain.planner.tables.runs_row import (
    LLAMA3_8B,
    LLAMA3_70B,
    PublishedRow,
    gpt,
    megatron_layout,
    row,
)

# (params B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU)
NARAYANAN_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

NARAYANAN_TABLE_1_RUN = {
    1.7: (16, 1, "torch"), 3.6: (16, 1, "torch"), 7.5: (16, 1, "torch"), 18.4: (8, 1, "torch"),
    39.1: (4, 1, "local"), 76.1: (2, 3, "local"), 145.6: (2, 2, "local"), 310.1: (1, 2, "local"),
    529.6: (1, 3, "local"), 1008.0: (1, 1, "local"),
}
"""How each Table 1 model ran, from the paper's reproduction script (NVIDIA/Megatron-LM,
``examples/sc21/run_table_1.sh``): params B -> (micro-batch size, chunks per rank, DDP
implementation). Chunks are the stage's layers over ``--num-layers-per-virtual-pipeline-stage``
(5, 5, 3 and 1 for the 76B, 145B, 310B and 530B models; the others run plain 1F1B)."""

# (params B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU); micro-batch 1
NARAYANAN_TABLE_2_PTDP = (
    (174.6, 96, 12288, 96, 8, 12, 384, 1536, 153), (174.6, 96, 12288, 96, 8, 12, 768, 1536, 149),
    (174.6, 96, 12288, 96, 8, 12, 1536, 1536, 141),
    (529.6, 128, 20480, 105, 8, 35, 560, 2240, 171),
    (529.6, 128, 20480, 105, 8, 35, 1120, 2240, 167),
    (529.6, 128, 20480, 105, 8, 35, 2240, 2240, 159),
)

# (name, heads, hidden, layers, tp, pp, GPUs, batch, micro-batch, chunks, full s, selective s)
KORTHIKANTI_TABLE_5 = (
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
)

MT_NLG = ((2240, 60.1), (2800, 50.2), (3360, 44.4))
"""Smith et al. 2022, 2.4: (GPUs, seconds per iteration) at global batch 1920, tp 8 × pp 35."""

BLOOM_176B = gpt(14336, 70, 112, vocab=250880)
"""BLOOM (Le Scao et al. 2022, arXiv:2211.05100): 70 layers, hidden 14,336, 112 heads,
GELU MLP of 4 × hidden, sequence 2,048, global batch 2,048; its 250,680-token vocabulary padded
to 250,880 as the trained model holds it. ALiBi and the embedding's LayerNorm cost nothing
the cost model prices."""

BLOOM_TFLOPS = 150.0
"""BigScience's BLOOM-176B training page: "training throughput: about 150 TFLOPs" per GPU on
384 A100 80GB, one model copy on 48 GPUs (tp 4 × pp 12, so dp 8), Megatron-DeepSpeed, which
reports hardware TFLOPs (the recomputed forward included)."""

NEMOTRON4_15B = ModelConfig(vocab_size=256000, dim=6144, n_layers=32, n_heads=48, n_kv_heads=8,
                            ffn_dim=24576, mlp="gelu", rope_theta=10000.0)
"""Nemotron-4 15B (squared-ReLU MLP: two matmuls like GELU, priced as ``gelu``)."""
NEMOTRON4_340B = ModelConfig(vocab_size=256000, dim=18432, n_layers=96, n_heads=96,
                             n_kv_heads=8, ffn_dim=73728, mlp="gelu")
"""Nemotron-4 340B as ``conf/training/nemotron/nemotron_340b.yaml`` (squared ReLU as ``gelu``)."""
LLAMA31_405B_DGXC = ModelConfig(vocab_size=51200, dim=16384, n_layers=126, n_heads=128,
                                n_kv_heads=16, ffn_dim=53248, mlp="swiglu")
"""Llama 3.1 405B as the dgxc-benchmarking recipe ran it: ``num_query_groups: 16``
(``llama3_1_405b.yaml``) and the GPT-2 tokenizer as a proxy (synthetic data; 50,257 padded to a
multiple of 128 × tp = 51,200)."""
GPT3_175B_NEMO = gpt(12288, 96, 96, vocab=50688, qkv_bias=True, wo_bias=True)
"""GPT-3 175B as ``conf/training/gpt3/175b.yaml`` (GPT-2 tokenizer padded to 128 × tp)."""

# (name, model, seq, tp, pp, cp, chunks, micro-batch, sequences per GPU per step,
#  checkpointing, split, ((GPUs, seconds per step), ...), the run's own settings)
DGXC_NEMO_2409 = (
    ("GPT-3 175B", GPT3_175B_NEMO, 2048, 4, 8, 1, 12, 1, 2, "selective", "train",
     ((128, 8.309), (2048, 8.49)), {}),
    ("Llama 3.1 8B", LLAMA3_8B, 8192, 1, 1, 2, 1, 1, 16, "none", "train",
     ((8, 12.91), (128, 13.10)), {}),
    ("Llama 3.1 70B", LLAMA3_70B, 8192, 4, 4, 2, 5, 1, 2, "none", "test",
     ((64, 14.72), (2048, 14.98)), {}),
    ("Llama 3.1 405B", LLAMA31_405B_DGXC, 8192, 8, 9, 2, 7, 1, 0.4375, "none", "test",
     ((576, 17.20), (2304, 17.62)), {}),
    ("Nemotron-4 15B", NEMOTRON4_15B, 4096, 4, 1, 1, 1, 4, 4, "none", "test",
     ((16, 2.812), (2048, 2.887)), {}),
    ("Nemotron-4 340B", NEMOTRON4_340B, 4096, 8, 8, 1, 12, 1, 0.25, "none", "test",
     ((128, 4.61), (2048, 4.84)), {"optimizer_state_bytes": 6.0}),
)
"""NVIDIA dgxc-benchmarking, NeMo 24.09 BF16 on DGX H100 (module docstring): the smallest and
the largest full-model scale of each recipe. Every recipe is priced with bf16 gradient
reduction (``optim.grad_sync_dtype: bf16``, which ``nemotron_340b.yaml`` sets and NeMo's
performance tuning guide recommends at scale; the other recipes' own settings are not in the
source, and with fp32 gradients no accounting here fits their published layouts in 80 GB), and
Nemotron-4 340B with the bf16 optimizer state its config sets (``optim.dtype: bf16``)."""

DGXC_NEMO_2409_FP8 = {
    "Llama 3.1 8B": ("train", ((8, 9.67), (128, 9.82))),
    "Llama 3.1 70B": ("test", ((64, 11.01), (2048, 11.39))),
    "Llama 3.1 405B": ("test", ((576, 11.24), (2304, 12.35))),
}
"""The same READMEs' FP8 tables (NeMo 24.09, ``DTYPE=fp8``: Transformer Engine FP8 linear
layers), same layouts and batches as the BF16 rows: (split, ((GPUs, seconds per step), ...)).
Llama 3.1 8B fits the megatron-core-2024 H100 FP8 efficiency (as its BF16 rows fit the bf16
one); 70B and 405B only check it."""

DGXC_GRAD_BYTES = 2
"""The gradient bytes the dgxc-benchmarking rows are priced with (see :data:`DGXC_NEMO_2409`)."""

NEMOTRON4_REPORT = ((1536, 768, 10.3), (3072, 1536, 10.3), (6144, 2304, 8.0))
"""Nemotron-4 340B Technical Report, Table 2: (GPUs, batch, seconds per iteration), tp 8 × pp 12
with interleaving, micro-batch 1, seq 4096."""


def _narayanan() -> list[PublishedRow]:
    rows = []
    for source, split, table in (("Narayanan 2021 Table 1", "train", NARAYANAN_TABLE_1),
                                 ("Narayanan 2021 Table 2", "test", NARAYANAN_TABLE_2_PTDP)):
        for size, heads, hidden, layers, tp, pp, gpus, batch, tflops in table:
            dp = gpus // (tp * pp)
            mb, chunks, ddp = NARAYANAN_TABLE_1_RUN[size] if split == "train" else (1, 1, "local")
            stack = "megatron-2021-torch-ddp" if ddp == "torch" else "megatron-2021"
            rows.append(row(
                f"GPT {size}B tp{tp} pp{pp} dp{dp}", source, split, "hardware_tflops_per_gpu",
                tflops, gpt(hidden, layers, heads), 2048, batch,
                Layout(dp=dp, tp=tp, pp=pp, microbatches=batch // (dp * mb),
                       pp_schedule="interleaved-1f1b" if chunks > 1 else "1f1b",
                       virtual_stages=chunks, activation_checkpointing="full"), "a100-80g", stack,
                "megatron-2021 a100" if split == "train" else "",
                "" if split == "train" else "no schedule given: priced as 1F1B"))
    return rows


def _korthikanti() -> list[PublishedRow]:
    rows = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, mb, chunks, *times in \
            KORTHIKANTI_TABLE_5:
        schedule = "interleaved-1f1b" if chunks > 1 else "1f1b"
        for mode, seconds in zip(("full", "selective"), times, strict=True):
            rows.append(row(
                f"GPT {name} tp{tp} pp{pp} {mode}", "Korthikanti 2022 Table 5", "test",
                "step_time_s", seconds, gpt(hidden, layers, heads), 2048, batch,
                Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, microbatches=batch // mb,
                       sequence_parallel=True, pp_schedule=schedule, virtual_stages=chunks,
                       activation_checkpointing=mode), "a100-80g", "megatron-2022"))
    return rows


def _mt_nlg() -> list[PublishedRow]:
    # The smallest run fits the stack's A100 efficiency; the larger two only check it.
    fits = {MT_NLG[0][0]: "megatron-deepspeed a100"}
    return [row(f"MT-NLG 530B tp8 pp35 dp{gpus // 280}", "Smith 2022 (MT-NLG) 2.4",
                "train" if gpus in fits else "test",
                "step_time_s", seconds, gpt(20480, 105, 128, vocab=50272), 2048, 1920,
                Layout(dp=gpus // 280, tp=8, pp=35, microbatches=1920 // (gpus // 280),
                       activation_checkpointing="full"), "a100-80g", "megatron-deepspeed",
                fits.get(gpus, ""), note="ZeRO stage not stated: priced without")
            for gpus, seconds in MT_NLG]


def _bloom() -> list[PublishedRow]:
    return [row("BLOOM 176B tp4 pp12 dp8", "BigScience BLOOM-176B training page", "test",
                "hardware_tflops_per_gpu", BLOOM_TFLOPS, BLOOM_176B, 2048, 2048,
                Layout(dp=8, tp=4, pp=12, zero=1, microbatches=2048 // (8 * 2),
                       activation_checkpointing="full"), "a100-80g", "megatron-deepspeed",
                note="not on the page: priced with micro-batch 2, full recompute, ZeRO-1 and "
                     "1F1B (without recompute or optimizer sharding it needs over 80 GB)")]


def _dgxc() -> list[PublishedRow]:
    rows = []
    for (name, model, seq, tp, pp, cp, chunks, mb, per_gpu, ckpt, split, runs,
         settings) in DGXC_NEMO_2409:
        traits = dataclasses.replace(MEGATRON_CORE_2024, grad_reduce_bytes=DGXC_GRAD_BYTES,
                                     **settings)
        fp8_split, fp8_runs = DGXC_NEMO_2409_FP8.get(name, ("", ()))
        precisions = (("", split, runs, traits, "megatron-core-2024 h100"),
                      (" FP8", fp8_split, fp8_runs,
                       dataclasses.replace(traits, fp8_linear=True),
                       "megatron-core-2024 h100 fp8"))
        for label, row_split, row_runs, row_traits, fits in precisions:
            for gpus, seconds in row_runs:
                batch = round(per_gpu * gpus)
                rows.append(row(
                    f"{name}{label} {gpus} H100", "NVIDIA dgxc-benchmarking (NeMo 24.09)",
                    row_split, "step_time_s", seconds, model, seq, batch,
                    megatron_layout(gpus, tp, pp, cp, chunks, batch, mb, ckpt),
                    "h100-80g", "megatron-core-2024",
                    fits if row_split == "train" else "",
                    "bf16 gradient reduction (see DGXC_NEMO_2409)"
                    + ("; FP8 linear layers (DGXC_NEMO_2409_FP8)" if label else ""),
                    traits=row_traits))
    return rows


def _nemotron_report() -> list[PublishedRow]:
    return [row(f"Nemotron-4 340B {gpus} H100 (report)", "Nemotron-4 340B report Table 2",
                "test", "step_time_s", seconds, NEMOTRON4_340B, 4096, batch,
                Layout(dp=gpus // 96, tp=8, pp=12, zero=1, sequence_parallel=True,
                       pp_schedule="interleaved-1f1b", virtual_stages=8,
                       microbatches=batch // (gpus // 96)), "h100-80g", "megatron-core-2024",
                note="chunks per rank not stated: 8 (one layer per virtual stage, as NVIDIA's "
                     "NeMo recipe for the model runs it); no recompute")
            for gpus, batch, seconds in NEMOTRON4_REPORT]


def megatron_rows() -> list[PublishedRow]:
    """Every Megatron-family row, in the order docs/planner.md lists them."""
    return (_narayanan() + _korthikanti() + _mt_nlg() + _bloom() + _dgxc()
            + _nemotron_report())
