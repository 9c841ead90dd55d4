"""Offloaded optimizer state and parameters (``parallel.offload``, docs/offload.md) on CPU
processes.

On a CPU-only machine ``host`` offload is the memory the state would use anyway, so these tests
run ``nvme`` (memory-mapped files, paged in a chunk at a time) with chunks far smaller than a
shard: every pass over offloaded state is cut. The bar is bit-identity with the same layout
without offload (losses, gradient norms, every master weight): offload moves state, it must not
change one number. Checkpoints are the same logical tensors with and without offload, so either
resumes the other at another layout.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

from meshtrain.commands.verify import LOSS_TOLERANCE_FP32
from meshtrain.config import config_from_dict
from tests.distributed import run_distributed
from tests.helpers import build_trainer, tiny_config

NVME = ("parallel.offload_device=nvme", "parallel.offload_chunk_mb=0.001")  # 4096-elt chunks
PARAMS = ("parallel.offload=optimizer+params", *NVME)
OPTIMIZER = ("parallel.offload=optimizer", *NVME)
STEPS = 4
TOTAL, SPLIT = 6, 4


def run_and_fingerprint(config_dicts: list[dict], steps: int) -> list[tuple]:
    """Train each config ``steps`` steps in this world; per config ``(losses and gradient
    norms, this rank's fp32 masters, the files in this rank's offload directory)``."""
    out = []
    for config_dict in config_dicts:
        trainer = build_trainer(config_dict)
        records = [trainer.train_step() for _ in range(steps)]
        masters = [s.master.clone() for s in trainer.optimizer.shards]
        offload = trainer.engine.offload
        files = sorted(os.listdir(offload.directory)) if offload and offload.directory else None
        out.append(([(r["loss"], r["grad_norm"]) for r in records], masters, files))
    return out


def _configs(tmp_path, cases: list[tuple[str, ...]], nproc: int) -> list[dict]:
    base = ("train.grad_clip=0.5", "train.weight_decay=0.1")
    return [tiny_config(*base, *case, run_dir=str(tmp_path / f"run{i}"), nproc=nproc).to_dict()
            for i, case in enumerate(cases)]


def _assert_same(plain: tuple, offloaded: tuple, label: str) -> None:
    assert offloaded[0] == plain[0], label  # losses and gradient norms, exactly
    assert len(offloaded[1]) == len(plain[1])
    for a, b in zip(plain[1], offloaded[1], strict=True):
        assert torch.equal(a, b), label


def test_offload_on_two_ranks_is_bit_identical_to_none(tmp_path):
    """dp 2: ZeRO-3 with parameters and optimizer on nvme (with and without the background
    step), ZeRO-1 and ZeRO-2 with the optimizer on nvme and on the host, and DiLoCo (two replica
    groups, ZeRO-1) with its inner and outer state on nvme, and bf16 parameters at ZeRO-3
    (optimizer+params) and ZeRO-2 (bf16 gradients), each against the same layout without
    offload; the offload directories hold no named file while the runs are on."""
    z3, z1, z2 = ("parallel.zero=3",), ("parallel.zero=1",), ("parallel.zero=2",)
    diloco = ("parallel.replicas=2", "parallel.dp=1", "parallel.zero=1",
              "parallel.sync_every=2")
    bf16_z3 = ("parallel.zero=3", "train.precision=bf16")
    bf16_z2 = ("parallel.zero=2", "train.precision=bf16", "parallel.grad_reduce_dtype=bf16")
    cases = [z3, (*z3, *PARAMS), (*z3, *PARAMS, "parallel.offload_overlap=true"),
             (*z3, *OPTIMIZER),
             z1, (*z1, *OPTIMIZER),
             z2, (*z2, *OPTIMIZER), (*z2, "parallel.offload=optimizer"),
             diloco, (*diloco, *OPTIMIZER),
             bf16_z3, (*bf16_z3, *PARAMS), bf16_z2, (*bf16_z2, *OPTIMIZER)]
    results = run_distributed(2, run_and_fingerprint, _configs(tmp_path, cases, 2), STEPS)
    for rank in results:
        r = dict(enumerate(rank))
        for plain, offloaded in ((0, 1), (0, 2), (0, 3), (4, 5), (6, 7), (6, 8), (9, 10),
                                 (11, 12), (13, 14)):
            _assert_same(r[plain], r[offloaded], f"{cases[offloaded]}")
        for i in (1, 2, 3, 5, 7, 10, 12, 14):
            assert r[i][2] == [], cases[i]  # nvme: an empty (existing) rank directory
    assert (tmp_path / "run1" / "offload" / "rank1").is_dir()


def test_offload_with_other_axes_is_bit_identical_to_none(tmp_path):
    """tp 2 × dp 2, pp 2 × dp 2 (1F1B, two micro-batches) and an MoE model at dp 4 × ep 2, all
    ZeRO-3 with parameters and optimizer on nvme (the MoE run re-places its experts after step
    2, moving offloaded state), and cp 2 × dp 2 at ZeRO-2 with the optimizer
    on nvme, each against the same layout without offload."""
    z3 = ("parallel.zero=3", "parallel.dp=2")
    layouts = [(*z3, "parallel.tp=2"),
               (*z3, "parallel.pp=2", "parallel.microbatches=2"),
               ("parallel.zero=3", "parallel.dp=4", "model.moe_experts=4", "parallel.ep=2",
                "parallel.ep_rebalance_every=2"),
               ("parallel.zero=2", "parallel.dp=2", "parallel.cp=2")]
    cases = []
    for layout in layouts:
        kind = OPTIMIZER if "parallel.zero=2" in layout else PARAMS
        cases += [layout, (*layout, *kind)]
    results = run_distributed(4, run_and_fingerprint, _configs(tmp_path, cases, 4), 3)
    for rank in results:
        for i in range(0, len(cases), 2):
            _assert_same(rank[i], rank[i + 1], f"{cases[i + 1]}")


# ------------------------------------------------------------------------- checkpoints


def train_then_save(config_dict: dict, steps: int) -> list[float]:
    """``steps`` steps, then a checkpoint; the losses."""
    trainer = build_trainer(config_dict)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    trainer.save_checkpoint()
    return losses


def resume_and_finish(config_dict: dict) -> list[float]:
    """Resume (``checkpoint.resume=auto``) and train to ``train.steps``; the losses."""
    return [r["loss"] for r in build_trainer(config_dict).fit()]


def _cfg(run_dir, *overrides, nproc):
    return tiny_config(f"train.steps={TOTAL}", *overrides, run_dir=str(run_dir),
                       nproc=nproc).to_dict()


def _saved_tensors(run_dir) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint, whole, by name."""
    import torch.distributed.checkpoint as dcp

    from meshtrain.checkpoint import manager
    from meshtrain.checkpoint.safe_reader import SafeFileSystemReader

    config = config_from_dict(_cfg(run_dir, nproc=1))
    directory = manager.newest_valid(manager.checkpoint_root(config))
    reader = SafeFileSystemReader(str(directory))
    names = [n for n, md in reader.read_metadata().state_dict_metadata.items()
             if hasattr(md, "size")]
    state = {n: torch.zeros(tuple(reader.read_metadata().state_dict_metadata[n].size))
             for n in names}
    with warnings.catch_warnings():  # read in this (non-distributed) process on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted one-process run's losses."""
    run_dir = tmp_path_factory.mktemp("reference")
    return resume_and_finish(_cfg(run_dir, nproc=1))


def test_offloaded_checkpoint_is_the_same_and_resumes_without_offload_elsewhere(tmp_path,
                                                                                reference):
    """dp 2 ZeRO-3 saved with parameters and optimizer on nvme writes the same tensors, bit
    for bit under the same names, as without offload; it resumes in one process without
    offload and at tp 2 without offload, on the reference's losses."""
    plain = _cfg(tmp_path / "plain", "parallel.zero=3", nproc=2)
    offloaded = _cfg(tmp_path / "offloaded", "parallel.zero=3", *PARAMS, nproc=2)
    first = run_distributed(2, train_then_save, plain, SPLIT)[0]
    assert run_distributed(2, train_then_save, offloaded, SPLIT)[0] == first
    saved, saved_plain = _saved_tensors(tmp_path / "offloaded"), _saved_tensors(tmp_path / "plain")
    assert sorted(saved) == sorted(saved_plain) and any(n.startswith("optim.") for n in saved)
    for name, tensor in saved_plain.items():
        assert torch.equal(saved[name], tensor), name
    shutil.copytree(tmp_path / "offloaded", tmp_path / "tp")
    rest = resume_and_finish(_cfg(tmp_path / "offloaded", "checkpoint.resume=auto", nproc=1))
    assert first + rest == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
    tp = _cfg(tmp_path / "tp", "parallel.tp=2", "checkpoint.resume=auto", nproc=2)
    rest = run_distributed(2, resume_and_finish, tp)[0]
    assert first + rest == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)


def test_plain_checkpoint_resumes_with_offload_elsewhere(tmp_path, reference):
    """One process saved without offload; dp 2 ZeRO-3 resumes it with parameters and optimizer
    on nvme (and dp 2 ZeRO-1 with the optimizer on nvme) on the reference's losses."""
    first = train_then_save(_cfg(tmp_path / "one", nproc=1), SPLIT)
    shutil.copytree(tmp_path / "one", tmp_path / "z1")
    z3 = _cfg(tmp_path / "one", "parallel.zero=3", *PARAMS, "checkpoint.resume=auto", nproc=2)
    z1 = _cfg(tmp_path / "z1", "parallel.zero=1", *OPTIMIZER, "checkpoint.resume=auto",
              nproc=2)
    for config in (z3, z1):
        rest = run_distributed(2, resume_and_finish, config)[0]
        assert first + rest == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
