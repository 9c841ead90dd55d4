"""The ``estimate``, ``plan`` and ``calibrate`` subcommands: their options and bodies.

:mod:`meshtrain.cli` registers them; here is what they parse and print. Input errors are
:class:`~meshtrain.config.ConfigError` (exit 2). ``estimate`` and ``plan`` validate shapes with
:func:`meshtrain.validation.model.validate_model` and degrees with
:func:`meshtrain.planner.cost.workload.check_layout`, never the runtime's "is this axis implemented"
checks: they price layouts the runtime may not run yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshtrain.config import Config, ConfigError, load_config
from meshtrain.config.layout_rules import check_world_size, dp_for_world, world_size
from meshtrain.config.loading import REQUIRED_WITHOUT_CONFIG
from meshtrain.validation.model import validate_shapes


def add_hardware_options(parser: argparse.ArgumentParser, gpus_required: bool) -> None:
    """--hardware, --gpus, --gpus-per-node, --json and the energy prices."""
    parser.add_argument("--hardware", required=True, metavar="NAME|profile.json",
                        help="a GPU profile (a100-80g, h100-80g, h200, b200, ...) or a "
                             "calibrate --out file")
    parser.add_argument("--gpus", type=int, required=gpus_required,
                        help="GPUs in the cluster" + ("" if gpus_required else
                                                      " (default: dp × cp × tp × pp)"))
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--host-memory-gb", type=float, metavar="GB",
                        help="host memory per node, GB, for offload (default: the profile's)")
    parser.add_argument("--nvme-tb", type=float, metavar="TB",
                        help="local NVMe capacity per node, TB, for offload_device = nvme "
                             "(default: the profile's; 0: none known, so plan puts no state "
                             "on NVMe and estimate does not check it)")
    from meshtrain.planner.sites.wide_area import add_site_options

    add_site_options(parser)
    from meshtrain.planner.cost.workload import STACKS

    parser.add_argument("--stack", default="meshtrain", choices=tuple(STACKS),
                        help="software stack to price (what it fuses, overlaps, saves for "
                             "backward, and its kernel efficiency on the GPU where it has its "
                             "own; meshtrain.planner.cost.workload.STACKS); default meshtrain")
    parser.add_argument("--trait", action="append", default=[], dest="traits",
                        metavar="NAME=VALUE",
                        help="change one of the stack's runtime traits as the run configured "
                             "it, e.g. tp_comm_overlap=false (repeatable; docs/planner.md, "
                             "Pricing a run as it ran)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--pue", type=float, default=1.2, help="datacenter PUE (default 1.2)")
    parser.add_argument("--price-per-kwh", type=float, default=0.10, help="currency per kWh")
    parser.add_argument("--carbon-g-per-kwh", type=float, default=400.0,
                        help="grid carbon intensity, g CO2 per kWh")


def add_estimate_options(parser: argparse.ArgumentParser) -> None:
    """``estimate``'s own options: the pipeline energy schedule."""
    parser.add_argument("--energy-schedule", action="store_true",
                        help="lower the clocks of pipeline actions off the critical path and "
                             "report the energy saved per step (docs/energy.md)")
    parser.add_argument("--max-slowdown", type=float, default=0.01,
                        help="longest step the energy schedule may cause, as a fraction "
                             "(default 0.01)")


def _energy(args: argparse.Namespace) -> dict:
    return {"pue": args.pue, "price_per_kwh": args.price_per_kwh,
            "carbon_g_per_kwh": args.carbon_g_per_kwh}


def _model_from_overrides(overrides: list[str]) -> Config:
    """The run config ``--set`` alone describes, refused unless it defines the model: never the
    demo's model filled in silently."""
    from meshtrain.config import parse_override

    given = {parse_override(text)[0] for text in overrides}
    missing = [key for key in REQUIRED_WITHOUT_CONFIG if key not in given]
    if missing:
        from meshtrain.planner.tables.presets import PRESETS

        raise ConfigError(
            "estimate needs a model: --model PRESET (" + ", ".join(sorted(PRESETS)[:6])
            + ", ...), --config run.toml, or --set for each of "
            + ", ".join(REQUIRED_WITHOUT_CONFIG) + f"; missing: {', '.join(missing)}.")
    return load_config(None, overrides)


def run_estimate(args: argparse.Namespace) -> int:
    """``meshtrain estimate``: price the layout a run config (or a preset's model, sequence
    length and batch, with ``--set`` layout keys) describes."""
    from meshtrain.commands.planner_report import format_estimate
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.planner.cost.fit_advice import why_not_fits
    from meshtrain.planner.cost.offload import Offload
    from meshtrain.planner.cost.workload import check_stack_offers

    model = getattr(args, "model", None)
    if model:
        from meshtrain.config import parse_override, set_key
        from meshtrain.planner.tables.presets import preset_config

        if args.config:
            raise ConfigError("estimate takes --model (a preset) or --config, not both.")
        config = preset_config(model)  # refuses an unknown name, listing the presets
        for text in args.overrides:
            set_key(config, *parse_override(text))
    elif args.config:
        config = load_config(args.config, args.overrides)
    else:
        config = _model_from_overrides(args.overrides)
    validate_shapes(config)
    par = config.parallel
    world = args.gpus or args.nproc
    for key in ("tp", "pp", "cp"):
        if getattr(par, key) < 1:
            raise ConfigError(f"parallel.{key} = {getattr(par, key)} must be at least 1.")
    if par.replicas < 1:
        raise ConfigError(f"parallel.replicas = {par.replicas} must be at least 1.")
    degrees = {"tp": par.tp, "pp": par.pp, "cp": par.cp, "replicas": par.replicas}
    if par.dp == 0:
        par.dp = dp_for_world(world, **degrees, what="--gpus") if world else 1
    layout = config.parallel.layout()
    gpus = args.gpus or world_size(par.dp, **degrees)
    check_world_size(gpus, dp=par.dp, **degrees, what="--gpus")
    profile = profile_from_args(args)
    cluster = cluster_from_args(args, profile, gpus)
    work = workload_from_args(config, args)
    check_stack_offers(work, layout, args.stack)
    offload = Offload.from_config(par)
    if par.replicas > 1:
        from meshtrain.planner.sites.diloco_cost import ReplicaSettings, estimate_replicated

        result = estimate_replicated(work, layout, cluster, ReplicaSettings.from_config(par),
                                     _energy(args), offload=offload)
    else:
        result = estimate(work, layout, cluster, _energy(args), offload=offload)
    if cluster.wan is not None or par.replicas > 1:
        from meshtrain.planner.sites.across_sites import describe_sites

        result["wide_area"] = describe_sites(work, layout, cluster, result)
    result["hardware"], result["stack"] = profile.name, args.stack
    result["traits"] = traits_set(args)
    if par.replicas > 1:  # each replica group's memory is its inner layout's
        from meshtrain.planner.sites.diloco_cost import inner_cluster, inner_workload

        result["why_not_fits"] = why_not_fits(inner_workload(work, par.replicas), layout,
                                              inner_cluster(cluster, par.replicas), result,
                                              args.stack, offload, par.replicas)
    else:
        result["why_not_fits"] = why_not_fits(work, layout, cluster, result, args.stack,
                                              offload)
    result["warnings"] = layout_warnings(layout, args.gpus_per_node)
    for warning in result["warnings"]:
        print(f"meshtrain: warning: {warning}", file=sys.stderr)
    text = format_estimate(result, profile.name)
    if result["traits"]:
        text += "\n" + traits_text(args.stack, result["traits"])
    if "wide_area" in result:
        from meshtrain.planner.sites.across_sites import format_sites

        text += "\n" + format_sites(result)
    if getattr(args, "energy_schedule", False):
        from meshtrain.planner.energy.schedule import format_energy_schedule, layout_schedule

        result["energy_schedule"] = layout_schedule(result, layout, profile, args.max_slowdown)
        text += "\n" + format_energy_schedule(result["energy_schedule"], " per pipeline")
    print(json.dumps(result, indent=2) if args.json else text)
    return 0


def workload_from_args(config: Config, args: argparse.Namespace):
    """The :class:`~meshtrain.planner.cost.workload.Workload` of ``config`` priced with
    ``--stack``, its traits changed by every ``--trait`` (which win over what the run config
    sets, e.g. ``parallel.grad_reduce_dtype``)."""
    import dataclasses

    from meshtrain.planner.cost.trait_overrides import apply_traits
    from meshtrain.planner.cost.workload import STACKS, Workload

    work = Workload.from_config(config, STACKS[args.stack])
    return dataclasses.replace(work, traits=apply_traits(work.traits, args.traits))


def traits_set(args: argparse.Namespace) -> dict:
    """What ``--trait`` changed, by name (the last value of each), for the JSON output."""
    from meshtrain.planner.cost.trait_overrides import parse_trait

    return dict(parse_trait(text) for text in args.traits)


def traits_text(stack: str, traits: dict) -> str:
    """``stack NAME with a=b, ...``: what ``--trait`` changed, for the text output."""
    from meshtrain.planner.cost.trait_overrides import format_value

    return f"stack {stack} with " + ", ".join(f"{name}={format_value(value)}"
                                              for name, value in traits.items())


def profile_from_args(args: argparse.Namespace):
    """The ``--hardware`` profile with ``--host-memory-gb`` and ``--nvme-tb`` applied."""
    import dataclasses

    from meshtrain.planner.tables.profiles import load_profile

    profile = load_profile(args.hardware)
    changes = {}
    for option, key in (("host_memory_gb", "host_memory_gb"), ("nvme_tb", "nvme_tb")):
        value = getattr(args, option, None)
        if value is not None:
            if value < 0:
                raise ConfigError(f"--{option.replace('_', '-')} {value:g} must not be negative.")
            changes[key] = value
    return dataclasses.replace(profile, **changes) if changes else profile


def cluster_from_args(args: argparse.Namespace, profile, gpus: int):
    """The :class:`~meshtrain.planner.hardware.profile.Cluster` of ``gpus`` GPUs the options
    describe,
    sites and wide-area link included (:mod:`meshtrain.planner.sites.wide_area`)."""
    from meshtrain.planner.hardware.profile import Cluster
    from meshtrain.planner.sites.wide_area import wide_area_from_options

    Cluster(profile, gpus, args.gpus_per_node)  # refuses a count that is not whole nodes
    nodes = max(1, -(-gpus // args.gpus_per_node))
    wan = wide_area_from_options(nodes, args.gpus_per_node, args.sites, args.nodes_per_site,
                                 args.wan_gbps, args.wan_latency_ms)
    return Cluster(profile, gpus, args.gpus_per_node, wan=wan)


def layout_warnings(layout, gpus_per_node: int) -> list[str]:
    """What a priced layout does that users rarely mean: tensor parallelism beyond a node."""
    if layout.tp > gpus_per_node:
        return [f"parallel.tp = {layout.tp} spans {-(-layout.tp // gpus_per_node)} nodes of "
                f"{gpus_per_node} GPUs: every layer's tp all-reduce then crosses the network "
                f"(priced at the inter-node bandwidth); tp <= {gpus_per_node} keeps it on the "
                "node's links."]
    return []


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``meshtrain plan``."""
    parser.add_argument("--model", required=True, metavar="NAME|config.toml",
                        help="a preset (llama3.1-8b, llama3.2-1b, qwen2.5-7b, qwen3-8b, "
                             "mixtral-8x7b, ...) or a TOML run config")
    parser.add_argument("--top", type=int, default=10, help="candidates to show (default 10)")
    parser.add_argument("--objective", default="time", choices=("time", "energy", "cost",
                                                                 "carbon"),
                        help="what to minimise (default time); see docs/energy.md")
    parser.add_argument("--tokens", type=float, metavar="T",
                        help="a training budget in tokens: choose the GPU count (up to --gpus) "
                             "too, and price the whole run (needs --deadline-hours)")
    parser.add_argument("--deadline-hours", type=float, metavar="H",
                        help="with --tokens: the run must finish within H hours")
    parser.add_argument("--gpu-hour-price", type=float, default=0.0,
                        help="--objective cost: price of one GPU hour (default 0: energy only)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override a model/train value")
    parser.add_argument("--explain", metavar="LAYOUT",
                        help="show LAYOUT (e.g. dp=8,tp=8,pp=4,sp=true,schedule=interleaved-"
                             "1f1b,v=2,mbs=1,ckpt=full) beside the first choice, term by term, "
                             "and where it ranks (docs/planner.md)")
    parser.add_argument("--offload", default="auto", choices=("auto", "always", "never"),
                        help="search parallel.offload settings: when nothing fits without "
                             "them (auto, the default), beside every layout, or never")
    add_hardware_options(parser, gpus_required=True)


def run_plan(args: argparse.Namespace) -> int:
    """``meshtrain plan``: rank layouts; exit 0 even when nothing fits (the answer says why)."""
    from meshtrain.commands.planner_report import format_plan
    from meshtrain.config import parse_override, set_key
    from meshtrain.planner.search.layouts import plan
    from meshtrain.planner.tables.presets import PRESETS, preset_config

    if args.model.lower() in PRESETS:
        config = preset_config(args.model)
        for text in args.overrides:
            set_key(config, *parse_override(text))
    elif Path(args.model).is_file():
        config = load_config(args.model, args.overrides)
    else:
        preset_config(args.model)  # raises the "known presets" message
    validate_shapes(config)
    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be at least 1.")
    profile = profile_from_args(args)
    if (args.tokens is None) != (args.deadline_hours is None):
        raise ConfigError("--tokens and --deadline-hours go together (a budget and a deadline).")
    cluster = cluster_from_args(args, profile, args.gpus)
    if args.tokens is not None:
        if getattr(args, "explain", None) is not None:
            raise ConfigError("plan --explain prices one layout on --gpus; drop --tokens.")
        if cluster.wan is not None:
            raise ConfigError("plan --tokens (a GPU-count budget) prices one site; drop "
                              "--sites / --nodes-per-site, or plan the sites without --tokens.")
        return _run_budget_plan(args, config, profile)
    work = workload_from_args(config, args)
    if getattr(args, "explain", None) is not None:
        return _run_explain(args, config, work, cluster, profile.name)
    result = plan(work, cluster, args.top, _energy(args), offload=args.offload).to_dict()
    if args.objective != "time":
        from meshtrain.planner.search.objective import rank_rows

        result["candidates"] = rank_rows(result["candidates"], args.objective,
                                         args.gpu_hour_price)
    result["objective"] = args.objective
    result.update(model=args.model, hardware=profile.name, stack=args.stack, gpus=args.gpus,
                  traits=traits_set(args), gpus_per_node=args.gpus_per_node,
                  seq_len=config.train.seq_len,
                  global_batch=config.train.global_batch)
    title = (f"{args.model} on {args.gpus} x {profile.name} ({args.gpus_per_node} per node), "
             f"seq {config.train.seq_len}, global batch {config.train.global_batch}")
    if result["traits"]:
        title += ", " + traits_text(args.stack, result["traits"])
    text = format_plan(result, title)
    if cluster.wan is not None:
        from meshtrain.planner.sites.across_sites import format_site_plan, plan_across_sites

        result["across_sites"] = plan_across_sites(work, cluster, result["candidates"],
                                                   config.parallel.outer_grad_dtype,
                                                   _energy(args))
        text += "\n" + format_site_plan(result["across_sites"])
    print(json.dumps(result, indent=2) if args.json else text)
    return 0


def _run_explain(args: argparse.Namespace, config: Config, work, cluster,
                 profile_name: str) -> int:
    """``plan --explain LAYOUT``: the layout beside the first choice, term by term."""
    from meshtrain.planner.search.explain import explain, format_explain, parse_layout

    layout = parse_layout(args.explain, work, args.gpus)
    result = explain(work, cluster, layout, args.stack, _energy(args))
    result.update(model=args.model, hardware=profile_name, stack=args.stack, gpus=args.gpus,
                  seq_len=config.train.seq_len, global_batch=config.train.global_batch)
    title = (f"{args.model} on {args.gpus} x {profile_name} ({args.stack}), seq "
             f"{config.train.seq_len}, global batch {config.train.global_batch}")
    print(json.dumps({"explain": result}, indent=2) if args.json
          else title + "\n" + format_explain(result))
    return 0


def _run_budget_plan(args: argparse.Namespace, config: Config, profile) -> int:
    """``plan --tokens T --deadline-hours H``: GPU count and layout for the objective."""
    from meshtrain.planner.search.objective import budget_plan, format_budget_plan

    work = workload_from_args(config, args)
    answer = budget_plan(work, profile, args.gpus, args.gpus_per_node,
                         args.tokens, args.deadline_hours, args.objective, _energy(args),
                         args.gpu_hour_price)
    answer.update(model=args.model, hardware=profile.name, seq_len=config.train.seq_len,
                  global_batch=config.train.global_batch)
    title = (f"{args.model} on up to {args.gpus} x {profile.name}, seq {config.train.seq_len}, "
             f"global batch {config.train.global_batch}")
    print(json.dumps(answer, indent=2) if args.json else format_budget_plan(answer, title))
    return 0


def add_calibrate_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``meshtrain calibrate``."""
    parser.add_argument("--out", help="profile JSON to write (default: $MESHTRAIN_PROFILE, else "
                        "$XDG_CACHE_HOME/meshtrain/profile.json or "
                        "~/.cache/meshtrain/profile.json: where parallel.auto looks)")
    parser.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    parser.add_argument("--sizes", default="4096,65536,1048576,16777216",
                        help="message sizes in bytes, comma-separated")
    parser.add_argument("--matmul-sizes", default="256,512,1024",
                        help="square GEMM sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="measured", help="profile name")
    parser.add_argument("--power-w", type=float, default=0.0, help="power per process, watts")


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{option} {text!r}: expected comma-separated integers.") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{option} {text!r}: expected positive integers.")
    return values


def run_calibrate(args: argparse.Namespace) -> int:
    """``meshtrain calibrate``: measure and write a profile JSON (default: where
    ``parallel.auto`` looks), with one progress line per step and where it wrote on stderr."""
    from meshtrain.planner.calibrate.measure import (
        calibrate,
        default_profile_path,
        progress_steps,
    )

    if args.nproc < 2:
        raise ConfigError(f"--nproc {args.nproc}: calibrate needs at least 2 processes.")
    sizes = _int_list(args.sizes, "--sizes")
    matmul_sizes = _int_list(args.matmul_sizes, "--matmul-sizes")
    default = default_profile_path()
    out = Path(args.out) if args.out else default
    print(f"meshtrain: calibrate: timing this machine with {args.nproc} processes in "
          f"{progress_steps(sizes)} steps, then writing {out}", file=sys.stderr, flush=True)
    profile = calibrate(args.nproc, sizes, matmul_sizes, args.repeats, args.name, args.power_w,
                        progress=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    used = ("parallel.auto uses it" if out.resolve() == default.resolve() else
            f"use it with --hardware {out} or parallel.auto_profile={out} (parallel.auto looks "
            f"at {default} by default)")
    print(f"meshtrain: calibrate wrote {out} ({used}): "
          f"{profile.peak_tflops * 1e3:.3g} GFLOP/s fp32 matmul per process, "
          f"{profile.hbm_gbps:.3g} GB/s copy, all-reduce {profile.intra_node_gbps:.3g} GB/s bus "
          f"+ {profile.intra_node_latency_us:.0f} us per step"
          + (f", shared-memory gradient all-reduce {profile.shared_memory_reduce_gbps:.3g} GB/s "
             f"bus + {profile.shared_memory_reduce_latency_us:.0f} us"
             if profile.shared_memory_reduce_gbps else ""), file=sys.stderr, flush=True)
    return 0
