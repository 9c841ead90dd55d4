"""``parallel.elastic``: a job that loses a node goes on, re-planned, on the nodes that remain.

Two torchrun agents on loopback (``--nnodes 1:2``, 2 processes each, c10d rendezvous,
``--max-restarts 3``) train dp 2 × tp 2 with a checkpoint every step. After step 5 the second
agent and its workers are killed for good. The first agent restarts its workers on a world of 2;
meshtrain re-plans the layout for 2 processes with the same global batch, resumes from the newest
checkpoint and finishes every step. Its losses must match an uninterrupted 4-process run: the data
order does not depend on the layout. A second test lets a new node join afterwards: the job
grows back to 4 processes and the configured layout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.run.launch import free_port

STEPS = 12
ARGS = ["--steps", str(STEPS), "--set", "model.dim=32", "--set", "model.n_layers=2",
        "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64",
        "--set", "train.seq_len=16", "--set", "train.global_batch=4",
        "--set", "train.warmup_steps=0", "--set", "data.max_bytes=200000",
        "--set", "train.precision=fp32", "--set", "parallel.dp=2", "--set", "parallel.tp=2",
        "--set", "train.collective_timeout_s=60"]
ELASTIC = ["--set", "parallel.elastic=true", "--set", "checkpoint.every=1",
           "--set", "checkpoint.keep=2"]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torch elastic starts its workers in sessions of their own,
    so killing the agent's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_node(agent: subprocess.Popen) -> None:
    """A lost node: SIGKILL the agent's process group and every worker it started."""
    workers = _descendants(agent.pid)
    os.killpg(agent.pid, signal.SIGKILL)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"the first agent never listened on {port}")


def _agent(port: int, run_dir: Path, steps: int) -> list[str]:
    """One node: a torchrun agent of 2 workers, elastic between 1 and 2 nodes."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
            "--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
            # last_call_timeout: how long the first agent waits for the second one at the start
            # (after that it would start alone), and the wait after the node is lost.
            "--rdzv-conf", "join_timeout=60,last_call_timeout=10,keep_alive_interval=1,"
                           "keep_alive_max_attempt=3",
            "--monitor-interval", "0.2", "--local-addr", "127.0.0.1",
            "-m", "meshtrain", "train", "--run-dir", str(run_dir), *ARGS, *ELASTIC,
            "--steps", str(steps)]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}


def _start_node(agent: list[str], log, env: dict) -> subprocess.Popen:
    """Start one torchrun agent in its own session, its output in ``log``."""
    return subprocess.Popen(agent, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _wait_for(condition, process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline and process.poll() is None, log.read_text()
        time.sleep(0.05)


def test_lost_node_replans_and_matches_uninterrupted_run(tmp_path):
    port = free_port()
    run_dir = tmp_path / "elastic"
    agent = _agent(port, run_dir, STEPS)
    env = ENV
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(3)]
    # The first agent hosts the rendezvous store: it must be the one that survives.
    first = _start_node(agent, logs[0], env)
    nodes = [first]
    try:
        _wait_listening(port)
        nodes.append(_start_node(agent, logs[1], env))
        _wait_for(lambda: any(r["step"] >= 5 for r in _records(run_dir)), first,
                  tmp_path / "agent0.log")
        _kill_node(nodes[1])
        # The uninterrupted reference (a local 4-process run) starts now, while the survivor
        # waits out last_call_timeout for the lost node, instead of after the job.
        nodes.append(_start_node([sys.executable, "-m", "meshtrain", "train", "--nproc", "4",
                                  "--run-dir", str(tmp_path / "local"), *ARGS], logs[2], env))
        first.wait(timeout=300)
        nodes[2].wait(timeout=300)
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill_node(node)
        for log in logs:
            log.close()
    output = (tmp_path / "agent0.log").read_text()
    assert first.returncode == 0, output
    assert "steps on 4 process(es) (dp=2 tp=2 pp=1)" in output, output
    assert "meshtrain: elastic: layout dp=2 tp=2 pp=1 (4 processes) ->" in output, output
    assert "WORLD_SIZE 2 differs from the 4 processes checkpoint step_" in output, output

    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    changed = [r for r in records if "layout" in r]
    assert len(changed) == 1, changed
    change = changed[0]["layout"]
    assert change["from"]["world_size"] == 4 and change["to"]["world_size"] == 2
    assert change["predicted_step_s"] > 0
    resumed = changed[0]["step"]
    assert 2 <= resumed <= STEPS
    assert all(r["restarts"] >= 1 for r in records[resumed - 1:])

    assert nodes[2].returncode == 0, (tmp_path / "agent2.log").read_text()
    local = _records(tmp_path / "local")
    assert [r["step"] for r in local] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records[5:]] == pytest.approx(
        [r["loss"] for r in local[5:]], abs=1e-4)


GROW_STEPS = 40


@pytest.mark.slow
def test_node_back_returns_to_the_configured_layout(tmp_path, capfd):
    """Shrink as above, then a new node joins the running job: torchrun restarts the workers on
    4 processes and meshtrain goes back to the configured dp 2 × tp 2 (about 75 s).

    Growing needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for the agents: with the rendezvous
    store shared with the workers (torch's default), torch's agents wait for each other's keys
    after the new node joins until the rendezvous times out (torch 2.13)."""
    port = free_port()
    run_dir = tmp_path / "elastic"
    agent = _agent(port, run_dir, GROW_STEPS)
    # Slow the 2-process phase (restart 1) down, so that the third node joins while it runs.
    env = {**ENV, "MESHTRAIN_FAULT": "slow:rank=0:factor=20:attempt=1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(3)]
    log0 = tmp_path / "agent0.log"
    first = _start_node(agent, logs[0], env)
    nodes = [first]
    try:
        _wait_listening(port)
        nodes.append(_start_node(agent, logs[1], env))
        _wait_for(lambda: any(r["step"] >= 3 for r in _records(run_dir)), first, log0)
        _kill_node(nodes[1])
        _wait_for(lambda: "(2 processes): WORLD_SIZE 2" in log0.read_text(), first, log0)
        nodes.append(_start_node(agent, logs[2], env))
        first.wait(timeout=300)
        nodes[2].wait(timeout=60)
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill_node(node)
        for log in logs:
            log.close()
    output = log0.read_text() + (tmp_path / "agent2.log").read_text()
    assert first.returncode == 0 and nodes[2].returncode == 0, output
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, GROW_STEPS + 1))
    changes = [r["layout"] for r in records if "layout" in r]
    assert [(c["from"]["world_size"], c["to"]["world_size"]) for c in changes] == \
        [(4, 2), (2, 4)], output
    assert changes[1]["to"]["dp"] == 2 and changes[1]["to"]["tp"] == 2
    assert changes[1]["how"] == "the config's own layout fits"

    assert main(["train", "--nproc", "4", "--run-dir", str(tmp_path / "local"), *ARGS,
                 "--steps", str(GROW_STEPS)]) == 0, capfd.readouterr().err
    local = _records(tmp_path / "local")
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in local], abs=1e-4)
