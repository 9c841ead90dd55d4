"""ZeRO-3 under pipeline parallelism: each stage's units gathered and freed around every
micro-batch's forward and backward, reduce-scattered per micro-batch; the stage's root
parameters (embedding, head, split blocks' norms) held for the step and reduced once.

Every layout is checked against one process on the same data and weights in fp32 within
:mod:`meshtrain.commands.verify`'s tolerances (loss 2e-4: the layouts sum the same terms in another
order; gradient norm relative 1e-3), and after its steps every full parameter buffer of every rank
must hold nothing (a unit prefetched but never run, left gathered, would serve stale weights after
the optimizer step). A checkpoint saved at pp2 × dp2 ZeRO-3 resumes on one process and back at
pp2 × dp2 ZeRO-3 with one process's losses and final weights.
"""

from __future__ import annotations

import pytest

from meshtrain.commands.verify import LOSS_TOLERANCE_FP32
from tests.distributed import run_distributed
from tests.helpers import (
    assert_matches_one_process,
    build_trainer,
    tiny_config,
    train_and_save,
)

STEPS = 2
Z3_PP = ("parallel.zero=3", "parallel.pp=2", "parallel.dp=2", "model.n_layers=4")


def train_cases(config_dicts: list[dict], steps: int) -> list[dict]:
    """Train each config ``steps`` steps; this rank's records, and the non-zero elements left
    in its full parameter buffers (released at rest: none)."""
    out = []
    for config_dict in config_dicts:
        trainer = build_trainer(config_dict)
        records = [trainer.train_step() for _ in range(steps)]
        resident = sum(int(b.param_buffer.count_nonzero()) for b in trainer.engine.buckets)
        out.append({"records": records, "resident": resident,
                    "buckets": len(trainer.engine.buckets)})
    return out


def test_zero3_with_pipeline_matches_one_process():
    """1F1B with 4 micro-batches; interleaved 1F1B (2 chunks per rank) with small buckets, so
    each block is several units and its norms join the root; GPipe with full activation
    checkpointing (each unit re-run inside its backward) and tied embeddings (the matrix its own
    root bucket on both end stages, summed between them); an MoE model with ep 2 folded over the
    dp ranks (expert buckets sharded over edp); the zero-bubble schedules, whose deferred
    weight gradients reach a unit after its next micro-batch's forward may have freed it:
    ZB-H1 with QK-norm and full checkpointing, ZB-V (first and last stage on one rank) with
    tied embeddings and small buckets."""
    cases = [
        tiny_config(*Z3_PP, "parallel.microbatches=4", nproc=4),
        tiny_config(*Z3_PP, "parallel.microbatches=4", "parallel.pp_schedule=interleaved-1f1b",
                    "parallel.virtual_stages=2", "parallel.dp_bucket_mb=0.004", nproc=4),
        tiny_config(*Z3_PP, "parallel.microbatches=2", "parallel.pp_schedule=gpipe",
                    "parallel.activation_checkpointing=full", "model.tie_embeddings=true",
                    nproc=4),
        tiny_config(*Z3_PP, "parallel.microbatches=2", "parallel.ep=2", "model.moe_experts=4",
                    "model.moe_top_k=2", "model.moe_ffn_dim=32", "model.moe_balance=aux-loss",
                    "model.moe_aux_coef=0.5", nproc=4),
        tiny_config(*Z3_PP, "parallel.microbatches=4", "parallel.pp_schedule=zb-h1",
                    "model.qk_norm=true", "parallel.activation_checkpointing=full", nproc=4),
        tiny_config(*Z3_PP, "parallel.microbatches=4", "parallel.pp_schedule=zb-v",
                    "parallel.virtual_stages=2", "model.tie_embeddings=true",
                    "parallel.dp_bucket_mb=0.004", nproc=4),
    ]
    by_rank = run_distributed(4, train_cases, [c.to_dict() for c in cases], STEPS, timeout=900)
    for index, config in enumerate(cases):
        assert_matches_one_process(by_rank[0][index]["records"], config, STEPS)
        for rank in by_rank:
            assert rank[index]["buckets"] > 1
            assert rank[index]["resident"] == 0, (config.parallel, rank[index])


def test_zero3_pipeline_checkpoint_moves_between_layouts(tmp_path):
    """Save at pp2 × dp2 ZeRO-3, resume on one process, then again at pp2 × dp2 ZeRO-3, which
    writes the final weights: the losses and final tensors are one process's."""
    import torch

    from meshtrain.checkpoint import iter_weights

    common = ("model.n_layers=4", "parallel.microbatches=2", "train.steps=4")

    def cfg(*overrides, nproc):
        return tiny_config(*common, "checkpoint.resume=auto", *overrides,
                           run_dir=str(tmp_path / "run"), nproc=nproc).to_dict()

    reference = train_and_save(tiny_config(*common, run_dir=str(tmp_path / "ref"),
                                           nproc=1).to_dict(), 4, True)
    layout = ("parallel.zero=3", "parallel.pp=2", "parallel.dp=2")
    losses = run_distributed(4, train_and_save, cfg(*layout, nproc=4), 2)[0]
    losses += train_and_save(cfg(nproc=1), 1)
    losses += run_distributed(4, train_and_save, cfg(*layout, nproc=4), 1, True)[0]
    assert losses == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
    saved = dict(iter_weights(tmp_path / "run" / "final"))
    expected = dict(iter_weights(tmp_path / "ref" / "final"))
    assert saved.keys() == expected.keys()
    for name, value in expected.items():  # fp32 sums in another order, 4 steps of Adam
        torch.testing.assert_close(saved[name], value, atol=1e-4, rtol=0, msg=name)

