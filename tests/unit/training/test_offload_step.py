"""The offloaded optimizer step (:mod:`meshtrain.training.offload_step`) against the step without
offload, in one process: the same losses, gradient norms, masters and moments, bit for bit, with
chunks far smaller than a shard (so every shard is cut, at unaligned range starts too), for the
fused kernel and the eager formula."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import build_trainer, tiny_config

STREAMED = ("parallel.offload=optimizer", "parallel.offload_device=nvme",
            "parallel.offload_chunk_mb=0.001")  # 4096-element chunks


def _trainer(run_dir, *overrides, fused: bool = True):
    from meshtrain.training.optimizer import FlatAdamW

    config = tiny_config("parallel.zero=1", "train.grad_clip=0.5", "train.weight_decay=0.1",
                         *overrides, run_dir=str(run_dir), nproc=1)
    trainer = build_trainer(config.to_dict())
    if not fused:
        trainer.optimizer = FlatAdamW(trainer.engine, config.train, fused=False)
    return trainer


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_streamed_step_is_bit_identical_to_the_plain_step(tmp_path, fused):
    plain = _trainer(tmp_path / "plain", fused=fused)
    streamed = _trainer(tmp_path / "streamed", *STREAMED, fused=fused)
    store = streamed.optimizer.offload
    assert store is not None and store.holds(streamed.optimizer.exp_avg[0])
    assert store.holds(streamed.optimizer.shards[0].master)
    assert max(s.master.numel() for s in streamed.optimizer.shards) > 4 * store.chunk_numel
    for _ in range(3):
        a, b = plain.train_step(), streamed.train_step()
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    assert a["grad_norm"] > 0.5  # clipping scaled every step's gradients
    for name in ("exp_avg", "exp_avg_sq"):
        for x, y in zip(getattr(plain.optimizer, name), getattr(streamed.optimizer, name),
                        strict=True):
            assert torch.equal(x, y), name
    for x, y in zip(plain.optimizer.shards, streamed.optimizer.shards, strict=True):
        assert torch.equal(x.master, y.master)
        assert torch.equal(x.bucket.param_buffer, y.bucket.param_buffer)


def test_offloaded_state_is_reported_apart(tmp_path):
    """``mem``: what the store holds is ``offload_bytes``, not optimizer or parameter bytes."""
    record = _trainer(tmp_path, *STREAMED).train_step()
    plain = _trainer(tmp_path / "plain").train_step()
    assert record["mem"]["optim_bytes"] == 0
    # master + two moments, fp32: what the plain run counts as optimizer state (moments) plus
    # the fp32 masters it shares with the parameters
    assert record["mem"]["offload_bytes"] == plain["mem"]["optim_bytes"] * 3 // 2
