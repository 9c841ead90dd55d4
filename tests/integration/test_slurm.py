"""``meshtrain train`` under SLURM, with the environment variables SLURM sets.

- In an ``sbatch`` batch script (one task: ``SLURM_PROCID=0``, the allocation's
  ``SLURM_NTASKS``, no ``srun`` step variables) ``--nproc 2`` spawns its 2 local workers.
- Under ``srun`` with 2 tasks each task joins as rank ``SLURM_PROCID``; ``MASTER_ADDR`` comes
  from ``SLURM_NODELIST`` (``localhost`` here) and ``MASTER_PORT`` from ``SLURM_JOB_ID``.
Both runs are dp 2 on the same data, so they must train to the same losses (fp32, same
reduction order: 1e-6).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.run import launch

ARGS = ["--steps", "2", "--set", "model.dim=32", "--set", "model.n_layers=2",
        "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64",
        "--set", "train.seq_len=16", "--set", "train.global_batch=4",
        "--set", "train.warmup_steps=0", "--set", "data.max_bytes=200000",
        "--set", "train.collective_timeout_s=120", "--set", "train.threads_per_worker=1"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in _TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_job_id() -> str:
    """A SLURM_JOB_ID whose derived port (20000 + id mod 10000) is free on loopback now."""
    for job in range(4321, 14321, 37):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", 20000 + job % 10000))
            except OSError:
                continue
        return str(job)
    pytest.skip("no free port in 20000-29999")


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _batch_env(job: str) -> dict[str, str]:
    env = _clean_env()
    env.update(SLURM_JOB_ID=job, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_NTASKS="2", SLURM_NPROCS="2", SLURM_NNODES="1",
               SLURM_JOB_NODELIST="localhost", SLURM_NODELIST="localhost",
               SLURM_TASKS_PER_NODE="2", SLURM_CPUS_ON_NODE="2", SLURMD_NODENAME="localhost")
    return env


def _srun_env(job: str, rank: int, tasks: int) -> dict[str, str]:
    env = _batch_env(job)
    env.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(tasks),
               SLURM_NPROCS=str(tasks), SLURM_STEP_ID="0", SLURM_STEPID="0",
               SLURM_STEP_NUM_TASKS=str(tasks), SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE=str(tasks),
               SLURM_LAUNCH_NODE_IPADDR="127.0.0.1")
    return env


def test_batch_script_spawns_and_srun_tasks_join(tmp_path):
    train = [sys.executable, "-m", "meshtrain", "train"]
    batch = subprocess.run([*train, "--nproc", "2", "--run-dir", str(tmp_path / "batch"), *ARGS],
                           env=_batch_env(_free_job_id()), capture_output=True, text=True,
                           timeout=300)
    assert batch.returncode == 0, batch.stderr[-3000:]

    job = _free_job_id()
    tasks = [subprocess.Popen([*train, "--run-dir", str(tmp_path / "srun"), *ARGS],
                              env=_srun_env(job, rank, 2), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = []
    try:
        for task in tasks:
            outputs.append(task.communicate(timeout=300)[0])
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
    assert [task.returncode for task in tasks] == [0, 0], "\n".join(outputs)[-3000:]
    assert sum(out.count("step     2/2") for out in outputs) == 1  # only rank 0 logs
    spawned, joined = _losses(tmp_path / "batch"), _losses(tmp_path / "srun")
    assert len(joined) == 2
    assert joined == pytest.approx(spawned, abs=1e-6)


@pytest.mark.parametrize("nodelist, host", [
    ("localhost", "localhost"), ("gpu[03-05,09]", "gpu03"), ("gpu7,gpu[1-2]", "gpu7"),
    ("a[1,4]b", "a1"), ("node[0012-0014]", "node0012")])
def test_first_slurm_host(nodelist, host):
    assert launch.first_slurm_host(nodelist) == host


def test_batch_script_env_is_not_a_job_to_join(monkeypatch):
    env = _batch_env("77")
    env["SLURM_NTASKS"] = "16"  # #SBATCH --ntasks=16: still the batch script
    monkeypatch.setattr(os, "environ", env)  # a plain dict, restored after the test
    assert not launch.in_existing_job()
    assert launch.job_world_size() == 1 and launch.job_rank() == 0
    env["SLURM_STEP_ID"] = "4294967294"  # the batch step's id on some versions
    assert not launch.in_existing_job()


def test_srun_env_joins_with_derived_address(monkeypatch):
    env = _srun_env("123456", 3, 4)
    env["SLURM_STEP_NODELIST"] = "node[07-08]"
    monkeypatch.setattr(os, "environ", env)  # a plain dict, restored after the test
    assert launch.in_existing_job()
    assert launch.job_world_size() == 4 and launch.job_rank() == 3
    launch.adopt_slurm_environment()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == \
        ("3", "4", "3")
    assert os.environ["MASTER_ADDR"] == "node07"
    assert os.environ["MASTER_PORT"] == str(20000 + 123456 % 10000)
