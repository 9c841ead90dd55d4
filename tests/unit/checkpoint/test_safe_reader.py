"""A checkpoint's DCP ``.metadata`` is read without running it
(:mod:`meshtrain.checkpoint.safe_reader`): DCP's real metadata loads, a planted one is refused
naming the file and the global, and every DCP read and ``torch.load`` in the package is the safe
kind."""

from __future__ import annotations

import ast
import functools
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import meshtrain
from meshtrain.checkpoint import manager
from meshtrain.checkpoint.dcp import Chunk, ChunkLoadPlanner, ChunkSavePlanner
from meshtrain.checkpoint.safe_reader import (
    METADATA_FILE,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    metadata_problem,
    read_metadata_file,
)
from meshtrain.config import Config

PACKAGE = Path(meshtrain.__file__).resolve().parent
FIXTURE = (Path(__file__).resolve().parents[2] / "data" / "previous-release-run" / "checkpoints"
           / "step_00000003")


class _Calls:
    """Pickles as a call of ``target(*args)``: what a planted pickle does."""

    def __init__(self, target, *args):
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


def _save(directory: Path) -> Path:
    """A DCP checkpoint as meshtrain writes one (in one process): chunks of tensors of several
    dtypes, and a JSON blob."""
    chunks = [Chunk("model.w", (2, 3), (0, 0), torch.arange(6, dtype=torch.float32).view(2, 3)),
              Chunk("model.h", (4,), (0,), torch.ones(4, dtype=torch.bfloat16)),
              Chunk("buffers.n", (1,), (0,), torch.tensor([7]))]
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(directory)),
             planner=ChunkSavePlanner(chunks, {"meta": b'{"step": 1}'}), no_dist=True)
    return directory


def _plant(directory: Path, payload) -> None:
    """Put ``payload`` inside the directory's real metadata, as a forger would."""
    metadata = read_metadata_file(directory / METADATA_FILE)
    metadata.planner_data = payload
    (directory / METADATA_FILE).write_bytes(pickle.dumps(metadata))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_real_metadata_reads_as_dcp_reads_it(tmp_path):
    for directory in (_save(tmp_path / "fresh"), FIXTURE):
        with (directory / METADATA_FILE).open("rb") as handle:
            plain = pickle.load(handle)  # our own files: the reference
        safe = SafeFileSystemReader(str(directory)).read_metadata()
        assert safe.state_dict_metadata == plain.state_dict_metadata
        assert safe.storage_data == plain.storage_data
        assert metadata_problem(directory) is None
    planner = ChunkLoadPlanner([], ["meta"])
    dcp.load({}, storage_reader=SafeFileSystemReader(str(tmp_path / "fresh")), planner=planner,
             no_dist=True)
    assert planner.blobs["meta"] == b'{"step": 1}'


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_planted_metadata_is_refused_and_nothing_runs(tmp_path):
    directory = _save(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    _plant(directory, _Calls(os.system, f"touch {marker}"))
    path = directory / METADATA_FILE
    with pytest.raises(UnsafeCheckpointError) as refused:
        read_metadata_file(path)
    assert f"checkpoint file {path} refers to the global posix.system" in str(refused.value)
    with pytest.raises(UnsafeCheckpointError):
        SafeFileSystemReader(str(directory)).read_metadata()
    with pytest.raises(BaseException, match="posix.system"):  # DCP's CheckpointException
        dcp.load({}, storage_reader=SafeFileSystemReader(str(directory)),
                 planner=ChunkLoadPlanner([], ["meta"]), no_dist=True)
    assert "posix.system" in metadata_problem(directory)
    assert not marker.exists()
    dcp.FileSystemReader(str(directory)).read_metadata()  # DCP's own reader runs it
    assert marker.exists()


@pytest.mark.parametrize("payload", [
    _Calls(eval, "1"), _Calls(__import__, "os"), _Calls(pickle.loads, b"."),
    _Calls(Path.write_text, Path("x"), "y")],
    ids=["builtins.eval", "builtins.__import__", "pickle.loads", "pathlib.Path.write_text"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_any_other_global_is_refused(tmp_path, payload):
    directory = _save(tmp_path / "ckpt")
    _plant(directory, payload)
    with pytest.raises(UnsafeCheckpointError, match="refers to the global"):
        read_metadata_file(directory / METADATA_FILE)


def test_a_file_that_is_not_dcp_metadata_is_refused(tmp_path):
    path = tmp_path / METADATA_FILE
    path.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UnsafeCheckpointError, match="holds a dict, not DCP metadata"):
        read_metadata_file(path)
    path.write_bytes(b"\x80\x04garbage")
    with pytest.raises(UnsafeCheckpointError, match="is not readable DCP metadata"):
        read_metadata_file(path)


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/passwd", "sub/x.distcp", ".."])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_chunk_outside_the_directory_is_refused(tmp_path, where):
    directory = _save(tmp_path / "ckpt")
    metadata = read_metadata_file(directory / METADATA_FILE)
    next(iter(metadata.storage_data.values())).relative_path = where
    (directory / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="outside its directory"):
        read_metadata_file(directory / METADATA_FILE)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_resume_auto_skips_a_planted_checkpoint_whose_checksums_match(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    good = _save(manager.step_dir(root, 1))
    manager.write_manifest(good, 1, Config(), {})
    planted = _save(manager.step_dir(root, 2))
    marker = tmp_path / "ran"
    _plant(planted, _Calls(os.system, f"touch {marker}"))
    manager.write_manifest(planted, 2, Config(), {})  # checksums of the planted files
    problem = manager.verify(planted)
    assert problem is not None and "refers to the global posix.system" in problem
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000002.*posix.system"):
        assert manager.newest_valid(root) == good
    assert "posix.system" in capsys.readouterr().err
    manager.prune(root, keep=1)  # a bad checkpoint is neither counted nor removed
    assert planted.is_dir() and good.is_dir()
    assert not marker.exists()


@functools.cache
def _all_calls() -> tuple:
    """``(path, name called, call node)`` of every call in the package (parsed once)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                found.append((path.relative_to(PACKAGE), called, node))
    return tuple(found)


def _calls(name: str):
    """``(path, call node)`` of every call of something named ``name`` in the package."""
    return [(path, node) for path, called, node in _all_calls() if called == name]


def test_every_dcp_read_in_the_package_goes_through_the_safe_reader():
    assert [str(p) for p, _ in _calls("FileSystemReader")] == []
    assert {str(p) for p, _ in _calls("SafeFileSystemReader")} == {
        "checkpoint/state.py", "checkpoint/reader.py"}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_blobs_are_kept_as_bytes_never_torch_loaded(tmp_path):
    """DCP's default load planner would ``torch.load(weights_only=False)`` a byte blob: every
    DCP load in the package passes meshtrain's planner, which keeps the bytes as they are."""
    marker = tmp_path / "ran"
    blob = pickle.dumps(_Calls(os.system, f"touch {marker}"))
    chunks = [Chunk("model.w", (2,), (0,), torch.zeros(2))]
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt")),
             planner=ChunkSavePlanner(chunks, {"meta": blob}), no_dist=True)
    planner = ChunkLoadPlanner([], ["meta"])
    dcp.load({}, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), planner=planner,
             no_dist=True)
    assert planner.blobs["meta"] == blob and not marker.exists()
    loads = list(_calls("load"))
    dcp_loads = [(p, n) for p, n in loads if getattr(n.func, "value", None) is not None
                 and getattr(n.func.value, "id", "") == "dcp"]
    assert len(dcp_loads) == 3  # state.load, and the checkpoint reader's two
    assert all(any(k.arg == "planner" for k in node.keywords) for _, node in dcp_loads)


def test_every_torch_load_in_the_package_is_weights_only():
    unsafe = [f"{path}:{node.lineno}" for path, node in _calls("load")
              if isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", "")
              == "torch" and not any(k.arg == "weights_only" and getattr(k.value, "value", None)
                                     is True for k in node.keywords)]
    assert not unsafe
    plain = [f"{path}:{node.lineno}" for name in ("loads", "load", "Unpickler")
             for path, node in _calls(name)
             if isinstance(node.func, ast.Attribute)
             and getattr(node.func.value, "id", "") in ("pickle", "cPickle", "dill", "marshal")]
    assert not plain
