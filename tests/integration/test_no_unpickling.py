"""Loading a checkpoint runs nothing in it, from outside (``docs/checkpoints.md``, "What loading a
checkpoint executes: nothing").

A real run's newest checkpoint gets a ``.metadata`` that is its real DCP metadata plus a payload
whose unpickling runs a shell command (touching a marker file), and a manifest whose sizes and
SHA-256 sums are recomputed over the planted files, as a forger would: the checksums pass. Every
command that loads a checkpoint must then leave the marker absent: ``train`` with
``checkpoint.resume=auto`` skips it (saying why) and resumes from the older good one, and
``train`` with ``checkpoint.resume`` naming it and ``convert --to-hf`` refuse it (exit 2) naming
the file and the global.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from meshtrain.checkpoint import manager
from meshtrain.checkpoint.safe_reader import METADATA_FILE, read_metadata_file
from tests.integration.test_cli import meshtrain_many

TINY = ["--nproc", "1", "--set", "model.dim=32", "--set", "model.n_layers=2",
        "--set", "model.n_heads=4", "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64",
        "--set", "train.seq_len=16", "--set", "train.global_batch=4",
        "--set", "train.warmup_steps=0", "--set", "data.max_bytes=200000",
        "--set", "checkpoint.every=1"]


class _Shell:
    """Pickles as ``os.system(command)``."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _plant(checkpoint: Path, marker: Path) -> None:
    """Arm ``checkpoint``'s metadata with a command touching ``marker`` and recompute its
    manifest's sizes and SHA-256 sums (as meshtrain computes them) over the planted files."""
    metadata = read_metadata_file(checkpoint / METADATA_FILE)
    metadata.planner_data = {"note": _Shell(f"touch {marker}")}
    (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    path = checkpoint / manager.MANIFEST
    manifest = json.loads(path.read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    path.write_text(json.dumps(manifest, indent=2))


def _said(text: str, words: str) -> bool:
    """Whether ``text`` says ``words``, however the CLI wrapped its lines (even in a path)."""
    return "".join(words.split()) in "".join(text.split())


def test_a_planted_checkpoint_is_never_unpickled(tmp_path):
    run_dir = tmp_path / "run"
    train = ["train", "--run-dir", str(run_dir), *TINY]
    first, = meshtrain_many([*train, "--steps", "2"])
    assert first["returncode"] == 0, first["stderr"]
    root = run_dir / "checkpoints"
    older, planted = manager.step_dir(root, 1), manager.step_dir(root, 2)
    marker = tmp_path / "ran"
    _plant(planted, marker)
    # the plant is armed (a plain unpickler runs it) and its checksums verify
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], "
                    "'rb'))", str(planted / METADATA_FILE)], check=True, capture_output=True)
    assert marker.exists()
    marker.unlink()
    problem = manager.verify(planted)
    assert problem is not None and "checksum" not in problem and "posix.system" in problem

    resumed, named, converted = meshtrain_many(
        [*train, "--steps", "3", "--set", "checkpoint.resume=auto"],
        ["train", "--run-dir", str(tmp_path / "other"), *TINY, "--steps", "3",
         "--set", f"checkpoint.resume={planted}"],
        ["convert", "--to-hf", str(planted), "--out", str(tmp_path / "hf")])
    assert not marker.exists()

    assert resumed["returncode"] == 0, resumed["stderr"]
    said = resumed["stderr"]
    assert _said(said, f"skipping checkpoint {planted}: checkpoint file "
                       f"{planted / METADATA_FILE} refers to the global posix.system"), said
    assert _said(said, f"resumed from {older} at step 1"), said
    assert manager.verify(manager.step_dir(root, 3)) is None  # it trained on and saved

    for refused in (named, converted):
        assert refused["returncode"] == 2, refused["stderr"]
        said = refused["stderr"]
        assert _said(said, f"{planted / METADATA_FILE} refers to the global posix.system"), said
    assert not (tmp_path / "hf").exists()
    assert not marker.exists()
