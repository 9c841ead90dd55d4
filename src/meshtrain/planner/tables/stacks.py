"""Kernel efficiencies fitted or published for each software stack on a GPU generation: the
:class:`~meshtrain.planner.hardware.stack_efficiency.StackEfficiency` entries that
``RuntimeTraits.kernel_efficiency`` lists (:mod:`meshtrain.planner.cost.workload`).
"""

from __future__ import annotations

from meshtrain.planner.hardware.stack_efficiency import StackEfficiency

MEGATRON_2021_A100 = StackEfficiency(
    gemm=0.70,
    source="megatron-2021 on A100: fitted on Narayanan et al. 2021 Table 1 (fit rows, excluded "
           "from the report): the value whose mean signed error over its ten rows, priced as "
           "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh ran them, is zero")
"""Megatron-LM as Narayanan et al. 2021 ran it on Selene's A100 80 GB (SC21). Also the A100
profiles' default for stacks without an A100 entry of their own (meshtrain: no published A100
runs to fit on), see :data:`meshtrain.planner.tables.profiles.PROFILES`. Korthikanti et al. 2022
(``megatron-2022``) ran the same code base on the same cluster and has no fit rows of its own:
it inherits this entry, and its Table 5 rows stay report rows."""

TORCHTITAN_2024_A100 = StackEfficiency(
    gemm=0.74,
    source="torchtitan-2024 on A100: fitted on torchtitan docs/performance.md's A100 Llama 2 13B "
           "run without activation checkpointing (FSDP2 on 64 A100 80 GB, local batch 2, seq "
           "4096, 2,162 tokens/s per GPU; the fit row, excluded from the report): the value "
           "that prices it at its published throughput")
"""torchtitan (PyTorch-native: cuBLAS GEMMs, SDPA attention, eager element-wise kernels) on
A100 80 GB. Its five other A100 rows and its H100 rows are report rows. On the H100 family it
has no fit row (its one H100 throughput row reports), so it falls back to the profile's figure
there."""
