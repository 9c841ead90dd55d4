"""Layout-free checkpoints: exact resume, resharding across layouts, corruption, refusal.

fp32 throughout. Resuming at the same layout must be bitwise identical; at another layout the
losses must agree within meshtrain.commands.verify's tolerance (2e-4), the same bound as layout
parity.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from meshtrain.commands.verify import LOSS_TOLERANCE_FP32
from meshtrain.config import config_from_dict
from tests.distributed import run_distributed
from tests.helpers import tiny_config

TOTAL, SPLIT = 6, 4


def _trainer(config):
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    return Trainer(config, build_mesh(config))


def train_then_stop(config_dict: dict, stop: int) -> list[float]:
    """Run ``stop`` of ``train.steps`` steps, checkpoint, and stop (a preempted job)."""

    trainer = _trainer(config_from_dict(config_dict))
    losses = [trainer.train_step()["loss"] for _ in range(stop)]
    trainer.save_checkpoint()
    return losses


def resume_and_finish(config_dict: dict) -> list[float]:
    """Resume (checkpoint.resume must be set) and train to ``train.steps``."""

    return [r["loss"] for r in _trainer(config_from_dict(config_dict)).fit()]


def uninterrupted(config_dict: dict) -> list[float]:

    return [r["loss"] for r in _trainer(config_from_dict(config_dict)).fit()]


def _cfg(run_dir, *overrides, nproc=None):
    return tiny_config(f"train.steps={TOTAL}", *overrides, run_dir=str(run_dir), nproc=nproc)


@pytest.fixture(scope="module")
def zero3_checkpoint(tmp_path_factory):
    """A dp2 ZeRO-3 run stopped after SPLIT steps, plus the uninterrupted reference losses."""
    root = tmp_path_factory.mktemp("zero3")
    reference = uninterrupted(_cfg(root / "reference", nproc=1).to_dict())
    saved = _cfg(root / "run", "parallel.zero=3", nproc=2)
    first = run_distributed(2, train_then_stop, saved.to_dict(), SPLIT)[0]
    assert first == pytest.approx(reference[:SPLIT], abs=LOSS_TOLERANCE_FP32)
    return root, reference, first


def test_exact_resume_same_layout_is_bitwise(zero3_checkpoint, tmp_path):
    root, _, first = zero3_checkpoint
    shutil.copytree(root / "run", tmp_path / "run")
    resumed = _cfg(tmp_path / "run", "parallel.zero=3", "checkpoint.resume=auto", nproc=2)
    rest = run_distributed(2, resume_and_finish, resumed.to_dict())[0]
    straight = run_distributed(2, uninterrupted,
                               _cfg(tmp_path / "straight", "parallel.zero=3", nproc=2).to_dict())[0]
    assert first + rest == straight  # bitwise: same layout, same order of every operation


@pytest.mark.parametrize("layout, nproc", [
    (("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"), 4),
    ((), 1),
])
def test_resume_at_another_layout(zero3_checkpoint, tmp_path, layout, nproc):
    root, reference, first = zero3_checkpoint
    shutil.copytree(root / "run", tmp_path / "run")
    resumed = _cfg(tmp_path / "run", *layout, "checkpoint.resume=auto", nproc=nproc)
    if nproc == 1:
        rest = resume_and_finish(resumed.to_dict())
    else:
        rest = run_distributed(nproc, resume_and_finish, resumed.to_dict())[0]
    assert len(rest) == TOTAL - SPLIT
    assert first + rest == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)


def test_interleaved_pipeline_zero1_resumes_at_dp2_zero2(tmp_path):
    """Save at pp2 interleaved (v=2) with ZeRO-1, resume at dp2 with ZeRO-2."""
    reference = uninterrupted(_cfg(tmp_path / "ref", "model.n_layers=4", nproc=1).to_dict())
    saved = _cfg(tmp_path / "run", "model.n_layers=4", "parallel.pp=2", "parallel.zero=1",
                 "parallel.pp_schedule=interleaved-1f1b", "parallel.virtual_stages=2",
                 "parallel.microbatches=2", nproc=4)
    first = run_distributed(4, train_then_stop, saved.to_dict(), SPLIT)[0]
    resumed = _cfg(tmp_path / "run", "model.n_layers=4", "parallel.zero=2",
                   "checkpoint.resume=auto", nproc=2)
    rest = run_distributed(2, resume_and_finish, resumed.to_dict())[0]
    assert first + rest == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)


def test_garbled_newest_falls_back(tmp_path, capsys):
    from meshtrain.checkpoint import manager

    config = _cfg(tmp_path, "checkpoint.every=2")
    trainer = _trainer(config)
    for _ in range(SPLIT):
        trainer.train_step()
        if trainer.step % 2 == 0:
            trainer.save_checkpoint()
    root = manager.checkpoint_root(config)
    newest = manager.step_dir(root, SPLIT)
    data_file = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    assert "does not match" in manager.verify(newest) or "bytes" in manager.verify(newest)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        chosen = manager.newest_valid(root)
    assert chosen == manager.step_dir(root, 2)
    resumed = _trainer(_cfg(tmp_path, "checkpoint.resume=auto"))
    with pytest.warns(UserWarning):
        resumed.restore()
    assert resumed.step == 2
    assert newest.exists()  # the broken one is reported, never deleted


def test_mismatched_model_refused_with_exit_2(tmp_path):
    config = _cfg(tmp_path)
    trainer = _trainer(config)
    trainer.train_step()
    trainer.save_checkpoint()
    run = subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", "--run-dir", str(tmp_path), "--set",
         "model.dim=64", "--set", "checkpoint.resume=auto", "--set", "model.n_heads=4"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "dim: checkpoint 32 vs config 64" in run.stderr and "Traceback" not in run.stderr


def test_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    """SIGKILL while a save is in progress: the previous checkpoint stays loadable."""
    from meshtrain.checkpoint import manager

    args = [sys.executable, "-m", "meshtrain", "train", "--run-dir", str(tmp_path), "--steps",
            "6", "--set", "checkpoint.every=2", "--set", "model.dim=32", "--set",
            "model.n_layers=2", "--set", "model.n_heads=4", "--set", "model.ffn_dim=64",
            "--set", "model.n_kv_heads=2", "--set", "train.warmup_steps=0",
            "--set", "train.lr=1e-2",
            "--set", "data.max_bytes=200000", "--set", "train.seq_len=16",
            "--set", "train.global_batch=8"]
    env = dict(os.environ, MESHTRAIN_TEST_SAVE_DELAY_S="8")
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    root = tmp_path / "checkpoints"
    deadline = time.time() + 240
    # Wait until the second save (step 4) is being written, i.e. step 2 is complete.
    while time.time() < deadline and not (root / ".tmp-step_00000004").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (root / ".tmp-step_00000004").exists()
    chosen = manager.newest_valid(root)
    assert chosen == manager.step_dir(root, 2)
    resumed = _trainer(tiny_config("train.steps=6", "checkpoint.resume=auto",
                                   run_dir=str(tmp_path)))
    resumed.restore()
    assert resumed.step == 2


def test_checkpoint_tensors_and_convert_to_hf(tmp_path):
    """A training checkpoint (dp2 × tp2, ZeRO-1) reads back as full tensors equal to the model's,
    and converts to a Hugging Face model with the same logits."""
    import torch

    from meshtrain.checkpoint import read_checkpoint_tensors
    from meshtrain.cli import main

    config = _cfg(tmp_path / "run", "parallel.tp=2", "parallel.zero=1", nproc=4)
    run_distributed(4, train_then_stop, config.to_dict(), 2)
    ckpt = tmp_path / "run" / "checkpoints"
    saved_config, tensors = read_checkpoint_tensors(ckpt)
    state = dict(tensors)
    assert saved_config.parallel.tp == 2 and "output.weight" in state
    assert state["layers.0.attention.wq.weight"].shape == (32, 32)  # full, not a tp shard

    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    from meshtrain.model import Transformer

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    model = Transformer(saved_config.model)
    model.load_state_dict(state, strict=False)
    tokens = torch.randint(0, saved_config.model.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)


def test_expert_parallel_round_trip(tmp_path):
    """Save an MoE model at dp2 × ep2 (ZeRO-1), resume on one process."""
    moe = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_balance=bias")
    reference = uninterrupted(_cfg(tmp_path / "ref", *moe, nproc=1).to_dict())
    saved = _cfg(tmp_path / "run", *moe, "parallel.ep=2", "parallel.zero=1", nproc=2)
    first = run_distributed(2, train_then_stop, saved.to_dict(), SPLIT)[0]
    rest = resume_and_finish(_cfg(tmp_path / "run", *moe, "checkpoint.resume=auto",
                                  nproc=1).to_dict())
    assert first + rest == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)


def test_init_from_weights_at_any_layout(tmp_path):
    """checkpoint.init_from loads full weights into any layout: tp2 and one process start from
    the same model (same first loss), which is not the fresh initialisation."""
    trained = _cfg(tmp_path / "donor", "train.steps=3", nproc=1)
    uninterrupted(trained.to_dict())
    weights = str(tmp_path / "donor" / "final")
    one = uninterrupted(_cfg(tmp_path / "one", "train.steps=1",
                             f"checkpoint.init_from={weights}", nproc=1).to_dict())
    tp2 = run_distributed(2, uninterrupted, _cfg(tmp_path / "tp2", "train.steps=1",
                                                 "parallel.tp=2",
                                                 f"checkpoint.init_from={weights}",
                                                 nproc=2).to_dict())[0]
    fresh = uninterrupted(_cfg(tmp_path / "fresh", "train.steps=1", nproc=1).to_dict())
    assert tp2 == pytest.approx(one, abs=LOSS_TOLERANCE_FP32)
    assert abs(one[0] - fresh[0]) > 0.1
