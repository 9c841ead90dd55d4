"""Crash safety from outside: SIGKILL a training run or a conversion at its most exposed moment
and check what is left on disk (:mod:`meshtrain.checkpoint.atomic`, ``docs/checkpoints.md``).

The test-only ``MESHTRAIN_TEST_SAVE_DELAY_S`` holds a save between its written set and the swap,
so the kill lands there on purpose. Weights are compared bit for bit (no tolerance: the files
are copies of one set, never recomputed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshtrain.checkpoint.safetensors_io import INDEX_NAME

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64", "--set", "train.seq_len=16",
        "--set", "train.global_batch=4", "--set", "train.warmup_steps=0",
        "--set", "data.max_bytes=200000", "--set", "train.lr=1e-2",
        # two pipeline stages: two writers, two files, so a mixed set could show
        "--set", "parallel.pp=2", "--set", "parallel.microbatches=2",
        "--set", "checkpoint.every=0"]
DELAY = "60"  # seconds a save holds before its swap; the test kills it well before


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.pop("MESHTRAIN_TEST_SAVE_DELAY_S", None)
    env.update(extra)
    return env


def _train(run_dir: Path, steps: int, *more: str) -> list[str]:
    return [sys.executable, "-m", "meshtrain", "train", "--nproc", "2", "--run-dir",
            str(run_dir), "--steps", str(steps), *TINY, *more]


def _train_on(run_dir: Path, steps: int) -> list[str]:
    """A longer run in a finished run's directory: the same run continued (no checkpoints to
    resume, so it trains from step 0 again; a fresh run there would be refused)."""
    return _train(run_dir, steps, "--set", "checkpoint.resume=auto")


def _run(args: list[str]) -> None:
    done = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (torch elastic starts each worker in a session of its
    own, so the launcher's process group does not hold the workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group and every process below it, as a crash would."""
    pids = _tree(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids[1:]) \
            and time.monotonic() < deadline:  # gone (or zombies reaped by init)
        time.sleep(0.05)


def _kill_when(args: list[str], ready, timeout: float = 240) -> None:
    """Start ``args`` (save delay on) and SIGKILL it and all its processes once ``ready()``."""
    proc = subprocess.Popen(args, env=_env(MESHTRAIN_TEST_SAVE_DELAY_S=DELAY),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, f"ended before the window: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "the save never reached its window"
            time.sleep(0.05)
    finally:
        _kill_tree(proc)
        proc.stderr.close()


def _staged(parent: Path, name: str, last: str):
    """True once ``NAME.tmp-*`` holds ``last``, the file a save writes last before its swap."""
    return lambda: any((p / last).is_file() for p in parent.glob(f"{name}.tmp-*"))


def _weights(directory: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every tensor of a weights directory, and the ``step`` in each file's metadata; checks
    that the index names only files that exist, and no other weights file lies there."""
    from safetensors import safe_open

    index = json.loads((directory / INDEX_NAME).read_text())
    files = set(index["weight_map"].values())
    assert {p.name for p in directory.glob("*.safetensors")} == files
    tensors, steps = {}, set()
    for name in sorted(files):
        with safe_open(str(directory / name), "pt") as handle:
            steps.add(handle.metadata()["step"])
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    assert set(tensors) == set(index["weight_map"])
    assert (directory / "config.json").is_file()
    return tensors, steps


def _assert_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def _leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("final."))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A finished 2-step run (final/ = its weights, two files) and its tensors."""
    run = tmp_path_factory.mktemp("finished") / "run"
    _run(_train(run, 2))
    first, steps = _weights(run / "final")
    assert steps == {"2"} and len(list((run / "final").glob("*.safetensors"))) == 2
    return run, first


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run for this test."""
    return Path(shutil.copytree(finished[0], tmp_path / "run"))


def test_final_weights_survive_a_kill_during_the_final_save(run, finished):
    """A run finished (final/ = its weights); a longer run into the same directory is killed
    while its final save holds before the swap: final/ is still the first run's complete set,
    file for file. The next save removes the leftover and swaps its own set in."""
    first = finished[1]

    _kill_when(_train_on(run, 3), _staged(run, "final", INDEX_NAME))
    kept, steps = _weights(run / "final")
    assert steps == {"2"}  # every file from the first run: never a mix
    _assert_equal(kept, first)
    (staged,) = run.glob("final.tmp-*")  # the new set was complete: the kill fell in the window
    new, steps = _weights(staged)
    assert steps == {"3"} and any(not torch.equal(new[k], first[k]) for k in first)

    _run(_train_on(run, 3))
    done, steps = _weights(run / "final")
    assert steps == {"3"}
    assert _leftovers(run) == []


def test_a_save_interrupted_between_its_two_renames_is_read_and_recovered(run, finished,
                                                                           tmp_path):
    """Where the filesystem cannot exchange two directories atomically, a save renames final/
    aside and then the new set into place; a crash between the two leaves no final/ but the
    complete previous set as final.old-<token> (what tests/unit/checkpoint/test_atomic.py's
    killed swap leaves). Readers take that set, and the next save renames it back first."""
    from meshtrain.checkpoint import convert_to_hf, iter_weights, load_hf, weights_config

    first = finished[1]
    token = f"{time.time_ns():020d}-1"
    (run / f"final.tmp-{token}").mkdir()  # the new set (its content does not matter here)
    os.rename(run / "final", run / f"final.old-{token}")  # the first rename, then the crash

    assert weights_config(run).dim == 32
    _assert_equal(dict(iter_weights(run)), first)
    hf = convert_to_hf(run, tmp_path / "hf")
    _assert_equal(load_hf(hf).state_dict(), first)

    _run(_train_on(run, 3))
    assert _weights(run / "final")[1] == {"3"}
    assert _leftovers(run) == []


def test_convert_to_hf_killed_mid_write_leaves_out_as_it_was(run, tmp_path):
    """convert --to-hf into an existing OUT, killed once the new files are written and before
    the swap: OUT keeps its old content, byte for byte; a completed conversion then replaces
    it and leaves nothing beside it."""
    from meshtrain.checkpoint import convert_to_hf

    out = tmp_path / "hf"
    out.mkdir()
    old = {"config.json": b'{"model_type": "llama", "old": true}', "model.safetensors": b"old"}
    for name, data in old.items():
        (out / name).write_bytes(data)
    convert = [sys.executable, "-m", "meshtrain", "convert", "--to-hf", str(run), "--out",
               str(out)]

    _kill_when(convert, _staged(tmp_path, "hf", "config.json"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    (staged,) = tmp_path.glob("hf.tmp-*")
    assert (staged / "model.safetensors").is_file()

    convert_to_hf(run, out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert "old" not in json.loads((out / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("hf")) == ["hf"]
