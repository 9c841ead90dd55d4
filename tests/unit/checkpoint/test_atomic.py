"""Crash-safe replacement of files and directories (:mod:`meshtrain.checkpoint.atomic`).

Crashes are real where it matters (a child process SIGKILLs itself between the two renames of a
swap); elsewhere a ``BaseException`` raised at the crash point stands for one (the code runs no
clean-up there). Plain small directories, no tolerances (contents compared exactly).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshtrain.checkpoint import atomic

OLD = {"config.json": "old config", "model.safetensors": "old weights"}
NEW = {"config.json": "new config", "model-00001-of-00001.safetensors": "new weights",
       "model.safetensors.index.json": "new index"}


def _make(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def _contents(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in directory.iterdir()}


def _beside(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p != target)


class Crash(BaseException):
    """A crash at this point: nothing after it runs."""


@pytest.fixture(params=["exchange", "two renames"])
def swap_kind(request, monkeypatch):
    """Both ways of swapping: the atomic exchange (Linux, this filesystem) and the fallback."""
    if request.param == "two renames":
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    return request.param


def test_the_exchange_is_available_here(tmp_path):
    a, b = _make(tmp_path / "a", {"x": "a"}), _make(tmp_path / "b", {"x": "b"})
    assert atomic._exchange(a, b)
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_swap_replaces_the_directory_and_leaves_nothing_beside_it(tmp_path, swap_kind):
    target = _make(tmp_path / "final", OLD)
    staging = atomic.staging_dir(target)
    assert staging.name.startswith("final.tmp-") and staging.parent == tmp_path
    for name, text in NEW.items():
        (staging / name).write_text(text)
    atomic.swap_in(staging, target)
    assert _contents(target) == NEW
    assert _beside(target) == []


def test_swap_into_a_missing_target(tmp_path, swap_kind):
    target = tmp_path / "run" / "final"
    staging = atomic.staging_dir(target)  # creates the parent
    (staging / "config.json").write_text("new")
    atomic.swap_in(staging, target)
    assert _contents(target) == {"config.json": "new"} and _beside(target) == []


def test_every_swap_step_is_synced_before_the_old_set_goes(tmp_path, swap_kind, monkeypatch):
    target = _make(tmp_path / "final", OLD)
    staging = atomic.staging_dir(target)
    (staging / "config.json").write_text("new")
    events = []
    real_fsync, real_rmtree = os.fsync, atomic.shutil.rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(
        ("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda path, **kw: (events.append(
        ("remove", str(path))), real_rmtree(path, **kw))[1])
    atomic.swap_in(staging, target)
    synced = [path for kind, path in events if kind == "fsync"]
    assert synced[0] == str(staging)  # the new set's entries, before it becomes visible
    removed = next(i for i, (kind, _) in enumerate(events) if kind == "remove")
    assert ("fsync", str(tmp_path)) in events[:removed]  # the swap is durable first


def test_a_kill_between_the_two_renames_leaves_the_old_set_aside_for_readers(tmp_path):
    """SIGKILL right after the first rename (final/ -> final.old-*), on a filesystem without the
    exchange: final/ is missing, the aside is the complete old set; readers get it, cleanup
    renames it back and removes the new set's temporary directory."""
    target = _make(tmp_path / "final", OLD)
    staging = atomic.staging_dir(target)
    for name, text in NEW.items():
        (staging / name).write_text(text)
    script = textwrap.dedent(f"""
        import os, signal
        from meshtrain.checkpoint import atomic
        atomic._exchange = lambda a, b: False
        real, calls = os.rename, []
        def rename(a, b):
            calls.append(a)
            if len(calls) == 2:  # the second rename: crash before it
                os.kill(os.getpid(), signal.SIGKILL)
            real(a, b)
        os.rename = rename
        atomic.swap_in({str(staging)!r}, {str(target)!r})
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert not target.exists()
    (aside,) = tmp_path.glob("final.old-*")
    assert _contents(aside) == OLD and _contents(staging) == NEW
    assert atomic.readable(target) == aside
    assert atomic.readable(target, lambda p: (p / "missing").exists()) is None

    atomic.cleanup(target)
    assert _contents(target) == OLD
    assert _beside(target) == []


def test_a_crash_while_holding_before_the_swap_leaves_the_target(tmp_path, swap_kind,
                                                                monkeypatch):
    target = _make(tmp_path / "final", OLD)
    staging = atomic.staging_dir(target)
    (staging / "config.json").write_text("new")
    monkeypatch.setenv(atomic.DELAY_ENV, "5")

    def crash(seconds):
        assert seconds == 5.0
        raise Crash

    monkeypatch.setattr(atomic.time, "sleep", crash)
    with pytest.raises(Crash):
        atomic.swap_in(staging, target)
    assert _contents(target) == OLD and _beside(target) == [staging.name]
    atomic.cleanup(target)
    assert _contents(target) == OLD and _beside(target) == []


def test_a_failed_second_rename_puts_the_old_set_back(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = _make(tmp_path / "final", OLD)
    staging = atomic.staging_dir(target)
    real, calls = os.rename, []

    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (test)")
        real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="No space left"):
        atomic.swap_in(staging, target)
    assert _contents(target) == OLD and _beside(target) == [staging.name]


def test_cleanup_never_touches_an_existing_target_nor_restores_an_incomplete_aside(tmp_path):
    target = _make(tmp_path / "final", OLD)
    _make(tmp_path / "final.tmp-1", {"model-00001-of-00002.safetensors": "partial"})
    _make(tmp_path / "final.old-1", OLD)
    _make(tmp_path / "finally", {"x": "not ours"})  # another name that merely starts alike
    atomic.cleanup(target)
    assert _contents(target) == OLD and _beside(target) == ["finally"]

    os.rename(target, tmp_path / "final.old-2")
    (tmp_path / "final.old-2" / "config.json").unlink()
    complete = lambda p: (p / "config.json").is_file()  # noqa: E731
    assert atomic.readable(target, complete) is None
    atomic.cleanup(target, complete)  # nothing complete to restore: leftovers go
    assert not target.exists() and _beside(target) == ["finally"]


def test_write_atomically_syncs_the_file_and_its_directory(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text("old")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(
        os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    atomic.write_atomically(path, '{"new": 1}')
    assert path.read_text() == '{"new": 1}'
    assert synced[0].startswith(str(path) + ".tmp-") and synced[-1] == str(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_write_atomically_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text("old")

    def fail(fd):
        raise OSError(5, "I/O error (test)")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="I/O error"):
        atomic.write_atomically(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [path.name]
