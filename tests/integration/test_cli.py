"""The ``meshtrain`` command end to end, as a user runs it (subprocesses, real exit codes).

The refusals (bad input, exit status 2) are many short commands: they run in one subprocess
together (:func:`meshtrain_many`), each through ``meshtrain.cli.main`` as ``python -m meshtrain``
calls it, so that each does not pay for an interpreter and a ``torch`` import of its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

TINY = ["--set", "model.dim=64", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.ffn_dim=128", "--set", "data.max_bytes=400000"]


def meshtrain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], capture_output=True,
                          text=True, timeout=timeout)


_MANY = """
import contextlib, io, json, sys, traceback
from meshtrain.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            traceback.print_exc()
            code = None
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def meshtrain_many(*commands: list[str], timeout: float = 300) -> list[dict]:
    """Run several ``meshtrain`` commands one after another in one fresh interpreter; each
    one's ``returncode`` (None where it raised: its traceback is in ``stderr``), ``stdout`` and
    ``stderr``."""
    done = subprocess.run([sys.executable, "-c", _MANY, json.dumps(list(commands))],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_loss_falls_and_generate(tmp_path):
    run = meshtrain("train", "--steps", "40", "--run-dir", str(tmp_path), *TINY,
                    "--set", "train.warmup_steps=5")
    assert run.returncode == 0, run.stderr
    records = _metrics(tmp_path)
    assert len(records) == 40
    for key in ("step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s",
                "mfu", "comm_bytes", "mem"):
        assert key in records[-1]
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < 0.8 * first, (first, last)

    gen = meshtrain("generate", "--checkpoint", str(tmp_path), "--prompt", "def ",
                    "--max-new-tokens", "20")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def ")


BAD_TRAIN = [
    (["--set", "parallel.bogus=1"], "parallel.bogus"),
    (["--set", "model.dim=64", "--set", "model.n_heads=3"], "n_heads"),
    (["--set", "parallel.zero=7"], "ZeRO stage"),
    (["--config", "/nonexistent.toml"], "does not exist"),
    (["--nproc", "3", "--set", "parallel.dp=2"], "--nproc"),
    (["--set", "parallel.tp=3"], "Valid tp for this model: 1, 2, 4, 8"),
    (["--set", "parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
]
BAD_VERIFY = [
    (["--nproc", "4", "--set", "train.global_batch=6"], "not divisible"),
    (["--nproc", "2", "--set", "parallel.microbatches=3", "--set", "train.global_batch=8"],
     "not divisible"),
    (["--set", "parallel.zero=-1"], "ZeRO stage"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Every bad ``train`` and ``verify`` command of the tests below, run in one subprocess:
    ``{("train", i): (run_dir, result), ("verify", i): (None, result)}``."""
    run_dirs = [tmp_path_factory.mktemp("bad-train") for _ in BAD_TRAIN]
    commands = [["train", "--run-dir", str(run_dir), *args]
                for run_dir, (args, _) in zip(run_dirs, BAD_TRAIN, strict=True)]
    commands += [["verify", *args] for args, _ in BAD_VERIFY]
    results = meshtrain_many(*commands)
    out = {("train", i): (run_dir, results[i]) for i, run_dir in enumerate(run_dirs)}
    out.update({("verify", i): (None, results[len(BAD_TRAIN) + i])
                for i in range(len(BAD_VERIFY))})
    return out


@pytest.mark.parametrize("case", range(len(BAD_TRAIN)),
                         ids=[fragment for _, fragment in BAD_TRAIN])
def test_bad_input_exits_2_without_traceback(refusals, case):
    run_dir, run = refusals[("train", case)]
    assert run["returncode"] == 2, run
    assert BAD_TRAIN[case][1] in run["stderr"]
    assert "Traceback" not in run["stderr"]
    assert not (run_dir / "metrics.jsonl").exists()


def test_generate_without_weights_exits_2(tmp_path):
    run = meshtrain("generate", "--checkpoint", str(tmp_path), "--prompt", "x")
    assert run.returncode == 2 and "Traceback" not in run.stderr


def test_two_local_workers_through_launcher(tmp_path):
    run = meshtrain("train", "--nproc", "2", "--steps", "3", "--run-dir", str(tmp_path), *TINY,
                    "--set", "train.global_batch=4", "--set", "train.seq_len=32")
    assert run.returncode == 0, run.stderr
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["tokens"] == 4 * 32
    assert records[0]["comm_bytes"]["dp"] > 0
    assert "data-parallel gradients reduce through shared memory (2 ranks" in run.stderr


def test_verify_json_zero3_two_processes():
    run = meshtrain("verify", "--nproc", "2", "--steps", "3", "--json", *TINY,
                    "--set", "parallel.zero=3", "--set", "train.global_batch=4",
                    "--set", "train.seq_len=32")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    for key in ("max_abs_loss_diff", "max_abs_grad_norm_diff", "tolerance", "ok",
                "layout_losses", "reference_losses"):
        assert key in report
    assert report["ok"] is True and len(report["layout_losses"]) == 3
    assert report["max_abs_loss_diff"] <= report["tolerance"]
    grads = report["gradients"]  # every parameter's step-1 gradient, gathered from ZeRO-3 shards
    assert grads["ok"] and grads["parameters"] == 2 * 9 + 3 and not grads["failures"]
    assert grads["max_rel_diff"] <= grads["grad_rtol"] == 1e-5


@pytest.mark.parametrize("case", range(len(BAD_VERIFY)),
                         ids=[fragment for _, fragment in BAD_VERIFY])
def test_verify_bad_layout_exits_2(refusals, case):
    _, run = refusals[("verify", case)]
    assert run["returncode"] == 2, run
    assert BAD_VERIFY[case][1] in run["stderr"] and "Traceback" not in run["stderr"]


def test_verify_mismatch_exits_1():
    # A real mismatch: a bf16 layout is compared with the exact fp32 one-process reference, and
    # at fp32's loss tolerance (2e-4) its rounding (~1e-2 after a few steps) fails the check.
    run = meshtrain("verify", "--nproc", "2", "--steps", "3", *TINY,
                    "--set", "train.global_batch=4", "--set", "train.seq_len=32",
                    "--set", "train.precision=bf16", "--tolerance", "2e-4")
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert "bf16) vs one process" in run.stdout
    verdict = run.stdout.strip().splitlines()[-1]
    found = re.search(r"max \|loss diff\| (\S+) \(tolerance 2\.0e-04\).*: MISMATCH$", verdict)
    assert found, run.stdout
    assert float(found.group(1)) > 2e-4
