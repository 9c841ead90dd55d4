"""Bad input for fault-tolerant replica groups is refused with exit 2 and a message naming the
key and what is valid; a group that is its own job builds a mesh of its inner layout alone."""

from __future__ import annotations

import importlib.util

import pytest

from meshtrain import faults
from meshtrain.cli import main
from meshtrain.parallel.mesh import ParallelMesh

FT = ["--set", "parallel.replica_fault_tolerance=true", "--set", "parallel.replicas=2",
      "--set", "parallel.lighthouse=http://127.0.0.1:29510"]
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None


@pytest.mark.parametrize(("extra", "words"), [
    (["--set", "parallel.replicas=1"], ["parallel.replicas >= 2"]),
    (["--set", "parallel.replica_group=2"], ["parallel.replica_group = 2", "0 to 1"]),
    (["--set", "parallel.outer_grad_dtype=int8"], ["outer_grad_dtype = int8", "fp32 and bf16"]),
    (["--set", "parallel.lighthouse="], ["parallel.lighthouse", "TORCHFT_LIGHTHOUSE"]),
    (["--set", "parallel.quorum_timeout_s=0"], ["parallel.quorum_timeout_s = 0"]),
])
def test_bad_fault_tolerance_settings_exit_2(extra, words, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    status = main(["train", "--run-dir", str(tmp_path), *FT, *extra])
    err = " ".join(capsys.readouterr().err.split())
    assert status == 2, err
    for word in words:
        assert word in err


def test_the_world_is_one_groups_inner_layout(capsys, tmp_path):
    """--nproc 4 for replicas 2 × dp 2 inside one job; a fault-tolerant group's is its own 2."""
    status = main(["train", "--run-dir", str(tmp_path), "--nproc", "4", *FT,
                   "--set", "parallel.dp=2"])
    assert status == 2
    assert "--nproc 4" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed")
def test_lighthouse_refuses_a_bad_option(capsys):
    assert main(["lighthouse", "--min-replicas", "0"]) == 2
    assert "--min-replicas 0 must be at least 1" in capsys.readouterr().err


def test_hold_fault_needs_a_file():
    with pytest.raises(ValueError, match="needs file=PATH"):
        faults.parse("hold:step=3")
    assert faults.parse("hold:step=3:file=/tmp/go")[0].file == "/tmp/go"


def test_mesh_of_a_group_alone():
    """Group 2 of 3 with dp 2: a world of 2 ranks, its own coordinates, no replica peers."""
    mesh = ParallelMesh(dp=2, rank=1, replicas=3, replica_group=2)
    assert (mesh.world_size, mesh.replica_rank, mesh.dp_rank) == (2, 2, 1)
    assert mesh.group_ranks("dp") == [0, 1] and mesh.group_ranks("replica") == [1]
    assert mesh.comm("replica").size == 1
    with pytest.raises(ValueError, match="outside replicas"):
        ParallelMesh(dp=2, rank=0, replicas=2, replica_group=2)
