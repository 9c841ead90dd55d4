"""The checkpoint directory (:mod:`meshtrain.checkpoint.manager`, :func:`state.save`): what a
save syncs and in which order, the leftovers it removes, which checkpoints count toward
``checkpoint.keep``. One process, a tiny model; exact checks, no tolerances."""

from __future__ import annotations

import os
from pathlib import Path

from meshtrain.checkpoint import manager, state
from meshtrain.config import Config
from tests.helpers import build_trainer, tiny_config


def _trainer(run_dir: Path, steps: int, *overrides: str):
    trainer = build_trainer(tiny_config(*overrides, run_dir=str(run_dir), nproc=1).to_dict())
    for _ in range(steps):
        trainer.train_step()
    return trainer


def test_a_save_syncs_its_directory_then_renames_then_syncs_the_root_then_prunes(tmp_path,
                                                                                 monkeypatch):
    trainer = _trainer(tmp_path, 1)
    root = tmp_path / "checkpoints"
    temp, final = root / ".tmp-step_00000001", root / "step_00000001"
    events = []
    real_fsync, real_rename, real_prune = os.fsync, Path.rename, manager.prune
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(
        ("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
    monkeypatch.setattr(Path, "rename", lambda self, to: (events.append(
        ("rename", str(self), str(to))), real_rename(self, to))[1])
    monkeypatch.setattr(manager, "prune", lambda *a: (events.append(("prune",)),
                                                      real_prune(*a))[1])
    state.save(trainer)
    rename = events.index(("rename", str(temp), str(final)))
    assert ("fsync", str(temp / manager.MANIFEST)) in events[:rename]
    assert events[rename - 1] == ("fsync", str(temp))  # the directory's entries, last
    assert events[rename + 1:] == [("fsync", str(root)), ("prune",)]
    assert manager.verify(final) is None


def test_a_save_removes_the_leftovers_of_interrupted_saves_of_other_steps(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 7):  # a save killed at step 1, and one of a run that had got further
        stale = root / f".tmp-step_{step:08d}"
        stale.mkdir(parents=True)
        (stale / "__0_0.distcp").write_bytes(b"partial")
    trainer = _trainer(tmp_path, 2)
    assert state.save(trainer) == manager.step_dir(root, 2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]
    assert manager.verify(manager.step_dir(root, 2)) is None


def _checkpoint(root: Path, step: int, good: bool = True) -> Path:
    directory = manager.step_dir(root, step)
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(bytes([step]) * 64)
    if good:
        manager.write_manifest(directory, step, Config(), {})
    return directory


def test_keep_counts_only_good_checkpoints_and_never_removes_a_bad_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _checkpoint(root, step)
    _checkpoint(root, 4, good=False)  # no manifest: a save interrupted after its rename
    garbled = _checkpoint(root, 5)
    (garbled / "__0_0.distcp").write_bytes(b"garbled")
    stale = root / ".tmp-step_00000006"  # an interrupted save's leftover
    stale.mkdir()
    manager.prune(root, keep=2)
    # The two newest good ones stay (not 4 and 5, which would leave one good checkpoint); the
    # bad ones are neither counted nor removed, so resume=auto can still say what is wrong.
    assert [p.name for p in manager.list_checkpoints(root)] == [
        "step_00000005", "step_00000004", "step_00000003", "step_00000002"]
    assert not stale.exists()
    assert manager.newest_valid(root, warn=False) == manager.step_dir(root, 3)
    manager.prune(root, keep=1)
    assert [p.name for p in manager.list_checkpoints(root)] == [
        "step_00000005", "step_00000004", "step_00000003"]
