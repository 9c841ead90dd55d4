"""``meshtrain train``: resolve a run's config and world, check it, then launch its workers (or
one rank's dry run).

:func:`resolve_run_config` is the one path from the command line to a validated config for every
train-like command (``train``, ``verify``): the config file and ``--set``s, then the layout
chosen by ``parallel.elastic``, ``parallel.auto`` or a saved re-plan, then validation.
"""

from __future__ import annotations

import argparse
import json
import shutil
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


RUN_DIR_FILES = ("metrics.jsonl", "config.json", "run.json", "run.json.tmp", "preempted.json",
                 "timeline.json", "timeline.png", "timeline_summary.json", "trackers.json",
                 "mlflow.db")
"""Files meshtrain writes at the top of a run directory (``--overwrite`` removes these)."""
RUN_DIR_DIRS = ("final", "final.tmp", "diagnostics", "tensorboard", "wandb", "mlflow-artifacts",
                "task_eval")
"""Directories meshtrain writes in a run directory, besides the checkpoints."""


def _last_metrics_step(path: Path) -> int:
    """The step of the last record of ``metrics.jsonl`` (0 when empty or unreadable)."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return int(json.loads(lines[-1]).get("step", 0)) if lines else 0
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def held_run(config: Config) -> tuple[str, int] | None:
    """``(run id, last step)`` of the run whose metrics or checkpoints ``train.run_dir`` (and
    its checkpoint directory) hold, or None when they hold none (or no step). The id is
    ``RUN_DIR/run.json``'s, else the checkpoints'; a run from before run ids reads as
    ``(no run id)``."""
    from meshtrain.checkpoint import manager

    run_dir = Path(config.train.run_dir)
    metrics = run_dir / "metrics.jsonl"
    checkpoints = manager.checkpoint_run_ids(manager.checkpoint_root(config))
    if not metrics.is_file() and not checkpoints:
        return None
    step = max([_last_metrics_step(metrics) if metrics.is_file() else 0,
                *checkpoints.values()])
    if step == 0:  # a run that stopped before its first step: nothing to lose
        return None
    named = sorted(i for i in checkpoints if i)
    run_id = manager.read_run_id(run_dir) or (named[0] if named else None)
    return run_id or "(no run id)", step


def remove_run_files(config: Config) -> list[Path]:
    """``--overwrite``: remove the files meshtrain wrote for the run in ``train.run_dir`` (its
    metrics, checkpoints, final weights, config, diagnostics, timeline, ...), never others;
    returns what was removed."""
    from meshtrain.checkpoint import manager
    from meshtrain.replan.on_measurement import DECISION_FILE

    run_dir = Path(config.train.run_dir)
    root = manager.checkpoint_root(config)
    removed = []
    for path in [run_dir / name for name in RUN_DIR_FILES + RUN_DIR_DIRS] + [root / DECISION_FILE]:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(path)
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if path.is_dir() and path.name.startswith((manager.PREFIX, manager.TMP_PREFIX)):
                shutil.rmtree(path)
                removed.append(path)
        if root == run_dir / "checkpoints" and not any(root.iterdir()):
            root.rmdir()
    return removed


def claim_run_dir(config: Config, overwrite: bool, is_first: bool) -> str:
    """Before launch: make sure ``train.run_dir`` is this run's and return the run id.

    A fresh run (``checkpoint.resume = none``) in a directory that holds another run's metrics or
    checkpoints is refused (ConfigError, exit 2) unless ``overwrite``, which (on rank 0 only)
    removes that run's files first. Resuming keeps the directory's run id (or takes its
    checkpoints'); a fresh run gets a new one, which rank 0 writes to ``RUN_DIR/run.json`` before
    the workers start (:func:`run_train`)."""
    from meshtrain.checkpoint import manager

    if overwrite:
        if is_first:
            removed = remove_run_files(config)
            if removed:
                print(f"meshtrain: --overwrite: removed {len(removed)} file(s) and folder(s) of "
                      f"the earlier run in {config.train.run_dir}", file=sys.stderr)
        config.checkpoint.resume = "none"  # starting over
        return manager.new_run_id()
    resume = config.checkpoint.resume
    if resume == "none":
        held = held_run(config)
        if held is not None:
            raise ConfigError(
                f"this directory holds run {held[0]} up to step {held[1]}: resume it with "
                f"`--set checkpoint.resume=auto`, or choose another `--run-dir`, or "
                f"`--overwrite` to start over (train.run_dir = {config.train.run_dir}).")
        return manager.new_run_id()
    recorded = manager.read_run_id(config.train.run_dir)
    if resume == "auto":
        root = manager.checkpoint_root(config)
        saved = manager.check_one_run(root, recorded)
        held = held_run(config) if is_first else None
        if held is not None and manager.newest_valid(root, warn=False) is None:
            print(f"meshtrain: checkpoint.resume = auto: {config.train.run_dir} holds run "
                  f"{held[0]} up to step {held[1]} but no checkpoint to resume from "
                  f"(checkpoint.every = {config.checkpoint.every}); training it again from "
                  "step 0, its metrics rewritten", file=sys.stderr)
        return recorded or saved or manager.new_run_id()
    return recorded or manager.new_run_id()


def run_train(args: argparse.Namespace) -> int:
    """``meshtrain train``: one rank's dry run, or check, write the run config and launch."""
    from meshtrain.faults import restart_attempt
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
    overwrite = getattr(args, "overwrite", False)
    if in_job and restart_attempt():  # torchrun restarted this job: the same run continues
        overwrite = False
        if config.checkpoint.resume == "none":
            config.checkpoint.resume = "auto"
    if overwrite:
        config.checkpoint.resume = "none"  # starting over: the old checkpoints go
    from meshtrain.checkpoint.manager import preflight, write_run_id

    preflight(config)  # a checkpoint of another model shape: exit 2 before anything starts
    # run dir writable, data readable, its token ids inside the vocabulary
    check_before_launch(config, verbose=is_first)
    if config.train.eval_tasks and is_first:  # every harness task and its data, on rank 0's host
        from meshtrain.training.harness.tasks import check_tasks

        check_tasks(config.train.eval_tasks, config.train.eval_tasks_include,
                    "train.eval_tasks_include")
    # another run's files in the run dir: refused, or removed with --overwrite (rank 0)
    run_id = claim_run_dir(config, overwrite, is_first)
    from meshtrain.commands.fit_check import check_fits

    check_fits(config, world, in_job, verbose=is_first)  # memory, before any model is built
    if is_first:
        write_run_id(config.train.run_dir, run_id)  # before any worker; manifests record it
        write_run_config(config)
    return launch(config, world, "train")
