"""Replica groups that fail alone (``parallel.replica_fault_tolerance``, torchft).

Real processes: ``meshtrain lighthouse`` and one ``meshtrain train`` per replica group (2 groups
of one process, a tiny model, H = 2). Group 1 SIGKILLs itself at the start of step 5 (the
test-only ``kill`` fault). Group 0 goes on alone: its syncs at steps 6 and 8 have one group
present. It is held at the start of step 9 (the test-only ``hold`` fault) only until the
restarted group 1 says it is joining, so that the restart, which takes seconds to import torch,
comes before the run ends; at the sync after step 10 group 1 heals from group 0's live state and
both finish step 16. Checked: group 0 logged every step, alone between the death and the
rejoin; group 1 logged steps 1–4, then 11–16; and the two groups' final weights are bitwise
identical (both apply the same outer steps from the same state, so no tolerance is needed).

The reference: the same 2 groups inside one 2-process job (``parallel.replicas = 2`` without
fault tolerance, itself tested against synchronous dp in tests/parallel/test_diloco.py). Until
the kill, the mean of the two groups' losses equals its loss at every step, within 1e-6: the
same fp32 pseudo-gradients are summed by gloo and divided by 2 in both, and only the two
groups' losses are averaged in another precision (float64 here, fp32 there; measured
differences 0 and 2.4e-7, one fp32 rounding of a loss near 5).
Skipped when torchft (the ``ft`` extra) is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="torchft is not installed (pip install -e '.[ft]')")

SRC = Path(__file__).resolve().parents[2] / "src"
STEPS, KILL_AT, HOLD_AT = 16, 5, 9
TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=64", "train.seq_len=16", "train.global_batch=8", "train.warmup_steps=0",
        "data.max_bytes=200000", "train.device=cpu", "train.log_every=1", "train.eval_every=0",
        "parallel.replicas=2", "parallel.sync_every=2", "parallel.quorum_timeout_s=240",
        "train.collective_timeout_s=60"]


TLS_HOST = "127.0.0.2"
"""With credentials: the groups' MESHTRAIN_FT_HOST (loopback, but not where their servers listen
behind the TLS fronts)."""


def _env(fault: str = "", tls: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    env.pop("MESHTRAIN_FAULT", None)
    if fault:
        env["MESHTRAIN_FAULT"] = fault
    if tls:
        env["MESHTRAIN_FT_HOST"] = TLS_HOST
    return env


def _wait_for(path: Path, text: str, process: subprocess.Popen, timeout: float) -> str:
    """The line of ``path`` containing ``text``, waiting while ``process`` runs."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        lines = [line for line in path.read_text().splitlines() if text in line] \
            if path.exists() else []
        if lines:
            return lines[0]
        assert process.poll() is None, f"{path.name} ended early:\n{path.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in {path} after {timeout} s")


def _train(tmp: Path, run_dir: str, log: str, sets: list[str], fault: str = "",
           tls: bool = False):
    args = [sys.executable, "-m", "meshtrain", "train", "--steps", str(STEPS),
            "--run-dir", str(tmp / run_dir)]
    for item in sets:
        args += ["--set", item]
    out = open(tmp / log, "w")
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_env(fault, tls),
                            cwd=tmp)


def _group(tmp: Path, index: int, lighthouse: str, log: str, fault: str = "",
           extra: tuple[str, ...] = ()):
    sets = [*TINY, *extra, "parallel.replica_fault_tolerance=true",
            f"parallel.replica_group={index}", f"parallel.lighthouse={lighthouse}"]
    keys = tmp / "keys"
    if keys.is_dir():  # the run's credentials: this group is site index + 1
        sets.append(f"parallel.tls_dir={keys / f'site-{index + 1}'}")
    return _train(tmp, f"group{index}", log, sets, fault, tls=keys.is_dir())


def _lighthouse(tmp: Path, tls: bool = False) -> tuple[subprocess.Popen, str]:
    """A ``meshtrain lighthouse`` on a free loopback port, and its address; with ``tls`` the
    run's credentials are made in ``tmp/keys`` (site 0: the lighthouse) and it serves over
    mutual TLS."""
    extra = []
    if tls:
        from meshtrain.host.credentials import make_run_credentials

        make_run_credentials(tmp / "keys", sites=3)
        extra = ["--tls-dir", str(tmp / "keys" / "site-0")]
    process = subprocess.Popen(
        [sys.executable, "-m", "meshtrain", "lighthouse", "--bind", "127.0.0.1:0",
         "--join-timeout-ms", "500", "--heartbeat-timeout-ms", "1000", *extra],
        stdout=open(tmp / "lighthouse.out", "w"), stderr=subprocess.DEVNULL, env=_env())
    line = _wait_for(tmp / "lighthouse.out", "TORCHFT_LIGHTHOUSE=", process, 120)
    return process, line.split("=", 1)[1]


def _final(run_dir: Path) -> bytes:
    return (run_dir / "final" / "model-00001-of-00001.safetensors").read_bytes()


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tls", [False, True], ids=["loopback", "mutual-tls"])
def test_killed_group_others_go_on_and_it_rejoins_in_sync(tmp_path, tls):
    """Group 0 finishes every step (alone while group 1 is dead); the restarted group 1 heals
    from it and both end with identical weights. ``mutual-tls``: the same with the run's
    credentials, every connection between the groups (lighthouse, stores, manager servers,
    the heal) over mutual TLS."""
    release = tmp_path / "release"
    reference = _train(tmp_path, "reference", "reference.log", TINY)  # both groups, one job
    procs = [reference]
    try:
        lighthouse, address = _lighthouse(tmp_path, tls)
        procs.append(lighthouse)
        survivor = _group(tmp_path, 0, address, "group0.log",
                          fault=f"hold:step={HOLD_AT}:file={release}")
        doomed = _group(tmp_path, 1, address, "group1.log", fault=f"kill:rank=0:step={KILL_AT}")
        procs += [survivor, doomed]
        assert doomed.wait(240) == -9, (tmp_path / "group1.log").read_text()[-3000:]
        # the same run continued in its own run dir (a fresh run there would be refused)
        restarted = _group(tmp_path, 1, address, "group1-restart.log",
                           extra=("checkpoint.resume=auto",))
        procs.append(restarted)
        _wait_for(tmp_path / "group1-restart.log", "joining the others", restarted, 240)
        release.touch()
        for proc, log in ((survivor, "group0.log"), (restarted, "group1-restart.log"),
                          (reference, "reference.log")):
            assert proc.wait(240) == 0, (tmp_path / log).read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "rejoined at step 10" in (tmp_path / "group1-restart.log").read_text()
    survivor_log = _metrics(tmp_path / "group0")
    assert [r["step"] for r in survivor_log] == list(range(1, STEPS + 1))
    present = {r["step"]: r["groups_present"] for r in survivor_log}
    assert present[4] == 2 and present[6] == present[8] == 1 and present[STEPS] == 2, present
    rejoined = _metrics(tmp_path / "group1")
    assert [r["step"] for r in rejoined] == [1, 2, 3, 4, *range(11, 17)]
    together = [(a["loss"] + b["loss"]) / 2
                for a, b in zip(survivor_log[:4], rejoined[:4], strict=True)]
    expected = [r["loss"] for r in _metrics(tmp_path / "reference")[:4]]
    assert together == pytest.approx(expected, abs=1e-6)
    assert _final(tmp_path / "group0") == _final(tmp_path / "group1")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_groups_as_jobs_match_one_job_with_fragments_and_bf16(tmp_path):
    """Without a death, 2 fault-tolerant groups of dp 2 with 2 streaming fragments and bf16
    pseudo-gradients end with the final weights of the same groups inside one 4-process job,
    bitwise: both sum the same bf16 tensors of two groups in gloo and halve them (exact)."""
    extra = ("parallel.dp=2", "parallel.sync_fragments=2", "parallel.outer_grad_dtype=bf16")
    reference = _train(tmp_path, "reference", "reference.log", [*TINY, *extra])
    procs = [reference]
    try:
        lighthouse, address = _lighthouse(tmp_path)
        procs.append(lighthouse)
        groups = [_group(tmp_path, g, address, f"group{g}.log", extra=extra) for g in (0, 1)]
        procs += groups
        for proc, log in ((groups[0], "group0.log"), (groups[1], "group1.log"),
                          (reference, "reference.log")):
            assert proc.wait(300) == 0, (tmp_path / log).read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert _final(tmp_path / "group0") == _final(tmp_path / "group1")
    assert _final(tmp_path / "group0") == _final(tmp_path / "reference")
    assert _metrics(tmp_path / "group0")[-1]["comm_bytes"]["replica"] > 0
