"""Offload priced: where ``parallel.offload`` puts a rank's ZeRO shard, what the host and the
NVMe drives must hold, and what the step pays (docs/planner.md, "Offload").

For a rank whose ZeRO shard holds ``S`` parameters (``P / N`` over the ``N = dp × cp`` ranks
sharing it; experts over their own group), ``k`` micro-batches per step, ``b`` bytes per
parameter element (2 bf16, 4 fp32) and ``G`` per gradient element (4 fp32, 2 with
``parallel.grad_reduce_dtype = bf16``), as the runtime does it (docs/offload.md):

**Memory.** The store holds the fp32 master (4 S; with fp32 parameters under
``optimizer+params`` the parameter shard is the master) and Adam's two moments (8 S): 12 S,
plus the bf16 parameter shard (2 S) under ``optimizer+params``, plus DiLoCo's outer state
(start weights and momentum, 8 S) with replica groups. On a GPU the device keeps no optimizer
state (a bf16 model's 12 S, an fp32 model's 8 S of moments: its master is the parameter
itself) and, under ``optimizer+params``, no parameter shard at rest (the gathered units are
unchanged); the gradient shard stays on the device. On a CPU profile ``host`` moves nothing
(an fp32 model gains a separate 4 S master copy below ``optimizer+params``), ``nvme`` also
takes the gradient shard at ZeRO 2-3. ``host`` needs, per node, the store of each of its ranks
plus :data:`RANK_HOST_BYTES` per rank within the host memory less :data:`SYSTEM_FRACTION`;
``nvme`` needs each rank's store rounded up to whole :data:`NVME_FILE_BYTES` files of drive
space, and in host memory only the chunks in flight.

**Time per step.** The host's AdamW streams ``(G + 24) S`` bytes (28 S with fp32 gradients) at
the node's ``host_adamw_gbps`` shared by its ranks (a CPU profile, which has none: the device's
own update at its per-process memory bandwidth, plus reading the master and writing it into a
separate parameter). Over each GPU's PCIe link: the gradient
shard to the host (``G S``), and to the device the updated masters written back into the
parameters (``b S``) or, under ``optimizer+params``, the parameter shard at each of the ``2 k``
gathers (``2 k b S``). NVMe (``nvme``, priced at the node's drive bandwidth shared by its
ranks): the step reads the master and moments (12 S) and writes them (12 S, and the bf16
parameter shard 2 S under ``optimizer+params``); the gathers read ``2 k b S``; where the
gradient shard is in the files (CPU, ZeRO 2-3) each micro-batch's accumulation reads and
writes ``G S``, the norm and the step read it and zeroing writes it: ``(k + 2) G S`` read,
``(k + 1) G S`` written. At ZeRO-3 with ``optimizer+params``, fp32, on the CPU: reads
``(8k + 4k + 4 + 16) S``, writes ``(4k + 12 + 4) S``. With ``offload_overlap`` the step (its
AdamW, its PCIe and NVMe transfers) runs during the next forward: only what outlasts one
micro-batch's forward is exposed; the gathers' transfers and the gradient accumulation stay
exposed. The device's own optimizer update (``optimizer_s``) is gone.
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.config import Config, ConfigError
from meshtrain.planner.cost.context_parallel import reduction_group
from meshtrain.planner.cost.expert_parallel import expert_reduction_size
from meshtrain.planner.cost.memory import GB, RankMemory, StageParams

SYSTEM_FRACTION = 0.10
"""Share of a node's host memory kept for the operating system, its page cache and daemons
(an assumption): offloaded state is planned into the rest."""
RANK_HOST_BYTES = 5e9
"""Host memory of one GPU training process beside its offloaded state (an assumption): the
interpreter, torch, CUDA's and NCCL's host allocations, data loading."""
NVME_FILE_BYTES = 2**30
"""The offload store cuts nvme tensors from files of at least this size
(:data:`meshtrain.parallel.offload.store.ARENA_BYTES`): a rank's drive space is its store
rounded up to whole files."""
RESIDENT_CHUNKS = 8
"""Chunks of ``offload_chunk_mb`` an nvme rank holds in host memory at once: one of each of the
four tensors a step touches and the next one, prefetched."""
MASTER_BYTES = 4.0
"""The fp32 master copy per parameter (the runtime's optimizer works on fp32)."""
OUTER_STATE_BYTES = 8.0
"""DiLoCo's outer state per shard parameter: fp32 start weights and momentum."""

_BASE_CONFIG = Config()


@dataclasses.dataclass(frozen=True)
class Offload:
    """The ``parallel.offload*`` settings a layout is priced with."""

    kind: str = "none"
    """``none``, ``optimizer`` or ``optimizer+params`` (``parallel.offload``)."""
    device: str = "host"
    """``host`` or ``nvme`` (``parallel.offload_device``)."""
    overlap: bool = False
    """The ZeRO-3 step in the background (``parallel.offload_overlap``)."""
    chunk_mb: float = 16.0
    """MiB per chunk of a pass over offloaded state (``parallel.offload_chunk_mb``)."""

    @property
    def active(self) -> bool:
        """Whether anything is offloaded."""
        return self.kind != "none"

    @property
    def params(self) -> bool:
        """Whether the parameter shard is offloaded too."""
        return self.kind == "optimizer+params"

    @classmethod
    def from_config(cls, parallel) -> Offload:
        """The settings of a run config's ``[parallel]`` section."""
        return cls(parallel.offload, parallel.offload_device, parallel.offload_overlap,
                   parallel.offload_chunk_mb)

    @classmethod
    def from_json(cls, data: dict | None) -> Offload:
        """The settings an estimate's ``offload`` entry or a ``plan`` candidate row names
        (``kind``/``offload``, ``device``/``offload_device``, ``overlap``/``offload_overlap``);
        none when ``data`` names none."""
        if not data:
            return cls()
        kind = data.get("kind", data.get("offload", "none")) or "none"
        return cls(kind, data.get("device", data.get("offload_device")) or "host",
                   bool(data.get("overlap", data.get("offload_overlap", False))))

    def settings(self) -> list[str]:
        """``parallel.KEY=VALUE`` for each setting away from the default."""
        out = [f"parallel.offload={self.kind}"] if self.active else []
        if self.active and self.device != "host":
            out.append(f"parallel.offload_device={self.device}")
        if self.overlap:
            out.append("parallel.offload_overlap=true")
        return out

    def describe(self) -> str:
        """``optimizer+params on host, overlapped`` (or ``none``)."""
        if not self.active:
            return "none"
        return f"{self.kind} on {self.device}" + (", overlapped" if self.overlap else "")


NO_OFFLOAD = Offload()


def check_offload(workload, layout, offload: Offload, replicas: int = 1) -> None:
    """Raise :class:`ConfigError` when the runtime refuses ``offload`` with ``layout``
    (:func:`meshtrain.validation.offload.validate_offload`'s own rules and messages) or the
    priced stack has no offload."""
    if not offload.active and not offload.overlap:
        return
    if not workload.traits.offload:
        raise ConfigError(f'parallel.offload = "{offload.kind}": the priced stack has no '
                          "offload (priced for --stack meshtrain only).")
    from meshtrain.validation.offload import validate_offload

    parallel = dataclasses.replace(
        _BASE_CONFIG.parallel, offload=offload.kind, offload_device=offload.device,
        offload_overlap=offload.overlap, offload_chunk_mb=offload.chunk_mb, zero=layout.zero,
        replicas=replicas)
    validate_offload(dataclasses.replace(_BASE_CONFIG, parallel=parallel))


def shard_params(params: StageParams, layout) -> float:
    """Parameters in a rank's ZeRO shard of its stage: dense over ``dp × cp``, experts over
    their reduction group."""
    return params.dense / reduction_group(layout)[0] + params.expert / expert_reduction_size(
        layout)


def store_bytes(workload, layout, offload: Offload, device_is_host: bool,
                replicas: int = 1) -> dict[str, float]:
    """Bytes per shard parameter the store holds, by part (see the module doc)."""
    bf16 = workload.precision == "bf16"
    moments = workload.traits.optimizer_state_bytes - MASTER_BYTES if bf16 else 8.0
    parts = {"master": MASTER_BYTES, "moments": moments}
    if offload.params and bf16:  # fp32 parameters are the master itself
        parts["parameters"] = 2.0
    if device_is_host and layout.zero >= 2:
        parts["gradients"] = grad_bytes(workload)
    if replicas > 1:
        parts["outer state"] = OUTER_STATE_BYTES
    return parts


def grad_bytes(workload) -> int:
    """Bytes per gradient element (fp32 models always keep 4)."""
    return workload.traits.grad_reduce_bytes if workload.precision == "bf16" else 4


def offloaded_memory(mem: RankMemory, shard: float, workload, layout, offload: Offload,
                     profile) -> RankMemory:
    """``mem`` (one rank's memory without offload) with ``offload``'s state moved off the
    device, the allocator's reserve recomputed on what stays."""
    if not offload.active:
        return mem
    param, grad, optim = mem.param_bytes, mem.grad_bytes, mem.optim_bytes
    if profile.device_is_host and offload.device == "host":
        if workload.precision != "bf16" and not offload.params:  # a separate fp32 master
            optim += MASTER_BYTES * shard
    else:
        optim = 0.0
        if offload.params:
            param = 0.0
        if profile.device_is_host and layout.zero >= 2:
            grad = 0.0
    allocated = param + grad + optim + mem.activation_bytes + mem.buffer_bytes
    return RankMemory(mem.stage, param, grad, optim, mem.activation_bytes, mem.buffer_bytes,
                      profile.allocator_reserve * allocated)


def ranks_per_node(cluster, replicas: int = 1) -> int:
    """Ranks sharing one node's host, drives and AdamW (replica groups may share a node)."""
    return max(1, min(cluster.gpus_per_node, cluster.gpus * replicas))


def _capacity(cluster, offload: Offload, per_rank: float, replicas: int) -> dict:
    """Host memory and drive space per node against what the profile has."""
    profile, ranks = cluster.profile, ranks_per_node(cluster, replicas)
    files = math.ceil(per_rank / NVME_FILE_BYTES) * NVME_FILE_BYTES
    host_rank = None
    if not profile.device_is_host:  # on a CPU profile the device check is the host check
        host_rank = RANK_HOST_BYTES + (per_rank if offload.device == "host"
                                       else RESIDENT_CHUNKS * offload.chunk_mb * 2**20)
    host_limit = profile.host_memory_gb * (1 - SYSTEM_FRACTION)
    nvme = offload.device == "nvme"
    out = {
        "ranks_per_node": ranks, "store_gb_per_rank": per_rank / GB,
        "host_gb_per_rank": None if host_rank is None else host_rank / GB,
        "host_gb_per_node": None if host_rank is None else ranks * host_rank / GB,
        "host_memory_gb": profile.host_memory_gb or None,
        "host_limit_gb": host_limit or None,
        "nvme_gb_per_rank": files / GB if nvme else None,
        "nvme_gb_per_node": ranks * files / GB if nvme else None,
        "nvme_limit_gb": profile.nvme_tb * 1000 or None,
    }
    out["host_fits"] = (out["host_gb_per_node"] is None or not profile.host_memory_gb
                        or out["host_gb_per_node"] <= host_limit)
    out["nvme_fits"] = (not nvme or not profile.nvme_tb
                        or out["nvme_gb_per_node"] <= out["nvme_limit_gb"])
    return out


def offload_cost(workload, layout, cluster, offload: Offload, shard: float, forward_s: float,
                 replicas: int = 1) -> dict:
    """What ``offload`` costs a rank whose shard holds ``shard`` parameters: the store, the
    host memory and drive space per node against the profile, and the step's terms
    (``forward_s``: one micro-batch's forward, what the overlapped step hides behind). A
    JSON-ready dict; ``exposed_s`` is the estimate's ``offload_s``."""
    profile, ranks = cluster.profile, ranks_per_node(cluster, replicas)
    on_host = profile.device_is_host
    parts = store_bytes(workload, layout, offload, on_host, replicas)
    out = {"kind": offload.kind, "device": offload.device, "overlap": offload.overlap,
           "store_bytes_per_param": parts}
    out.update(_capacity(cluster, offload, sum(parts.values()) * shard, replicas))
    k, b, g = layout.microbatches, workload.act_bytes, grad_bytes(workload)
    adamw_bytes = (g + 24) * shard
    if profile.host_adamw_gbps:
        adamw_rate = profile.host_adamw_gbps * 1e9 / ranks
    elif on_host:  # the device's own update, plus the masters written into the parameters
        separate = workload.precision == "bf16" or not offload.params
        adamw_bytes = (workload.traits.optimizer_bytes_per_param
                       + (MASTER_BYTES + b if separate else 0.0)) * shard
        adamw_rate = cluster.process_rates()[1] * 1e9
    else:
        raise ConfigError(f"--hardware {profile.name} has no host figures (host_adamw_gbps, "
                          "pcie_gbps, host_memory_gb): offload cannot be priced on it.")
    gathers = 2 * k * b * shard if offload.params else 0.0
    to_host = 0.0 if on_host else g * shard
    write_back = 0.0 if on_host or offload.params else b * shard
    pcie_rate = profile.pcie_gbps * 1e9
    if not on_host and not pcie_rate:
        raise ConfigError(f"--hardware {profile.name} has no pcie_gbps: offload cannot be "
                          "priced on it.")
    pcie = (to_host + write_back + (0.0 if on_host else gathers)) / pcie_rate if pcie_rate else 0.0
    step_pcie = (to_host + write_back) / pcie_rate if pcie_rate else 0.0
    reads = writes = step_reads = step_writes = 0.0
    if offload.device == "nvme":
        step_reads = (MASTER_BYTES + parts["moments"]) * shard
        step_writes = step_reads + parts.get("parameters", 0.0) * shard
        in_files = "gradients" in parts
        reads = step_reads + gathers + ((k + 2) * g * shard if in_files else 0.0)
        writes = step_writes + ((k + 1) * g * shard if in_files else 0.0)
        step_reads += g * shard if in_files else 0.0
    nvme_read = profile.nvme_read_gbps * 1e9 / ranks
    nvme_write = profile.nvme_write_gbps * 1e9 / ranks
    nvme = (reads / nvme_read if nvme_read else 0.0) + (writes / nvme_write if nvme_write else 0.0)
    step_nvme = ((step_reads / nvme_read if nvme_read else 0.0)
                 + (step_writes / nvme_write if nvme_write else 0.0))
    adamw = adamw_bytes / adamw_rate
    total = adamw + pcie + nvme
    hidden = 0.0
    if offload.overlap:
        background = adamw + step_pcie + step_nvme
        hidden = min(background, forward_s)
    out.update({
        "adamw_bytes": adamw_bytes, "pcie_to_host_bytes": to_host,
        "pcie_to_device_bytes": write_back + (0.0 if on_host else gathers),
        "nvme_read_bytes": reads, "nvme_write_bytes": writes,
        "nvme_priced": offload.device != "nvme" or bool(nvme_read and nvme_write),
        "adamw_s": adamw, "pcie_s": pcie, "nvme_s": nvme, "hidden_s": hidden,
        "total_s": total, "exposed_s": total - hidden,
    })
    out["fits"] = out["host_fits"] and out["nvme_fits"]
    return out


def capacity_text(cost: dict) -> str:
    """The host memory and drive space per node against the profile, in words with the
    numbers (what a refusal names)."""
    parts = []
    ranks = cost["ranks_per_node"]
    if cost["host_gb_per_node"] is not None:
        need = (f"host memory {cost['host_gb_per_node']:,.0f} GB per node ({ranks} ranks x "
                f"{cost['host_gb_per_rank']:,.1f} GB: "
                + (f"{cost['store_gb_per_rank']:,.1f} GB offloaded state + "
                   if cost["device"] == "host" else "chunks in flight + ")
                + f"{RANK_HOST_BYTES / GB:.0f} GB process)")
        if cost["host_memory_gb"]:
            verdict = "fits" if cost["host_fits"] else "DOES NOT FIT"
            need += (f" of {cost['host_limit_gb']:,.0f} GB usable ({cost['host_memory_gb']:,.0f}"
                     f" GB less {SYSTEM_FRACTION:.0%} for the system): {verdict}")
        else:
            need += " (host memory unknown: not checked; --host-memory-gb)"
        parts.append(need)
    if cost["nvme_gb_per_node"] is not None:
        need = (f"NVMe {cost['nvme_gb_per_node']:,.0f} GB per node ({ranks} ranks x "
                f"{cost['nvme_gb_per_rank']:,.0f} GB in 1 GiB files)")
        if cost["nvme_limit_gb"]:
            verdict = "fits" if cost["nvme_fits"] else "DOES NOT FIT"
            need += f" of {cost['nvme_limit_gb']:,.0f} GB: {verdict}"
        else:
            need += " (NVMe capacity unknown: not checked; --nvme-tb)"
        parts.append(need)
    return "; ".join(parts)


def format_offload(cost: dict) -> list[str]:
    """The estimate's offload lines: the setting, what each node must hold, the step's terms."""
    setting = Offload.from_json(cost).describe()
    lines = [f"offload: {setting}, {cost['store_gb_per_rank']:,.1f} GB of state per rank"
             + (f"; {capacity_text(cost)}" if capacity_text(cost) else "")]
    terms = (f"host AdamW {cost['adamw_s']:.3g}s, PCIe {cost['pcie_s']:.3g}s, "
             f"NVMe {cost['nvme_s']:.3g}s")
    if not cost["nvme_priced"]:
        terms += " (no NVMe bandwidth in the profile: not priced)"
    if cost["overlap"]:
        terms += f"; {cost['hidden_s']:.3g}s hidden behind the next forward"
    lines.append(f"offload adds {cost['exposed_s']:.3g}s per step: {terms}")
    return lines
