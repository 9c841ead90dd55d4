"""Hardware profiles (one accelerator and its links) and the cluster they make.

A :class:`HardwareProfile` holds what the cost model needs about one GPU: dense bf16 peak,
memory, HBM bandwidth, the fraction of peak large matmuls reach, the per-kernel overhead, the
*bus* bandwidth (nccl-tests convention, see :mod:`meshtrain.parallel.comm`) a collective reaches
inside a node (NVLink) and the per-GPU bandwidth across nodes (InfiniBand / RoCE), their latencies,
and the power a GPU draws with its share of the server (for energy). Named profiles come from
vendor data sheets (:mod:`meshtrain.planner.tables.profiles`); ``meshtrain calibrate --out
profile.json`` writes a measured one, and a path
to such a file is accepted wherever a profile name is. A calibrated CPU profile also carries the
rates of one process computing alone (``solo_*``) and says that communication takes the cores
compute needs (``comm_overlaps_compute = False``); :meth:`HardwareProfile.per_process` turns it
into one rank's rates for a number of processes and threads.

A :class:`Cluster` is a profile × ``gpus`` × ``gpus_per_node``. :meth:`Cluster.collective_time`
prices one collective for a group laid out with a given stride over the ranks (tp innermost,
pp outermost, as :mod:`meshtrain.parallel.mesh` places them): a group inside one node runs at the
NVLink bus bandwidth; a group spanning nodes with ``g`` of its ranks per node runs at ``g`` times
the per-GPU network bandwidth (each GPU drives its own NIC, NCCL runs one ring per NIC), capped by
NVLink. A cluster split into sites (:mod:`meshtrain.planner.sites.wide_area`) prices a group that
spans sites at its share of the wide-area link instead, never faster than the above.
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.config import ConfigError
from meshtrain.planner.sites.wide_area import WideArea, gpus_per_site, spans_sites, wan_bandwidth


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator type and the links between accelerators (units in field names)."""

    name: str
    peak_tflops: float
    """Dense bf16 peak (no sparsity). Calibrated CPU profiles: the measured fp32 GEMM rate of
    one thread while ``calibrated_processes`` one-thread processes compute at once."""
    memory_gb: float
    """Device memory in GB (10^9 bytes) as the driver reports it (a GPU sold as "80 GB" has
    81,559 to 81,920 MiB, 85.5 to 85.9 GB)."""
    hbm_gbps: float
    """Device-memory bandwidth, GB/s."""
    matmul_efficiency: float
    """Fraction of ``peak_tflops`` that large bf16 GEMMs reach in a training step: the default
    for stacks without an entry for this profile's ``family``
    (:mod:`meshtrain.planner.hardware.stack_efficiency`), which replace it with their own."""
    kernel_overhead_us: float
    """Fixed cost per kernel (launch, tail effects), the reason small GEMMs run below peak."""
    intra_node_gbps: float
    """All-reduce bus bandwidth achieved inside a node (NVLink / NVSwitch), GB/s."""
    inter_node_gbps: float
    """Network bandwidth per GPU across nodes (one NIC per GPU), GB/s."""
    intra_node_latency_us: float
    inter_node_latency_us: float
    power_w: float
    """Power per GPU including its share of the server (CPUs, NICs, fans), watts."""
    reserved_gb: float = 3.0
    """Memory outside the framework's allocator (CUDA context, NCCL and cuBLAS buffers): the
    usable memory is ``memory_gb - reserved_gb``."""
    allocator_reserve: float = 0.0
    """What the caching allocator holds beyond the live tensors at the peak (fragmentation,
    cached blocks), as a fraction of them: the ``reserve`` component of a rank's memory. Named
    GPU profiles carry the fitted PyTorch figure
    (:data:`meshtrain.planner.tables.profiles.ALLOCATOR_RESERVE`); 0 on CPU profiles (glibc
    ``malloc``, measured as it is)."""
    attention_efficiency: float = 0.75
    """Fused (flash) attention throughput relative to large GEMMs (the default for stacks
    without their own, :mod:`meshtrain.planner.hardware.stack_efficiency`)."""
    attention_by_head_dim: dict | None = None
    """Calibrated profiles: ``{head_dim: [efficiency, backward / forward time]}`` of the fused
    causal attention measured at a few head widths (narrow heads run far below the GEMM rate on
    CPUs); the nearest width replaces ``attention_efficiency`` and the FlashAttention-2 ratio."""
    fp32_rate: float = 0.0625
    """fp32 GEMM throughput as a fraction of ``peak_tflops``: true fp32 on the CUDA cores, as
    meshtrain never enables TF32 (A100: 19.5 of 312 TFLOP/s; each profile states its own), 1
    for a calibrated CPU profile, whose ``peak_tflops`` is the measured fp32 rate."""
    fp8_rate: float = 0.0
    """Dense FP8 (e4m3) GEMM peak as a multiple of ``peak_tflops``: 2 on the H100 family, B200
    and MI300X (each data sheet's dense FP8 figure is twice its bf16 one), 0 where the chip has
    no FP8 tensor cores (A100, CPUs), where an estimate with ``RuntimeTraits.fp8_linear`` is
    refused."""
    fp8_matmul_efficiency: float = 0.0
    """Fraction of the FP8 peak (``peak_tflops * fp8_rate``) a stack's FP8 linear layers reach,
    the casts to FP8 included: the default for stacks without an FP8 figure of their own for
    this profile's ``family`` (:mod:`meshtrain.planner.hardware.stack_efficiency`)."""
    comm_overlaps_compute: bool = True
    """Whether a collective can run beside compute without slowing it (GPUs: NCCL on its own
    SMs and copy engines). False on CPUs where every core computes: gloo's reduction and copies
    then take the same cores, so overlapped communication is still paid in full."""
    overlap_contention: float = 0.0
    """Fraction of the time of a collective hidden behind compute that the step still pays:
    NCCL's kernels take SMs and memory bandwidth from the kernels they run beside, so those run
    slower while it does (:func:`meshtrain.planner.cost.overlap.contended`). Named GPU profiles
    carry the figure fitted on the published train rows (:data:`meshtrain.planner.tables.
    profiles.OVERLAP_CONTENTION`); 0 where nothing is hidden (``comm_overlaps_compute =
    False``)."""
    solo_tflops: float = 0.0
    """Calibrated CPU profiles: the GEMM rate of one process computing alone, where
    ``peak_tflops`` is what each of ``calibrated_processes`` gets while all compute at once (on
    a small or shared machine far less: cores, caches and memory bandwidth are shared). 0 on GPUs,
    where every process owns its device. See :meth:`per_process`."""
    solo_hbm_gbps: float = 0.0
    """Calibrated CPU profiles: streaming copy bandwidth of one process alone (as above)."""
    calibrated_processes: int = 0
    """Processes (one thread each) that computed at once for ``peak_tflops`` / ``hbm_gbps``."""
    shared_memory_reduce_gbps: float = 0.0
    """Calibrated CPU profiles: bus bandwidth of meshtrain's shared-memory gradient all-reduce
    between the processes of one host (:mod:`meshtrain.parallel.shared_memory`), GB/s; 0 = not
    measured, and data-parallel reductions are priced at ``intra_node_gbps``."""
    shared_memory_reduce_latency_us: float = 0.0
    """Fixed cost of one shared-memory reduction (its three barriers and thread hand-off)."""
    gpu_tdp_w: float = 0.0
    """The accelerator's own power limit at full load, watts (``power_w`` adds the server's
    share); 0 = unknown (no energy schedule). See :mod:`meshtrain.planner.energy.schedule`."""
    max_clock_mhz: float = 0.0
    """Highest (boost) compute clock, MHz; the clock every action runs at without a schedule."""
    min_clock_mhz: float = 0.0
    """Lowest clock the energy schedule uses: about where the supply voltage stops falling
    with the clock (below it power falls only linearly while time still grows)."""
    clock_step_mhz: float = 15.0
    """Spacing of the settable clocks (NVIDIA application clocks come in 15 MHz steps)."""
    static_power_fraction: float = 0.3
    """Share of ``gpu_tdp_w`` that does not scale with the clock (leakage, memory, fans): what a
    waiting accelerator draws, the floor under the cubic dynamic part."""
    power_limit_w: float = 0.0
    """Board power limit the GPUs run at when below ``gpu_tdp_w`` (0 = the TDP): compute runs at
    the clock whose power, on the energy model's curve (``static_power_fraction`` of the TDP
    plus a dynamic part cubic in the clock), meets the limit (:meth:`clock_ratio`)."""
    max_mfu: float = 0.0
    """Highest model-FLOPs utilisation a training step is known to reach on this accelerator
    (the best published figure, see :data:`PUBLISHED_MFU_CAPS`); the estimate never promises
    more (:func:`meshtrain.planner.cost.estimate.estimate`). 0 = no published figure, no cap."""
    family: str = ""
    """GPU generation a stack's kernel figures are keyed by (``a100``; ``h100`` for every
    profile with the H100's compute, h200 included; ...;
    :mod:`meshtrain.planner.hardware.stack_efficiency`); "" for a calibrated profile, which keeps
    its
    measured figures."""
    efficiency_source: str = ""
    """Where ``matmul_efficiency`` and ``attention_efficiency`` come from."""
    host_memory_gb: float = 0.0
    """Host (CPU) memory per node, GB: where ``parallel.offload_device = host`` keeps the
    offloaded state (:mod:`meshtrain.planner.cost.offload`). 0 = unknown (not checked)."""
    nvme_tb: float = 0.0
    """Local NVMe capacity per node, TB (10^12 bytes), for ``offload_device = nvme``; 0 =
    unknown (not checked, its traffic not priced)."""
    nvme_read_gbps: float = 0.0
    """Sequential read bandwidth of the node's NVMe drives together, GB/s."""
    nvme_write_gbps: float = 0.0
    """Sequential write bandwidth of the node's NVMe drives together, GB/s."""
    pcie_gbps: float = 0.0
    """Host link of one GPU, GB/s per direction (PCIe x16): offloaded gradients, masters and
    parameter shards cross it."""
    host_adamw_gbps: float = 0.0
    """Bytes per second of optimizer state the host's AdamW streams per node with all its cores
    (28 bytes per parameter with fp32 gradients: gradient read; master and both moments read and
    written), shared by the node's ranks. 0 on CPU profiles: the per-process memory bandwidth
    (``hbm_gbps``) is used; measure one process with ``python benchmarks/offload.py
    --step-only``."""
    host_source: str = ""
    """Where the host fields (memory, NVMe, PCIe, AdamW) come from."""
    source: str = ""
    measured: dict | None = None
    """For calibrated profiles: the raw measurements (bandwidth by message size, ...)."""

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (what ``calibrate --out`` writes)."""
        return dataclasses.asdict(self)

    @property
    def device_is_host(self) -> bool:
        """Whether the compute device is the host CPU itself (a CPU profile: calibrated or
        built in, with a solo rate), so ``offload_device = host`` moves nothing off it."""
        return self.solo_tflops > 0

    def attention_figures(self, head_dim: int, backward_ratio: float) -> tuple[float, float]:
        """(efficiency, backward / forward) of fused attention for heads ``head_dim`` wide."""
        if not self.attention_by_head_dim:
            return self.attention_efficiency, backward_ratio
        nearest = min(self.attention_by_head_dim, key=lambda d: abs(int(d) - head_dim))
        efficiency, ratio = self.attention_by_head_dim[nearest]
        return efficiency, ratio

    def clock_ratio(self) -> float:
        """Sustained compute clock over the maximum under ``power_limit_w``: ``r`` with
        ``static + (tdp - static) r^3 = limit``, never below ``min_clock_mhz``; 1 without a
        limit below the TDP."""
        if not self.power_limit_w or not self.gpu_tdp_w or self.power_limit_w >= self.gpu_tdp_w:
            return 1.0
        static = self.static_power_fraction * self.gpu_tdp_w
        ratio = max((self.power_limit_w - static) / (self.gpu_tdp_w - static), 0.0) ** (1 / 3)
        floor = self.min_clock_mhz / self.max_clock_mhz if self.max_clock_mhz else 0.0
        return max(ratio, floor)

    def per_process(self, processes: int, threads: int = 1) -> tuple[float, float]:
        """(peak TFLOP/s, memory GB/s) one of ``processes`` processes with ``threads`` threads
        each gets. GPUs: the profile's figures. Calibrated CPUs: the machine's throughput with
        ``k = processes × threads`` busy threads is the solo figure for ``k = 1``, ``k`` times the
        concurrent per-thread figure up to the calibrated count, and flat beyond it (the cores
        are full); each process gets its share."""
        if not self.solo_tflops or not self.calibrated_processes:
            return self.peak_tflops * self.clock_ratio(), self.hbm_gbps
        busy = max(processes, 1) * max(threads, 1)
        if busy == 1:
            return self.solo_tflops, self.solo_hbm_gbps or self.hbm_gbps
        share = min(busy, self.calibrated_processes) / max(processes, 1)
        return self.peak_tflops * share, self.hbm_gbps * share


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``gpus`` accelerators of one profile, ``gpus_per_node`` to a node."""

    profile: HardwareProfile
    gpus: int
    gpus_per_node: int = 8
    threads_per_process: int = 1
    """CPU runs: intra-op threads of each worker process (see :meth:`process_rates`)."""
    wan: WideArea | None = None
    """Sites and the wide-area link between them (None: one site)."""
    busy_processes: int = 0
    """Processes computing at once on the machine(s) when more than ``gpus`` do (one DiLoCo
    replica group's share of a job, see :func:`meshtrain.planner.sites.diloco_cost.inner_cluster`);
    0 = ``gpus``. Only calibrated CPU profiles' rates depend on it."""
    axis_scale: tuple[tuple[str, float], ...] = ()
    """``(axis, factor)`` pairs: each collective of that parallel axis (``dp``, ``tp``, ``pp``,
    ``ep``, ``cp``) takes ``factor`` times its priced time; what ``parallel.replan_every``
    measured (:mod:`meshtrain.replan.measured`). Empty = the profile's figures alone."""

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"--gpus {self.gpus} and --gpus-per-node {self.gpus_per_node} "
                              f"must be at least 1.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError(f"--gpus {self.gpus} is not a whole number of nodes of "
                              f"{self.gpus_per_node} GPUs.")
        if self.wan is not None and (self.gpus < self.gpus_per_node * self.wan.sites
                                     or self.nodes % self.wan.sites):
            raise ConfigError(f"{self.wan.sites} sites need whole nodes each: --gpus "
                              f"{self.gpus} makes {self.nodes} node(s) of {self.gpus_per_node}.")

    @property
    def sites(self) -> int:
        """Sites the cluster spans (1 without a wide-area link)."""
        return self.wan.sites if self.wan else 1

    def axis_factor(self, axis: str) -> float:
        """How many times its priced time a collective of ``axis`` takes (1 unless measured)."""
        return dict(self.axis_scale).get(axis, 1.0)

    def process_rates(self) -> tuple[float, float]:
        """(peak TFLOP/s, memory GB/s) of one rank while all ``gpus`` ranks compute
        (:meth:`HardwareProfile.per_process`)."""
        return self.profile.per_process(self.busy_processes or self.gpus,
                                        self.threads_per_process)

    @property
    def nodes(self) -> int:
        """Nodes in the cluster."""
        return max(1, math.ceil(self.gpus / self.gpus_per_node))

    def ranks_per_node(self, size: int, stride: int) -> int:
        """How many members of a group (``size`` ranks, ``stride`` apart) share one node."""
        if stride >= self.gpus_per_node:
            return 1
        return max(1, min(size, self.gpus_per_node // stride))

    def group_bandwidth(self, size: int, stride: int) -> tuple[float, float]:
        """(bus bandwidth in bytes/s, per-step latency in s) of a group's collectives."""
        p = self.profile
        per_node = self.ranks_per_node(size, stride)
        if per_node >= size:
            return p.intra_node_gbps * 1e9, p.intra_node_latency_us * 1e-6
        bandwidth = min(p.intra_node_gbps, per_node * p.inter_node_gbps) * 1e9
        latency = p.inter_node_latency_us * 1e-6
        if spans_sites(self.wan, self.gpus, size, stride):
            wide, wide_latency = wan_bandwidth(self.wan, self.gpus, size, stride)
            return min(bandwidth, wide), max(latency, wide_latency)
        return bandwidth, latency

    def collective_time(self, op: str, full_bytes: float, size: int, stride: int = 1,
                        axis: str = "") -> float:
        """Seconds for one collective over ``size`` ranks on a tensor of ``full_bytes``.

        Bus bytes follow :func:`meshtrain.config.runtime_facts.bus_bytes`; the latency term counts
        ``2 log2(n)`` steps (NCCL's tree / ring hybrid at scale, simplified), and at least the
        ring's ``n - 1`` for all-gather and reduce-scatter, which NCCL has no tree for (so a
        gather over thousands of ranks is latency-bound). ``axis`` names the parallel axis the
        group belongs to, for :attr:`axis_scale`.
        """
        if size <= 1 or full_bytes <= 0:
            return 0.0
        scale = self.axis_factor(axis) if self.axis_scale else 1.0
        bandwidth, latency = self.group_bandwidth(size, stride)
        if op == "all_to_all":
            return scale * self._all_to_all_time(full_bytes, size, stride)
        if op == "send":
            bus = full_bytes
            steps = 1
        else:
            factor = 2.0 if op == "all_reduce" else 1.0
            bus = factor * (size - 1) / size * full_bytes
            steps = 2 * math.ceil(math.log2(size))
            if op in ("all_gather", "reduce_scatter"):  # NCCL runs these as rings only
                steps = max(steps, size - 1)
        return scale * (bus / bandwidth + steps * latency)

    def dp_gradient_reduce_time(self, op: str, full_bytes: float, size: int, stride: int,
                                fp32_buckets: bool, axis: str = "dp") -> float:
        """Seconds for a data-parallel gradient ``all_reduce`` / ``reduce_scatter``: through
        shared memory when the profile measured it, the group sits on one node and the buckets
        are fp32 (what the runtime does, see :mod:`meshtrain.parallel.shared_memory`), else as
        any collective (:meth:`collective_time`)."""
        p = self.profile
        if (size > 1 and full_bytes > 0 and fp32_buckets and p.shared_memory_reduce_gbps > 0
                and op in ("all_reduce", "reduce_scatter")
                and self.ranks_per_node(size, stride) >= size):
            # The all-reduce's second half (copying the other segments) is skipped by a
            # reduce-scatter: half the bus bytes, as for gloo.
            factor = 2.0 if op == "all_reduce" else 1.0
            bus = factor * (size - 1) / size * full_bytes
            return self.axis_factor(axis) * (bus / (p.shared_memory_reduce_gbps * 1e9) + (
                p.shared_memory_reduce_latency_us * 1e-6))
        return self.collective_time(op, full_bytes, size, stride, axis)

    def _all_to_all_time(self, full_bytes: float, size: int, stride: int) -> float:
        """All-to-all: the off-node share goes through this GPU's NIC, the rest over NVLink."""
        p = self.profile
        per_node = self.ranks_per_node(size, stride)
        on_node = (per_node - 1) / size * full_bytes
        off_node = (size - per_node) / size * full_bytes
        latency = (p.inter_node_latency_us if off_node else p.intra_node_latency_us) * 1e-6
        off_site = 0.0
        if spans_sites(self.wan, self.gpus, size, stride):
            # Each rank's share for other sites crosses the site's link, which every rank of
            # the site uses at once; the rest of its off-node share stays on the site's network.
            per_site = gpus_per_site(self.wan, self.gpus)
            in_site = min(size, max(1, per_site // stride))
            off_site = (size - in_site) / size * full_bytes
            off_node -= off_site
            time = off_site * per_site / self.wan.bytes_per_s
            latency = max(latency, self.wan.wan_latency_ms * 1e-3)
        else:
            time = 0.0
        time += on_node / (p.intra_node_gbps * 1e9) + off_node / (p.inter_node_gbps * 1e9)
        return time + (size - 1) * latency / 4  # peers are addressed concurrently

    def p2p_time(self, nbytes: float, stride: int, group_size: int = 2,
                 axis: str = "pp") -> float:
        """One point-to-point send between ranks ``stride`` apart, in a chain of
        ``group_size`` such ranks (pipeline stages): when the chain spans sites its slowest
        hop crosses the wide-area link, shared by the ``stride`` chains sending at once.
        ``axis``: for :attr:`axis_scale`."""
        if nbytes <= 0:
            return 0.0
        p = self.profile
        if spans_sites(self.wan, self.gpus, group_size, stride):
            senders = min(stride, gpus_per_site(self.wan, self.gpus))
            return self.axis_factor(axis) * (
                nbytes * senders / self.wan.bytes_per_s
                + max(self.wan.wan_latency_ms * 1e-3, p.inter_node_latency_us * 1e-6))
        if stride < self.gpus_per_node:
            one = nbytes / (p.intra_node_gbps * 1e9) + p.intra_node_latency_us * 1e-6
        else:
            one = nbytes / (p.inter_node_gbps * 1e9) + p.inter_node_latency_us * 1e-6
        return self.axis_factor(axis) * one
