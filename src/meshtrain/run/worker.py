"""What every worker process runs: join the process group, build the mesh, run the task.

Started either in-process (one worker), by :mod:`meshtrain.run.launch` as
``python -m meshtrain.run.worker CONFIG_JSON TASK``, or directly under torchrun/SLURM.

Every collective is bounded by ``train.collective_timeout_s``. A multi-process worker keeps
``RUN_DIR/diagnostics/rank{N}.json`` current (:mod:`meshtrain.run.diagnostics`) and, when it fails,
records the error there (and in torch elastic's error file) instead of printing a traceback: the
launcher prints one summary for the whole job.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

from meshtrain import faults
from meshtrain.config import Config, ConfigError, config_from_dict
from meshtrain.errors import RunFailure
from meshtrain.parallel.mesh import ParallelMesh, init_distributed, shutdown_distributed
from meshtrain.replan import on_measurement as replan
from meshtrain.run import diagnostics
from meshtrain.training import preemption


def _set_threads() -> None:
    threads = os.environ.get("MESHTRAIN_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def build_mesh(config: Config, dry_run: tuple[int, int] | None = None) -> ParallelMesh:
    """Join the environment's process group (if any) and build this rank's mesh.

    ``dry_run = (rank, world)`` (:mod:`meshtrain.commands.dry_run`): that rank's mesh on the meta
    device
    over torch's fake process group (no environment, no peers)."""
    from meshtrain.training.trainer import resolve_device

    device = resolve_device(config.train.device) if dry_run is None else torch.device("meta")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        init_distributed(device, config.train.collective_timeout_s, dry_run)
    except RuntimeError as error:
        if "address already in use" in str(error).lower() or "EADDRINUSE" in str(error):
            raise ConfigError(
                f"MASTER_PORT {os.environ.get('MASTER_PORT')} on "
                f"{os.environ.get('MASTER_ADDR')} is already in use (another job?); choose "
                f"another MASTER_PORT.") from None
        raise
    par = config.parallel
    tied: tuple[int, ...] = ()
    if config.model.tie_embeddings and par.pp > 1:  # the first and last stage share the matrix
        from meshtrain.parallel.pipeline import build_schedule

        tied = build_schedule(par.pp_schedule, par.pp, par.microbatches,
                              par.virtual_stages).embedding_ranks
    return ParallelMesh.from_environment(dp=max(par.dp, 1), tp=par.tp, pp=par.pp, ep=par.ep,
                                         cp=par.cp, replicas=par.replicas,
                                         seed=config.train.seed, device=device,
                                         timeout_s=config.train.collective_timeout_s,
                                         tied_pp_ranks=tied,
                                         replica_group=par.replica_group
                                         if par.replica_fault_tolerance else None)


def _run_task(config: Config, mesh: ParallelMesh, task: str,
              signals: preemption.StopSignals):
    """Run ``task``; returns the trainer (its ``preempted`` and ``replanned`` say whether and
    why it stopped early)."""
    if task != "train":
        raise ValueError(f"unknown worker task {task!r}")
    from meshtrain.training.trainer import Trainer

    trainer = Trainer(config, mesh)
    trainer.stop_signals = signals
    trainer.fit()
    return trainer


def _stop_for_replan(config: Config, mesh: ParallelMesh, decision: dict) -> int:
    """Every rank saved the checkpoint of the decision's step: rank 0 writes ``replan.json``,
    then all wait for each other (nobody leaves before it is written) and leave with
    :data:`~meshtrain.replan.on_measurement.REPLAN_EXIT`, on which the launcher or torchrun
    restarts them."""
    if mesh.rank == 0:
        replan.write_decision(config, decision)
        print(f"meshtrain: replan: checkpoint of step {decision['step']} saved to "
              f"{decision['checkpoint']}; stopping with exit status {replan.REPLAN_EXIT} to "
              f"relaunch at {decision['best']['layout']} (meshtrain's launcher and torchrun "
              f"restart on it; elsewhere run the same command again with "
              f"checkpoint.resume=auto)", file=sys.stderr, flush=True)
    done = torch.zeros(1, device=mesh.device)
    mesh.comm("world").all_reduce(done)
    return replan.REPLAN_EXIT


def run(config: Config, task: str = "train") -> int:
    """Run ``task`` in this process (a worker of the job); returns the exit status.

    SIGTERM/SIGUSR1 stop training after the current step with a checkpoint
    (:mod:`meshtrain.training.preemption`); the status is then
    :data:`~meshtrain.training.preemption.PREEMPTED_EXIT`,
    or 0 under meshtrain's own launcher, which reads ``RUN_DIR/preempted.json`` and reports
    it (so that torch elastic does not count the stop as a failure to restart from); a launched
    worker stops on SIGUSR1 only (the launcher forwards SIGTERM as SIGUSR1). A run that
    ``parallel.replan_every`` stopped to relaunch at another layout returns
    :data:`~meshtrain.replan.on_measurement.REPLAN_EXIT`
    (:mod:`meshtrain.replan.on_measurement`)."""
    # meshtrain's launcher passes its signals on as SIGUSR1: SIGTERM from torch elastic's agent
    # (stopping the workers after another one failed) must stop a launched worker as before.
    launched = bool(os.environ.get(diagnostics.LAUNCHED_ENV))
    with preemption.StopSignals(None if launched else _note_signal,
                                signals=(signal.SIGUSR1,) if launched
                                else preemption.SIGNALS) as signals:
        return _run(config, task, signals)


def _note_signal(signum: int) -> None:
    """The first SIGTERM/SIGUSR1 of a worker outside meshtrain's launcher: rank 0 says so."""
    if faults.current_rank() == 0:
        print(f"meshtrain: {preemption.signal_name(signum)} received: stopping after this step "
              f"with a checkpoint (a second signal stops at once)", file=sys.stderr, flush=True)


def _run(config: Config, task: str, signals: preemption.StopSignals) -> int:
    _set_threads()
    attempt = faults.restart_attempt()
    if attempt and config.checkpoint.resume == "none":
        config.checkpoint.resume = "auto"  # a restarted worker continues from the newest one
    from meshtrain.host.job import job_rank, job_world_size

    replan.apply_saved(config, job_world_size(), verbose=job_rank() == 0)
    mesh = build_mesh(config)
    if attempt and mesh.is_logging_rank:
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS") or config.train.max_restarts
        print(f"meshtrain: restart {attempt} of at most {limit}; resuming "
              f"from the newest valid checkpoint", file=sys.stderr, flush=True)
    mesh.comm_log.debug = config.train.debug_collectives
    timeout = config.train.collective_timeout_s
    interval = diagnostics.interval_for(timeout)
    monitor = None
    if mesh.world_size > 1:
        monitor = diagnostics.RankMonitor(mesh, config.train.run_dir, interval).start()
    try:
        trainer = _run_task(config, mesh, task, signals)
        preempted = trainer.preempted
        if trainer.replanned is not None:
            status = _stop_for_replan(config, mesh, trainer.replanned)
            if monitor is not None:
                monitor.finish()
            shutdown_distributed()
            return status
    except Exception as error:
        if monitor is None:
            raise
        monitor.finish(error)
        kind = diagnostics.classify(error)
        if kind in ("timeout", "peer_lost") and not os.environ.get(diagnostics.LAUNCHED_ENV):
            if kind == "timeout":
                diagnostics.report_from_worker(mesh, config.train.run_dir, interval, timeout)
            raise RunFailure(f"rank {mesh.rank}: {type(error).__name__}: {error}") from None
        raise
    if monitor is not None:
        monitor.finish()
    shutdown_distributed()
    if preempted is None:
        return 0
    launched = bool(os.environ.get(diagnostics.LAUNCHED_ENV))
    if mesh.is_logging_rank:
        preemption.write_marker(config.train.run_dir, preempted)
        if not launched:  # meshtrain's launcher prints it for the whole job
            print(f"meshtrain: {preemption.summary(preempted)}", file=sys.stderr, flush=True)
    return 0 if launched else preemption.PREEMPTED_EXIT


def record_error_file(error: BaseException) -> None:
    """Write ``error`` to torch elastic's error file (``TORCHELASTIC_ERROR_FILE``), atomically.

    The same JSON as torch's ``@record``, but written to a temporary file and renamed into
    place: torch's version truncates the file first, and when the agent stops this worker (its
    peer died) between the truncation and the write, the agent reads an empty file and crashes
    on it instead of restarting the job (seen once in the restart test).
    """
    import time
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": traceback.format_exc(),
                                      "timestamp": str(int(time.time()))}}}
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as handle:
            json.dump(data, handle)
        os.replace(partial, path)
    except OSError:
        pass  # the launcher then reports the exit code alone


def main(argv: list[str] | None = None) -> int:
    """Entry point of a spawned worker: ``python -m meshtrain.run.worker CONFIG_JSON TASK``.

    Failures are recorded (torch elastic's error file, ``RUN_DIR/diagnostics``) for the
    launcher's summary; the exit status is 2 for a config error found here (e.g. unusable data),
    1 for any other failure.
    """
    args = sys.argv[1:] if argv is None else argv
    config = config_from_dict(json.loads(open(args[0]).read()), origin=args[0])
    try:
        status = run(config, args[1] if len(args) > 1 else "train")
    except Exception as error:  # the launcher explains it from the error file
        record_error_file(error)
        # Leave at once: a normal interpreter exit can wait seconds on the process group's
        # unfinished collectives, and the other workers are stopped only once this one is gone.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if isinstance(error, ConfigError) else 1)
    leave_process(status)


def leave_process(status: int) -> None:
    """Flush the streams, run the exit handlers, then end the process with ``status`` without
    the interpreter's finalisation, where tensors still referenced from c10d's C++ threads can
    abort the process (SIGABRT, "terminate called without an active exception") after a run
    that succeeded."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
