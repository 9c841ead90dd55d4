"""Failure paths end to end: hangs, numerical faults, killed workers, bad input, restarts.

Faults are injected with the test-only ``MESHTRAIN_FAULT`` variable (:mod:`meshtrain.faults`).
The launcher runs in this process (``cli.main``) so that only the workers pay torch's import.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from meshtrain import faults
from meshtrain.cli import main
from meshtrain.run.diagnostics import explain_failure, hang_summary

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64", "--set", "train.seq_len=16",
        "--set", "train.global_batch=4", "--set", "train.warmup_steps=0",
        "--set", "data.max_bytes=200000", "--set", "train.lr=1e-2"]


@pytest.fixture
def fault(monkeypatch):
    """Set ``MESHTRAIN_FAULT`` for this process and the workers it starts."""
    def set_fault(spec: str) -> None:
        monkeypatch.setenv(faults.ENV_VAR, spec)
        faults.reset()
    yield set_fault
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    faults.reset()


def train(run_dir: Path, *args: str) -> int:
    return main(["train", "--run-dir", str(run_dir), *TINY, *args])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------- hangs


def _snap(rank, seq, recent, status="running"):
    return {"rank": rank, "status": status, "step": 2, "axes": {"dp": {"ranks": [0, 1],
            "seq": seq}}, "recent": recent}


def _rec(seq, done, site="trainer.py:105"):
    return {"axis": "dp", "op": "all_reduce", "shape": [1], "dtype": "torch.float32",
            "site": site, "seq": seq, "step": 2, "done": done, "peer": None}


def test_hang_summary_names_the_rank_that_did_not_arrive():
    snaps = {0: _snap(0, 4, [_rec(3, True), _rec(4, False)]), 1: _snap(1, 3, [_rec(3, True)])}
    text = hang_summary(snaps, 2, "run")
    first = text.splitlines()[0]
    assert first.startswith("rank 1 did not arrive at dp #4 all_reduce (1,) float32")
    assert "trainer.py:105" in first and "where rank 0 waits" in first
    assert "rank 1: not in a collective" in text
    # A rank with no file at all is reported as such and counted as not arrived.
    text = hang_summary({0: snaps[0]}, 2, "run")
    assert text.startswith("rank 1 did not arrive") and "rank 1: no diagnostics" in text


def test_hang_summary_from_async_calls_and_failure_messages(tmp_path):
    # NCCL calls return at once (done), yet the rank waits on the device for the late one.
    snaps = {0: _snap(0, 4, [_rec(4, True)]), 1: _snap(1, 3, [_rec(3, True)])}
    assert hang_summary(snaps, 2).startswith("rank 1 did not arrive at dp #4")
    # Launcher side: a signal names the rank; the launcher's own SIGTERMs are not the cause.
    status, text = explain_failure({0: -15, 1: -9}, {}, tmp_path, 2, 300)
    assert status == 1 and text.startswith("worker rank 1 was killed by SIGKILL")
    status, text = explain_failure({0: 2}, {0: "ConfigError: data.source: x is empty."},
                                   tmp_path, 2, 300)
    assert status == 2 and text == "data.source: x is empty."
    assert faults.parse("kill:rank=1:step=5,nan_loss:step=2") == (
        faults.Fault("kill", 5, rank=1), faults.Fault("nan_loss", 2))
    with pytest.raises(ValueError, match="needs rank"):
        faults.parse("kill:step=5")


def test_collective_timeout_names_missing_rank_and_exits_1(tmp_path, fault, capfd):
    fault("skip_collective:rank=1:step=2")
    start = time.monotonic()
    status = train(tmp_path, "--nproc", "2", "--steps", "3",
                   "--set", "train.collective_timeout_s=5")
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert status == 1, err
    assert "timed out after 5 s" in err
    assert "rank 1 did not arrive at dp #" in err and "where rank 0 waits" in err
    assert "all_reduce (1,)" in err and "trainer.py:" in err
    assert err.count("did not arrive") == 1 and "Traceback" not in err
    assert elapsed < 150, elapsed  # not the 300 s default, and no hang
    snap = json.loads((tmp_path / "diagnostics" / "rank0.json").read_text())
    assert snap["kind"] == "timeout" and snap["recent"][-1]["seq"] >= 1


def test_debug_collectives_reports_first_mismatch(tmp_path, fault, capfd):
    fault("skip_collective:rank=1:step=2:then=continue")
    status = train(tmp_path, "--nproc", "2", "--steps", "3",
                   "--set", "train.debug_collectives=true",
                   "--set", "train.collective_timeout_s=60")
    err = capfd.readouterr().err
    assert status == 1, err
    assert "collective mismatch on the dp group" in err
    # Both ranks are at the same collective number (what they have issued on dp so far).
    seq = re.search(r"rank 0 calls #(\d+) all_reduce \(1,\) float32 at trainer.py:", err)
    assert seq, err
    assert f"rank 1 calls #{seq.group(1)} all_reduce" in err and "Traceback" not in err


# ------------------------------------------------------------------------- numerical faults


def test_nonfinite_loss_is_skipped_and_counted(tmp_path, fault, capfd):
    fault("nan_loss:step=2")
    assert train(tmp_path, "--steps", "4") == 0, capfd.readouterr().err
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert np.isnan(records[1]["loss"]) and records[1]["nonfinite_skips"] == 1
    assert all(np.isfinite(r["loss"]) for r in records[2:])
    assert records[0]["nonfinite_skips"] == 0 and records[-1]["nonfinite_skips"] == 1
    assert "step 2: non-finite loss = nan" in capfd.readouterr().err


def test_nonfinite_stop_names_step_and_parameter(tmp_path, fault, capfd):
    fault("nan_loss:step=3")
    assert train(tmp_path, "--steps", "5", "--set", "train.on_nonfinite=stop") == 1
    err = capfd.readouterr().err
    assert "step 3: non-finite loss = nan" in err and "Traceback" not in err
    assert "first non-finite gradient: tok_embeddings.weight" in err
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


def test_nonfinite_stop_saves_last_good_state(tmp_path, fault, capfd):
    fault("nan_loss:step=3")
    status = train(tmp_path, "--steps", "5", "--set", "train.on_nonfinite=stop",
                   "--set", "checkpoint.every=10")
    err = capfd.readouterr().err
    assert status == 1 and "Saved the last good state (step 2)" in err, err
    assert (tmp_path / "checkpoints" / "step_00000002" / "manifest.json").is_file()


def test_too_many_nonfinite_steps_in_a_row_stop(tmp_path, fault, capfd):
    fault("nan_loss:step=2,nan_loss:step=3")
    assert train(tmp_path, "--steps", "5", "--set", "train.max_nonfinite_skips=2") == 1
    err = capfd.readouterr().err
    assert "step 3:" in err and "2 steps in a row" in err and "Traceback" not in err


# ------------------------------------------------------------------------- dead workers


def test_killed_worker_exits_1_naming_rank_and_signal(tmp_path, fault, capfd):
    fault("kill:rank=1:step=2")
    status = train(tmp_path, "--nproc", "2", "--steps", "4")
    err = capfd.readouterr().err
    assert status == 1
    assert "worker rank 1 was killed by SIGKILL" in err and "Traceback" not in err


# ------------------------------------------------------------------------- bad input


def _source(path: Path, data: bytes) -> list[str]:
    path.write_bytes(data)
    return ["--set", f"data.source={path}"]


def _bin_source(path: Path, ids) -> list[str]:
    return _source(path, np.asarray(ids, dtype="<u2").tobytes())


BAD_INPUTS = {
    "missing config": (lambda d: ["--config", str(d / "nope.toml")], "does not exist"),
    "non-numeric dim": (lambda d: ["--set", "model.dim=abc"], "model.dim = 'abc'"),
    "negative lr": (lambda d: ["--set", "train.lr=-1"], "train.lr = -1.0 must be positive"),
    "pp above layers": (lambda d: ["--nproc", "4", "--set", "parallel.pp=4"],
                        "model.n_layers = 2 is fewer than the 4 pipeline stages"),
    "unknown schedule": (lambda d: ["--set", "parallel.pp_schedule=zigzag"], "zigzag"),
    "run dir is a file": (lambda d: ["--run-dir", str(d / "metrics.jsonl" / "sub")],
                          "not a writable directory"),
    "empty data file": (lambda d: _source(d / "empty.txt", b""), "is empty"),
    "damaged parquet": (lambda d: _source(d / "x.parquet", b"junk"),
                        "not a readable Parquet file"),
    "bin id beyond vocab": (lambda d: _bin_source(d / "t.bin", [1, 2, 300] * 50),
                            "token id 300"),
    "bin too short": (lambda d: _bin_source(d / "t.bin", [1, 2]), "fewer than one sample"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_and_keeps_files(tmp_path, capfd, case):
    make_args, fragment = BAD_INPUTS[case]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    kept = {"metrics.jsonl": '{"step": 1, "loss": 1.0}\n', "config.json": '{"old": true}'}
    for name, text in kept.items():
        (run_dir / name).write_text(text)
    args = make_args(run_dir)
    if "--run-dir" not in args:
        args = ["--run-dir", str(run_dir), *args]
    status = main(["train", *TINY, "--steps", "1", *args])
    err = capfd.readouterr().err
    assert status == 2, err
    assert fragment in " ".join(err.split()) and "Traceback" not in err  # the CLI wraps lines
    for name, text in kept.items():
        assert (run_dir / name).read_text() == text


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_data_file_exits_2(tmp_path, capfd):
    data = tmp_path / "secret.txt"
    data.write_text("x" * 1000)
    data.chmod(0)
    status = train(tmp_path / "run", "--steps", "1", "--set", f"data.source={data}")
    err = capfd.readouterr().err
    assert status == 2 and "cannot read" in err and "Traceback" not in err


def test_hf_tokenizer_larger_than_vocab_exits_2(tmp_path, capfd):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(300)} | {"[UNK]": 300}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    status = main(["train", "--run-dir", str(tmp_path), *TINY, "--steps", "1",
                   "--set", f"data.tokenizer={tmp_path / 'tokenizer.json'}",
                   "--set", "model.vocab_size=264"])
    err = capfd.readouterr().err
    assert status == 2 and "smaller than the tokenizer's vocabulary (301)" in err


def test_master_port_in_use_exits_2(tmp_path, monkeypatch, capfd):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        status = train(tmp_path, "--nproc", "2", "--steps", "1")
    err = capfd.readouterr().err
    assert status == 2 and "already in use" in err and "MASTER_PORT" in err


# ------------------------------------------------------------------------- restarts


def test_worker_error_file_is_written_whole_in_torch_elastics_format(tmp_path, monkeypatch):
    """The launcher's summary reads each failed worker's error file; it appears complete or not
    at all (written aside and renamed), in the JSON torch elastic's agent parses."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from meshtrain.run.worker import record_error_file

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise RuntimeError("gloo: connection closed by peer")
    except RuntimeError as error:
        record_error_file(error)
    assert os.listdir(tmp_path) == ["error.json"]  # nothing partial left behind
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "RuntimeError: gloo: connection closed by peer"
    assert "raise RuntimeError" in failure.message["extraInfo"]["py_callstack"]


def test_killed_worker_restarts_and_resumes(tmp_path, fault, capfd):
    """SIGKILL one worker of dp 2 × tp 2 at step 5 with checkpoints every 2 steps: the job
    restarts, resumes from step 4, and logs steps 1..6 once, with the losses of an uninterrupted
    run (one process: layouts agree to ~1e-6, a lost optimizer state or data position would
    differ by ~1e-2)."""
    assert train(tmp_path / "clean", "--steps", "6") == 0, capfd.readouterr().err
    fault("kill:rank=1:step=5")
    status = train(tmp_path / "restarted", "--nproc", "4", "--steps", "6",
                   "--set", "parallel.tp=2", "--set", "checkpoint.every=2",
                   "--max-restarts", "2")
    err = capfd.readouterr().err
    assert status == 0, err
    assert "restart 1 of at most 2" in err
    clean, restarted = metrics(tmp_path / "clean"), metrics(tmp_path / "restarted")
    assert [r["step"] for r in restarted] == [1, 2, 3, 4, 5, 6]
    assert [r["restarts"] for r in restarted] == [0, 0, 0, 0, 1, 1]
    assert [r["loss"] for r in restarted] == pytest.approx([r["loss"] for r in clean], abs=1e-5)


# ------------------------------------------------------------------------- stragglers


def test_slowed_rank_is_named_in_metrics_and_warned(tmp_path, fault, capfd):
    """dp 2 × tp 2 with rank 3's compute injected 3 × slower: ``metrics.jsonl`` names it as the
    straggler, with how long the others waited for it, and rank 0 warns within 5 steps."""
    fault("slow:rank=3:factor=3")
    status = train(tmp_path, "--nproc", "4", "--steps", "6", "--set", "parallel.tp=2")
    err = capfd.readouterr().err
    assert status == 0, err
    records = metrics(tmp_path)
    named = [r["step"] for r in records if r["straggler"]["rank"] == 3]
    assert len([step for step in named if step <= 5]) >= 3, [r["straggler"] for r in records]
    assert all(r["straggler"]["excess_s"] > 0 for r in records if r["step"] in named)
    warned = re.findall(r"warning: step (\d+): rank (\d+) is a straggler", err)
    assert warned and warned[0][1] == "3" and int(warned[0][0]) <= 5, err
    assert "train.straggler_factor = 1.5" in err
