"""The planner's price of the global-batch MoE load balance (``model.moe_balance_scope``)."""

from __future__ import annotations

import pytest

from meshtrain.config import load_config
from meshtrain.config.runtime_facts import bus_bytes
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.expert_parallel import balance_reductions
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.validation.run_config import validate_config

MOE = ["model.dim=512", "model.n_heads=8", "model.n_layers=4", "model.vocab_size=1024",
       "model.moe_experts=8", "model.moe_top_k=2", "train.global_batch=64",
       "train.seq_len=1024", "model.moe_balance=aux-loss"]


def _price(*overrides: str, world: int = 8) -> tuple[dict, Workload]:
    config = load_config(None, [*MOE, *overrides])
    validate_config(config, world)
    workload = Workload.from_config(config)
    return estimate(workload, config.parallel.layout(), Cluster(PROFILES["h100-80g"], world)), \
        workload


def test_global_batch_with_one_micro_batch_adds_one_count_all_reduce_per_moe_layer():
    plain, _ = _price("parallel.ep=2")
    scoped, workload = _price("parallel.ep=2", "model.moe_balance_scope=global-batch")
    layout = load_config(None, [*MOE, "parallel.ep=2", "parallel.dp=8"]).parallel.layout()
    assert balance_reductions(workload, layout, list(range(4))) == [8 * 8] * 4
    assert scoped["balance_comm_bytes"] == 4 * bus_bytes("all_reduce", 64, 8) > 0
    assert plain["balance_comm_bytes"] == 0 and plain["breakdown"]["balance_prepass_s"] == 0
    assert scoped["breakdown"]["balance_prepass_s"] == 0
    added = scoped["step_sync_by_axis_s"]["dp"] - plain["step_sync_by_axis_s"]["dp"]
    assert added > 0 and scoped["step_time_s"] == pytest.approx(plain["step_time_s"] + added)


@pytest.mark.parametrize("overrides", [["parallel.microbatches=4"],
                                       ["parallel.pp=2", "parallel.microbatches=4"]])
def test_several_micro_batches_or_stages_pay_the_routing_pre_pass(overrides):
    plain, _ = _price(*overrides)
    scoped, _ = _price(*overrides, "model.moe_balance_scope=global-batch")
    prepass = scoped["breakdown"]["balance_prepass_s"]
    forward = plain["stage_times_s"][0][0]  # one micro-batch's forward on the first stage
    pp = 2 if "parallel.pp=2" in overrides else 1
    assert prepass == pytest.approx((4 + pp - 1) * forward, rel=0.5)
    assert scoped["step_time_s"] > plain["step_time_s"] + 0.9 * prepass
    # the pre-pass's forward is hardware work: more of it per step
    assert scoped["hardware_tflops_per_gpu"] * scoped["step_time_s"] > \
        plain["hardware_tflops_per_gpu"] * plain["step_time_s"] + 0.5 * prepass * \
        plain["hardware_tflops_per_gpu"]
    # one [MoE layers of the stage, E] table per step
    assert scoped["balance_comm_bytes"] == bus_bytes("all_reduce", 8 * 8 * 4 // pp, 8 // pp)


def test_micro_batch_and_sequence_scopes_cost_nothing():
    plain, _ = _price("parallel.microbatches=4")
    for scope in ("micro-batch", "sequence"):
        priced, _ = _price("parallel.microbatches=4", f"model.moe_balance_scope={scope}")
        assert priced["step_time_s"] == plain["step_time_s"]
        assert priced["balance_comm_bytes"] == 0
