"""Offload end to end (``meshtrain train``, docs/offload.md): a run killed mid-way resumes exactly,
refusals exit 2 before any worker, and (slow) the peak resident memory of every worker, measured
from outside, halves for a model whose states dominate it.

The launcher runs in this process (``cli.main``) for the kill test, as in test_reliability.py;
the memory test runs ``meshtrain train`` in a subprocess and reads each worker's ``VmHWM``
(:mod:`meshtrain.commands.bench.memory_peak`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtrain import faults
from meshtrain.cli import main
from meshtrain.commands.bench.memory_peak import measure_train_peaks

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64", "--set", "train.seq_len=16",
        "--set", "train.global_batch=4", "--set", "train.warmup_steps=0",
        "--set", "data.max_bytes=200000", "--set", "train.lr=1e-2"]
ZERO3 = ["--nproc", "2", "--set", "parallel.zero=3"]
OFFLOAD = ["--set", "parallel.offload=optimizer+params", "--set", "parallel.offload_device=nvme",
           "--set", "parallel.offload_chunk_mb=0.001"]
MIB = 2**20


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_killed_offloaded_run_resumes_exactly(tmp_path, monkeypatch, capfd):
    """dp 2 ZeRO-3 with parameters and optimizer on nvme, checkpoints every 2 steps, rank 1
    SIGKILLed at the start of step 5: the job restarts from step 4 and its six losses equal,
    bit for bit, those of the same run uninterrupted and of the run without offload; the
    killed processes left no file in the offload directories."""
    def train(run_dir: Path, *more: str) -> int:
        return main(["train", "--run-dir", str(run_dir), "--steps", "6", *TINY, *ZERO3, *more])

    assert train(tmp_path / "plain") == 0, capfd.readouterr().err
    assert train(tmp_path / "clean", *OFFLOAD) == 0, capfd.readouterr().err
    monkeypatch.setenv(faults.ENV_VAR, "kill:rank=1:step=5")
    faults.reset()
    try:
        status = train(tmp_path / "killed", *OFFLOAD, "--set", "checkpoint.every=2",
                       "--max-restarts", "2")
    finally:
        monkeypatch.delenv(faults.ENV_VAR)
        faults.reset()
    err = capfd.readouterr().err
    assert status == 0, err
    assert "restart 1 of at most 2" in err and "resumed from" in err
    killed = [json.loads(line) for line in
              (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["restarts"] for r in killed] == [0, 0, 0, 0, 1, 1]
    assert [r["loss"] for r in killed] == _losses(tmp_path / "clean") == _losses(
        tmp_path / "plain")
    for rank in (0, 1):
        assert list((tmp_path / "killed" / "offload" / f"rank{rank}").iterdir()) == []


@pytest.mark.parametrize("setting, message", [
    (["--set", "parallel.offload=optimizer"], "needs parallel.zero = 1, 2 or 3"),
    (["--set", "parallel.zero=2", "--set", "parallel.offload=optimizer+params"],
     'parallel.offload = "optimizer+params" needs parallel.zero = 3'),
    (["--set", "parallel.zero=1", "--set", "parallel.offload=optimizer", "--set",
      "parallel.offload_overlap=true"], "offload_overlap = true needs"),
    (["--set", "parallel.offload=disk"], 'parallel.offload = "disk" is not valid'),
])
def test_refused_offload_exits_2_naming_the_key(tmp_path, capfd, setting, message):
    status = main(["train", "--run-dir", str(tmp_path / "run"), "--nproc", "2", *TINY,
                   *setting])
    err = capfd.readouterr().err
    assert status == 2 and message in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


#: ~118M parameters, 91 % of them in wide MLPs (ffn 8192 at dim 1024), one 16-token sequence
#: per rank: fp32 master/parameter + gradient + two moments (16 bytes per parameter, 0.94 GB
#: per rank at dp 2 ZeRO-3) dominate the memory, activations are small.
WIDE = ["model.dim=1024", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=0",
        "model.ffn_dim=8192", "train.steps=2", "train.global_batch=2", "train.seq_len=16",
        "train.precision=fp32", "train.warmup_steps=0", "train.log_every=1",
        "checkpoint.every=0", "train.device=cpu", "data.max_bytes=200000", "parallel.dp=2",
        "parallel.zero=3"]


@pytest.mark.slow
def test_offload_halves_each_workers_peak_memory(tmp_path):
    """Every worker's VmHWM (read from /proc by the launcher's poller and an exit hook, over
    init, two steps and the final save) with parameters and optimizer on nvme is at most half
    of the same run's without offload, and the losses are the same. Measured 2026-12-05: about
    582 MiB against 1485 MiB per rank (0.39; the floor is the ~340 MiB of an idle worker)."""
    plain = measure_train_peaks(WIDE, 2, tmp_path / "plain", timeout_s=300)
    offloaded = measure_train_peaks(WIDE + ["parallel.offload=optimizer+params",
                                            "parallel.offload_device=nvme"],
                                    2, tmp_path / "offloaded", timeout_s=300)
    ratios = [a / b for a, b in zip(offloaded["peaks"], plain["peaks"], strict=True)]
    assert max(ratios) <= 0.5, ([round(p / MIB) for p in offloaded["peaks"]],
                                [round(p / MIB) for p in plain["peaks"]])
    assert _losses(tmp_path / "offloaded" / "run") == _losses(tmp_path / "plain" / "run")
