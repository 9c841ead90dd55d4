"""``docs/guide.md`` runs: every ``sh`` block of the guide, in order, as a user would type it.

The blocks run one after another, each in its own ``bash -e``, from one empty directory, with
this checkout's meshtrain first on ``PATH`` (``meshtrain``, ``python`` and ``torchrun`` are small
wrappers around this interpreter). There is no ``sbatch`` on ``PATH``, so the SLURM block takes
its path for a machine without SLURM; then that block runs again through stand-ins for ``sbatch``
and ``srun`` that start the batch script and its tasks on this machine with the variables SLURM
sets for a one-node job, as ``test_slurm.py`` does by hand, and the comparison block after it
again. A block that exits non-zero fails the test with its text and output; afterwards the files
and outputs the guide promises are checked.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
BLOCK_TIMEOUT_S = 300

_WRAPPERS = {
    "meshtrain": '#!/bin/sh\nexec "{python}" -m meshtrain "$@"\n',
    "python": '#!/bin/sh\nexec "{python}" "$@"\n',
    "torchrun": '#!/bin/sh\nexec "{python}" -m torch.distributed.run "$@"\n',
}

_SBATCH = '''#!{python}
"""Stand-in for sbatch on one node: run the script here, with a batch job's SLURM variables."""
import os, re, socket, subprocess, sys

args = sys.argv[1:]
wait = False
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag not in ("--wait", "-W"):
        sys.exit(f"sbatch stand-in: unsupported option {{flag}}")
    wait = True
script = args[0]
options = dict(re.findall(r"^#SBATCH\\s+--([\\w-]+)=(\\S+)", open(script).read(), re.M))
if int(options.get("nodes", "1")) != 1:
    sys.exit("sbatch stand-in: one node only")
tasks = options.get("ntasks-per-node", options.get("ntasks", "1"))


def free_job_id():
    """A job id whose derived port (20000 + id mod 10000, meshtrain's default) is free."""
    for job in range(4321, 14321, 37):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", 20000 + job % 10000))
            except OSError:
                continue
        return str(job)
    sys.exit("sbatch stand-in: no free port")


job = free_job_id()
env = dict(os.environ, SLURM_JOB_ID=job, SLURM_JOBID=job,
           SLURM_JOB_NAME=options.get("job-name", script), SLURM_PROCID="0", SLURM_LOCALID="0",
           SLURM_NODEID="0", SLURM_NTASKS=tasks, SLURM_NPROCS=tasks, SLURM_NNODES="1",
           SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost", SLURM_NODELIST="localhost",
           SLURM_TASKS_PER_NODE=tasks, SLURM_NTASKS_PER_NODE=tasks,
           SLURM_CPUS_PER_TASK=options.get("cpus-per-task", "1"), SLURM_SUBMIT_DIR=os.getcwd(),
           SLURMD_NODENAME="localhost")
output = options.get("output", "slurm-%j.out").replace("%j", job)
print(f"Submitted batch job {{job}}", flush=True)
with open(output, "w") as out:
    code = subprocess.run(["bash", script], env=env, stdout=out,
                          stderr=subprocess.STDOUT).returncode
if code:
    sys.stderr.write(open(output).read())
sys.exit(code if wait else 0)
'''

_SRUN = '''#!{python}
"""Stand-in for srun inside the sbatch stand-in: SLURM_NTASKS tasks of one step, on this host."""
import os, subprocess, sys

tasks = int(os.environ["SLURM_NTASKS"])
step = dict(SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_STEP_NUM_TASKS=str(tasks),
            SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="localhost",
            SLURM_STEP_TASKS_PER_NODE=str(tasks), SLURM_LAUNCH_NODE_IPADDR="127.0.0.1")
procs = [subprocess.Popen(sys.argv[1:], env=dict(os.environ, **step, SLURM_PROCID=str(rank),
                                                 SLURM_LOCALID=str(rank)))
         for rank in range(tasks)]
codes = [proc.wait() for proc in procs]
sys.exit(next((code for code in codes if code), 0))
'''

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
_SUITE_VARS = ("MESHTRAIN_REUSE_WORKERS", "MESHTRAIN_P2P_SEMANTICS")


def guide_blocks(text: str) -> list[tuple[int, str]]:
    """The guide's ``sh`` blocks, each with the line its fence opens on."""
    blocks = []
    for match in re.finditer(r"^```sh\n(.*?)^```$", text, re.M | re.S):
        blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


def _install_tools(bin_dir: Path, tools: dict[str, str]) -> None:
    bin_dir.mkdir()
    for name, template in tools.items():
        path = bin_dir / name
        path.write_text(template.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _user_env(*bin_dirs: Path) -> dict[str, str]:
    """This environment as a user's shell would have it: no SLURM or torchrun job, none of the
    test suite's own settings, this checkout importable and its tools first on PATH."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SLURM_") and key not in _LAUNCHER_VARS + _SUITE_VARS}
    env["PATH"] = os.pathsep.join([*map(str, bin_dirs), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    return env


def run_doc_blocks(doc: Path, work: Path, env: dict[str, str],
                   only=lambda block: True) -> list[tuple[str, str]]:
    """Run every ``sh`` block of ``doc`` (those ``only`` accepts) in order, each in its own
    ``bash -e`` from ``work``; returns ``(block, output)`` of each, failing the test at the first
    block that fails."""
    outputs = []
    for line, block in guide_blocks(doc.read_text()):
        if not only(block):
            continue
        try:
            run = subprocess.run(["bash", "-e", "-c", block], cwd=work, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            pytest.fail(f"{doc.name} block at line {line} ran past {BLOCK_TIMEOUT_S} s:\n"
                        f"{block}\n--- output ---\n{error.output}")
        if run.returncode != 0:
            pytest.fail(f"{doc.name} block at line {line} exited {run.returncode}:\n{block}"
                        f"\n--- output ---\n{run.stdout}")
        outputs.append((block, run.stdout))
    return outputs


def test_sh_blocks_are_found():
    blocks = [block for _, block in guide_blocks(GUIDE.read_text())]
    for command in ("meshtrain prepare", "meshtrain estimate", "meshtrain plan",
                    "meshtrain train --config tiny.toml --nproc 2", "torchrun", "sbatch",
                    "checkpoint.resume=auto", "meshtrain convert --to-hf", "meshtrain generate"):
        assert any(command in block for block in blocks), command


def _curves(comparison_output: str) -> list[list[float]]:
    return [ast.literal_eval(line.split(":", 1)[1].strip())
            for line in comparison_output.splitlines()]


def test_guide_runs(tmp_path):
    work, bin_dir, slurm_dir = tmp_path / "work", tmp_path / "bin", tmp_path / "slurm-bin"
    work.mkdir()
    _install_tools(bin_dir, _WRAPPERS)
    outputs = run_doc_blocks(GUIDE, work, _user_env(bin_dir))
    assert "sbatch" not in "".join(p.name for p in bin_dir.iterdir())
    assert sorted(p.name for p in work.glob("slurm-*.out")) == ["slurm-local-0.out",
                                                                "slurm-local-1.out"]

    assert (work / "prepared" / "meta.json").is_file()
    records = [json.loads(r) for r in (work / "runs/tiny/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))  # resumed twice, each step once
    assert [r["step"] for r in records if "eval_loss" in r] == [10, 20, 30, 40]
    assert json.loads((work / "runs/tiny/config.json").read_text())["parallel"]["tp"] == 2
    for run_dir in ("runs/torchrun", "runs/slurm"):
        assert (work / run_dir / "final" / "model.safetensors.index.json").is_file(), run_dir
    hf = work / "hf-tiny"
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))

    by_command = {command: out for block, out in outputs for command in
                  ("meshtrain generate", "held-out loss", 'for run in ("runs/tiny"')
                  if command in block}
    assert by_command["meshtrain generate"].startswith("def ")
    assert by_command["held-out loss"].count("held-out loss") == 2
    curves = _curves(by_command['for run in ("runs/tiny"'])
    assert len(curves) == 3
    for curve in curves[1:]:  # the same layout under three launchers: the same losses
        assert curve == pytest.approx(curves[0], abs=1e-3)

    # The SLURM block again, now through the sbatch and srun stand-ins.
    shutil.rmtree(work / "runs" / "slurm")
    for log in work.glob("slurm-*.out"):
        log.unlink()
    _install_tools(slurm_dir, {"sbatch": _SBATCH, "srun": _SRUN})
    again = run_doc_blocks(GUIDE, work, _user_env(slurm_dir, bin_dir),
                           only=lambda block: "sbatch" in block or 'for run in ("runs' in block)
    assert "Submitted batch job" in again[0][1] and not list(work.glob("slurm-local-*"))
    assert _curves(again[1][1]) == curves


def test_comparison_without_a_run_explains_itself(tmp_path):
    """The comparison block in a directory where no run was made: a line per missing run, no
    traceback."""
    bin_dir = tmp_path / "bin"
    _install_tools(bin_dir, _WRAPPERS)
    outputs = run_doc_blocks(GUIDE, tmp_path, _user_env(bin_dir),
                             only=lambda block: 'for run in ("runs' in block)
    assert outputs[0][1].count("has no metrics.jsonl: run its section above first") == 3
    assert "Traceback" not in outputs[0][1]
