"""Refuse a run that cannot fit in memory, before any worker builds its model.

``meshtrain train`` calls :func:`check_fits` right after
:func:`meshtrain.validation.preflight.check_before_launch`: it prices one rank of every
pipeline stage with the planner's memory model (:func:`meshtrain.planner.cost.memory.rank_memory`:
parameters, gradients and optimizer states by ZeRO stage, activations by schedule and
checkpointing, the logits and the loss's fp32 buffers, the gradient reduction's buffers) and adds
what the planner leaves out because it does not change between layouts:

- the loss's buffers as the runtime allocates them, in place of the planner's figure: under tp
  the vocab-parallel loss's fp32 buffers (:data:`LOSS_BYTES_PER_LOGIT`), else the chunked
  loss's gradient of the logits and one fp32 chunk (:func:`loss_bytes`);
- the document mask of ``data.document_mask``: a ``B × S × S`` boolean per micro-batch, and the
  additive mask SDPA converts it to (activation dtype), saved by every block that keeps its
  attention inputs for backward (measured on the CPU: 4 bytes × ``B S S`` per block in fp32);
- the rotary tables (``cos``/``sin``, ``S × head_dim`` each, one pair per sequence length);
- DiLoCo's outer state (start weights and momentum, 8 bytes per optimizer-shard parameter);
- the runtime itself: what a worker holds before it builds anything (torch, gloo, meshtrain:
  :data:`CPU_RUNTIME_BYTES` of host memory per CPU worker, measured as a tiny run's ``VmHWM``;
  :data:`CUDA_CONTEXT_BYTES` of device memory per GPU worker).

It compares that with what is available:

- on the CPU, the ranks on this host share its memory: the sum over the local ranks against
  ``MemAvailable`` of ``/proc/meminfo`` (``psutil`` where there is no ``/proc``), lowered to
  the room left under a cgroup memory limit when the process runs under one (its page cache
  counted as free, as the kernel reclaims it first);
- on a GPU (``train.device`` is or resolves to ``cuda``), each rank against the free memory of
  its own device (``torch.cuda.mem_get_info``, imported only then; asked in a short child
  process when the launcher spawns several local workers, so that the launcher holds no CUDA
  context on their devices while they train).

A run is refused (:class:`~meshtrain.config.ConfigError`, exit 2) only when the estimate exceeds
the available memory times :data:`FIT_MARGIN` (>= 1): the estimate is meant for refusing what
clearly cannot run (a 1M-token sequence on a laptop), not for packing a machine to its last
byte, and its error against a measured ``VmHWM`` is what the margin allows for (see
docs/guide.md). The message gives both numbers, the largest contributors and what to change.
Where the available memory cannot be read, nothing is refused.

Why here, in ``commands``: the estimate is the planner's (``planner`` sits above
``validation`` in the import order, so ``validation/preflight.py`` cannot call it) and the
launcher's knowledge of its local ranks is the command's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from meshtrain.commands.fit_offload import offloaded_parts
from meshtrain.config import Config, ConfigError
from meshtrain.config.runtime_facts import LOSS_CHUNK_ELEMENTS

GB = 1e9
FIT_MARGIN = 1.1
"""A run is refused only when its estimated memory exceeds the available memory times this
factor. On the small CPU runs measured (dp, tp, pp, ZeRO 1, long sequences with and without
document masking, vocabularies up to 65,536) the estimate was 0.91-1.08 x the ``VmHWM`` measured
from outside, so a refused run needs at least ~2 % more than what is available; the estimate
leaves out allocator slack and fragmentation, which only add to that."""
LOSS_BYTES_PER_LOGIT = 12.0
"""Bytes per logit the vocab-parallel loss (tp > 1) holds at the start of backward beyond the
logits themselves: its fp32 softmax, and the fp32 gradients its backward allocates. (Measured
on the CPU in fp32 for the eager ``F.cross_entropy(logits.float())`` it replaced without tp,
vocabulary 32768 -> 65536 at 2048 tokens per micro-batch: 16.2 bytes per logit in all, 4 of
them the logits.)"""


def loss_bytes(logits: float, act_bytes: float, tp: int) -> float:
    """What the loss holds beyond the ``logits`` logits themselves (``act_bytes`` each): the
    vocab-parallel loss's fp32 buffers under tp, else the chunked loss's (a gradient of the
    logits in their dtype and one fp32 chunk with its temporary,
    :mod:`meshtrain.training.cross_entropy`; measured as above: 8.3 bytes per logit in all in
    fp32, against 16.2 for the eager loss)."""
    if tp > 1:
        return LOSS_BYTES_PER_LOGIT * logits
    return act_bytes * logits + 2 * 4 * min(LOSS_CHUNK_ELEMENTS, logits)


CPU_RUNTIME_BYTES = 0.35e9
"""Host memory a CPU worker holds before it builds its model: the Python interpreter, torch,
gloo and meshtrain (the ``VmHWM`` of a 2-layer dim-32 run is 0.35-0.40 GB per worker)."""
CUDA_CONTEXT_BYTES = 0.5e9
"""Device memory a GPU worker's CUDA context and kernels take before any tensor."""


@dataclasses.dataclass
class RankEstimate:
    """Memory of one rank of pipeline stage ``stage``; ``ranks``: how many ranks are alike."""

    stage: int
    ranks: int
    parts: dict[str, float]

    @property
    def total(self) -> float:
        """Everything together, bytes."""
        return sum(self.parts.values())


def _model_with_vocab(config: Config):
    """The model config with ``vocab_size`` filled in from the tokenizer when it is 0."""
    if config.model.vocab_size:
        return config.model
    from meshtrain.data.tokenizer import tokenizer_vocab_size

    return dataclasses.replace(config.model,
                               vocab_size=tokenizer_vocab_size(config.data.tokenizer))


def estimate_ranks(config: Config, world: int, device_type: str = "cpu") -> list[RankEstimate]:
    """One :class:`RankEstimate` per pipeline stage of the validated ``config`` run on
    ``world`` processes."""
    from meshtrain.planner.cost.memory import rank_memory
    from meshtrain.planner.cost.pipeline import pipeline_estimate
    from meshtrain.planner.cost.workload import Workload, stack_split, stage_layers

    model = _model_with_vocab(config)
    run = dataclasses.replace(config, model=model)
    workload = Workload.from_config(run)
    # Physical memory: the shared-memory reducer's peers' segments are pages of their owners'
    # buffers, counted in every reader's VmHWM but resident once on the host.
    # DiLoCo's replica groups each take their share of the global batch (like more dp ranks).
    workload = dataclasses.replace(
        workload, global_batch=workload.global_batch // max(config.parallel.replicas, 1),
        traits=dataclasses.replace(workload.traits, shared_memory_reduce=False))
    layout = config.parallel.layout()
    placement = stage_layers(model, stack_split(workload, layout))
    inflight = pipeline_estimate(layout.pp_schedule, layout.pp, layout.microbatches,
                                 layout.virtual_stages, 1.0, 1.0, 1.0).peak_inflight
    b = layout.micro_batch_size(workload.global_batch)
    seq = workload.seq_len
    act = workload.act_bytes
    mode = layout.activation_checkpointing
    out = []
    for stage, layers in enumerate(placement):
        mem = rank_memory(workload, layout, stage, layers, inflight[stage],
                          config.parallel.dp_bucket_mb)
        planner_logits = logits = 0.0
        if stage == layout.pp - 1:
            count = seq / layout.cp * b * model.vocab_size / layout.tp
            planner_logits = (workload.traits.loss_bytes_per_logit + act - 2) * count
            logits = act * count + loss_bytes(count, act, layout.tp)
        parts = {"parameters": mem.param_bytes, "gradients": mem.grad_bytes,
                 "optimizer states": mem.optim_bytes,
                 "activations": mem.activation_bytes - planner_logits, "logits": logits,
                 "gradient reduction buffers": mem.buffer_bytes}
        if config.data.document_mask and layers:
            # The boolean mask (kept for the whole forward and backward of the micro-batch)
            # and SDPA's additive copy of it, saved by each block whose attention inputs are
            # kept (one block's at a time under selective or full recomputation).
            saving = len(layers) if mode == "none" else 1
            rows = seq / layout.cp
            parts["document mask"] = b * rows * seq * (1 + act * saving) * inflight[stage]
        # cos and sin (S x head_dim each, one pair per length) and the signed sine each
        # rotation builds from them
        parts["rotary tables"] = 2.0 * seq * model.head_dim * act * (2 if layers else 0)
        if config.parallel.replicas > 1:  # DiLoCo's start weights and momentum
            parts["DiLoCo outer state"] = (mem.optim_bytes * 8
                                           / (12 if workload.precision == "bf16" else 8))
        parts["runtime"] = CUDA_CONTEXT_BYTES if device_type == "cuda" else CPU_RUNTIME_BYTES
        parts = offloaded_parts(parts, config, device_type)  # parallel.offload: kept elsewhere
        out.append(RankEstimate(stage, world // layout.pp, parts))
    return out


# ---------------------------------------------------------------- what is available

def _meminfo_available() -> float | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return float(psutil.virtual_memory().available)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: str, names: tuple[str, ...]) -> int:
    """The first of ``names`` in the cgroup ``memory.stat`` file ``path`` (0 when absent)."""
    try:
        with open(path) as handle:
            values = dict(line.split()[:2] for line in handle if len(line.split()) >= 2)
    except OSError:
        return 0
    for name in names:
        if values.get(name, "").isdigit():
            return int(values[name])
    return 0


_CGROUPS = (  # (limit, usage, stat, its page-cache fields): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
     "/sys/fs/cgroup/memory.stat", ("file",)),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
     "/sys/fs/cgroup/memory/memory.stat", ("total_cache", "cache")),
)


def _cgroup_room() -> float | None:
    """Bytes left under this process's cgroup memory limit, counting its page cache (which the
    kernel reclaims before it kills anything) as free; None without a limit."""
    for limit_path, usage_path, stat_path, cache_fields in _CGROUPS:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            cache = _stat_value(stat_path, cache_fields)
            return float(max(limit - max(usage - cache, 0), 0))
    return None


def host_available() -> tuple[float, str] | None:
    """``(bytes, where from)`` of host memory available to new processes; None if unknown."""
    available = _meminfo_available()
    if available is None:
        return None
    room = _cgroup_room()
    if room is not None and room < available:
        return room, "left under this cgroup's memory limit"
    return available, "MemAvailable"


def _local_ranks(world: int, in_job: bool) -> int:
    if not in_job:
        return world
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0].split(",")[0]
        if value.isdigit() and int(value) > 0:
            return min(int(value), world)
    return world


def resolve_device_type(device: str) -> str:
    """``cpu`` or ``cuda``: what ``train.device`` resolves to (``auto``: CUDA when available;
    torch is imported only then)."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else device.split(":")[0]


_QUERY = ("import json, sys, torch\n"
          "print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range(int(sys.argv[1]))]))")


def cuda_free(local_ranks: int, in_process: bool) -> list[float] | None:
    """Free bytes of the devices of the local ranks (device ``LOCAL_RANK`` when this process is
    the only one here, else devices ``0 .. local_ranks - 1``); None when they cannot be read."""
    if in_process:  # this process is the worker that will use the device: its context is no loss
        import torch

        # The device the worker will take (LOCAL_RANK; under srun, SLURM_LOCALID becomes it).
        index = int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)
        try:
            return [float(torch.cuda.mem_get_info(index)[0])]
        except Exception:  # noqa: BLE001 - no usable device: the worker reports it
            return None
    try:
        done = subprocess.run([sys.executable, "-c", _QUERY, str(local_ranks)],
                              capture_output=True, text=True, timeout=120, check=True)
        return [float(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------- the check

_ADVICE = {
    "activations": "lower train.seq_len or the micro-batch (raise parallel.microbatches or "
                   'lower train.global_batch), set parallel.activation_checkpointing = "full", '
                   "or split them over more ranks (parallel.tp with sequence_parallel, "
                   "parallel.cp, parallel.pp)",
    "logits": "lower train.seq_len, the micro-batch or model.vocab_size, or raise parallel.tp "
              "(the logits are split over tp)",
    "document mask": "lower train.seq_len (the mask grows with its square) or the micro-batch, "
                     "or set data.document_mask = false",
    "parameters": "a smaller model (model.dim, model.n_layers, model.vocab_size) or more "
                  "ranks to split it (parallel.tp, parallel.pp, parallel.zero = 3)",
    "gradients": "parallel.zero = 2 or 3 over more dp ranks, or a smaller model",
    "optimizer states": "parallel.zero = 1 or more over more dp ranks, or a smaller model",
    "gradient reduction buffers": "a smaller parallel.dp_bucket_mb",
    "rotary tables": "lower train.seq_len",
    "DiLoCo outer state": "parallel.zero = 1 or more, or fewer parameters per rank",
    "runtime": "fewer processes on this host (--nproc)",
}


def _advice(part: str, micro_batch: int) -> str:
    text = _ADVICE[part]
    if micro_batch == 1:  # nothing to lower there
        text = text.replace(" or the micro-batch (raise parallel.microbatches or lower "
                            "train.global_batch)", "").replace(", the micro-batch or", " or")
        text = text.replace(" or the micro-batch,", ",")
    return text


def _gb(value: float) -> str:
    return f"{value / GB:.2f} GB" if value < 100 * GB else f"{value / GB:,.0f} GB"


def check_fits(config: Config, world: int, in_job: bool = False, verbose: bool = True) -> None:
    """Raise :class:`ConfigError` when the validated ``config`` clearly cannot fit in the memory
    of this host (CPU) or of its devices (GPU); see the module docstring. ``verbose``: print
    one line with the estimate and the available memory when it fits."""
    device = resolve_device_type(config.train.device)
    if device not in ("cpu", "cuda"):
        return
    ranks = estimate_ranks(config, world, device)
    local = _local_ranks(world, in_job)
    largest = max(ranks, key=lambda r: r.total)
    if device == "cpu":
        found = host_available()
        if found is None:
            return
        available, source = found
        # The local ranks' share of every stage (all of them when this launcher spawns them).
        needed = sum(r.total * r.ranks for r in ranks) * local / world
        where = (f"it needs about {_gb(needed)} of host memory" if local == 1 else
                 f"the {local} ranks on this host need about {_gb(needed)} of host memory "
                 f"together (up to {_gb(largest.total)} per rank)")
        what = f"{_gb(available)} is available ({source})"
    else:
        free = cuda_free(local, in_process=in_job or world == 1)
        if not free:
            return
        available = min(free)
        needed = largest.total
        where = f"a rank needs about {_gb(needed)} of device memory"
        what = f"{_gb(available)} is free on {'its' if len(free) == 1 else 'the smallest'} device"
    if needed <= available * FIT_MARGIN:
        if verbose:
            print(f"meshtrain: memory check: {where.replace('it needs', 'the run needs', 1)}; "
                  f"{what}", file=sys.stderr, flush=True)
        return
    parts = sorted(largest.parts.items(), key=lambda kv: -kv[1])
    top = [(name, value) for name, value in parts if value > 0][:3]
    stage = f" (pipeline stage {largest.stage})" if len(ranks) > 1 else ""
    contributors = ", ".join(f"{name} {_gb(value)}" for name, value in top)
    b = config.parallel.layout().micro_batch_size(
        config.train.global_batch // max(config.parallel.replicas, 1))
    advice = "; ".join(f"for the {name}: {_advice(name, b)}" for name, _ in top[:2])
    raise ConfigError(
        f"this run cannot fit in memory: {where}, but only {what}. Largest per rank{stage}: "
        f"{contributors} (train.seq_len = {config.train.seq_len}, micro-batch {b}, vocabulary "
        f"{_model_with_vocab(config).vocab_size}, precision {config.train.precision}). To fit: "
        f"{advice}.")
