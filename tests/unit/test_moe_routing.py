"""Unit tests of MoE routing semantics, step statistics and the expert-parallel building blocks
(single process)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from meshtrain.config import ConfigError, ModelConfig
from meshtrain.model import build_model
from meshtrain.parallel.comm import CommLog, CountedComm
from meshtrain.parallel.expert import ExpertParallelExperts
from meshtrain.training.moe_stats import summarize_loads
from meshtrain.validation import validate_config
from tests.helpers import tiny_config

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=64, moe_experts=4,
                     moe_top_k=2, moe_ffn_dim=16)


def _moe(**changes):
    return build_model(dataclasses.replace(CONFIG, **changes)).layers["0"].moe


def _tokens(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, CONFIG.dim, generator=torch.Generator().manual_seed(seed))


def test_aux_loss_is_switch_formula_over_the_forward_tokens():
    moe = _moe(moe_balance="aux-loss", moe_aux_coef=0.1)
    x = _tokens()
    moe(x)
    scores = torch.softmax(x @ moe.router.weight.T, dim=-1)
    counts = moe.last_stats["tokens_per_expert"].float()
    expected = 0.1 * 4 * ((counts / counts.sum()) * scores.mean(dim=0)).sum()
    torch.testing.assert_close(moe.last_stats["aux_loss"], expected)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_top_k_gates_are_normalised_and_shared_experts_always_run(score):
    moe = _moe(moe_score=score, moe_shared_experts=1)
    x = _tokens()
    indices, weights, _ = moe.route(x)
    assert indices.shape == (24, 2) and (indices[:, 0] != indices[:, 1]).all()
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(24))
    routed, _ = moe.compute_experts(x, indices, weights)
    torch.testing.assert_close(moe(x), routed + moe.shared_experts(x))


def test_step_stats_sum_forwards_but_not_checkpoint_recomputation():
    moe = _moe()
    x = _tokens().requires_grad_()
    moe(x)
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # recomputed in backward
    stats = moe.pop_step_stats()
    assert stats["forwards"].item() == 2
    assert stats["tokens_per_expert"].sum().item() == 2 * 24 * 2
    assert moe.pop_step_stats()["forwards"].item() == 0  # popped: a fresh window


def test_load_summary():
    table = torch.tensor([[4.0, 4.0, 4.0, 4.0, 0.0], [10.0, 2.0, 2.0, 2.0, 3.0]],
                         dtype=torch.float64)
    summary = summarize_loads(table, [1, 3])
    assert summary["dropped"] == 3
    assert summary["layers"]["1"] == {"max_load": 4, "mean_load": 4.0, "max_over_mean": 1.0,
                                      "cv": 0.0, "dropped": 0}
    assert summary["layers"]["3"]["max_over_mean"] == pytest.approx(2.5)
    assert summary["layers"]["3"]["cv"] == pytest.approx(torch.tensor(
        [10.0, 2, 2, 2]).std(unbiased=False).item() / 4)
    assert summary["max_over_mean"] == pytest.approx(2.5)


def test_expert_parallel_experts_on_one_rank_equal_grouped_experts():
    moe = _moe()
    comm = CountedComm("ep", None, 1, CommLog())
    local = ExpertParallelExperts(moe.experts, comm, ep_rank=0, ep_size=1)
    torch.testing.assert_close(local.w1, moe.experts.w1)
    assert local.w1._meshtrain_dp_axis == "edp" and local.w1._meshtrain_full_shape == (4, 32, 16)
    x, counts = _tokens(10), [3, 0, 5, 2]
    torch.testing.assert_close(local(x, counts), moe.experts(x, counts))


def test_expert_slice_takes_its_experts_of_the_full_tensor():
    moe = _moe()
    comm = CountedComm("ep", None, 1, CommLog())
    second = ExpertParallelExperts(moe.experts, comm, ep_rank=1, ep_size=2)
    torch.testing.assert_close(second.w2, moe.experts.w2[2:4])
    full = torch.arange(4 * 16 * 32.0).view(4, 16, 32)
    torch.testing.assert_close(second.w2._meshtrain_shard(full), full[2:4])
    assert second.w2._meshtrain_global_offset == (2, 0, 0)


def test_bias_balancing_does_not_depend_on_micro_batching():
    from meshtrain.model import moe_layers
    from meshtrain.training.trainer import Trainer
    from meshtrain.worker import build_mesh

    runs = []
    for micro in (1, 4):
        config = tiny_config("model.moe_experts=4", "model.moe_balance=bias",
                             "model.moe_bias_rate=0.01", f"parallel.microbatches={micro}")
        trainer = Trainer(config, build_mesh(config))
        records = [trainer.train_step() for _ in range(2)]
        runs.append((records, [m.expert_bias.clone() for m in moe_layers(trainer.model)]))
    (one, bias_one), (four, bias_four) = runs
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in four], abs=1e-5)
    for a, b in zip(bias_one, bias_four, strict=True):
        torch.testing.assert_close(a, b)
    assert one[0]["moe"]["layers"]["0"]["mean_load"] == 8 * 16 * 2 / 4


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.ep=3"], "does not divide parallel.dp = 4"),
    (["model.moe_experts=6", "parallel.ep=4"], "not divisible by parallel.ep"),
    (["model.moe_top_k=5"], "moe_top_k = 5 must be between 1"),
    (["parallel.ep=2", "model.moe_experts=0"], "needs a Mixture-of-Experts model"),
    (["parallel.ep=2", "parallel.zero=3"], "zero = 3 with parallel.ep > 1"),
])
def test_bad_expert_parallel_configs(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny_config("model.moe_experts=4", *overrides, nproc=4)


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[2].glob("configs/*.toml")),
                         ids=lambda p: p.name)
def test_example_configs_are_valid(path):
    from meshtrain.config import load_config

    assert validate_config(load_config(path)) >= 1
