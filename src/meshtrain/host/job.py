"""Where this process stands in a job: torchrun's or SLURM's rank and world, and its threads.

Kept apart from :mod:`meshtrain.run.launch` (which starts workers) so that the planner can read the
job's shape without depending on the launcher.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshtrain.config import Config

# Step ids SLURM gives the batch script and the "extern" step: not an srun step.
_NON_SRUN_STEPS = {"4294967294", "4294967295", "batch", "extern"}


def in_srun_step() -> bool:
    """True when this process is one task of an ``srun`` step (not the ``sbatch`` batch script).

    ``srun`` sets ``SLURM_STEP_NUM_TASKS``/``SLURM_STEP_ID`` for its tasks; the batch script has
    ``SLURM_PROCID=0`` and the allocation's ``SLURM_NTASKS`` but runs no peers of its own.
    """
    if "SLURM_PROCID" not in os.environ:
        return False
    if os.environ.get("SLURM_STEP_NUM_TASKS"):
        return True
    step = os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID")
    return bool(step) and step not in _NON_SRUN_STEPS


def slurm_step_tasks() -> int:
    """Tasks in this ``srun`` step (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``/``NPROCS``)."""
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def in_existing_job() -> bool:
    """True when torchrun or a multi-task ``srun`` step already started this process.

    Inside an ``sbatch`` batch script (one task, no ``srun``) this is False, so
    ``--nproc N`` spawns its N local workers.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return in_srun_step() and slurm_step_tasks() > 1


def job_world_size() -> int:
    """Processes in the torchrun/SLURM job this process belongs to (1 outside one)."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return slurm_step_tasks() if in_srun_step() else 1


def job_rank() -> int:
    """This process's rank in the torchrun/SLURM job (0 outside one)."""
    if os.environ.get("RANK"):
        return int(os.environ["RANK"])
    return int(os.environ["SLURM_PROCID"]) if in_srun_step() else 0


def threads_per_worker(config: Config, local_workers: int) -> int:
    """Intra-op threads for each local worker."""
    if config.train.threads_per_worker > 0:
        return config.train.threads_per_worker
    return max(1, (os.cpu_count() or 1) // max(local_workers, 1))
