"""What every worker process runs: join the process group, build the mesh, run the task.

Started either in-process (one worker), by :mod:`meshtrain.launch` as
``python -m meshtrain.worker CONFIG_JSON TASK``, or directly under torchrun/SLURM.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from meshtrain.config import Config
from meshtrain.mesh import ParallelMesh, init_distributed, shutdown_distributed


def _set_threads() -> None:
    threads = os.environ.get("MESHTRAIN_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def build_mesh(config: Config) -> ParallelMesh:
    """Join the environment's process group (if any) and build this rank's mesh."""
    from meshtrain.training.trainer import resolve_device

    device = resolve_device(config.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    init_distributed(device)
    par = config.parallel
    return ParallelMesh.from_environment(dp=max(par.dp, 1), tp=par.tp, pp=par.pp, ep=par.ep,
                                         seed=config.train.seed, device=device)


def run(config: Config, task: str = "train") -> int:
    """Run ``task`` in this process (a worker of the job); returns the exit status."""
    _set_threads()
    mesh = build_mesh(config)
    try:
        if task == "train":
            from meshtrain.training.trainer import Trainer

            Trainer(config, mesh).fit()
        else:
            raise ValueError(f"unknown worker task {task!r}")
    finally:
        shutdown_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of a spawned worker: ``python -m meshtrain.worker CONFIG_JSON TASK``."""
    from torch.distributed.elastic.multiprocessing.errors import record

    args = sys.argv[1:] if argv is None else argv
    config = Config.from_dict(json.loads(open(args[0]).read()), origin=args[0])
    return record(run)(config, args[1] if len(args) > 1 else "train")


if __name__ == "__main__":
    sys.exit(main())
