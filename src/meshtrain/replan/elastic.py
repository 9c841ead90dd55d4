"""``parallel.elastic = true``: re-plan the parallel layout when a job starts on another world.

Under an elastic launch (``torchrun --nnodes MIN:MAX`` with a c10d rendezvous and
``--max-restarts``) a lost node makes torch elastic restart the workers that remain, with a
smaller ``WORLD_SIZE``. Every start of ``meshtrain train`` calls :func:`adapt` before the config
is validated. It compares the start's world with the *reference*: the layout the newest valid
checkpoint was saved at (its manifest), else the config's own layout. When they differ it
chooses the layout for this world:

- the config's own layout when it fits this world (e.g. the nodes came back, or ``parallel.dp``
  is 0 and fills whatever is left), unless ``parallel.auto`` asks the planner anyway;
- otherwise the planner's best layout (:func:`meshtrain.replan.auto.rank_layouts`, priced with
  the calibrated profile when there is one, :func:`~meshtrain.replan.auto.resolve_profile`)
  that fits in memory and that this runtime accepts. ``train.global_batch`` is kept: on fewer
  ranks each one takes more micro-batches (gradient accumulation), so the optimizer sees the same
  batches in the same order (the data order does not depend on dp,
  :class:`~meshtrain.data.sampler.GlobalBatchSampler`).

The checkpoint then loads at the new layout (checkpoints load at any layout,
:mod:`meshtrain.checkpoint`). Every change is printed once by rank 0::

    meshtrain: elastic: layout dp=2 tp=2 pp=1 (4 processes) -> dp=1 tp=2 pp=1 zero=0
    microbatches=2 (checkpointing none) (2 processes): WORLD_SIZE 2 differs from the 4 processes
    checkpoint step_00000005 was saved at; predicted 0.0123 s/step (priced with builtin-cpu ...)

and :func:`take_change` hands it to the trainer, which adds it as the ``layout`` field of the
first ``metrics.jsonl`` line after it. Every rank decides alone from the same inputs (the
checkpoint directory, the config, the profile), so all ranks choose the same layout.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

from meshtrain.config import Config, ConfigError
from meshtrain.config.layout_rules import model_parallel_size, world_fits, world_size
from meshtrain.replan.layout_change import remember_change

PLANNED_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero", "microbatches", "pp_schedule",
                "virtual_stages", "sequence_parallel", "activation_checkpointing")
"""The ``[parallel]`` keys a re-plan may change."""

SHAPE_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero")
"""What a checkpoint's manifest records of its layout, and what makes a layout change."""



def check_restartable(config: Config, option: str) -> None:
    """Refuse what stops a restarted job from resuming the newest checkpoint at another layout
    (ConfigError naming ``option``, the setting that restarts it): no periodic checkpoints, a
    fixed ``checkpoint.resume`` path, replica groups, a fixed ``parallel.pp_split``."""
    c, par = config.checkpoint, config.parallel
    if c.every < 1:
        raise ConfigError(f"{option} needs periodic checkpoints: a restart resumes from the "
                          f"newest one. Set checkpoint.every (e.g. 50).")
    if c.resume not in ("auto", "none"):
        raise ConfigError(f"{option} resumes from the newest checkpoint of checkpoint.dir; "
                          f"checkpoint.resume = {c.resume!r} would restart from that one "
                          f"every time. Use \"auto\" (or \"none\").")
    if par.replicas > 1:
        raise ConfigError(f"{option} does not re-plan replica groups (a DiLoCo checkpoint "
                          f"resumes only at the same parallel.replicas); set "
                          f"parallel.replicas = 1 or turn {option} off.")
    if par.pp_split:
        raise ConfigError(f"{option} may change the number of pipeline stages, which a fixed "
                          f"parallel.pp_split cannot follow; leave pp_split empty.")


def validate_elastic(config: Config) -> None:
    """Refuse ``parallel.elastic`` where a restart on another world cannot resume (ConfigError,
    exit 2)."""
    if config.parallel.elastic:
        check_restartable(config, "parallel.elastic = true")


def _config_world(config: Config) -> int | None:
    """Processes the config's layout needs; None when ``dp = 0`` (it fills any multiple)."""
    par = config.parallel
    if par.dp == 0:
        return None
    return world_size(par.dp, par.tp, par.pp, par.cp, par.replicas)


def start_world(config: Config, nproc: int | None) -> int:
    """The processes of this start: ``nproc`` (the job's, or ``--nproc``), else what
    ``parallel.auto`` would use, else what the config's layout needs (1 × the model-parallel
    degrees when ``dp = 0``)."""
    if nproc is not None:
        return nproc
    if config.parallel.auto:
        from meshtrain.replan.auto import default_processes

        return default_processes(config)
    par = config.parallel
    return _config_world(config) or model_parallel_size(par.tp, par.pp, par.cp, par.replicas)


def _fits(config: Config, world: int) -> bool:
    par = config.parallel
    needed = _config_world(config)
    if needed is None:
        return world_fits(world, tp=par.tp, pp=par.pp, cp=par.cp, replicas=par.replicas)
    return needed == world


def _describe_shape(shape: dict) -> str:
    text = f"dp={shape['dp']} tp={shape['tp']} pp={shape['pp']}"
    for key in ("cp", "ep"):
        if shape.get(key, 1) > 1:
            text += f" {key}={shape[key]}"
    return text + (f" zero={shape['zero']}" if shape.get("zero") else "")


def reference(config: Config) -> tuple[dict, int | None, str]:
    """``(shape, world, where)``: the layout this start is compared with — the newest valid
    checkpoint's (its manifest) when this start resumes (``checkpoint.resume = "auto"``, or any
    restart), else the config's (world None when ``dp = 0``)."""
    from meshtrain import faults
    from meshtrain.checkpoint import manager

    if config.checkpoint.resume == "auto" or faults.restart_attempt() > 0:
        probe = copy.deepcopy(config)
        probe.checkpoint.resume = "auto"
        directory = manager.resolve_resume(probe, warn=False)
        if directory is not None:
            saved = manager.read_manifest(directory).get("layout", {})
            if "world_size" in saved:
                shape = {key: saved.get(key, 1 if key != "zero" else 0) for key in SHAPE_KEYS}
                return (shape, int(saved["world_size"]),
                        f"checkpoint {Path(directory).name} was saved at")
    shape = {key: getattr(config.parallel, key) for key in SHAPE_KEYS}
    return shape, _config_world(config), "the config's layout needs"


def adapt(config: Config, world: int, in_job: bool, verbose: bool = True) -> None:
    """Set ``config.parallel`` for a start on ``world`` processes (see the module doc); remember
    the change, and print it when ``verbose`` (the job's rank 0), when the layout differs from
    the reference one."""
    from meshtrain.replan.auto import describe, job_cluster, predict, rank_layouts

    validate_elastic(config)
    if config.checkpoint.resume == "none":  # any start may be a restart on other nodes
        config.checkpoint.resume = "auto"
    old_shape, old_world, where = reference(config)
    if old_world == world and _fits(config, world) and not config.parallel.auto:
        return  # the same world as before, at the config's own layout
    cluster, origin = job_cluster(config, world, in_job)
    if _fits(config, world) and not config.parallel.auto:
        result = predict(config, world, cluster)
        how = "the config's own layout fits"
    else:
        chosen, searched = rank_layouts(config, world, cluster)
        if not chosen:
            raise ConfigError(
                f"parallel.elastic: none of the {searched} layouts of {world} processes both "
                f"fits in memory and is accepted by this runtime for this model (global batch "
                f"{config.train.global_batch}); the job cannot go on with {world} processes.")
        result, candidate = chosen[0]
        values = {key: getattr(candidate.parallel, key) for key in PLANNED_KEYS}
        config.parallel = dataclasses.replace(config.parallel, **values)
        how = f"planned over {searched} layouts"
    new_shape = {key: result["layout"][key] for key in SHAPE_KEYS}
    if old_world == world and new_shape == old_shape:
        return  # e.g. a restart on as many processes as the checkpoint: the same plan again
    if old_world != world:
        reason = f"WORLD_SIZE {world} differs from the {old_world} processes {where}"
    elif config.parallel.auto:
        reason = f"parallel.auto chose another layout for {world} processes"
    else:
        reason = f"the config's layout does not fit {world} processes"
    change = {"from": {**old_shape, "world_size": old_world},
              "to": {**new_shape, "world_size": world,
                     "microbatches": result["layout"]["microbatches"]},
              "reason": reason, "how": how,
              "predicted_step_s": result["step_time_s"],
              "profile": f"{cluster.profile.name} from {origin}"}
    remember_change(change)
    if verbose:
        old_text = _describe_shape(old_shape) + (f" ({old_world} processes)" if old_world
                                                 else "")
        print(f"meshtrain: elastic: layout {old_text} -> {describe(result)} ({world} "
              f"processes): {reason}; {how}; predicted {result['step_time_s']:.3g} s/step "
              f"(priced with {change['profile']}); global batch "
              f"{config.train.global_batch} kept", file=sys.stderr, flush=True)
