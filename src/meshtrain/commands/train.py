"""``meshtrain train``: resolve a run's config and world, check it, then launch its workers (or
one rank's dry run).

:func:`resolve_run_config` is the one path from the command line to a validated config for every
train-like command (``train``, ``verify``): the config file and ``--set``s, then the layout
chosen by ``parallel.elastic``, ``parallel.auto`` or a saved re-plan, then validation.
"""

from __future__ import annotations

import argparse
import sys
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


def run_train(args: argparse.Namespace) -> int:
    """``meshtrain train``: one rank's dry run, or check, write the run config and launch."""
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
    # run dir writable, data readable, its token ids inside the vocabulary
    check_before_launch(config, verbose=is_first)
    from meshtrain.commands.fit_check import check_fits

    check_fits(config, world, in_job, verbose=is_first)  # memory, before any model is built
    if is_first:
        write_run_config(config)
    return launch(config, world, "train")
