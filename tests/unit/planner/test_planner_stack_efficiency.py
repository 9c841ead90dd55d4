"""Kernel efficiency as a property of the stack on a GPU generation (planner.stack_efficiency)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.timing import block_cost
from meshtrain.planner.cost.workload import (
    MEGATRON_2021,
    MEGATRON_2022,
    MESHTRAIN,
    STACKS,
    TORCHTITAN_2024,
    Workload,
)
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.hardware.stack_efficiency import StackEfficiency, kernel_efficiency
from meshtrain.planner.tables.fitting import (
    fit_gemm_efficiency,
    fit_groups,
    priced,
    speed_error,
    with_stack_efficiency,
)
from meshtrain.planner.tables.presets import preset_config
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.planner.tables.published import published_rows
from meshtrain.planner.tables.stacks import (
    MEGATRON_2021_A100,
    MEGATRON_CORE_2024_H100,
    MEGATRON_DEEPSPEED_A100,
    TORCHTITAN_2024_A100,
    TORCHTITAN_2025_H100,
)


def _stack(gemm: float, attention: float | None = None, family: str = "a100"):
    entry = StackEfficiency(gemm=gemm, source="test", attention=attention)
    return dataclasses.replace(MESHTRAIN, kernel_efficiency=((family, entry),),
                               elementwise_traffic=0.0)


def test_two_stacks_on_one_gpu_differ_as_their_gemm_efficiencies_say():
    # Without per-kernel overhead or element-wise traffic, a compute-bound block's time is its
    # FLOPs over peak x efficiency: the two stacks' times stand in the inverse ratio.
    profile = dataclasses.replace(PROFILES["a100-80g"], kernel_overhead_us=0.0)
    cluster = Cluster(profile, 8, 8)
    model = preset_config("llama3-8b").model
    layout = Layout(dp=8, zero=3)
    slow, fast = (block_cost(Workload(model, 4096, 16, "bf16", _stack(gemm)), layout, cluster, 0)
                  for gemm in (0.5, 0.8))
    assert slow.compute / fast.compute == pytest.approx(0.8 / 0.5, rel=1e-6)
    # The estimate says which efficiency it used, and prices the step accordingly.
    results = [estimate(Workload(model, 4096, 16, "bf16", _stack(g)), layout, cluster,
                        use_simulator=False) for g in (0.5, 0.8)]
    assert [r["kernel_efficiency"]["gemm"] for r in results] == [0.5, 0.8]
    assert results[0]["step_time_s"] > results[1]["step_time_s"]
    assert all(r["kernel_efficiency"]["from"] == "stack entry a100" for r in results)


def test_a_stacks_attention_entry_replaces_the_profiles():
    profile = dataclasses.replace(PROFILES["a100-80g"], kernel_overhead_us=0.0)
    cluster = Cluster(profile, 1, 8)
    model = preset_config("llama3-8b").model
    costs = {a: block_cost(Workload(model, 8192, 1, "bf16", _stack(0.7, a)), Layout(), cluster, 0)
             for a in (None, 0.75, 0.375)}
    assert costs[None].forward == pytest.approx(costs[0.75].forward)  # the profile's 0.75
    assert costs[0.375].forward > costs[0.75].forward


def test_published_stacks_carry_their_a100_fits():
    a100 = PROFILES["a100-80g"]
    assert kernel_efficiency(MEGATRON_2021.kernel_efficiency, a100).gemm == MEGATRON_2021_A100.gemm
    assert (kernel_efficiency(TORCHTITAN_2024.kernel_efficiency, a100).gemm
            == TORCHTITAN_2024_A100.gemm)
    # Korthikanti et al. 2022 ran the same code on the same cluster: the 2021 fit carries over.
    assert MEGATRON_2022.kernel_efficiency == MEGATRON_2021.kernel_efficiency
    assert STACKS["megatron-2021-torch-ddp"].kernel_efficiency == MEGATRON_2021.kernel_efficiency
    # Megatron-DeepSpeed has its own, lower A100 entry, fitted on one MT-NLG run.
    deepspeed = kernel_efficiency(STACKS["megatron-deepspeed"].kernel_efficiency, a100)
    assert deepspeed.gemm == MEGATRON_DEEPSPEED_A100.gemm < MEGATRON_2021_A100.gemm


@pytest.mark.parametrize("stack,profile", [("meshtrain", "a100-80g"), ("meshtrain", "h100-80g"),
                                           ("torchtitan-2024", "h100-96g-hbm2e-500w"),
                                           ("megatron-2021", "h100-80g"),
                                           ("torchtitan-2024", "b200")])
def test_a_stack_without_an_entry_falls_back_to_the_profile(stack, profile):
    p = PROFILES[profile]
    kernels = kernel_efficiency(STACKS[stack].kernel_efficiency, p)
    assert kernels.gemm == p.matmul_efficiency and kernels.attention is None
    assert kernels.family == "" and p.efficiency_source in kernels.source
    assert kernels.to_dict(p)["attention"] == p.attention_efficiency


def test_h100_family_entries_apply_to_every_profile_with_h100_compute():
    stack = _stack(0.5, family="h100")
    for name in ("h100-80g", "h100-96g", "h100-96g-hbm2e-500w", "h800", "h200"):
        assert kernel_efficiency(stack.kernel_efficiency, PROFILES[name]).gemm == 0.5
    assert (kernel_efficiency(stack.kernel_efficiency, PROFILES["a100-80g"]).gemm
            == MEGATRON_2021_A100.gemm)


def test_a_calibrated_profile_keeps_its_measured_figures():
    measured = dataclasses.replace(PROFILES["a100-80g"], matmul_efficiency=0.55,
                                   measured={"reference_block": {}})
    kernels = kernel_efficiency(TORCHTITAN_2024.kernel_efficiency, measured)
    assert kernels.gemm == 0.55 and "measured" in kernels.source
    cpu = dataclasses.replace(PROFILES["a100-80g"], family="", matmul_efficiency=0.9,
                              attention_by_head_dim={"64": [0.2, 3.0]})
    kernels = kernel_efficiency(TORCHTITAN_2024.kernel_efficiency, cpu)
    assert kernels.gemm == 0.9 and kernels.to_dict(cpu)["attention"] is None


def test_every_profile_and_stack_entry_states_its_source():
    for profile in PROFILES.values():
        assert profile.family and profile.efficiency_source, profile.name
    for traits in STACKS.values():
        for family, entry in traits.kernel_efficiency:
            assert family in {p.family for p in PROFILES.values()} and entry.source
    for entry in (MEGATRON_2021_A100, TORCHTITAN_2024_A100, MEGATRON_CORE_2024_H100,
                  TORCHTITAN_2025_H100, MEGATRON_DEEPSPEED_A100):
        assert "train row" in entry.source, entry.source


def _mean_speed_error(rows, gemm):
    return sum(speed_error(r, priced(with_stack_efficiency(r, gemm),
                                     dataclasses.replace(PROFILES[r.profile], max_mfu=0.0)))
               for r in rows) / len(rows)


@pytest.mark.parametrize("key,entry", [("megatron-2021 a100", MEGATRON_2021_A100),
                                       ("torchtitan-2024 a100", TORCHTITAN_2024_A100),
                                       ("megatron-deepspeed a100", MEGATRON_DEEPSPEED_A100),
                                       ("megatron-core-2024 h100", MEGATRON_CORE_2024_H100),
                                       ("torchtitan-2025 h100", TORCHTITAN_2025_H100)])
def test_stack_efficiencies_are_the_fits_on_train_rows_only(key, entry):
    # Each entry is where its train rows' mean speed error crosses zero (published --fit);
    # those rows are train rows, never test rows.
    rows = fit_groups(published_rows())[key]
    assert rows and all(r.split == "train" and r.fits == key for r in rows)
    assert _mean_speed_error(rows, entry.gemm - 0.01) < 0 < _mean_speed_error(
        rows, entry.gemm + 0.01), key
    assert fit_gemm_efficiency(rows) == pytest.approx(entry.gemm, abs=0.001)


def test_cli_estimate_takes_a_stack_and_reports_its_kernel_efficiency(meshtrain):
    args = ["estimate", "--model", "llama3-8b", "--hardware", "a100-80g", "--gpus", "8",
            "--set", "parallel.zero=3"]
    out = {stack: json.loads(meshtrain(*args, "--json", "--stack", stack).stdout)
           for stack in ("torchtitan-2024", "meshtrain")}
    titan, ours = out["torchtitan-2024"]["kernel_efficiency"], out["meshtrain"]["kernel_efficiency"]
    assert titan["gemm"] == TORCHTITAN_2024_A100.gemm and titan["from"] == "stack entry a100"
    assert "torchtitan" in titan["source"]
    assert ours["gemm"] == MEGATRON_2021_A100.gemm and ours["from"] == "hardware profile"
    text = meshtrain(*args, "--stack", "torchtitan-2024").stdout
    assert (f"kernels: GEMM at {TORCHTITAN_2024_A100.gemm:.0%} of peak, attention 0.75 "
            "(stack entry a100)") in text
