"""Start the worker processes of a run, or join a job that ``torchrun`` or SLURM already started.

- Inside ``torchrun`` (``RANK``/``WORLD_SIZE`` set) or an ``srun`` step with several tasks
  (``SLURM_PROCID`` and ``SLURM_STEP_NUM_TASKS`` > 1), this process *is* a worker: it joins the
  existing job. An ``sbatch`` batch script (``SLURM_PROCID=0`` but no ``srun`` step) is not a
  job to join: ``--nproc N`` spawns N local workers there.
- Otherwise ``--nproc 1`` runs in this process, and ``--nproc N`` spawns N local workers through
  ``torch.distributed.run``'s elastic launcher (gloo on CPU, NCCL on CUDA), restarting them up
  to ``train.max_restarts`` times after a failure. ``MASTER_PORT``, when set, is the port they
  rendezvous on (refused with exit 2 when it is taken); otherwise a free one is picked.

Nothing of a run on one machine listens beyond loopback: the local workers' rendezvous store
listens on ``127.0.0.1`` only (:data:`LOOPBACK_RENDEZVOUS`; torch's own c10d and static
rendezvous stores listen on every interface whatever host they are given), and gloo and NCCL get
``GLOO_SOCKET_IFNAME=lo`` and ``NCCL_SOCKET_IFNAME=lo`` unless the user set them (gloo otherwise
listens on the address the host name resolves to, NCCL's bootstrap on the first interface that is
not loopback). A job that torchrun or SLURM started is the cluster's rendezvous and is left
as it is, and so is a fault-tolerant replica group whose lighthouse is on another machine
(:mod:`meshtrain.validation.network`).

Workers that stop with :data:`~meshtrain.replan.on_measurement.REPLAN_EXIT`
(``parallel.replan_every`` chose
another layout and saved a checkpoint) are restarted like failed ones, on a budget of
``train.max_restarts + parallel.replan_max`` (:func:`restart_budget`).

When a worker fails, the launcher prints one message for the whole job
(:func:`meshtrain.run.diagnostics.explain_failure`): a killed worker's rank and signal, or for a
collective timeout which rank(s) did not arrive and where every rank waits.

SIGTERM and SIGUSR1 to the launcher are passed on to its workers (as SIGUSR1), which finish
their step, save a checkpoint and stop (:mod:`meshtrain.training.preemption`); the launcher then
exits with :data:`~meshtrain.training.preemption.PREEMPTED_EXIT` and says so. A second signal is
passed on too and stops everything at once (``128 + signal``).

The resolved config travels to the workers as ``RUN_DIR/config.json``; it was validated before
any process started. Each worker gets ``threads_per_worker`` intra-op threads (by default the
machine's cores divided among the local workers), so N workers on few cores do not thrash.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

from meshtrain.config import Config, ConfigError
from meshtrain.errors import RunFailure
from meshtrain.host import loopback
from meshtrain.host.allocator import allocator_env
from meshtrain.host.job import (  # noqa: F401 (job_rank, job_world_size: used from here too)
    in_existing_job,
    in_srun_step,
    job_rank,
    job_world_size,
    slurm_step_tasks,
    threads_per_worker,
)
from meshtrain.replan import on_measurement as replan
from meshtrain.run import diagnostics
from meshtrain.training import preemption


class LaunchError(RunFailure):
    """A worker failed; the message says which rank and why."""


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``."""
    head = nodelist.strip()
    bracket, comma = head.find("["), head.find(",")
    if comma != -1 and (bracket == -1 or comma < bracket):
        return head[:comma]
    if bracket == -1:
        return head
    first = head[bracket + 1:].split(",")[0].split("-")[0].rstrip("]")
    return head[:bracket] + first


def slurm_master_port() -> int:
    """A rendezvous port derived from ``SLURM_JOB_ID`` (20000-29999), so that two jobs sharing
    a node do not collide; 29500 without a job id."""
    job = os.environ.get("SLURM_JOB_ID", "")
    return 20000 + int(job) % 10000 if job.isdigit() else 29500


def adopt_slurm_environment() -> None:
    """Translate an ``srun`` task's variables into the ones ``torch.distributed`` reads.

    ``MASTER_ADDR`` defaults to the first node of the step (``SLURM_STEP_NODELIST``, else
    ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``), where task 0 runs, and ``MASTER_PORT`` to
    20000 + ``SLURM_JOB_ID`` mod 10000; set either in the batch script to override.
    """
    if "RANK" in os.environ or not in_srun_step():
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = str(slurm_step_tasks())
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get(
        "SLURM_NTASKS_PER_NODE") or "1"
    os.environ.setdefault("LOCAL_WORLD_SIZE", per_node.split("(")[0].split(",")[0])
    nodelist = next((os.environ[name] for name in (
        "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if os.environ.get(name)), "")
    default_addr = first_slurm_host(nodelist) if nodelist else os.environ.get(
        "SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_ADDR", default_addr)
    os.environ.setdefault("MASTER_PORT", str(slurm_master_port()))


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rendezvous_port() -> int:
    """``MASTER_PORT`` when set (refused with a ConfigError when taken), else a free port."""
    text = os.environ.get("MASTER_PORT")
    if not text:
        return free_port()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"MASTER_PORT = {text!r} is not a TCP port number (1-65535).")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", int(text)))
        except OSError as error:
            raise ConfigError(
                f"MASTER_PORT = {text} is already in use on this machine ({error.strerror}); "
                f"another job may be running. Choose another MASTER_PORT, or unset it to let "
                f"meshtrain pick a free port.") from None
    return int(text)


def write_run_config(config: Config) -> Path:
    """Write the resolved config to ``RUN_DIR/config.json`` and return its path."""
    run_dir = Path(config.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    path.write_text(json.dumps(config.to_dict(), indent=2))
    return path


def launch(config: Config, world_size: int, task: str = "train") -> int:
    """Run ``task`` for a validated ``config`` on ``world_size`` processes; returns exit status."""
    from meshtrain.run import worker

    if in_existing_job():
        adopt_slurm_environment()
        return worker.run(config, task)
    chosen = loopback.keep_collectives_on_loopback() if on_one_machine(config) else []
    try:
        if world_size == 1:
            os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_worker(config, 1)))
            return worker.run(config, task)
        return spawn_local(config, world_size, task)
    finally:
        for name in chosen:  # a test's launch in-process leaves the environment as it was
            os.environ.pop(name, None)


def on_one_machine(config: Config) -> bool:
    """True when every process this launch talks to runs on this machine: always, except for a
    fault-tolerant replica group whose lighthouse (and so its peer groups) is elsewhere."""
    par = config.parallel
    if not par.replica_fault_tolerance:
        return True
    from meshtrain.validation.network import lighthouse_is_local

    return lighthouse_is_local(par.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", ""))


def spawn_local(config: Config, nproc: int, task: str) -> int:
    """Spawn ``nproc`` workers on this machine and wait for them."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = rendezvous_port()
    config_path = write_run_config(config)
    diagnostics.clear(config.train.run_dir)
    threads = threads_per_worker(config, nproc)
    launch_config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
        rdzv_backend=register_loopback_rendezvous(),
        rdzv_endpoint=f"{loopback.LOOPBACK}:{port}",
        max_restarts=restart_budget(config), monitor_interval=0.1, start_method="spawn",
        local_addr="127.0.0.1",
        # SIGTERM and SIGUSR1 are meshtrain's (forwarded to the workers, below), not torch
        # elastic's, which would stop the workers and kill them after a grace period.
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
    )
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MESHTRAIN_THREADS"] = str(threads)
    os.environ[diagnostics.LAUNCHED_ENV] = "1"
    # CPU workers start with meshtrain's malloc settings (none for a job on a GPU)
    os.environ.update(allocator_env(device=config.train.device, zero=config.parallel.zero))
    # torch elastic logs every worker failure at length; the summary below replaces that.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    preemption.clear_marker(config.train.run_dir)
    signals = preemption.StopSignals(_forward_first, preemption.forward_to_workers,
                                     exit_on_second=False)
    try:
        with signals:
            elastic_launch(launch_config, sys.executable)(
                "-m", "meshtrain.run.worker", str(config_path), task)
    except ChildFailedError as error:
        codes = {rank: f.exitcode for rank, f in error.failures.items()}
        if set(codes.values()) == {replan.REPLAN_EXIT}:  # no restart left to relaunch with
            print(f"meshtrain {task}: the workers stopped to relaunch at a re-planned layout "
                  f"but no restart was left (train.max_restarts); run the same command with "
                  f"--set checkpoint.resume=auto to continue at it", file=sys.stderr, flush=True)
            return replan.REPLAN_EXIT
        messages = {rank: _failure_text(f.message) for rank, f in error.failures.items()}
        status, message = diagnostics.explain_failure(
            codes, messages, config.train.run_dir, nproc, config.train.collective_timeout_s)
        if status == 2:
            raise ConfigError(message) from None
        raise LaunchError(message) from None
    finally:
        os.environ.pop(diagnostics.LAUNCHED_ENV, None)
    info = preemption.read_marker(config.train.run_dir)
    if info is not None:
        if signals.received:  # the signal this launcher got, not the SIGUSR1 it passed on
            info["signal"] = preemption.signal_name(signals.received)
            preemption.write_marker(config.train.run_dir, info)
        print(f"meshtrain {task}: {preemption.summary(info)}", file=sys.stderr, flush=True)
        return preemption.PREEMPTED_EXIT
    return 0


LOOPBACK_RENDEZVOUS = "meshtrain-loopback"
"""The rendezvous of local workers: torch elastic's static one (one node, the store reused by
every restart of the workers), whose store listens on ``127.0.0.1`` only."""


def register_loopback_rendezvous() -> str:
    """Register :data:`LOOPBACK_RENDEZVOUS` with torch elastic (idempotent); returns its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _create_loopback_rendezvous)
    return LOOPBACK_RENDEZVOUS


def _create_loopback_rendezvous(params):
    """torch elastic's handler creator for :data:`LOOPBACK_RENDEZVOUS` (one node, rank 0)."""
    host, port = loopback.split_address(params.endpoint)
    timeout = int(params.config.get("timeout", 900))
    return _loopback_rendezvous_class()(host, port, 0, 1, params.run_id, timeout)


@functools.cache
def _loopback_rendezvous_class():
    """The handler class (built on first use, so that importing this module loads no torch)."""
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        """torch's static rendezvous with its store on a loopback socket."""

        def get_backend(self) -> str:
            return LOOPBACK_RENDEZVOUS

        def next_rendezvous(self):
            if self._store is None:
                self._store = loopback.loopback_store(
                    self.master_port, self.world_size, self.timeout, multi_tenant=True)
            return RendezvousInfo(PrefixStore(self.run_id, self._store), self.rank,
                                  self.world_size,
                                  RendezvousStoreInfo(loopback.LOOPBACK, self.master_port))

    return LoopbackRendezvous


def restart_budget(config: Config) -> int:
    """Restarts torch elastic may make: ``train.max_restarts`` after failures, plus
    ``parallel.replan_max`` relaunches at a re-planned layout when ``replan_every`` is on
    (:mod:`meshtrain.replan.on_measurement`), so that those do not use up the failures' budget."""
    extra = config.parallel.replan_max if config.parallel.replan_every else 0
    return config.train.max_restarts + extra


def _forward_first(signum: int) -> None:
    """The launcher's first SIGTERM/SIGUSR1: pass it to the workers, and say what happens."""
    pids = preemption.forward_to_workers(signum)
    print(f"meshtrain: {preemption.signal_name(signum)} received; passed on to the {len(pids)} "
          f"worker(s): they finish their step, save a checkpoint and stop (a second signal "
          f"stops them at once)", file=sys.stderr, flush=True)


def _failure_text(message) -> str:
    """The one-line message of a torch elastic ``ProcessFailure``."""
    if isinstance(message, dict):
        return str(message.get("message", ""))
    return message if isinstance(message, str) else ""
