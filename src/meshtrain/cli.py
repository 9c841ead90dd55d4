"""The ``meshtrain`` command: parse arguments, dispatch, map errors to exit statuses.

Exit statuses: 0 done; 2 a config or usage error (one paragraph on stderr, no traceback);
1 a failure during the run; 75 ``meshtrain train`` stopped by SIGTERM/SIGUSR1 after saving a
checkpoint (:mod:`meshtrain.training.preemption`), 128 + signal when a second signal stopped it at
once.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from meshtrain.config import Config, ConfigError, default_config_path, load_config
from meshtrain.validation.run_config import validate_config


def _replicas_note(par) -> str:
    """``; R replica groups synced every H steps`` for DiLoCo runs, else empty."""
    if par.replicas == 1:
        return ""
    if par.replica_fault_tolerance:
        return (f"; replica group {par.replica_group} of {par.replicas}, synced every "
                f"{par.sync_every} steps through torchft")
    fragments = f" in {par.sync_fragments} fragments" if par.sync_fragments > 1 else ""
    return (f" in each of {par.replicas} replica groups, synced every {par.sync_every} "
            f"steps{fragments}")

def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML run config, or a run's config.json "
                        "(default: the built-in demo)")
    parser.add_argument("--nproc", type=int,
                        help="processes to launch (default: replicas × dp × tp × pp)")
    parser.add_argument("--steps", type=int, help="total optimizer steps (train.steps)")
    parser.add_argument("--run-dir", help="where metrics.jsonl and final weights go")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="meshtrain",
        description="Train transformer language models with data, tensor, pipeline and expert "
                    "parallelism that give the same numbers as one process.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (no --config: the built-in demo)")
    _add_run_options(train)
    train.add_argument("--max-restarts", type=int, metavar="N",
                       help="restart the workers up to N times after a failure, resuming from "
                            "the newest checkpoint (train.max_restarts)")
    train.add_argument("--dry-run", action="store_true",
                       help="build one rank's real objects on the meta device over a fake "
                            "process group and print its bytes and collectives; trains nothing "
                            "(docs/dry_run.md)")
    train.add_argument("--world", type=int, metavar="N", help="--dry-run: ranks in the layout")
    train.add_argument("--rank", type=int, metavar="R", help="--dry-run: the rank (default 0)")
    train.add_argument("--json", action="store_true", help="--dry-run: one JSON document")
    ver = sub.add_parser("verify", help="check a layout against a one-process reference")
    _add_run_options(ver)
    ver.add_argument("--tolerance", type=float,
                     help="max |loss difference| (default 2e-4 for fp32, 5e-2 for bf16)")
    ver.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    gen = sub.add_parser("generate", help="generate text from a finished run's final weights")
    gen.add_argument("--checkpoint", required=True, help="run directory (or its final/ folder)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    bench = sub.add_parser("bench", help="meshtrain vs PyTorch-native peers, side by side")
    bench.add_argument("--suite", dest="suites", action="append", default=[], metavar="NAME",
                       help="suite to run (repeatable or comma-separated; default: all)")
    bench.add_argument("--steps", type=int, default=10, help="measured steps per run")
    bench.add_argument("--warmup", type=int, default=2, help="discarded steps per run")
    bench.add_argument("--repeats", type=int, default=5,
                       help="alternating runs per side (the medians are over these)")
    bench.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    bench.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE", help="override the benchmarked shape")
    bench.add_argument("--procs", default="1,2,4", metavar="N,N,...",
                       help="process counts of the scaling suite (default 1,2,4)")
    bench.add_argument("--plot", default="", metavar="PNG",
                       help="write the scaling suite's tokens/s against processes as a PNG")
    bench.add_argument("--same-allocator", action=argparse.BooleanOptionalAction, default=True,
                       help="start the peer's processes with meshtrain's malloc settings too, "
                            "so the ratios compare the frameworks' work alone (the default; "
                            "--no-same-allocator: the peers get glibc's defaults); the "
                            "allocator suite measures what the settings gain")
    _add_planner_parsers(sub)
    sim = sub.add_parser("simulate", help="time a pipeline schedule (bubble, memory, timeline)")
    sim.add_argument("--schedule", required=True,
                     help="gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-v")
    sim.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    sim.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    sim.add_argument("--virtual-stages", type=int,
                     help="chunks per rank (default 2 for interleaved-1f1b and zb-v, else 1)")
    sim.add_argument("--times", default="1,1,1", metavar="F,B,W",
                     help="forward, backward-input, backward-weight time of one micro-batch "
                          "through one rank's layers (default 1,1,1)")
    sim.add_argument("--comm", type=float, default=0.0, help="latency of each p2p transfer")
    sim.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sim.add_argument("--plot", metavar="PNG", help="write the timeline as a PNG")
    sim.add_argument("--trace", metavar="JSON", help="write a Chrome trace-event JSON")
    sim.add_argument("--slow-stage", metavar="S:FACTOR",
                     help="stage S takes FACTOR times as long (e.g. 3:1.2)")
    sim.add_argument("--energy-schedule", action="store_true",
                     help="lower the clocks of actions off the critical path; report the "
                          "saving and draw the scheduled step (docs/energy.md)")
    sim.add_argument("--hardware", default="h100-80g",
                     help="--energy-schedule: the GPU profile's clock-power curve")
    sim.add_argument("--max-slowdown", type=float, default=0.01,
                     help="--energy-schedule: longest step allowed, as a fraction (0.01)")
    sim.add_argument("--steady-state", action="store_true",
                     help="--energy-schedule: steps overlap without a flush (the next step's "
                          "warm-up fills this one's drain), so only idle inside each rank's "
                          "busy span is slack")
    _add_convert_parser(sub)
    from meshtrain.commands.lighthouse import add_lighthouse_options

    add_lighthouse_options(sub.add_parser(
        "lighthouse", help="serve the torchft lighthouse that fault-tolerant replica groups "
                           "join (docs/diloco.md)"))
    return parser


def _add_convert_parser(sub) -> None:
    """``convert``: Hugging Face Llama/Qwen/Mixtral <-> meshtrain weights directories."""
    conv = sub.add_parser("convert", help="convert weights to or from Hugging Face format")
    source = conv.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="HF_DIR",
                        help="Hugging Face Llama/Qwen/Mixtral directory -> meshtrain weights dir")
    source.add_argument("--to-hf", metavar="DIR",
                        help="meshtrain weights dir, run dir (with final/) or training "
                             "checkpoint -> Hugging Face directory")
    conv.add_argument("--out", required=True, help="directory to write")
    conv.add_argument("--dtype", help="dtype of the written weights (default: float32 for "
                                      "--from-hf; for --to-hf the dtype it came from HF in)")
    conv.add_argument("--max-shard-gb", type=float, default=5.0,
                      help="--to-hf: largest safetensors shard, in GiB (default 5)")


def _add_planner_parsers(sub) -> None:
    """``estimate``, ``plan`` and ``calibrate`` (options in :mod:`meshtrain.commands.planner`)."""
    from meshtrain.commands.planner import (
        add_calibrate_options,
        add_estimate_options,
        add_hardware_options,
        add_plan_options,
    )

    est = sub.add_parser("estimate", help="predict memory, step time and MFU of a run config")
    _add_run_options(est)
    est.add_argument("--model", metavar="PRESET",
                     help="price a preset's model, sequence length and batch (llama3.1-8b, "
                          "qwen2.5-7b, qwen3-32b, ...; see meshtrain plan) instead of --config")
    add_hardware_options(est, gpus_required=False)
    add_estimate_options(est)
    add_plan_options(sub.add_parser("plan", help="rank parallel layouts for a model and cluster"))
    prep = sub.add_parser("prepare", help="tokenize text sources once into memory-mapped shards")
    prep.add_argument("sources", nargs="+", help=".txt/.jsonl/.parquet files, directories, globs")
    prep.add_argument("--out", required=True, help="directory to write the prepared corpus to")
    prep.add_argument("--tokenizer", default="bytes", help='"bytes" or a tokenizer.json path')
    prep.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    prep.add_argument("--workers", type=int, default=1,
                      help="tokenizer processes (large files are shared between them)")
    add_calibrate_options(sub.add_parser("calibrate",
                                         help="measure this machine into a profile JSON"))


def resolve_run_config(args: argparse.Namespace, in_job: bool = False) -> tuple[Config, int]:
    """Load, override and validate the config of a train-like command; return it and the world.

    ``in_job``: this process is one worker of a torchrun/SLURM job, whose size is the world
    (``--nproc``, when given, must agree with it).
    """
    path = args.config if args.config else default_config_path()
    config = load_config(path, args.overrides)
    if args.steps is not None:
        config.train.steps = args.steps
    if args.run_dir is not None:
        config.train.run_dir = args.run_dir
    if getattr(args, "max_restarts", None) is not None:
        config.train.max_restarts = args.max_restarts
    nproc = args.nproc
    if in_job:
        from meshtrain.run.launch import job_world_size

        if nproc is not None and nproc != job_world_size():
            raise ConfigError(f"--nproc {nproc} does not match the {job_world_size()} processes "
                              f"that torchrun/SLURM started; drop --nproc under torchrun/srun.")
        nproc = job_world_size()
    if config.parallel.elastic:  # re-plan when the world changed (meshtrain.replan.elastic)
        from meshtrain.replan.elastic import adapt, start_world
        from meshtrain.run.launch import job_rank

        nproc = start_world(config, nproc)
        adapt(config, nproc, in_job, verbose=job_rank() == 0)
    elif config.parallel.auto:  # the planner picks the layout (meshtrain.replan.auto)
        from meshtrain.replan.auto import choose_layout

        nproc = choose_layout(config, nproc, in_job)
    from meshtrain.replan.on_measurement import apply_saved, validate_replan

    validate_replan(config)
    if in_job and config.parallel.replan_every:  # torchrun restarted this worker after a replan
        from meshtrain.run.launch import job_rank

        apply_saved(config, nproc, verbose=job_rank() == 0)
    world = validate_config(config, nproc)
    return config, world


def requested_device(args: argparse.Namespace) -> str:
    """The ``train.device`` a train-like command asks for (its config file and ``--set``s), read
    before anything imports torch."""
    return requested_allocator_job(args)[0]


def requested_allocator_job(args: argparse.Namespace) -> tuple[str, int]:
    """``(train.device, parallel.zero)`` of a train-like command (what its host allocator
    settings depend on, :func:`meshtrain.host.allocator.allocator_env`), read before anything
    imports torch."""
    path = args.config if args.config else default_config_path()
    config = load_config(path, args.overrides)
    return config.train.device, config.parallel.zero


def cmd_train(args: argparse.Namespace) -> int:
    """``meshtrain train``."""
    from meshtrain.run.launch import in_existing_job, job_rank, launch, write_run_config
    from meshtrain.validation.preflight import check_before_launch

    if args.dry_run or args.world is not None or args.rank is not None:
        from meshtrain.commands import dry_run  # one rank's objects on meta; nothing is launched

        dry_run.check_args(args)
        config, world = resolve_run_config(args)
        return dry_run.main(config, world, args.rank, args.json)
    in_job = in_existing_job()
    config, world = resolve_run_config(args, in_job)
    is_first = job_rank() == 0
    if is_first:
        print(f"meshtrain: training {config.model.n_layers}-layer dim-{config.model.dim} model "
              f"for {config.train.steps} steps on {world} process(es) "
              f"(dp={config.parallel.dp} tp={config.parallel.tp} pp={config.parallel.pp}"
              f"{f' cp={config.parallel.cp}' if config.parallel.cp > 1 else ''}"
              f"{_replicas_note(config.parallel)}); "
              f"run dir {Path(config.train.run_dir)}", file=sys.stderr)
    from meshtrain.checkpoint.manager import preflight

    preflight(config)  # a checkpoint of another model shape: exit 2 before anything starts
    check_before_launch(config)  # run dir writable, data readable and in the vocabulary
    if is_first:
        write_run_config(config)
    return launch(config, world, "train")


def cmd_verify(args: argparse.Namespace) -> int:
    """``meshtrain verify``: exit 0 when the layout matches one process, 1 when it does not."""
    from meshtrain.commands.verify import format_report, to_json, verify

    steps_given = args.steps
    config, world = resolve_run_config(args)
    steps = steps_given if steps_given is not None else 5
    report = verify(config, world, steps, loss_tol=args.tolerance)
    print(to_json(report) if args.json else format_report(report))
    return 0 if report["ok"] else 1


def cmd_generate(args: argparse.Namespace) -> int:
    """``meshtrain generate``."""
    from meshtrain.commands.generate import generate, load_for_generation

    model, tokenizer, _ = load_for_generation(args.checkpoint)
    text = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                    args.top_k, args.seed)
    print(args.prompt + text)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``meshtrain bench``."""
    import json

    from meshtrain.commands.bench import BenchOptions, format_table, run_bench

    try:
        procs = tuple(int(n) for n in args.procs.split(",") if n.strip())
    except ValueError:
        raise ConfigError(f'--procs "{args.procs}" is not a comma list of process counts, '
                          'e.g. 1,2,4.') from None
    options = BenchOptions(suites=args.suites, steps=args.steps, warmup=args.warmup,
                           repeats=args.repeats, overrides=args.overrides, procs=procs,
                           plot=args.plot, same_allocator=args.same_allocator)
    results = run_bench(options)  # a failing worker: WorkerError, exit status 1
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """``meshtrain estimate``."""
    from meshtrain.commands.planner import run_estimate

    return run_estimate(args)


def cmd_plan(args: argparse.Namespace) -> int:
    """``meshtrain plan``."""
    from meshtrain.commands.planner import run_plan

    return run_plan(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``meshtrain calibrate``."""
    from meshtrain.commands.planner import run_calibrate

    return run_calibrate(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    """``meshtrain simulate``: build, check and time a pipeline schedule."""
    import json

    from meshtrain.parallel.pipeline.schedules import default_virtual_stages
    from meshtrain.parallel.pipeline.simulator import format_report, parse_times, simulate_named
    from meshtrain.parallel.pipeline.timeline import plot_timeline, write_chrome_trace

    v = args.virtual_stages if args.virtual_stages is not None else \
        default_virtual_stages(args.schedule)
    from meshtrain.parallel.pipeline.simulator import StageTimes, simulate
    from meshtrain.planner.energy.schedule import format_energy_schedule, simulate_energy

    schedule, result, report = simulate_named(args.schedule, args.pp, args.microbatches, v,
                                              parse_times(args.times), args.comm)
    times, energy, events = simulate_energy(
        schedule, StageTimes(**report["stage_times"]), args.slow_stage, args.hardware,
        args.max_slowdown, args.energy_schedule, args.steady_state)
    if args.slow_stage:
        result = simulate(schedule, times)
        report.update(slow_stage=args.slow_stage, makespan=result.makespan,
                      bubble_fraction=result.bubble_fraction, closed_form_bubble=None)
    title = (f"{args.schedule} pp={args.pp} m={args.microbatches} v={v}: bubble "
             f"{result.bubble_fraction:.3f}")
    if energy is not None:
        report["energy_schedule"] = energy
        title += f"; energy schedule saves {energy['saving']:.1%} ({energy['slowdown']:+.2%})"
    if args.plot:
        plot_timeline(events or result.events, args.pp, args.plot, title)
    if args.trace:
        write_chrome_trace(events or result.events, args.trace)
    text = format_report(report)
    if energy is not None:
        text += "\n" + format_energy_schedule(energy)
    print(json.dumps(report, indent=2) if args.json else text)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """``meshtrain convert --from-hf HF_DIR | --to-hf DIR --out DIR``."""
    from meshtrain.checkpoint.hf.io import convert_from_hf, convert_to_hf, parse_dtype

    dtype = parse_dtype(args.dtype) if args.dtype else None
    if args.from_hf:
        out = convert_from_hf(args.from_hf, args.out, dtype)
    else:
        out = convert_to_hf(args.to_hf, args.out, dtype, int(args.max_shard_gb * 2**30))
    print(f"meshtrain convert: wrote {out}", file=sys.stderr)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """``meshtrain prepare``: see :mod:`meshtrain.data.prepare`."""
    from meshtrain.data.prepare import prepare

    meta = prepare(args.sources, args.out, args.tokenizer, args.text_field, args.workers,
                   progress=sys.stderr.isatty())
    state = "up to date (same sources, tokenizer and field; nothing rewritten)" \
        if meta["up_to_date"] else "prepared"
    print(f"meshtrain prepare: {args.out} {state}: {meta['tokens']} tokens, "
          f"{meta['documents']} documents, {len(meta['shards'])} shards ({meta['dtype']})")
    return 0


def cmd_lighthouse(args: argparse.Namespace) -> int:
    """``meshtrain lighthouse``: see :mod:`meshtrain.commands.lighthouse`."""
    from meshtrain.commands.lighthouse import serve

    return serve(args)


COMMANDS = {"lighthouse": cmd_lighthouse, "prepare": cmd_prepare, "train": cmd_train,
            "verify": cmd_verify,
            "generate": cmd_generate, "bench": cmd_bench, "estimate": cmd_estimate,
            "plan": cmd_plan, "calibrate": cmd_calibrate, "simulate": cmd_simulate,
            "convert": cmd_convert}


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    from meshtrain.errors import RunFailure
    from meshtrain.run.launch import LaunchError

    args = build_parser().parse_args(argv)
    try:
        if argv is None and args.command == "train":  # the real command line, not a test's call
            from meshtrain.host.allocator import reexec_with_allocator_env

            reexec_with_allocator_env(*requested_allocator_job(args))
        status = COMMANDS[args.command](args)
    except ConfigError as error:
        print(textwrap.fill(f"meshtrain {args.command}: {error}", width=100), file=sys.stderr)
        return 2
    except (LaunchError, RunFailure) as error:
        print(f"meshtrain {args.command}: {error}", file=sys.stderr)
        return getattr(error, "exit_status", 1)
    except KeyboardInterrupt:
        print(f"meshtrain {args.command}: interrupted", file=sys.stderr)
        return 1
    if argv is None and "torch.distributed" in sys.modules:
        # The real command line, which may have run a process group in this process (an srun
        # or torchrun task, a one-process run): leave as a spawned worker does, past the
        # interpreter's finalisation that can abort a run that finished. A command that never
        # imported torch (help, estimate, plan) ran none and exits normally.
        from meshtrain.run.worker import leave_process

        leave_process(status)
    return status
