"""One job as two "nodes" on this machine: two torchrun agents that meshtrain joins.

Each agent runs ``python -m meshtrain train`` in 2 processes and the agents meet at one c10d
rendezvous endpoint, exactly as on two real machines. The 4-process job must train to the same
losses as ``meshtrain train --nproc 4`` with the same config (dp 2 × tp 2), and only rank 0 may
write metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.cli import main
from meshtrain.run.launch import free_port

ARGS = ["--steps", "3", "--set", "model.dim=32", "--set", "model.n_layers=2",
        "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64",
        "--set", "train.seq_len=16", "--set", "train.global_batch=4",
        "--set", "train.warmup_steps=0", "--set", "data.max_bytes=200000",
        "--set", "parallel.tp=2", "--set", "train.collective_timeout_s=120"]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(record["step"], record["loss"]) for record in map(json.loads, lines)]


def test_two_torchrun_nodes_match_one_local_launch(tmp_path, capfd):
    port = free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "multinode-test",
             "--local-addr", "127.0.0.1", "-m", "meshtrain", "train",
             "--run-dir", str(tmp_path / "nodes"), *ARGS]
    nodes = [subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=400)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert sum(out.count("step     3/3") for out in outputs) == 1  # only rank 0 logs

    assert main(["train", "--nproc", "4", "--run-dir", str(tmp_path / "local"), *ARGS]) == 0, \
        capfd.readouterr().err
    joined, local = _losses(tmp_path / "nodes"), _losses(tmp_path / "local")
    assert [step for step, _ in joined] == [1, 2, 3]
    assert [loss for _, loss in joined] == pytest.approx([loss for _, loss in local], abs=1e-6)
    config = json.loads((tmp_path / "nodes" / "config.json").read_text())
    assert config["parallel"]["tp"] == 2 and config["parallel"]["dp"] == 2
