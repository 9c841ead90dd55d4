"""``parallel.replan_every``: a run that measures a slow axis relaunches once at a faster layout.

Four CPU processes train dp 2 x tp 2 under meshtrain's own launcher. With every tp collective
delayed by 20 ms (the ``slow_axis`` fault, a slow tp link), the measurement of steps 2-4 makes
the planner price tp-free layouts far faster: the workers checkpoint step 4, exit 76, and the
launcher restarts them at the new layout, which finishes steps 5-8. The layout does not change
the maths (same global batch, same data order), so every loss must match a run that stayed at
dp 2 x tp 2 — the same command without the fault and with ``replan_gain = 0.99``, which logs
"keep" and never relaunches. fp32 on CPU: the losses differ only by summation order (tp's
partial sums, dp's reduction), far below the 1e-4 asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain import faults
from meshtrain.replan import on_measurement as replan
from tests.integration.test_reliability import TINY

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
ARGS = ["--nproc", "4", "--steps", str(STEPS), "--set", "train.eval_every=0",
        "--set", "parallel.tp=2", "--set", "parallel.replan_every=3",
        "--set", "checkpoint.every=100", "--set", "train.precision=fp32",
        "--set", "train.collective_timeout_s=60"]


def _train(run_dir: Path, *extra: str, fault: str = "") -> tuple[int, str, list[dict]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               MESHTRAIN_PROFILE=str(run_dir / "no-profile.json"))  # the built-in CPU figures
    env.pop(faults.ENV_VAR, None)
    if fault:
        env[faults.ENV_VAR] = fault
    done = subprocess.run([sys.executable, "-m", "meshtrain", "train", "--run-dir", str(run_dir),
                           *TINY, *ARGS, *extra], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if done.returncode == 0 else []
    return done.returncode, done.stderr, [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """The run at dp 2 x tp 2 throughout (no slow axis; a gain no layout offers)."""
    return _train(tmp_path_factory.mktemp("kept"), "--set", "parallel.replan_gain=0.99")


def test_slow_axis_changes_the_layout_once_logs_why_and_keeps_the_losses(tmp_path, kept):
    status, err, records = _train(tmp_path, fault="slow_axis:axis=tp:ms=20")
    assert status == 0, err
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    decided = records[3]["replan"]
    assert decided["decision"] == "relaunch" and decided["after_step"] == 4
    assert decided["measured_s"]["tp"] > 5 * decided["measured_s"]["compute"]
    assert decided["to"]["tp"] == 1 and decided["gain"] > 0.10
    assert err.count("Decision: relaunch with it") == 1
    assert "measured per step: compute" in err and "tp 0." in err
    assert "stopping with exit status 76 to relaunch at dp=" in err
    assert "Traceback" not in err
    change = records[4]["layout"]  # the new layout's first line
    assert change["reason"] == "replan" and change["to"]["tp"] == 1
    assert change["from"]["tp"] == 2 and "predicted" in change["how"]
    assert [r["restarts"] for r in records] == [0] * 4 + [1] * 4
    assert not any("replan" in r for r in records[4:])  # once per run: no second measurement
    saved = json.loads((tmp_path / "checkpoints" / replan.DECISION_FILE).read_text())
    assert saved["replans"] == 1 and saved["checkpoint"].endswith("step_00000004")
    _, _, reference = kept
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference],
                                                         abs=1e-4)


def test_without_a_gain_worth_it_the_run_keeps_its_layout(kept):
    """The reference run of the test above (its fixture, already run): logs "keep", no
    relaunch."""
    status, err, records = kept
    assert status == 0, err
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    decided = records[3]["replan"]
    assert decided["decision"] == "keep" and "parallel.replan_gain = 0.99" in decided["why"]
    assert "Decision: keep the layout" in err and "exit status 76" not in err
    assert all(r["restarts"] == 0 for r in records) and "layout" not in records[4]
