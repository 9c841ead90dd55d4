"""``parallel.auto = true``: choose the parallel layout for this model on this machine.

:func:`choose_layout` runs in :func:`meshtrain.commands.train.resolve_run_config` before anything
launches. It prices every layout of ``nproc`` processes (``--nproc``; else the visible GPUs, or
``os.cpu_count()`` on CPU) with the planner's cost model, drops those that do not fit in memory,
ranks the rest by predicted tokens/s, and takes the fastest one that
:func:`meshtrain.validation.run_config.validate_parallel` accepts — so only layouts this runtime
implements and this model's shape allows are chosen. It then sets ``parallel.{dp, tp, pp, zero,
microbatches, pp_schedule, virtual_stages, sequence_parallel, activation_checkpointing}`` and
prints one paragraph on stderr: the layout, its predicted step time and tokens/s, what bounds it,
and the runner-up. ``parallel.ep``, ``parallel.cp`` (and ``pp_split``) are kept as configured:
candidates must agree with them (with cp > 1 the other degrees fill ``nproc / cp``).

The hardware profile, first found wins:

1. ``parallel.auto_profile`` (a ``meshtrain calibrate`` JSON, or a named profile such as
   ``h100-80g``);
2. the default calibration file, ``$MESHTRAIN_PROFILE``, else
   ``$XDG_CACHE_HOME/meshtrain/profile.json`` (``~/.cache``;
   :func:`meshtrain.planner.calibrate.measure.default_profile_path`), which ``meshtrain calibrate``
   writes when given no ``--out``; the paragraph on stderr names it;
3. on CUDA, the named profile matching the device name (A100, H100, H200, B200, MI300X);
4. on CPU, :func:`meshtrain.planner.calibrate.measure.quick_profile`: one or two seconds in this
process
   (GEMM rate, copy bandwidth, op overhead; gloo figures built in). Inside a torchrun/SLURM job
   every rank chooses for itself, so there the built-in :data:`BUILTIN_CPU` figures are used
   instead: a measurement could differ between ranks, and so could their choices.

On CPU, a calibrated profile's rates are per thread; with ``T`` intra-op threads per worker the
planner counts ``T`` busy threads per process (:meth:`HardwareProfile.per_process`). Every
candidate uses the same processes and threads, so the ranking does not depend on that scaling;
the printed prediction does.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

from meshtrain.config import Config, ConfigError
from meshtrain.config.layout import Layout
from meshtrain.config.layout_rules import model_parallel_size
from meshtrain.planner.cost.offload import Offload, check_offload
from meshtrain.planner.cost.workload import Workload, layout_from_json
from meshtrain.planner.hardware.profile import Cluster, HardwareProfile
from meshtrain.planner.tables.profiles import PROFILES, load_profile, profile_for_gpu

BUILTIN_CPU = HardwareProfile(
    name="builtin-cpu", peak_tflops=0.02, memory_gb=4.0, hbm_gbps=5.0, matmul_efficiency=1.0,
    kernel_overhead_us=5.0, intra_node_gbps=1.0, inter_node_gbps=1.0, intra_node_latency_us=100.0,
    inter_node_latency_us=100.0, power_w=0.0, reserved_gb=0.0, attention_efficiency=1.0,
    fp32_rate=1.0, comm_overlaps_compute=False, solo_tflops=0.04, solo_hbm_gbps=10.0,
    calibrated_processes=2,
    attention_by_head_dim={"16": [0.15, 3.0], "32": [0.2, 3.0], "64": [0.23, 3.0]},
    source="built-in CPU figures (one core of a small VM: 40 GFLOP/s fp32 alone, 20 when "
           "sharing; attention at 15-23% of that; gloo 1 GB/s, 100 us); run meshtrain "
           "calibrate for this machine's")
"""Deterministic CPU figures for ``parallel.auto`` inside a job with no calibration file (its
memory is replaced by this node's RAM per process)."""

REPRICE_TOP = 20
"""Candidates re-priced with the pipeline schedule simulator after the closed-form ranking."""

def _uses_cuda(config: Config) -> bool:
    import torch

    return config.train.device == "cuda" or (config.train.device == "auto"
                                             and torch.cuda.is_available())


def default_processes(config: Config) -> int:
    """``--nproc`` when not given: the visible GPUs, else the CPU cores."""
    if _uses_cuda(config):
        import torch

        return max(torch.cuda.device_count(), 1)
    return os.cpu_count() or 1


def resolve_profile(config: Config, nproc: int, in_job: bool) -> tuple[HardwareProfile, str]:
    """The profile ``parallel.auto`` prices with, and where it came from (see module doc)."""
    from meshtrain.planner.calibrate.measure import default_profile_path, quick_profile

    given = config.parallel.auto_profile
    if given:
        try:
            return load_profile(given), f"parallel.auto_profile {given}"
        except ConfigError as error:
            raise ConfigError(str(error).replace("--hardware", "parallel.auto_profile")) from None
    default = default_profile_path()
    if default.is_file():
        return load_profile(str(default)), f"the calibration file {default}"
    if _uses_cuda(config):
        import torch

        name = torch.cuda.get_device_name().lower()
        profile = profile_for_gpu(name)
        if profile is not None:
            return PROFILES[profile], f"data-sheet profile {profile} for {name}"
        raise ConfigError(f"parallel.auto: no built-in profile for the GPU {name!r}; run "
                          f"meshtrain calibrate or set parallel.auto_profile to a profile "
                          f"({', '.join(PROFILES)}) or a calibrate JSON.")
    if in_job:
        from meshtrain.planner.calibrate.measure import _memory_gb

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", nproc))
        return (dataclasses.replace(BUILTIN_CPU, memory_gb=_memory_gb(max(per_node, 1))),
                "built-in CPU figures (no calibration file; the same on every rank)")
    return quick_profile(nproc), (f"a quick measurement of this CPU (no calibration file at "
                                  f"{default}: meshtrain calibrate writes one)")


def _candidate_config(config: Config, layout: Layout) -> Config:
    """``config`` running ``layout``: its degrees and schedule, ``virtual_stages`` as the chunks
    per rank the runtime's schedule takes (2 for zb-v); ``pp_split`` stays as configured."""
    candidate = copy.deepcopy(config)
    values = {**dataclasses.asdict(layout.layout()), "virtual_stages": layout.chunks_per_rank,
              "pp_split": config.parallel.pp_split}
    candidate.parallel = dataclasses.replace(candidate.parallel, **values)
    return candidate


def _split_fits(split: str, layout: Layout, n_layers: int) -> bool:
    """Whether a configured ``pp_split`` is valid for ``layout``'s stages (the runtime's own
    check, :func:`~meshtrain.parallel.pipeline.stage_split.parse_split`); without a pipeline it
    is not used."""
    from meshtrain.parallel.pipeline.stage_split import parse_split

    if not split or layout.pp == 1:
        return True
    try:
        parse_split(split, n_layers, layout.pp * layout.chunks_per_rank)
    except ConfigError:
        return False
    return True


def _with_split(result: dict, split: str) -> Layout:
    """The layout an estimate priced, with the configured ``pp_split`` (not in its JSON)."""
    return dataclasses.replace(layout_from_json(result["layout"]), pp_split=split)


def _offload_runs(workload: Workload, layout: Layout, offload: Offload) -> bool:
    """Whether ``layout`` can run the configured ``parallel.offload*`` (its ZeRO stage)."""
    try:
        check_offload(workload, layout, offload)
    except ConfigError:
        return False
    return True


def _valid(candidate: Config) -> bool:
    from meshtrain.validation.run_config import validate_parallel

    try:
        validate_parallel(candidate)
    except ConfigError:
        return False
    return True


def _rank_key(result: dict) -> tuple:
    """Fastest first; among predictions equal to 3 significant digits, the simpler layout."""
    lay = result["layout"]
    complexity = (lay["pp"] > 1, lay["cp"] > 1, lay["tp"] > 1, lay["zero"], lay["microbatches"],
                  lay["activation_checkpointing"] != "none", lay["sequence_parallel"])
    return float(f"{result['step_time_s']:.3g}"), complexity


def _summary(result: dict) -> str:
    """``compute 80%, tp_comm 12%, bubble 5%``: the largest parts of the predicted step."""
    step = result["step_time_s"]
    parts = sorted(((v, k.removesuffix("_s")) for k, v in result["breakdown"].items()
                    if k != "dp_comm_total_s" and v > 0), reverse=True)
    return ", ".join(f"{name} {v / step:.0%}" for v, name in parts[:3])


def _shape(result: dict) -> tuple[int, int, int, int]:
    lay = result["layout"]
    return lay["dp"], lay["cp"], lay["tp"], lay["pp"]


def rank_layouts(config: Config, nproc: int, cluster: Cluster) -> tuple[list[tuple], int]:
    """``([best, runner-up], searched)``: (estimate, config) pairs of valid layouts that fit,
    the runner-up being the fastest of another ``dp × tp × pp`` shape (none when no other shape
    is valid), and how many layouts were priced."""
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.planner.search.layouts import enumerate_layouts, price_layouts
    from meshtrain.validation.model import validate_shapes

    shaped = copy.deepcopy(config)
    validate_shapes(shaped)  # fills the vocabulary size the cost model needs
    workload = Workload.from_config(shaped)
    batch = workload.global_batch
    sizes = tuple(b for b in range(1, batch + 1) if batch % b == 0)
    split = config.parallel.pp_split  # kept as configured: priced with the split that runs
    offload = Offload.from_config(config.parallel)  # kept too: only stages that can run it
    layouts = [dataclasses.replace(lay, pp_split=split)
               for lay in enumerate_layouts(workload, cluster, micro_batch_sizes=sizes,
                                            cps=(config.parallel.cp,))
               if lay.ep == config.parallel.ep
               and _split_fits(split, lay, workload.model.n_layers)
               and _offload_runs(workload, lay, offload)]
    searched = price_layouts(workload, cluster, layouts, offload=offload)
    priced = [r for _, r in searched if r["fits"]]
    priced.sort(key=lambda r: -r["tokens_per_s"])
    front = [estimate(workload, _with_split(r, split), cluster, offload=offload)
             for r in priced[:REPRICE_TOP]]
    front.sort(key=_rank_key)
    chosen: list[tuple] = []
    for result in front + priced[REPRICE_TOP:]:
        if chosen and _shape(result) == _shape(chosen[0][0]):
            continue
        candidate = _candidate_config(config, _with_split(result, split))
        if _valid(candidate):
            chosen.append((result, candidate))
            if len(chosen) == 2:
                break
    return chosen, len(searched)


def predict(config: Config, world: int, cluster: Cluster) -> dict:
    """The planner's estimate of ``config``'s own layout on ``world`` processes of ``cluster``
    (``parallel.dp = 0`` filled in)."""
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.validation.model import validate_shapes

    shaped = copy.deepcopy(config)
    validate_shapes(shaped)
    if shaped.parallel.dp == 0:
        par = shaped.parallel
        par.dp = world // model_parallel_size(par.tp, par.pp, par.cp, par.replicas)
    return estimate(Workload.from_config(shaped), shaped.parallel.layout(), cluster,
                    offload=Offload.from_config(shaped.parallel))


def describe(result: dict) -> str:
    """``dp=2 tp=1 pp=1 zero=0 microbatches=1 (1f1b, checkpointing none)``."""
    lay = result["layout"]
    text = f"dp={lay['dp']} tp={lay['tp']} pp={lay['pp']}"
    if lay["cp"] > 1:
        text += f" cp={lay['cp']}"
    if lay["ep"] > 1:
        text += f" ep={lay['ep']}"
    text += f" zero={lay['zero']} microbatches={lay['microbatches']}"
    extras = []
    if lay["pp"] > 1:
        chunks = layout_from_json(lay).chunks_per_rank
        extras.append(lay["schedule"] + (f" v={chunks}" if chunks > 1 else ""))
    if lay["sequence_parallel"]:
        extras.append("sequence parallel")
    extras.append(f"checkpointing {lay['activation_checkpointing']}")
    return f"{text} ({', '.join(extras)})"


def job_cluster(config: Config, nproc: int, in_job: bool) -> tuple[Cluster, str]:
    """The machine ``parallel.auto`` (and ``parallel.elastic``) prices layouts of ``nproc``
    processes on, and where its profile came from (:func:`resolve_profile`)."""
    from meshtrain.host.job import threads_per_worker

    profile, origin = resolve_profile(config, nproc, in_job)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", nproc)) if in_job else nproc
    threads = 1 if profile.solo_tflops == 0 else threads_per_worker(config, per_node)
    return Cluster(profile, nproc, max(per_node, 1), threads), origin


def choose_layout(config: Config, nproc: int | None, in_job: bool = False) -> int:
    """Set ``config.parallel`` to the best valid layout for ``nproc`` processes (default:
    :func:`default_processes`), print why on stderr, and return the process count."""
    from meshtrain.host.job import job_rank

    nproc = default_processes(config) if nproc is None else nproc
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be at least 1.")
    cluster, origin = job_cluster(config, nproc, in_job)
    profile, threads = cluster.profile, cluster.threads_per_process
    chosen, searched = rank_layouts(config, nproc, cluster)
    if not chosen:
        raise ConfigError(
            f"parallel.auto: none of the {searched} layouts of {nproc} processes both fits in "
            f"memory and is accepted by this runtime for this model (global batch "
            f"{config.train.global_batch}); try another --nproc or a global batch that is a "
            f"multiple of it.")
    best, candidate = chosen[0]
    config.parallel = dataclasses.replace(candidate.parallel)
    on_cpu = f" ({threads} thread(s) each)" if profile.solo_tflops else ""
    text = (f"meshtrain: parallel.auto chose {describe(best)} for {nproc} process(es){on_cpu}, "
            f"priced with {profile.name} from {origin}: predicted "
            f"{best['step_time_s']:.3g} s/step, {best['tokens_per_s']:,.0f} tokens/s "
            f"({_summary(best)}).")
    if len(chosen) > 1:
        second = chosen[1][0]
        slower = second["step_time_s"] / best["step_time_s"] - 1
        text += (f" Runner-up (best other dp x tp x pp): {describe(second)} at "
                 f"{second['step_time_s']:.3g} s/step ({second['tokens_per_s']:,.0f} tokens/s, "
                 f"{slower:.0%} slower).")
    else:
        text += " No layout of another dp x tp x pp shape is valid and fits."
    text += f" {searched} layouts searched."
    if job_rank() == 0:
        print(text, file=sys.stderr, flush=True)
    return nproc
