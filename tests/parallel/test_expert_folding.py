"""Experts folded over the tensor-parallel ranks (expert layout independent of attention's).

At dp2 × tp2 with ep 4 every rank holds one of the 4 experts (read from its own parameter
tensors) and computes only its share of the assignments, and the run matches one process in
fp32 within :mod:`meshtrain.commands.verify`'s tolerances (loss 2e-4: the layouts sum the same
terms in another order; gradient norm relative 1e-3), with and without sequence parallelism, and at
pp2 × tp2 with ep 2 spanning the tp ranks. The measured ``comm_bytes.ep`` equals the planner's
``ep_comm_bytes``, and a checkpoint saved at dp2 × tp2 × ep4 resumes on one process, then at
dp2 × ep2, then back at dp2 × tp2 × ep4, with the losses of one uninterrupted process.
"""

from __future__ import annotations

import pytest

from meshtrain.commands.verify import LOSS_TOLERANCE_FP32
from meshtrain.config import Config, ConfigError, load_config
from meshtrain.validation.run_config import validate_config
from tests.distributed import run_distributed
from tests.helpers import (
    assert_matches_one_process,
    build_trainer,
    tiny_config,
    train_and_save,
)

STEPS = 2
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32",
       "model.moe_balance=aux-loss", "model.moe_aux_coef=0.5")
FOLDED = ("parallel.tp=2", "parallel.ep=4")
BIAS = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32",
        "model.moe_balance=bias", "model.moe_bias_rate=0.01")
"""Balancing from the global batch's loads: the same numbers whatever the dp × micro-batch split
(the aux loss is per micro-batch, so its one-process reference must split alike)."""


def _expert_holdings(trainer) -> dict:
    """This rank's expert parameters as it really holds them: per MoE layer the global experts
    of its rows, and its expert elements against the full model's."""
    from meshtrain.parallel.expert import ExpertParallelExperts

    held, local, full = {}, 0, 0
    for name, module in trainer.model.named_modules():
        if isinstance(module, ExpertParallelExperts):
            held[name] = module.placement.local_experts()
            assert module.w1.shape[0] == len(held[name])
            for param in (module.w1, module.w2, module.w3):
                local += param.numel()
                full += param.numel() // param.shape[0] * module.total_experts
    return {"experts": held, "local": local, "full": full}


def train_cases(config_dicts: list[dict], steps: int) -> list[dict]:
    """Train each config ``steps`` steps; this rank's records and expert holdings."""
    out = []
    for config_dict in config_dicts:
        trainer = build_trainer(config_dict)
        records = [trainer.train_step() for _ in range(steps)]
        out.append({"records": records, "holdings": _expert_holdings(trainer),
                    "tp_rank": trainer.mesh.tp_rank, "ep_rank": trainer.mesh.ep_rank})
    return out


def _planned_ep_bytes(config: Config) -> float:
    """The planner's ``comm_bytes.ep`` per rank and step, averaged over the pipeline stages."""
    from meshtrain.planner.cost.expert_parallel import ep_step_bus_bytes
    from meshtrain.planner.cost.workload import Workload

    layers = list(range(config.model.n_layers))
    workload = Workload.from_config(config)
    return ep_step_bus_bytes(workload, config.parallel.layout(), layers) / config.parallel.pp


def test_dp2_tp2_ep4_holds_one_expert_per_rank_and_matches_one_process():
    """The done-when check: 4 processes, 4 experts, ep 4 spanning the tp ranks (and the same
    with sequence parallelism, and pp2 × tp2 with ep 2 folded over tp, ZeRO-1 / ZeRO-2)."""
    cases = [
        tiny_config(*MOE, *FOLDED, "parallel.zero=1", nproc=4),
        tiny_config(*MOE, *FOLDED, "parallel.sequence_parallel=true", "parallel.zero=2",
                    "parallel.microbatches=2", nproc=4),
        tiny_config(*MOE, "parallel.tp=2", "parallel.ep=2", "parallel.pp=2",
                    "parallel.microbatches=2", "model.n_layers=4", nproc=4),
    ]
    by_rank = run_distributed(4, train_cases, [c.to_dict() for c in cases], STEPS, timeout=900)
    for index, config in enumerate(cases):
        assert_matches_one_process(by_rank[0][index]["records"], config, STEPS)
        ranks = [rank[index] for rank in by_rank]
        mean_ep = [sum(r["records"][s]["comm_bytes"]["ep"] for r in ranks) / len(ranks)
                   for s in range(STEPS)]
        assert mean_ep == pytest.approx([_planned_ep_bytes(config)] * STEPS, rel=1e-9)
    for index in (0, 1):  # ep 4: every rank one expert, a quarter of the expert elements
        holdings = [rank[index]["holdings"] for rank in by_rank]
        for h in holdings:
            assert h["local"] * 4 == h["full"] > 0
            assert all(len(experts) == 1 for experts in h["experts"].values())
        for layer in holdings[0]["experts"]:
            assert sorted(h["experts"][layer][0] for h in holdings) == [0, 1, 2, 3]
    # pp2 × tp2 × ep2: the two tp ranks of a stage hold different halves of the experts.
    for rank in by_rank:
        h = rank[2]["holdings"]
        assert h["local"] * 2 == h["full"]
        assert all(e == [2 * rank[2]["tp_rank"], 2 * rank[2]["tp_rank"] + 1]
                   for e in h["experts"].values())


@pytest.mark.slow
def test_checkpoint_round_trip_across_folded_and_plain_layouts(tmp_path):
    """Save at dp2 × tp2 × ep4, resume on one process, then at dp2 × ep2, then back at
    dp2 × tp2 × ep4: the experts land where they belong (the losses are one process's, and the
    final weights gathered from the folded layout are one process's tensors)."""
    import torch

    from meshtrain.checkpoint import iter_weights

    def cfg(*overrides, nproc):
        return tiny_config(*BIAS, "train.steps=5", "checkpoint.resume=auto", *overrides,
                           run_dir=str(tmp_path / "run"), nproc=nproc).to_dict()

    reference = train_and_save(tiny_config(*BIAS, "train.steps=5", run_dir=str(tmp_path / "ref"),
                                           nproc=1).to_dict(), 5, True)
    losses = run_distributed(4, train_and_save, cfg(*FOLDED, "parallel.zero=1", nproc=4), 2)[0]
    losses += train_and_save(cfg(nproc=1), 1)
    losses += run_distributed(2, train_and_save, cfg("parallel.ep=2", "parallel.zero=2",
                                                     nproc=2), 1)[0]
    losses += run_distributed(4, train_and_save, cfg(*FOLDED, nproc=4), 1, True)[0]
    assert losses == pytest.approx(reference, abs=LOSS_TOLERANCE_FP32)
    saved = dict(iter_weights(tmp_path / "run" / "final"))
    expected = dict(iter_weights(tmp_path / "ref" / "final"))
    assert saved.keys() == expected.keys()
    for name, value in expected.items():  # fp32 sums in another order, 5 steps of Adam
        torch.testing.assert_close(saved[name], value, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("overrides, fragment", [
    (("parallel.tp=2", "parallel.ep=3", "model.moe_experts=6"), "does not divide parallel.dp"),
    (("parallel.tp=4", "parallel.ep=6", "model.moe_experts=12", "parallel.dp=3",
      "train.global_batch=12"), "neither divides parallel.tp"),
    (("parallel.tp=2", "parallel.ep=4", "model.moe_experts=6"), "not divisible by parallel.ep"),
])
def test_folded_degrees_are_validated(overrides, fragment):
    base = ["model.moe_experts=4", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
            "parallel.dp=2"]
    config = load_config(None, base + list(overrides))
    with pytest.raises(ConfigError, match=fragment):
        validate_config(config, None)


@pytest.mark.parametrize("total, size", [(0, 2), (1, 2), (7, 2), (8, 4), (10, 3)])
def test_tp_shares_cover_the_sorted_rows_once(total, size):
    """The tp ranks' shares of the sorted rows are disjoint and cover them, and the per-expert
    counts of the shares add up to the experts' counts."""
    import torch

    from meshtrain.parallel.expert.fold import row_range, share_counts

    counts = torch.tensor([total // 2, 0, total - total // 2])
    ranges = [row_range(total, size, r) for r in range(size)]
    rows = [i for start, stop in ranges for i in range(start, stop)]
    assert rows == list(range(total))
    shares = [share_counts(counts, start, stop) for start, stop in ranges]
    assert torch.equal(sum(shares), counts)
    assert [int(s.sum()) for s in shares] == [stop - start for start, stop in ranges]


def test_expert_groups_fold_over_tp_and_keep_the_dp_split_at_tp1():
    from meshtrain.parallel.mesh import ParallelMesh

    def groups(axis, **degrees):
        world = degrees.get("dp", 1) * degrees.get("tp", 1) * degrees.get("pp", 1)
        return sorted({tuple(ParallelMesh(rank=r, **degrees).group_ranks(axis))
                       for r in range(world)})

    # dp2 × tp2, ep 4: one expert group of all four ranks, each its own edp group.
    assert groups("ep", dp=2, tp=2, ep=4) == [(0, 1, 2, 3)]
    assert groups("edp", dp=2, tp=2, ep=4) == [(0,), (1,), (2,), (3,)]
    # dp2 × tp2, ep 2: the tp pairs hold the experts; the dp ranks replicate them.
    assert groups("ep", dp=2, tp=2, ep=2) == groups("tp", dp=2, tp=2, ep=2) == [(0, 1), (2, 3)]
    assert groups("edp", dp=2, tp=2, ep=2) == [(0, 2), (1, 3)]
    # pp2 × tp2, ep 2: each stage folds its own ranks.
    assert groups("ep", tp=2, pp=2, ep=2) == [(0, 1), (2, 3)]
    assert groups("dp_tp", tp=2, pp=2, ep=2) == [(0, 1), (2, 3)]
    # tp 1: ep consecutive data-parallel ranks, as before folding.
    assert groups("ep", dp=4, ep=2) == [(0, 1), (2, 3)]
    assert groups("edp", dp=4, ep=2) == [(0, 2), (1, 3)]
    with pytest.raises(ValueError, match="divide tp"):
        ParallelMesh(dp=3, tp=4, ep=6)
