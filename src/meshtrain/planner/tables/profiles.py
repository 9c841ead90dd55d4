"""The named hardware profiles: data-sheet figures of each accelerator and its server, the best
published MFU of each family, and how a reported GPU name or a calibrated JSON file maps to a
profile. The :class:`~meshtrain.planner.hardware.profile.HardwareProfile` type they fill is in
:mod:`meshtrain.planner.hardware.profile`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from meshtrain.config import ConfigError
from meshtrain.planner.hardware.profile import HardwareProfile
from meshtrain.planner.tables.stacks import MEGATRON_2021_A100, MEGATRON_CORE_2024_H100

PUBLISHED_MFU_CAPS = {
    "a100": (0.604, "the best MFU among the A100 train rows (meshtrain.planner.tables.fitting."
                    "fit_mfu_cap): torchtitan docs/performance.md (its 2024 A100 tables), Llama 2 "
                    "13B with FSDP2 on 64 A100 80 GB, local batch 2, seq 4096, no activation "
                    "checkpointing, 2,162 tokens/s per GPU: 60.4 % with the cost model's 6N + "
                    "12 L h s FLOPs per token and 312 TFLOP/s (the source states 61.1 % with its "
                    "own count)"),
    "h100": (0.595, "the best MFU among the H100 train rows (meshtrain.planner.tables.fitting."
                    "fit_mfu_cap): NVIDIA dgxc-benchmarking, NeMo 24.09 BF16, Llama 3.1 8B at "
                    "cp 2 on 8 H100, 12.91 s per step of 128 x 8,192 tokens: 59.5 % with the "
                    "cost model's FLOPs per token and 989 TFLOP/s. Applied to every profile with "
                    "the H100's compute (h100-80g, h100-96g, h100-96g-hbm2e-500w, h800, h200)"),
}
"""Best published MFU by accelerator family, with where it comes from (``max_mfu``)."""

ALLOCATOR_RESERVE = 0.082
"""The PyTorch caching allocator's reserve over the live tensors at the peak (fragmentation,
cached free blocks), as a fraction: fitted by :func:`meshtrain.planner.tables.fitting.
fit_allocator_reserve` on the memory rows marked train (torchtitan docs/performance.md Table 1,
Llama 3.1 8B with FSDP on 8 H100: 82.4 GiB, the allocator's ``max_memory_reserved``), so that
the predicted reserve matches what that row reserved beyond the predicted tensors, never below
0. Every named GPU profile carries it (``HardwareProfile.allocator_reserve``)."""

OVERLAP_CONTENTION = 0.47
"""Fraction of the time of a collective hidden behind compute that the compute still loses to
it on a GPU (``HardwareProfile.overlap_contention``): fitted by :func:`meshtrain.planner.tables.
fitting.fit_overlap_contention` on every train row of a speed constant, as the value at which
their errors are smallest once each stack's constants are fitted again at it. Only rows whose
runs hide communication move with it: of the train rows, megatron-core-2024's on H100 (the
distributed optimizer's reduce-scatter and all-gather, Transformer Engine's tp overlap), at 8
to 2,048 GPUs. Every named GPU profile carries it: NCCL (and RCCL) run their collectives as
kernels on the GPU's own SMs on every generation."""

_MIB = 2**20 / 1e9
_GIB = 2**30 / 1e9
# Memory is the capacity the driver reports, in 10^9 bytes: a "80 GB" GPU is 80 GiB-class
# (nvidia-smi: A100-SXM4-80GB 81,920 MiB, H100 80GB HBM3 81,559 MiB, A100-SXM4-40GB 40,960 MiB,
# H200 143,771 MiB, B200 182,784 MiB); parts without a reported figure here take the vendor's
# GB as GiB (h100-96g, the 96 GB Grand Teton H100, MI300X).
# Data-sheet values. Bus bandwidths are what nccl-tests reports for all-reduce on such systems,
# below the raw link rate; inter-node is per GPU (DGX-style: one NIC per GPU). fp32_rate is the
# datasheet's FP32 (CUDA-core, no TF32) TFLOP/s over its dense bf16 figure: A100 19.5 / 312,
# H100 SXM (and H800, H200) 67 / 989, B200 80 / 2250, MI300X 163.4 / 1307.
# matmul_efficiency and attention_efficiency are the defaults of stacks without an entry of
# their own for the profile's family (meshtrain.planner.hardware.stack_efficiency); each profile's
# efficiency_source says where they come from.
_A100_EFFICIENCY = ("megatron-2021's A100 fit (stack_efficiency.MEGATRON_2021_A100), the "
                    "A100 figure fitted on the oldest stack in the validation set; attention "
                    "efficiency 0.75 by analogy (unused by Megatron-LM 2021, which has no fused "
                    "attention)")
_H100_GEMM = MEGATRON_CORE_2024_H100.gemm
_H100_EFFICIENCY = (f"{_H100_GEMM} megatron-core-2024's H100 fit (stack_efficiency."
                    "MEGATRON_CORE_2024_H100), the H100 figure fitted on the H100 train rows "
                    "(dgxc-benchmarking, NeMo 24.09); attention efficiency 0.75 by analogy")
_ANALOGY = (f"by analogy with the H100's {_H100_GEMM} (megatron-core-2024's H100 fit), "
            "unvalidated: no published run on this GPU is in the validation set")
_H100_FP8_GEMM = MEGATRON_CORE_2024_H100.fp8_gemm
"""The FP8 efficiency (of the FP8 peak) of every profile with FP8 tensor cores, for stacks
without their own: megatron-core-2024's H100 fit, by analogy off the H100 family."""
_H200_GEMM = round(_H100_GEMM + 0.02, 3)
_MI300X_GEMM = round(_H100_GEMM - 0.02, 3)
HOST_ADAMW_FRACTION = 0.4
"""Fraction of the host's peak DRAM bandwidth that its AdamW over offloaded state streams (all
cores, every rank of the node at once): an assumption, not a measurement. AdamW on a CPU is
bound by memory traffic (28 bytes per parameter against a few dozen flops); write-allocate
traffic, two sockets and pinned buffers placed on either keep it well below the peak. Measure
a machine with ``python benchmarks/offload.py --step-only`` (one process) and write the figure
into a profile JSON's ``host_adamw_gbps``."""


def _host(memory_gib: float, drives: int, drive_tb: float, pcie_gbps: float,
          dram_peak_gbps: float, source: str) -> dict:
    """The host fields of a node: memory (GiB as the DIMMs count it, in GB), ``drives`` data
    NVMe drives of ``drive_tb`` TB at a PCIe 4.0 U.2 drive's 6.4 GB/s read and 3.8 GB/s write
    each (Samsung PM1733 3.84 TB data sheet), each GPU's host link, and the AdamW rate
    (:data:`HOST_ADAMW_FRACTION` of the DRAM peak)."""
    return {"host_memory_gb": round(memory_gib * _GIB, 1), "nvme_tb": drives * drive_tb,
            "nvme_read_gbps": drives * 6.4, "nvme_write_gbps": drives * 3.8,
            "pcie_gbps": pcie_gbps,
            "host_adamw_gbps": round(HOST_ADAMW_FRACTION * dram_peak_gbps, 1),
            "host_source": source + f"; {drives} x {drive_tb} TB NVMe at 6.4 / 3.8 GB/s read / "
                           f"write each (PCIe 4.0 U.2 class: Samsung PM1733 data sheet); AdamW at "
                           f"{HOST_ADAMW_FRACTION:.0%} of {dram_peak_gbps:g} GB/s DRAM peak "
                           "(assumed, not measured)"}


_PCIE5 = 63.0  # PCIe 5.0 x16 per direction: 32 GT/s x 16 lanes x 128b/130b
_PCIE4 = 31.5  # PCIe 4.0 x16 per direction
_DGX_H100_HOST = _host(
    2048, 8, 3.84, _PCIE5, 614.4,
    "DGX H100 / H200 (NVIDIA DGX BasePOD reference architecture: 2 TB DDR5, dual Xeon "
    "Platinum 8480C, eight 3.84 TB U.2 NVMe data drives; NVIDIA's MLPerf DGX H100 system "
    "description: 32 x 64 GB DIMMs, 'data bandwidth for GPU-PCIe: 504 GB/s', i.e. PCIe 5.0 x16 "
    "per GPU); DRAM peak 2 sockets x 8 channels of DDR5-4800")
_DGX_A100_HOST = _host(
    2048, 8, 3.84, _PCIE4, 409.6,
    "DGX A100 640 GB (NVIDIA DGX A100 data sheet: 2 TB, 30 TB of U.2 NVMe (8 x 3.84 TB), dual "
    "AMD EPYC 7742; A100 SXM4 host link PCIe 4.0 x16); DRAM peak 2 sockets x 8 channels of "
    "DDR4-3200")
_DGX_A100_320_HOST = _host(
    1024, 4, 3.84, _PCIE4, 409.6,
    "DGX A100 320 GB (NVIDIA DGX A100 data sheet: 1 TB, 15 TB of U.2 NVMe (4 x 3.84 TB), dual "
    "AMD EPYC 7742; PCIe 4.0 x16 per GPU); DRAM peak 2 sockets x 8 channels of DDR4-3200")
_DGX_B200_HOST = _host(
    2048, 8, 3.84, _PCIE5, 716.8,
    "DGX B200 (NVIDIA DGX B200 user guide: 2 TB in 32 DIMMs, upgradable to 4 TB; 8 x 3.84 TB "
    "NVMe U.2 data cache in RAID 0; dual Xeon 8570, PCIe 5.0); DRAM peak 2 sockets x 8 "
    "channels of DDR5-5600")
_MI300X_HOST = _host(
    1536, 2, 3.5, _PCIE5, 921.6,
    "AMD's 8 x MI300X MLPerf Inference v4.1 system (1.5 TiB in 24 x 64 GB DIMMs, dual EPYC "
    "9374F, 2 x 3.5 TB NVMe data disks, 'PCIe Gen5 x16' host interconnect); DRAM peak 2 "
    "sockets x 12 channels of DDR5-4800")
_H100_ANALOGY_HOST = {**_DGX_H100_HOST, "host_source": "by analogy with h100-80g (no published "
                      "host of this part's own is used here): " + _DGX_H100_HOST["host_source"]}

PROFILES: dict[str, HardwareProfile] = {
    profile.name: profile
    for profile in (
        HardwareProfile(
            "a100-40g", peak_tflops=312.0, fp32_rate=0.0625, memory_gb=_MIB * 40960,
            hbm_gbps=1555.0,
            matmul_efficiency=MEGATRON_2021_A100.gemm, kernel_overhead_us=6.0,
            intra_node_gbps=230.0, inter_node_gbps=23.0, intra_node_latency_us=8.0,
            inter_node_latency_us=15.0,
            gpu_tdp_w=400.0, max_clock_mhz=1410.0, min_clock_mhz=705.0,
            power_w=800.0, max_mfu=PUBLISHED_MFU_CAPS["a100"][0],
            family="a100", efficiency_source=_A100_EFFICIENCY,
            allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            **_DGX_A100_320_HOST,
            source="NVIDIA A100 datasheet; DGX A100 (8x HDR 200 Gb/s, 6.5 kW)"),
        HardwareProfile(
            "a100-80g", peak_tflops=312.0, fp32_rate=0.0625, memory_gb=_MIB * 81920,
            hbm_gbps=2039.0,
            matmul_efficiency=MEGATRON_2021_A100.gemm, kernel_overhead_us=6.0,
            intra_node_gbps=230.0, inter_node_gbps=23.0, intra_node_latency_us=8.0,
            inter_node_latency_us=15.0,
            gpu_tdp_w=400.0, max_clock_mhz=1410.0, min_clock_mhz=705.0,
            power_w=800.0, max_mfu=PUBLISHED_MFU_CAPS["a100"][0],
            family="a100", efficiency_source=_A100_EFFICIENCY,
            allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            **_DGX_A100_HOST,
            source="NVIDIA A100 datasheet; DGX A100 (8x HDR 200 Gb/s, 6.5 kW)"),
        HardwareProfile(
            "h100-80g", peak_tflops=989.0, fp32_rate=0.0677, memory_gb=_MIB * 81559,
            fp8_rate=2.0, fp8_matmul_efficiency=_H100_FP8_GEMM,
            hbm_gbps=3350.0,
            matmul_efficiency=_H100_GEMM, kernel_overhead_us=5.0, intra_node_gbps=370.0,
            inter_node_gbps=45.0, intra_node_latency_us=6.0, inter_node_latency_us=12.0,
            gpu_tdp_w=700.0, max_clock_mhz=1980.0, min_clock_mhz=990.0,
            power_w=1275.0, max_mfu=PUBLISHED_MFU_CAPS["h100"][0],
            family="h100", efficiency_source=_H100_EFFICIENCY,
            allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            **_DGX_H100_HOST,
            source="NVIDIA H100 SXM datasheet; DGX H100 (8x NDR 400 Gb/s, 10.2 kW)"),
        HardwareProfile(
            "h100-96g", peak_tflops=989.0, fp32_rate=0.0677, memory_gb=_GIB * 96, hbm_gbps=4000.0,
            fp8_rate=2.0, fp8_matmul_efficiency=_H100_FP8_GEMM,
            matmul_efficiency=_H100_GEMM, kernel_overhead_us=5.0, intra_node_gbps=370.0,
            inter_node_gbps=45.0, intra_node_latency_us=6.0, inter_node_latency_us=12.0,
            gpu_tdp_w=700.0, max_clock_mhz=1980.0, min_clock_mhz=990.0,
            power_w=1275.0, max_mfu=PUBLISHED_MFU_CAPS["h100"][0],
            family="h100", efficiency_source=_H100_EFFICIENCY,
            allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            **_H100_ANALOGY_HOST,
            source="H100 with 96 GB HBM3 (six stacks; the GH200 datasheet's H100: 96 GB, 4 TB/s); "
                   "compute, links and power as h100-80g"),
        HardwareProfile(
            "h100-96g-hbm2e-500w", peak_tflops=989.0, fp32_rate=0.0677, memory_gb=_GIB * 96,
            fp8_rate=2.0, fp8_matmul_efficiency=_H100_FP8_GEMM,
            hbm_gbps=2400.0, matmul_efficiency=_H100_GEMM, kernel_overhead_us=5.0,
            intra_node_gbps=370.0, inter_node_gbps=50.0, intra_node_latency_us=6.0,
            inter_node_latency_us=12.0, gpu_tdp_w=700.0, max_clock_mhz=1980.0,
            min_clock_mhz=990.0, power_limit_w=500.0, power_w=1075.0,  # h100-80g's server share
            max_mfu=PUBLISHED_MFU_CAPS["h100"][0],
            family="h100", efficiency_source=_H100_EFFICIENCY,
            allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            **_H100_ANALOGY_HOST,
            source="Grand Teton H100 as torchtitan's docs/performance.md describes it: SXM H100 "
                   "with 96 GB HBM2e at 2.4 TB/s, run at the default 500 W power limit (of "
                   "700 W), 8 per host on NVLink, 400 Gb/s RDMA per GPU; compute as h100-80g"),
        HardwareProfile(
            "h800", peak_tflops=989.0, fp32_rate=0.0677, memory_gb=_MIB * 81559, hbm_gbps=3350.0,
            fp8_rate=2.0, fp8_matmul_efficiency=_H100_FP8_GEMM,
            matmul_efficiency=_H100_GEMM, kernel_overhead_us=5.0, intra_node_gbps=165.0,
            inter_node_gbps=45.0, intra_node_latency_us=6.0, inter_node_latency_us=12.0,
            gpu_tdp_w=700.0, max_clock_mhz=1980.0, min_clock_mhz=990.0,
            power_w=1275.0, max_mfu=PUBLISHED_MFU_CAPS["h100"][0],
            family="h100", efficiency_source=_H100_EFFICIENCY,
            allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            **_H100_ANALOGY_HOST,
            source="H800 SXM: H100 SXM compute and memory with NVLink cut to 400 GB/s (of 900), "
                   "so the node's all-reduce bus bandwidth is h100-80g's x 400/900; "
                   "8x 400 Gb/s InfiniBand per node as the DeepSeek-V3 report describes"),
        HardwareProfile(
            "h200", peak_tflops=989.0, fp32_rate=0.0677, memory_gb=_MIB * 143771, hbm_gbps=4800.0,
            fp8_rate=2.0, fp8_matmul_efficiency=_H100_FP8_GEMM,
            matmul_efficiency=_H200_GEMM, kernel_overhead_us=5.0, intra_node_gbps=370.0,
            inter_node_gbps=45.0, intra_node_latency_us=6.0, inter_node_latency_us=12.0,
            gpu_tdp_w=700.0, max_clock_mhz=1980.0, min_clock_mhz=990.0,
            power_w=1275.0, max_mfu=PUBLISHED_MFU_CAPS["h100"][0],
            family="h100", efficiency_source=f"{_H200_GEMM} {_ANALOGY}, a little above for its HBM",
            allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            **_DGX_H100_HOST,
            source="NVIDIA H200 SXM datasheet; HGX H200 (8x NDR 400 Gb/s)"),
        HardwareProfile(
            "b200", peak_tflops=2250.0, fp32_rate=0.0356, memory_gb=_MIB * 182784, hbm_gbps=7700.0,
            fp8_rate=2.0, fp8_matmul_efficiency=_H100_FP8_GEMM,
            matmul_efficiency=_H100_GEMM, kernel_overhead_us=5.0, intra_node_gbps=720.0,
            inter_node_gbps=45.0, intra_node_latency_us=5.0, inter_node_latency_us=12.0,
            gpu_tdp_w=1000.0, max_clock_mhz=1965.0, min_clock_mhz=990.0,
            power_w=1790.0, family="b200", efficiency_source=f"{_H100_GEMM} {_ANALOGY}",
            allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            **_DGX_B200_HOST,
            source="NVIDIA DGX B200 datasheet (8x 400 Gb/s, 14.3 kW)"),
        HardwareProfile(
            "mi300x", peak_tflops=1307.0, fp32_rate=0.125, memory_gb=_GIB * 192, hbm_gbps=5300.0,
            fp8_rate=2.0, fp8_matmul_efficiency=_H100_FP8_GEMM,
            matmul_efficiency=_MI300X_GEMM, kernel_overhead_us=8.0, intra_node_gbps=300.0,
            inter_node_gbps=45.0, intra_node_latency_us=10.0, inter_node_latency_us=15.0,
            gpu_tdp_w=750.0, max_clock_mhz=2100.0, min_clock_mhz=1050.0,
            power_w=1300.0, family="mi300x", allocator_reserve=ALLOCATOR_RESERVE,
            overlap_contention=OVERLAP_CONTENTION,
            efficiency_source=f"{_MI300X_GEMM} {_ANALOGY}, a little below for a less mature stack",
            **_MI300X_HOST,
            source="AMD Instinct MI300X datasheet (8x 400 Gb/s)"),
    )
}


GPU_NAMES = (("gh200", "h100-96g"), ("h200", "h200"), ("h800", "h800"), ("h100", "h100-80g"),
             ("b200", "b200"), ("mi300", "mi300x"), ("a100", "a100-80g"))
"""(part of the device name, profile) to match a GPU's reported name to its data-sheet profile,
first match wins (a GH200 superchip's GPU is an H100 with 96 GB, not an H200)."""


def profile_for_gpu(device_name: str) -> str | None:
    """The data-sheet profile name for a GPU by its reported name (None when there is none)."""
    name = device_name.lower()
    return next((profile for key, profile in GPU_NAMES if key in name), None)


def load_profile(name_or_path: str) -> HardwareProfile:
    """A named profile, or a profile JSON file written by ``meshtrain calibrate``."""
    key = name_or_path.lower()
    if key in PROFILES:
        return PROFILES[key]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ConfigError(f"--hardware {name_or_path}: no such profile file.")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ConfigError(f"--hardware {name_or_path}: not a JSON profile ({error}).") from None
        fields = {f.name for f in dataclasses.fields(HardwareProfile)}
        missing = [f.name for f in dataclasses.fields(HardwareProfile)
                   if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise ConfigError(f"--hardware {name_or_path}: profile lacks {', '.join(missing)}.")
        return HardwareProfile(**{k: v for k, v in data.items() if k in fields})
    raise ConfigError(f'--hardware "{name_or_path}" is neither a known profile nor a file; '
                      f"known profiles: {', '.join(PROFILES)} (or a calibrate --out JSON file).")
