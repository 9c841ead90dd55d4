"""Kernel efficiencies fitted for each software stack on a GPU generation: the
:class:`~meshtrain.planner.hardware.stack_efficiency.StackEfficiency` entries that
``RuntimeTraits.kernel_efficiency`` lists (:mod:`meshtrain.planner.cost.runtime`). Each is
fitted on the rows marked train for it (:mod:`meshtrain.planner.tables.fitting`,
``python -m meshtrain.planner.tables.published --fit``) and checked only against test rows.
"""

from __future__ import annotations

from meshtrain.planner.hardware.stack_efficiency import StackEfficiency

MEGATRON_2021_A100 = StackEfficiency(
    gemm=0.706,
    source="megatron-2021 on A100: fitted on Narayanan et al. 2021 Table 1 (its ten train rows, "
           "priced as NVIDIA/Megatron-LM examples/sc21/run_table_1.sh ran them): the value at "
           "which they are on average neither faster nor slower than published")
"""Megatron-LM as Narayanan et al. 2021 ran it on Selene's A100 80 GB (SC21). Also the A100
profiles' default for stacks without an A100 entry of their own (meshtrain: no published A100
runs to fit on), see :data:`meshtrain.planner.tables.profiles.PROFILES`. Korthikanti et al. 2022
(``megatron-2022``) and Megatron-DeepSpeed ran the same kernels on the same GPUs;
``megatron-2022`` has no train rows of its own and inherits this entry (its rows stay test
rows). Megatron-DeepSpeed has an entry of its own (:data:`MEGATRON_DEEPSPEED_A100`)."""

MEGATRON_DEEPSPEED_A100 = StackEfficiency(
    gemm=0.579,
    source="megatron-deepspeed on A100: fitted on MT-NLG 530B's smallest run (Smith et al. 2022, "
           "2.4: 2,240 A100 80 GB, tp 8 x pp 35 x dp 8, 60.1 s per iteration; the train row): the "
           "value that prices it at its published step time")
"""Megatron-LM's kernels under DeepSpeed's pipeline engine and ZeRO-1 (MT-NLG, BLOOM) on A100
80 GB. With megatron-2021's A100 figure every run of this stack would be predicted 12-22 %
faster than it ran (MT-NLG's three runs, BLOOM): what the engine adds beyond the terms the cost
model prices for it (1F1B, whole-boundary sends, unoverlapped ZeRO-1 reduction) is not
attributed to a mechanism, so it is fitted here as a lower efficiency on one run. MT-NLG's two
larger runs and BLOOM (another team, model and layout) are test rows."""

TORCHTITAN_2024_A100 = StackEfficiency(
    gemm=0.824,
    source="torchtitan-2024 on A100: fitted on torchtitan docs/performance.md's A100 Llama 2 13B "
           "run without activation checkpointing (FSDP2 on 64 A100 80 GB, local batch 2, seq "
           "4096, 2,162 tokens/s per GPU; the train row): the value that prices it at its "
           "published throughput")
"""torchtitan (PyTorch-native: cuBLAS GEMMs, SDPA attention, eager element-wise kernels) on
A100 80 GB. Its five other A100 rows and its H100 rows are test rows. On the H100 family it
has no train row, so it falls back to the profile's figure there."""

MEGATRON_CORE_2024_H100 = StackEfficiency(
    gemm=0.667,
    fp8_gemm=0.566,
    source="megatron-core-2024 on H100: fitted on its train rows (NVIDIA dgxc-benchmarking, NeMo "
           "24.09 BF16: GPT-3 175B on 128 and 2,048 H100, Llama 3.1 8B on 8 and 128 H100; FP8: "
           "Llama 3.1 8B on 8 and 128 H100): the values at which they are on average neither "
           "faster nor slower than published")
"""Megatron-Core (NeMo 24.09, Transformer Engine) on H100 80 GB; its other dgxc-benchmarking
rows (Llama 3.1 70B and 405B, Nemotron-4 15B and 340B) and the Nemotron-4 340B report's rows
are test rows, and so are those recipes' FP8 rows but Llama 3.1 8B's (``fp8_gemm``: of the FP8
peak, Transformer Engine's casts included). Also ``llama3-2024``'s entry (Meta's runs are test
rows) and the H100-family profiles' default for stacks without an H100 entry of their own (see
:data:`meshtrain.planner.tables.profiles.PROFILES`)."""

TORCHTITAN_2025_H100 = StackEfficiency(
    gemm=0.627,
    source="torchtitan-2025 on H100: fitted on torchtitan docs/performance.md Table 1's 'FSDP + "
           "torch.compile' row (Llama 3.1 8B on 8 Grand Teton H100, 6,667 tokens/s per GPU; the "
           "train row): the value that prices it at its published throughput")
"""torchtitan with torch.compile (December 2024) on the 500 W Grand Teton H100; Table 3's
128-GPU compile row is a test row."""

MEGATRON_CORE_2025_H100 = StackEfficiency(
    gemm=MEGATRON_CORE_2024_H100.gemm,
    fp8_gemm=MEGATRON_CORE_2024_H100.fp8_gemm,
    expert_overhead_ns=163.3,
    source="megatron-core-2025 on H100: the GEMM figures of megatron-core-2024 (no dense train "
           "row of its own); the per-expert overhead fitted on Megatron-Bridge's Qwen3-30B-A3B "
           "run on 16 H100 (NeMo 26.02, FP8, pp 2 x ep 8, 5,113 tokens/s per GPU; the train row): "
           "the value that prices it at its published throughput")
"""Megatron-Core as Megatron-Bridge's 2025-2026 performance recipes run it on H100 80 GB. Its
MoE layers pay, for each token a rank routes and each local expert, a time beyond the experts'
GEMMs (``expert_overhead_ns``): priced without it, its Qwen3 MoE rows ran 1.2-3.0 x slower than
the roofline of their GEMMs, attention and all-to-alls, most for the fine-grained 30B-A3B with
16 experts per rank. The mechanism is not separated (work done expert by expert: permutation,
per-expert GEMMs and FP8 casts, the dropless dispatcher's bookkeeping). Of the two simplest
forms (per routed token and local expert, or per local expert and micro-batch) the Qwen3 rows
imply this one consistently across both model sizes and micro-batch sizes (docs/planner.md,
*Per-expert overhead*); only the train row sets its value, and the other Qwen3 rows check it."""
