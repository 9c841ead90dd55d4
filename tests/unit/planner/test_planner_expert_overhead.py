"""The per-expert overhead of a stack's MoE layers (``StackEfficiency.expert_overhead_ns``):
priced only where a stack has it, only on MoE layers, shrinking as expert parallelism spreads the
experts, reported in the estimate, and fitted on its train row alone."""

import dataclasses

import pytest

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.workload import STACKS, Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.planner.tables.published import published_rows
from meshtrain.planner.tables.stacks import MEGATRON_CORE_2025_H100

MOE = ModelConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=4,
                  ffn_dim=6144, moe_experts=64, moe_top_k=4, moe_ffn_dim=768)
DENSE = dataclasses.replace(MOE, moe_experts=0)


def _without_overhead(traits):
    entries = tuple((family, dataclasses.replace(entry, expert_overhead_ns=0.0))
                    for family, entry in traits.kernel_efficiency)
    return dataclasses.replace(traits, kernel_efficiency=entries)


def _step(model, layout, traits, profile="h100-80g"):
    work = Workload(model, 4096, 64, "bf16", traits)
    return estimate(work, layout, Cluster(PROFILES[profile], layout.world_size, 8))


def test_only_moe_layers_of_a_stack_with_an_entry_pay_it():
    stack = STACKS["megatron-core-2025"]
    layout = Layout(dp=8, ep=8, zero=1)
    with_it = _step(MOE, layout, stack)
    assert with_it["kernel_efficiency"]["expert_overhead_ns"] == pytest.approx(
        MEGATRON_CORE_2025_H100.expert_overhead_ns)
    assert with_it["step_time_s"] > _step(MOE, layout, _without_overhead(stack))["step_time_s"]
    # A dense model, another stack, another GPU generation: nothing added.
    dense = Layout(dp=8, zero=1)
    assert _step(DENSE, dense, stack)["step_time_s"] == pytest.approx(
        _step(DENSE, dense, _without_overhead(stack))["step_time_s"])
    assert _step(MOE, layout, STACKS["megatron-core-2024"])["kernel_efficiency"][
        "expert_overhead_ns"] == 0
    assert _step(MOE, layout, stack, "a100-80g")["kernel_efficiency"]["expert_overhead_ns"] == 0


def test_spreading_the_experts_over_more_ranks_shrinks_it_in_proportion():
    stack = STACKS["megatron-core-2025"]
    added = {}
    for ep in (2, 4, 8):
        layout = Layout(dp=8, ep=ep, zero=1)
        added[ep] = (_step(MOE, layout, stack)["breakdown"]["compute_s"]
                     - _step(MOE, layout, _without_overhead(stack))["breakdown"]["compute_s"])
    # The same tokens per rank; 32, 16 and 8 local experts.
    assert added[2] == pytest.approx(2 * added[4], rel=1e-6)
    assert added[4] == pytest.approx(2 * added[8], rel=1e-6)


def test_it_is_fitted_on_one_train_row_and_checked_on_the_other_qwen3_rows():
    rows = [r for r in published_rows() if r.fits == "megatron-core-2025 h100 experts"]
    assert [r.name for r in rows] == ["Qwen3 30B-A3B FP8 16 H100 (26.02)"]
    checked = [r for r in published_rows()
               if r.stack == "megatron-core-2025" and r.workload.model.moe_experts
               and r.split == "test"]
    assert len(checked) == 4


def test_the_estimate_text_names_it_for_an_moe_model_only(capsys):
    from meshtrain.cli import main

    base = ["estimate", "--hardware", "h100-80g", "--gpus", "16", "--stack",
            "megatron-core-2025", "--set", "parallel.dp=16", "--set", "parallel.zero=1"]
    assert main([*base, "--model", "qwen3-30b-a3b", "--set", "parallel.ep=8",
                 "--set", "parallel.microbatches=64"]) == 0
    overhead = MEGATRON_CORE_2025_H100.expert_overhead_ns
    assert f"MoE layers {overhead:.0f} ns a routed token per local expert" in \
        capsys.readouterr().out
    assert main([*base, "--model", "llama3-8b"]) == 0
    assert "routed token" not in capsys.readouterr().out
