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
from meshtrain.validation.run_config import validate_config
from tests.helpers import tiny_config

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, ffn_dim=64, moe_experts=4,
                     moe_top_k=2, moe_ffn_dim=16)


def _moe(**changes):
    return build_model(dataclasses.replace(CONFIG, **changes)).layers["0"].moe


def _tokens(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, CONFIG.dim, generator=torch.Generator().manual_seed(seed))


# Four tokens whose router probabilities over the 4 experts are chosen: the router reads the first
# four input features (identity weights), and a token's features are log-probabilities, so its
# softmax gives them back exactly. Top-2 (hand-picked): {0, 1}, {1, 2}, {0, 3}, {0, 1}.
ROUTER_PROBS = [[0.4, 0.3, 0.2, 0.1],
                [0.1, 0.4, 0.3, 0.2],
                [0.5, 0.1, 0.1, 0.3],
                [0.6, 0.2, 0.15, 0.05]]
# f_i (share of the 8 assignments): 3/8, 3/8, 1/8, 1/8. P_i (mean probability): 1.6/4 = 0.4,
# 1.0/4 = 0.25, 0.75/4 = 0.1875, 0.65/4 = 0.1625. sum f_i P_i = (1.2 + 0.75 + 0.1875 + 0.1625) / 8
# = 0.2875; times E = 4 and coef 0.1: 0.115 (the uniform minimum would be 0.1).
HAND_AUX_LOSS = 0.115


def test_aux_loss_is_the_switch_loss_of_a_hand_computed_routing():
    moe = _moe(moe_balance="aux-loss", moe_aux_coef=0.1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, :4] = torch.eye(4)
    x = torch.zeros(4, CONFIG.dim)
    x[:, :4] = torch.tensor(ROUTER_PROBS).log()
    moe(x)
    assert moe.last_stats["tokens_per_expert"].tolist() == [3, 3, 1, 1]
    assert moe.last_stats["aux_loss"].item() == pytest.approx(HAND_AUX_LOSS, rel=1e-6)


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
    assert summary["layers"]["1"] == {"min_load": 4, "max_load": 4, "mean_load": 4.0,
                                      "max_over_mean": 1.0, "cv": 0.0, "dropped": 0}
    assert summary["layers"]["3"]["max_over_mean"] == pytest.approx(2.5)
    assert summary["layers"]["3"]["cv"] == pytest.approx(torch.tensor(
        [10.0, 2, 2, 2]).std(unbiased=False).item() / 4)
    assert summary["max_over_mean"] == pytest.approx(2.5)


def test_expert_parallel_experts_on_one_rank_equal_grouped_experts():
    moe = _moe()
    comm = CountedComm("ep", None, 1, CommLog())
    local = ExpertParallelExperts(moe.experts, comm, ep_rank=0, ep_size=1)
    torch.testing.assert_close(local.w1, moe.experts.w1)
    record = local.param_shardings["w1"]
    assert record.dp_axis == "edp" and record.full_shape == (4, 32, 16) and record.ep_dim == 0
    x, counts = _tokens(10), torch.tensor([3, 0, 5, 2])
    torch.testing.assert_close(local(x, counts), moe.experts(x, counts))


def test_expert_slice_takes_its_experts_of_the_full_tensor():
    moe = _moe()
    comm = CountedComm("ep", None, 1, CommLog())
    second = ExpertParallelExperts(moe.experts, comm, ep_rank=1, ep_size=2)
    torch.testing.assert_close(second.w2, moe.experts.w2[2:4])
    full = torch.arange(4 * 16 * 32.0).view(4, 16, 32)
    record = second.param_shardings["w2"]
    torch.testing.assert_close(record.local_piece(full), full[2:4])
    assert record.global_offset(3) == (2, 0, 0) and record.expert_rows() == [2, 3]


def test_bias_balancing_does_not_depend_on_micro_batching():
    from meshtrain.model import moe_layers
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

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
    (["parallel.ep=3"], "does not divide parallel.dp × parallel.tp = 4 × 1 = 4"),
    (["model.moe_experts=6", "parallel.ep=4"], "not divisible by parallel.ep"),
    (["model.moe_top_k=5"], "moe_top_k = 5 must be between 1"),
    (["parallel.ep=2", "model.moe_experts=0"], "needs a Mixture-of-Experts model"),
])
def test_bad_expert_parallel_configs(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny_config("model.moe_experts=4", *overrides, nproc=4)


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[3].glob("configs/*.toml")),
                         ids=lambda p: p.name)
def test_example_configs_are_valid(path):
    from meshtrain.config import load_config

    assert validate_config(load_config(path)) >= 1


def test_node_limited_routing_keeps_the_best_groups():
    """8 experts in 4 groups of 2, at most 2 groups per token: the groups with the largest sum
    of their two scores are kept, and the top-k comes from them only."""
    moe = _moe(moe_experts=8, moe_top_k=3, moe_groups=4, moe_max_groups=2)
    biased = torch.tensor([[0.30, 0.01, 0.20, 0.19, 0.02, 0.03, 0.25, 0.00]])
    # group sums: 0.31, 0.39, 0.05, 0.25 -> groups 1 and 0; the plain top-3 would take 6 (0.25)
    limited = moe.limit_to_groups(biased)
    assert torch.isinf(limited[0, 4:]).all() and torch.equal(limited[0, :4], biased[0, :4])
    assert torch.topk(limited, 3).indices.tolist() == [[0, 2, 3]]
    indices, weights, _ = moe.route(_tokens(64))
    groups = indices // 2
    assert all(len(set(row)) <= 2 for row in groups.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))
    unlimited = _moe(moe_experts=8, moe_top_k=3)
    with torch.no_grad():
        unlimited.router.weight.copy_(moe.router.weight)
    free = unlimited.route(_tokens(64))[0] // 2
    assert any(len(set(row)) > 2 for row in free.tolist())  # the limit does change routing


def test_first_dense_blocks():
    model = build_model(dataclasses.replace(CONFIG, n_layers=3, moe_first_dense=1))
    assert not model.layers["0"].is_moe and model.layers["1"].is_moe and model.layers["2"].is_moe
    assert hasattr(model.layers["0"], "feed_forward")


@pytest.mark.parametrize("overrides, fragment", [
    (["model.moe_first_dense=2"], r"moe_first_dense = 2 with model.moe_every = 1 leaves no MoE "
                                  r"block among the 2 layers"),
    (["model.moe_groups=3"], r"moe_groups = 3 does not divide model.moe_experts = 4; valid: 0 "
                             r"\(no groups\) or 1, 2, 4"),
    (["model.moe_max_groups=1"], "moe_max_groups = 1 needs expert groups"),
    (["model.moe_groups=2", "model.moe_max_groups=3"], "valid: 0 \\(every group\\) to 2"),
    (["model.moe_groups=4", "model.moe_max_groups=1"], "use moe_max_groups >= 2"),
])
def test_bad_fine_grained_moe_configs(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny_config("model.moe_experts=4", *overrides)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_without_norm_topk_the_gates_are_the_raw_scores(score):
    x = _tokens()
    normalised, raw = _moe(moe_score=score), _moe(moe_score=score, moe_norm_topk=False)
    indices, weights, _ = raw.route(x)
    logits = x @ raw.router.weight.t()
    scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    torch.testing.assert_close(weights, scores.gather(-1, indices))
    same_indices, normalised_weights, _ = normalised.route(x)
    assert torch.equal(indices, same_indices)  # selection is unchanged, only the gates
    torch.testing.assert_close(normalised_weights, weights / weights.sum(-1, keepdim=True))


def test_shared_gate_scales_the_shared_expert_by_a_sigmoid():
    moe = _moe(moe_shared_experts=1, moe_shared_ffn_dim=24, moe_shared_gate=True)
    assert moe.shared_experts.w1.weight.shape == (24, CONFIG.dim)
    assert moe.shared_gate.weight.shape == (1, CONFIG.dim)
    x = _tokens()
    indices, weights, _ = moe.route(x)
    routed, _ = moe.compute_experts(x, indices, weights)
    gate = torch.sigmoid(x @ moe.shared_gate.weight.t())
    torch.testing.assert_close(moe(x), routed + gate * moe.shared_experts(x))
    moe(x).sum().backward()
    assert moe.shared_gate.weight.grad.abs().sum() > 0


def test_default_top1_softmax_gate_stays_the_raw_probability():
    moe = _moe(moe_top_k=1)
    x = _tokens()
    indices, weights, _ = moe.route(x)
    probs = torch.softmax(x @ moe.router.weight.t(), -1)
    torch.testing.assert_close(weights, probs.gather(-1, indices))


@pytest.mark.parametrize("overrides, fragment", [
    (["model.moe_shared_gate=true"], "moe_shared_gate = true needs shared experts"),
    (["model.moe_shared_ffn_dim=32"], "moe_shared_ffn_dim = 32 needs shared experts"),
    (["model.moe_shared_experts=1", "model.moe_shared_ffn_dim=-1"], "moe_shared_ffn_dim"),
])
def test_bad_shared_expert_configs(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny_config("model.moe_experts=4", *overrides)


def test_parameter_count_includes_the_shared_width_and_gate():
    from meshtrain.config.model_size import count_parameters

    config = dataclasses.replace(CONFIG, n_layers=2, moe_first_dense=1, moe_shared_experts=1,
                                 moe_shared_ffn_dim=40, moe_shared_gate=True)
    model = build_model(config)
    assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())
