"""``parallel.replan_every = K``: re-plan the layout from what the run measured, once.

After a warm-up step, every rank times ``K`` steps: the seconds it spent in the collectives of
each parallel axis and the rest of each step, its compute
(:class:`~meshtrain.replan.monitor.ReplanMonitor`, reduced over ranks). Rank 0 then
(:func:`decide`):

1. prices the running layout with the hardware profile the planner uses (the same one
   ``parallel.auto`` and ``parallel.elastic`` resolve inside a job) and compares that prediction
   with the measured step time;
2. derives measured per-axis costs: scales of the profile's compute rate and of each axis's
   collectives, measured / predicted (:mod:`meshtrain.replan.measured`);
3. re-prices every layout of this world with those costs through the planner
   (:func:`meshtrain.replan.auto.rank_layouts`: fits in memory, accepted by this runtime, the
   global batch kept) and takes the best one other than the running layout;
4. relaunches with it when it is predicted faster than the measured step by more than
   ``parallel.replan_gain``; otherwise keeps the layout.

The decision is printed by rank 0 and is the ``replan`` field of that step's ``metrics.jsonl``
line, either way. To relaunch, every rank saves a checkpoint of the step, rank 0 writes
``replan.json`` into the checkpoint directory (:func:`write_decision`) and every worker exits
with :data:`REPLAN_EXIT`. ``meshtrain train --nproc N`` restarts its workers on that status
(its restart budget grows by ``parallel.replan_max``); under ``torchrun`` its
``--max-restarts`` does. The restarted workers read ``replan.json`` before they build the mesh
(:func:`apply_saved`), resume the checkpoint at the new layout and log the change as the
``layout`` field (reason ``"replan"``) of their first line. The data order and the global batch
do not depend on the layout, so the losses go on as they would have.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from pathlib import Path

from meshtrain.config import Config, ConfigError
from meshtrain.replan.elastic import PLANNED_KEYS, SHAPE_KEYS, check_restartable
from meshtrain.replan.layout_change import remember_change

REPLAN_EXIT = 76
"""Exit status of a worker that stopped to be relaunched at a re-planned layout (after saving a
checkpoint and ``replan.json``); meshtrain's launcher and torchrun restart on it."""
DECISION_FILE = "replan.json"
"""The relaunch decision, in the checkpoint directory: layout, step, why, replans so far."""


def validate_replan(config: Config) -> None:
    """Refuse ``parallel.replan_*`` values that cannot work (ConfigError, exit 2)."""
    par = config.parallel
    if par.replan_every < 0:
        raise ConfigError(f"parallel.replan_every = {par.replan_every} must be 0 (off) or the "
                          f"number of steps to measure before re-planning (e.g. 20).")
    if not 0 < par.replan_gain < 1:
        raise ConfigError(f"parallel.replan_gain = {par.replan_gain:g} must be a fraction of "
                          f"the step time between 0 and 1 (exclusive), e.g. 0.10 for 10 %.")
    if par.replan_max < 1:
        raise ConfigError(f"parallel.replan_max = {par.replan_max} must be at least 1; set "
                          f"parallel.replan_every = 0 to turn re-planning off.")
    if not par.replan_every:
        return
    check_restartable(config, "parallel.replan_every")
    last = par.replan_every + 1
    if last >= config.train.steps:
        raise ConfigError(f"parallel.replan_every = {par.replan_every} decides after step "
                          f"{last} (one warm-up step, then {par.replan_every} measured), but "
                          f"train.steps = {config.train.steps} leaves no step after it; use "
                          f"replan_every < {max(config.train.steps - 2, 1)} or more steps.")
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS") == "0":
        raise ConfigError("parallel.replan_every relaunches the workers at the new layout, but "
                          "this torchrun job has --max-restarts 0; give torchrun "
                          "--max-restarts 1 (or more), or set parallel.replan_every = 0.")


def decision_path(config: Config) -> Path:
    """``replan.json`` in the checkpoint directory (``checkpoint.dir`` or RUN_DIR/checkpoints)."""
    from meshtrain.checkpoint.manager import checkpoint_root

    return checkpoint_root(config) / DECISION_FILE


def _resuming(config: Config) -> bool:
    from meshtrain import faults

    return config.checkpoint.resume == "auto" or faults.restart_attempt() > 0


def read_decision(config: Config) -> dict | None:
    """The saved relaunch decision this start resumes after, or None (a fresh start, none
    saved, or an unreadable file)."""
    if not _resuming(config):
        return None
    try:
        return json.loads(decision_path(config).read_text())
    except (OSError, ValueError):
        return None


def replans_done(config: Config) -> int:
    """Relaunches this run has made so far (from ``replan.json``; 0 on a fresh start)."""
    saved = read_decision(config)
    return int(saved.get("replans", 0)) if saved else 0


def write_decision(config: Config, decision: dict) -> None:
    """Save a relaunch decision (rank 0, after the checkpoint of its step), atomically."""
    path = decision_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(decision, indent=1))
    os.replace(partial, path)


def apply_saved(config: Config, world: int, verbose: bool) -> bool:
    """Set ``config.parallel`` to the saved re-planned layout when this start resumes after it
    (same world, newest checkpoint at or after the decision's step); remember the change for
    the first metrics line. Returns whether it did."""
    from meshtrain.checkpoint import manager

    saved = read_decision(config)
    if not config.parallel.replan_every or not saved or saved.get("decision") != "relaunch":
        return False
    probe = copy.deepcopy(config)
    probe.checkpoint.resume = "auto"
    newest = manager.resolve_resume(probe, warn=False)
    to = saved["to"]
    if (newest is None or to["world_size"] != world
            or int(manager.read_manifest(newest).get("step", -1)) < saved["step"]):
        return False
    values = {key: to[key] for key in PLANNED_KEYS}
    if all(getattr(config.parallel, key) == value for key, value in values.items()):
        return False
    config.parallel = dataclasses.replace(config.parallel, **values)
    remember_change({"from": saved["from"], "to": {key: to[key] for key in SHAPE_KEYS}
                     | {"world_size": world, "microbatches": to["microbatches"]},
                     "reason": "replan", "how": saved["why"],
                     "predicted_step_s": saved["best"]["predicted_step_s"],
                     "profile": saved["profile"]})
    if verbose:
        print(f"meshtrain: replan: relaunched at {saved['best']['layout']} (decided after step "
              f"{saved['step']}); resuming from {newest}", file=sys.stderr, flush=True)
    return True


def _shape_text(values: dict) -> str:
    text = " ".join(f"{key}={values[key]}" for key in ("dp", "tp", "pp"))
    return text + "".join(f" {key}={values[key]}" for key in ("cp", "ep") if values[key] > 1)


def decide(config: Config, world: int, step: int, measured: dict, done: int) -> dict:
    """Rank 0's decision after ``step`` from ``measured`` = ``{"steps", "step_s", "axes":
    {runtime axis: seconds}}`` (per step, mean over ranks); ``done`` relaunches so far. Returns
    the ``replan`` record (see the module doc); ``decision`` is ``"relaunch"`` or ``"keep"``."""
    from meshtrain.replan.auto import describe, job_cluster, predict, rank_layouts
    from meshtrain.replan.measured import (
        measured_cluster,
        measured_scales,
        planner_axes,
        predicted_parts,
    )

    par, threshold = config.parallel, config.parallel.replan_gain
    cluster, origin = job_cluster(config, world, in_job=True)
    planned = predict(config, world, cluster)
    axes = planner_axes(measured["axes"])
    step_s = measured["step_s"]
    scales = measured_scales(planned, step_s, axes)
    costs = measured_cluster(cluster, scales)
    repriced = predict(config, world, costs)
    chosen, searched = rank_layouts(config, world, costs)
    current = {key: getattr(par, key) for key in PLANNED_KEYS}
    others = [(result, candidate) for result, candidate in chosen
              if {key: getattr(candidate.parallel, key) for key in PLANNED_KEYS} != current]
    record = {
        "after_step": step, "measured_steps": measured["steps"], "measured_step_s": step_s,
        "predicted_step_s": planned["step_time_s"], "repriced_step_s": repriced["step_time_s"],
        "measured_s": {"compute": max(step_s - sum(axes.values()), 0.0),
                       **{axis: value for axis, value in axes.items() if value > 0}},
        "predicted_s": {k: v for k, v in predicted_parts(planned).items() if v > 0},
        "scales": scales, "profile": f"{cluster.profile.name} from {origin}",
        "searched": searched, "threshold": threshold, "best": None, "gain": None,
    }
    if others:
        best, candidate = others[0]
        gain = 1 - best["step_time_s"] / step_s
        record["best"] = {"layout": describe(best), "predicted_step_s": best["step_time_s"]}
        record["gain"] = gain
    if not others:
        decision, why = "keep", "no other layout of this world fits and is valid"
    elif record["gain"] <= threshold:
        decision, why = "keep", (f"the best other layout is predicted {record['gain']:.0%} "
                                 f"faster, not more than parallel.replan_gain = {threshold:g}")
    else:
        decision, why = "relaunch", (f"{record['best']['layout']} is predicted "
                                     f"{record['gain']:.0%} faster than the measured step "
                                     f"(more than parallel.replan_gain = {threshold:g})")
    record.update(decision=decision, why=why, replans=done + (decision == "relaunch"),
                  replan_max=par.replan_max)
    if decision == "relaunch":
        values = {key: getattr(candidate.parallel, key) for key in PLANNED_KEYS}
        record["from"] = {key: getattr(par, key) for key in SHAPE_KEYS} | {"world_size": world}
        record["to"] = values | {"world_size": world}
    record["message"] = _message(record, _shape_text(current))
    return record


def _message(record: dict, layout: str) -> str:
    """Rank 0's one paragraph on the decision."""
    scales = record["scales"]
    parts = ", ".join(f"{name} {seconds:.3g} s (x{scales.get(name, 1.0):.3g} the profile's)"
                      for name, seconds in record["measured_s"].items())
    text = (f"meshtrain: replan: after step {record['after_step']} at {layout}: measured "
            f"{record['measured_step_s']:.3g} s/step over {record['measured_steps']} steps, "
            f"the plan predicted {record['predicted_step_s']:.3g} s/step (priced with "
            f"{record['profile']}); measured per step: {parts}. ")
    if record["best"] is not None:
        text += (f"Re-priced with these costs over {record['searched']} layouts: this layout "
                 f"{record['repriced_step_s']:.3g} s/step, the best other "
                 f"{record['best']['layout']} {record['best']['predicted_step_s']:.3g} s/step "
                 f"(predicted gain {record['gain']:.0%}). ")
    if record["decision"] == "relaunch":
        return text + (f"Decision: relaunch with it ({record['why']}; replan "
                       f"{record['replans']} of at most {record['replan_max']}).")
    return text + f"Decision: keep the layout ({record['why']})."
