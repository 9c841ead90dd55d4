"""ZeRO-3 with expert parallelism: expert parameters sharded over the ranks that hold them.

Under ZeRO-3 an MoE unit is one bucket per reduction axis: router (and shared experts) sharded
over ``dp``, the experts over ``edp`` (the ``dp × tp / ep`` ranks holding the same experts). Each
layout is checked against one process on the same data and weights in fp32 within
:mod:`meshtrain.commands.verify`'s tolerances (loss 2e-4: the layouts sum the same terms in another
order; gradient norm relative 1e-3): dp2 × ep2, dp4 × ep2 with 2 micro-batches, and dp2 × tp2 with
ep 4 folded over the tp ranks. Each rank's share of the expert elements, read off the buffers it
really holds at rest, is ``1 / (ep · edp)``; a checkpoint saved at dp4 × ep2 ZeRO-3 resumes on one
process and at tp4 × ep2 ZeRO-3 with the losses of one uninterrupted process, and the final
weights gathered from a ZeRO-3 layout are one process's tensors.
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
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32",
       "model.moe_balance=aux-loss", "model.moe_aux_coef=0.5", "parallel.zero=3")


def _expert_share(trainer) -> dict:
    """The expert elements this rank holds at rest (its ``edp`` buckets' parameter shards, and
    their padding) against the full model's, and what is left in their full buffers."""
    from meshtrain.parallel.expert import ExpertParallelExperts

    full = 0
    for module in trainer.model.modules():
        if isinstance(module, ExpertParallelExperts):
            for param in (module.w1, module.w2, module.w3):
                full += param.numel() // param.shape[0] * module.total_experts
    engine = trainer.engine
    expert = [b for b in engine.buckets if b.axis == "edp"]
    held = sum(b.param_shard.numel() for b in expert)
    padding = sum(b.padded_numel - b.numel for b in expert)
    return {"held": held, "padding": padding, "full": full,
            # A released full buffer's pages are handed back and read as zeros (CUDA: 0 bytes).
            "resident": sum(int(b.param_buffer.count_nonzero()) for b in expert),
            "axes": sorted({b.axis for b in engine.buckets})}


def train_cases(config_dicts: list[dict], steps: int) -> list[dict]:
    """Train each config ``steps`` steps; this rank's records and expert share."""
    out = []
    for config_dict in config_dicts:
        trainer = build_trainer(config_dict)
        records = [trainer.train_step() for _ in range(steps)]
        out.append({"records": records, "share": _expert_share(trainer)})
    return out


def test_zero3_with_expert_parallelism_matches_one_process():
    """dp4 × ep2 (edp 2, 2 micro-batches), dp2 × tp2 × ep4 (experts folded over tp, edp 1), and
    dp2 × tp2 × ep2 with sequence parallelism and small buckets (so blocks split into several
    ZeRO-3 units, the MoE unit one bucket per axis; edp 2 over the dp ranks)."""
    cases = [
        tiny_config(*MOE, "parallel.dp=4", "parallel.ep=2", "parallel.microbatches=2",
                    nproc=4),
        tiny_config(*MOE, "parallel.dp=2", "parallel.tp=2", "parallel.ep=4", nproc=4),
        tiny_config(*MOE, "parallel.dp=2", "parallel.tp=2", "parallel.ep=2",
                    "parallel.sequence_parallel=true", "parallel.dp_bucket_mb=0.004", nproc=4),
    ]
    by_rank = run_distributed(4, train_cases, [c.to_dict() for c in cases], STEPS, timeout=900)
    for index, config in enumerate(cases):
        assert_matches_one_process(by_rank[0][index]["records"], config, STEPS)
        par = config.parallel
        edp = par.dp * par.tp // par.ep
        for rank in by_rank:
            share = rank[index]["share"]
            assert share["axes"] == ["dp", "edp"]
            # 1 / (ep · edp) of the experts, give or take the padding to a multiple of edp.
            assert share["held"] * par.ep * edp - share["padding"] * par.ep <= share["full"]
            assert share["full"] <= share["held"] * par.ep * edp
            assert share["resident"] == 0  # the full expert buffers are released at rest


def test_zero3_with_experts_at_dp2_ep2_matches_one_process():
    """Two processes, one expert group: each rank holds half the experts, unsharded (edp 1),
    its dense parameters sharded over dp 2."""
    config = tiny_config(*MOE, "parallel.dp=2", "parallel.ep=2", nproc=2)
    by_rank = run_distributed(2, train_cases, [config.to_dict()], STEPS)
    assert_matches_one_process(by_rank[0][0]["records"], config, STEPS)
    for rank in by_rank:
        share = rank[0]["share"]
        assert share["held"] * 2 == share["full"] and share["padding"] == 0


def test_zero3_expert_checkpoint_moves_between_layouts(tmp_path):
    """Save at dp4 × ep2 ZeRO-3, resume on one process, then at tp4 × ep2 ZeRO-3 (experts
    folded over the tp ranks, each expert half sharded over an edp group of two tp ranks), which
    also writes the final weights: the losses and final tensors are one process's."""
    import torch

    from meshtrain.checkpoint import iter_weights

    bias = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32",
            "model.moe_balance=bias", "model.moe_bias_rate=0.01", "train.steps=4")

    def cfg(*overrides, nproc):
        return tiny_config(*bias, "checkpoint.resume=auto", *overrides,
                           run_dir=str(tmp_path / "run"), nproc=nproc).to_dict()

    reference = train_and_save(tiny_config(*bias, run_dir=str(tmp_path / "ref"),
                                           nproc=1).to_dict(), 4, True)
    z3 = "parallel.zero=3"
    losses = run_distributed(4, train_and_save, cfg("parallel.dp=4", "parallel.ep=2", z3,
                                                    nproc=4), 2)[0]
    losses += train_and_save(cfg(nproc=1), 1)
    losses += run_distributed(4, train_and_save, cfg("parallel.tp=4", "parallel.ep=2", z3,
                                                     nproc=4), 1, True)[0]
    assert losses == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
    saved = dict(iter_weights(tmp_path / "run" / "final"))
    expected = dict(iter_weights(tmp_path / "ref" / "final"))
    assert saved.keys() == expected.keys()
    for name, value in expected.items():  # fp32 sums in another order, 4 steps of Adam
        torch.testing.assert_close(saved[name], value, atol=1e-4, rtol=0, msg=name)


def test_zero3_expert_moves_match_one_process():
    """Dynamic expert placement at ZeRO-3: forced general permutations (experts change rank and
    local index, across the edp shards of dp4 × ep2) and a rebalance of a skewed router, each
    against one process; the rebalance halves the busiest ep rank's tokens."""
    from tests.parallel.test_expert_placement import (
        ASSIGNMENTS,
        SKEW,
        _assert_parity,
        run_cases,
    )
    from tests.parallel.test_expert_placement import (
        MOE as PLACED,
    )

    forced_cfg = tiny_config(*PLACED, "model.moe_balance=bias", "model.moe_bias_rate=0.01",
                             "parallel.ep=2", "parallel.zero=3", nproc=4)
    forced = {1: {0: [1, 3, 0, 2], 1: [2, 3, 0, 1]}, 2: {0: [3, 2, 1, 0]}}
    skewed = tiny_config(*PLACED, *SKEW, "parallel.ep_rebalance_every=2", "parallel.ep=2",
                         "parallel.zero=3", nproc=4)
    by_rank = run_distributed(4, run_cases, [(forced_cfg.to_dict(), 4, False, forced),
                                             (skewed.to_dict(), 4, True, {})], timeout=900)
    _assert_parity(forced_cfg, by_rank[0][0]["records"], False)
    _assert_parity(skewed, by_rank[0][1]["records"], True)
    moe = [r["moe"] for r in by_rank[0][1]["records"]]
    assert [m["ep_max_rank_tokens"] for m in moe] == [ASSIGNMENTS] * 2 + [ASSIGNMENTS / 2] * 2
