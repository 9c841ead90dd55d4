"""Preemption without loss: SIGTERM/SIGUSR1 stop a run after a step, with a checkpoint of it.

``meshtrain train`` runs as a child process here (the signals go to it, not to pytest). The
signal is sent once ``metrics.jsonl`` shows a few steps; the run stops a step or two later,
wherever the ranks agree, and a resumed run must continue the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain import faults
from meshtrain.training import preemption
from tests.integration.test_reliability import TINY

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def command(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "meshtrain", "train", "--run-dir", str(run_dir), *TINY,
            "--steps", str(STEPS), "--set", "train.eval_every=0", *args]


def environment(fault: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.pop(faults.ENV_VAR, None)
    if fault:
        env[faults.ENV_VAR] = fault
    return env


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def start(run_dir: Path, *args: str, fault: str = "") -> subprocess.Popen:
    """Start ``meshtrain train``; its stdout and stderr are read together."""
    return subprocess.Popen(command(run_dir, *args), env=environment(fault), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 120):
    """Wait until ``metrics.jsonl`` shows ``step`` (the run is in its training loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in metrics(run_dir)):
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended early ({proc.returncode}): {proc.communicate()[0]}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout} s")


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    """Wait for the run: its exit status and its output."""
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def run(run_dir: Path, *args: str) -> tuple[int, str]:
    return finish(start(run_dir, *args))


def worker_of_rank(launcher_pid: int, rank: int) -> int:
    """The pid of the launcher's worker whose ``RANK`` is ``rank``."""
    for pid in preemption.worker_pids(launcher_pid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under {launcher_pid}")


def test_sigterm_to_launcher_saves_the_step_and_resume_matches(tmp_path):
    """tp 2, checkpoints every 1000 steps: SIGTERM to ``meshtrain train`` mid-run saves a
    checkpoint of the step where the ranks stop, exits 75 saying "preempted", and
    ``checkpoint.resume = auto`` continues with the losses of an uninterrupted run."""
    layout = ("--nproc", "2", "--set", "parallel.tp=2", "--set", "checkpoint.every=1000")
    status, err = run(tmp_path / "clean", *layout)
    assert status == 0, err
    proc = start(tmp_path / "cut", *layout)
    wait_for_step(proc, tmp_path / "cut", 3)
    proc.send_signal(signal.SIGTERM)
    status, err = finish(proc)
    assert status == preemption.PREEMPTED_EXIT, err
    assert "SIGTERM received; passed on to the 2 worker(s)" in err
    stopped = metrics(tmp_path / "cut")[-1]["step"]
    assert 3 <= stopped < STEPS
    assert f"preempted by SIGTERM after step {stopped}: checkpoint saved to" in err
    assert "Traceback" not in err
    checkpoints = tmp_path / "cut" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == [f"step_{stopped:08d}"]
    assert (checkpoints / f"step_{stopped:08d}" / "manifest.json").is_file()
    assert not (tmp_path / "cut" / "final").exists()  # not finished: no final weights
    marker = json.loads((tmp_path / "cut" / "preempted.json").read_text())
    assert marker["step"] == stopped and marker["signal"] == "SIGTERM"
    status, err = run(tmp_path / "cut", *layout, "--set", "checkpoint.resume=auto")
    assert status == 0, err
    assert f"resumed from {checkpoints / f'step_{stopped:08d}'} at step {stopped}" in err
    clean, resumed = metrics(tmp_path / "clean"), metrics(tmp_path / "cut")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in clean], abs=1e-6)
    assert not (tmp_path / "cut" / "preempted.json").exists()  # the launcher cleared it


def test_sigusr1_to_one_worker_stops_every_rank_at_one_step_without_checkpoint_config(tmp_path):
    """No checkpoint settings at all (``checkpoint.every = 0``): SIGUSR1 to rank 1's worker
    alone (as a scheduler signalling one task would) stops both ranks after the same step and
    saves it under RUN_DIR/checkpoints."""
    proc = start(tmp_path, "--nproc", "2")
    wait_for_step(proc, tmp_path, 3)
    os.kill(worker_of_rank(proc.pid, 1), signal.SIGUSR1)
    status, err = finish(proc)
    assert status == preemption.PREEMPTED_EXIT, err
    stopped = metrics(tmp_path)[-1]["step"]
    assert stopped < STEPS
    saved = tmp_path / "checkpoints" / f"step_{stopped:08d}"
    assert f"preempted by SIGUSR1 after step {stopped}: checkpoint saved to {saved}" in err
    assert (saved / "manifest.json").is_file()


def test_sigterm_to_a_one_process_run(tmp_path):
    """One process, no launcher in between (as each task of an ``srun`` step): the worker itself
    stops after the step, saves it and exits 75."""
    proc = start(tmp_path, "--nproc", "1", "--steps", "200")  # its steps are fast: room to stop
    wait_for_step(proc, tmp_path, 2)
    proc.send_signal(signal.SIGTERM)
    status, out = finish(proc)
    assert status == preemption.PREEMPTED_EXIT, out
    stopped = metrics(tmp_path)[-1]["step"]
    assert "SIGTERM received: stopping after this step with a checkpoint" in out
    assert f"preempted by SIGTERM after step {stopped}: checkpoint saved to" in out
    assert (tmp_path / "checkpoints" / f"step_{stopped:08d}" / "manifest.json").is_file()


def test_second_signal_stops_at_once(tmp_path):
    """Two SIGTERMs: the second stops the job at once with 128 + 15 and saves nothing."""
    # Step 3 takes 1000 times its compute: both signals land in it (steps 1-2 run at full
    # speed, so the test does not wait through slowed warm-up steps).
    slow = "slow:rank=0:factor=1000:step=3,slow:rank=1:factor=1000:step=3"
    proc = start(tmp_path, "--nproc", "2", fault=slow)
    wait_for_step(proc, tmp_path, 2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # two pending signals of one kind would be delivered once
    proc.send_signal(signal.SIGTERM)
    status, err = finish(proc, timeout=60)
    assert status == 128 + signal.SIGTERM, err
    assert "second signal (SIGTERM): stopping at once" in err
    assert "a second SIGTERM stopped the run at once" in err
    assert not (tmp_path / "checkpoints").exists()


def test_stop_signals_note_the_first_and_raise_on_the_second():
    seen = []
    with preemption.StopSignals(on_first=seen.append, exit_on_second=False, quiet=True) as sig:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert sig.received == signal.SIGUSR1 and seen == [signal.SIGUSR1]
        with pytest.raises(preemption.StoppedAtOnce) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs here
    assert stopped.value.exit_status == 143
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # restored
