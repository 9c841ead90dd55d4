"""A checkpoint written by the previous release resumes under this one.

``tests/data/previous-release-run`` holds the step-3 checkpoint of a one-process run written by
an earlier release (``expected.json`` says which and with what command), and the losses and
gradient norms that release produced when it resumed that checkpoint for two more steps. This
release must resume it to the same numbers: the checkpoint format, the data position and the RNG
state it carries all still mean what they meant. Same layout: the same arithmetic in the same
order, so the tolerance is fp32 round-off only (1e-6 relative); across a layout change (dp 2)
the reduction order differs, so 1e-5.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "previous-release-run"


@pytest.mark.parametrize("nproc,layout,rtol", [(1, [], 1e-6), (2, ["parallel.dp=2"], 1e-5)],
                         ids=["same-layout", "dp2"])
def test_a_previous_release_checkpoint_resumes_to_its_numbers(tmp_path, nproc, layout, rtol):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    resumed = expected["resumed_by_that_release"]
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE / "checkpoints", run_dir / "checkpoints")
    sets = expected["command"].split("--set ")[1:]
    args = [sys.executable, "-m", "meshtrain", "train", "--nproc", str(nproc), "--steps",
            str(resumed["steps"]), "--run-dir", str(run_dir), "--set", "checkpoint.resume=auto"]
    for item in [s.strip() for s in sets] + layout:
        args += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: r for r in rows}
    assert sorted(got) == [r["step"] for r in resumed["rows"]], "did not resume at step 4"
    for want in resumed["rows"]:
        assert got[want["step"]]["loss"] == pytest.approx(want["loss"], rel=rtol)
        assert got[want["step"]]["grad_norm"] == pytest.approx(want["grad_norm"], rel=rtol)
