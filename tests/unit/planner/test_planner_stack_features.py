"""What each stack profile prices and refuses, and the memory it holds as those stacks hold it."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.config import ConfigError
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.memory import layer_activation_units
from meshtrain.planner.cost.overlap import pipelined_exposed
from meshtrain.planner.cost.runtime import AUTOMODEL_2026
from meshtrain.planner.cost.workload import (
    LLAMA3_2024,
    MEGATRON_2022,
    MEGATRON_CORE_2024,
    MEGATRON_CORE_2025,
    MEGATRON_DEEPSPEED,
    MESHTRAIN,
    TORCHTITAN_2025,
    Workload,
    check_stack_offers,
)
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.presets import preset_config
from meshtrain.planner.tables.profiles import ALLOCATOR_RESERVE, PROFILES
from meshtrain.planner.tables.runs_automodel import QWEN3_TRAITS

LLAMA_8B = preset_config("llama3-8b").model
H100 = PROFILES["h100-80g"]


def _work(traits, seq=8192, batch=16, model=LLAMA_8B):
    return Workload(model, seq, batch, "bf16", traits)


@pytest.mark.parametrize("stack,traits,layout", [
    ("megatron-2022", MEGATRON_2022, Layout(dp=2, tp=4, zero=1, sequence_parallel=True,
                                            activation_checkpointing="selective")),
    ("megatron-deepspeed", MEGATRON_DEEPSPEED, Layout(dp=2, tp=2, pp=2, zero=1,
                                                      microbatches=4,
                                                      activation_checkpointing="full")),
    ("megatron-core-2024", MEGATRON_CORE_2024, Layout(dp=2, tp=2, pp=2, cp=2, zero=1,
                                                      sequence_parallel=True,
                                                      pp_schedule="interleaved-1f1b",
                                                      virtual_stages=2, microbatches=4)),
    ("torchtitan-2025", TORCHTITAN_2025, Layout(dp=2, tp=2, pp=2, zero=3,
                                                sequence_parallel=True, microbatches=4,
                                                activation_checkpointing="selective")),
    # Megatron-Bridge's: uneven chunks (the embedding and the loss counted as layers).
    ("megatron-core-2025", MEGATRON_CORE_2025, Layout(dp=2, tp=2, pp=2, zero=1,
                                                      sequence_parallel=True,
                                                      pp_schedule="interleaved-1f1b",
                                                      virtual_stages=2, microbatches=4,
                                                      pp_split="7,8,8,9")),
    # Llama 3 405B's: ZeRO-2, interleaved, first chunk the embedding alone, last the head alone.
    ("llama3-2024", LLAMA3_2024, Layout(dp=2, tp=2, pp=2, cp=2, zero=2, sequence_parallel=True,
                                        pp_schedule="interleaved-1f1b", virtual_stages=2,
                                        microbatches=4, pp_split="0,16,16,0")),
])
def test_each_stack_runs_what_its_runs_used(stack, traits, layout):
    check_stack_offers(_work(traits), layout, stack)


@pytest.mark.parametrize("stack,traits,layout,words", [
    ("megatron-2022", MEGATRON_2022, Layout(dp=2, zero=2), "ZeRO stages it offers: 0, 1"),
    ("megatron-deepspeed", MEGATRON_DEEPSPEED,
     Layout(pp=4, pp_schedule="interleaved-1f1b", virtual_stages=2, microbatches=8),
     "it offers 1f1b"),
    ("megatron-deepspeed", MEGATRON_DEEPSPEED, Layout(tp=2, sequence_parallel=True),
     "no sequence parallelism"),
    ("megatron-core-2024", MEGATRON_CORE_2024, Layout(dp=2, zero=3), "ZeRO stages"),
    ("megatron-core-2024", MEGATRON_CORE_2024, Layout(pp=2, pp_schedule="zb-h1",
                                                      microbatches=2), "zb-h1"),
    ("megatron-core-2025", MEGATRON_CORE_2025, Layout(dp=2, zero=2), "ZeRO stages it offers"),
    ("llama3-2024", LLAMA3_2024, Layout(dp=2, zero=1), "ZeRO stages it offers: 0, 2, 3"),
])
def test_each_stack_refuses_only_what_it_could_not_run(stack, traits, layout, words):
    with pytest.raises(ConfigError, match=words):
        check_stack_offers(_work(traits), layout, stack)


def test_fused_swiglu_keeps_six_units_of_the_mlp_instead_of_eight():
    layout = Layout()
    eager = layer_activation_units(LLAMA_8B, 0, 8192, layout, True)
    fused = layer_activation_units(LLAMA_8B, 0, 8192, layout, True, fused_swiglu=True)
    assert eager - fused == pytest.approx(2 * LLAMA_8B.ffn_dim / LLAMA_8B.dim)
    # Selective recompute already keeps only the fused kernel's input and output.
    assert layer_activation_units(LLAMA_8B, 0, 8192, layout, True, "selective") == \
        layer_activation_units(LLAMA_8B, 0, 8192, layout, True, "selective", fused_swiglu=True)


def test_fsdp2_keeps_fp32_parameters_and_no_master_copy():
    layout = Layout(dp=8, zero=3)
    rank = estimate(_work(TORCHTITAN_2025), layout, Cluster(H100, 8, 8))["per_rank"][0]
    ours = estimate(_work(MESHTRAIN), layout, Cluster(H100, 8, 8))["per_rank"][0]
    states = rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]
    assert states / (ours["param_bytes"] + ours["grad_bytes"] + ours["optim_bytes"]) == \
        pytest.approx(16 / 18)
    assert rank["param_bytes"] == pytest.approx(2 * ours["param_bytes"])


def test_the_distributed_optimizer_reduce_scatters_in_place():
    layout = Layout(dp=8, zero=1)
    cluster = Cluster(H100, 8, 8)
    core = estimate(_work(MEGATRON_CORE_2024), layout, cluster)["per_rank"][0]
    ours = estimate(_work(MESHTRAIN), layout, cluster)["per_rank"][0]
    assert core["buffer_bytes"] == 0 < ours["buffer_bytes"]


def test_the_allocator_reserve_is_a_gpu_fraction_and_none_on_a_cpu():
    layout = Layout(dp=8, zero=1)
    rank = estimate(_work(MESHTRAIN), layout, Cluster(H100, 8, 8))["per_rank"][0]
    allocated = rank["total_bytes"] - rank["reserve_bytes"]
    assert ALLOCATOR_RESERVE > 0
    assert rank["reserve_bytes"] == pytest.approx(ALLOCATOR_RESERVE * allocated, rel=1e-6)
    cpu = dataclasses.replace(H100, allocator_reserve=0.0, family="")
    assert estimate(_work(MESHTRAIN), layout, Cluster(cpu, 8, 8))["per_rank"][0][
        "reserve_bytes"] == 0


def test_gpu_capacity_is_what_the_driver_reports():
    assert PROFILES["h100-80g"].memory_gb == pytest.approx(81559 * 2**20 / 1e9)
    assert PROFILES["a100-80g"].memory_gb == pytest.approx(81920 * 2**20 / 1e9)


def test_pipelined_collectives_expose_their_first_step_and_what_outlasts_compute():
    assert pipelined_exposed(8.0, 100.0, 8) == pytest.approx(1.0)
    assert pipelined_exposed(8.0, 3.0, 4) == pytest.approx(2.0 + 3.0)
    assert pipelined_exposed(0.0, 1.0, 4) == 0.0


def test_megatron_core_hides_tp_and_cp_communication_behind_compute():
    layout = Layout(dp=1, tp=4, cp=2, zero=0, sequence_parallel=True, microbatches=8)
    cluster = Cluster(H100, 8, 8)
    plain = dataclasses.replace(MEGATRON_CORE_2024, tp_comm_overlap=False, cp_comm_overlap=False)
    hidden, exposed = (estimate(_work(t), layout, cluster) for t in (MEGATRON_CORE_2024, plain))
    for axis in ("tp", "cp"):
        entry = hidden["overlap"][axis]
        assert entry["overlapped_s"] > 0 and entry["exposed_s"] < entry["total_s"]
        assert entry["total_s"] == pytest.approx(exposed["overlap"][axis]["total_s"])
        assert exposed["overlap"][axis]["overlapped_s"] == 0
    assert hidden["step_time_s"] < exposed["step_time_s"]


def test_meta_runtime_shards_gradients_and_reduces_them_every_micro_batch():
    # Llama 3's FSDP (llama3-2024, ZeRO-2) against Megatron-Core's distributed optimizer
    # (ZeRO-1) on the same pipelined layout: fp32 gradients are held as a 1/dp shard instead of
    # whole, and reduce-scattered during every micro-batch's backward instead of once.
    layout = Layout(dp=8, tp=8, pp=2, zero=2, sequence_parallel=True, microbatches=8,
                    pp_split="16,16")
    cluster = Cluster(H100, 128, 8)
    work = _work(LLAMA3_2024, batch=64)
    meta = estimate(work, layout, cluster)
    core = estimate(_work(MEGATRON_CORE_2024, batch=64), dataclasses.replace(layout, zero=1),
                    cluster)
    for m, c in zip(meta["per_rank"], core["per_rank"], strict=True):
        assert m["grad_bytes"] == pytest.approx(c["grad_bytes"] / 8)
    few = estimate(work, dataclasses.replace(layout, microbatches=2), cluster)
    assert meta["breakdown"]["dp_comm_total_s"] > 3 * few["breakdown"]["dp_comm_total_s"]
    assert core["breakdown"]["dp_comm_total_s"] < meta["breakdown"]["dp_comm_total_s"] / 3


@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (8, True)])
def test_memory_efficient_norms_keep_neither_norm_input_and_cost_no_time(tp, sp):
    # A norm that keeps its output (which the next matmul keeps anyway) frees each block of its
    # two norm inputs: two bf16 tensors of the rank's tokens × dim (a tp-th of the tokens under
    # sequence parallelism). Time is not priced differently.
    layout = Layout(dp=1, tp=tp, pp=2, sequence_parallel=sp, microbatches=4)
    plain = layer_activation_units(LLAMA_8B, 0, 8192, layout, True, "none", fused_swiglu=True)
    lean = layer_activation_units(LLAMA_8B, 0, 8192, layout, True, "none", fused_swiglu=True,
                                  memory_efficient_norm=True)
    assert plain - lean == pytest.approx(4.0 / (tp if sp else 1))
    fp8 = dict(fused_swiglu=True, fp8_linear=True)
    assert layer_activation_units(LLAMA_8B, 0, 8192, layout, True, "none", **fp8,
                                  memory_efficient_norm=True) == \
        layer_activation_units(LLAMA_8B, 0, 8192, layout, True, "none", **fp8)
    cluster = Cluster(H100, 2 * tp, 8)
    base = estimate(_work(MEGATRON_CORE_2024), layout, cluster)
    norms = estimate(_work(dataclasses.replace(MEGATRON_CORE_2024, memory_efficient_norm=True)),
                     layout, cluster)
    assert norms["step_time_s"] == base["step_time_s"]
    tokens = 8192 / (tp if sp else 1)
    for b, n in zip(base["per_rank"], norms["per_rank"], strict=True):
        saved = b["activation_bytes"] - n["activation_bytes"]
        # Two norm inputs for every block and micro-batch held (each rank holds 16 blocks for
        # at least one micro-batch), and for the block in backward.
        blocks = saved / (2 * tokens * LLAMA_8B.dim * 2)
        assert blocks >= 16 and blocks == pytest.approx(round(blocks), abs=1e-6)


QWEN3_30B_A3B = preset_config("qwen3-30b-a3b").model


def _moe_layer_bytes(traits, tp):
    layout = Layout(dp=8 // tp, tp=tp, ep=8, sequence_parallel=tp > 1)
    return layer_activation_units(QWEN3_30B_A3B, 0, 4096, layout, True, "none",
                                  fused_swiglu=True,
                                  moe_sequence_sharded=traits.moe_sequence_sharded,
                                  moe_gate_in_activation=traits.moe_gate_in_activation)


def test_megatron_core_2025_keeps_a_tp_th_of_an_moe_layers_tokens_on_each_rank():
    # Expert tensor parallelism 1: each tp rank routes its own S/tp tokens, so everything an
    # MoE block keeps is divided by tp; meshtrain's replicated region keeps the gathered expert
    # outputs and the router's work whole on every tp rank, so it divides by less.
    for traits, exact in ((MEGATRON_CORE_2025, True), (MESHTRAIN, False)):
        one, two = _moe_layer_bytes(traits, 1), _moe_layer_bytes(traits, 2)
        assert (two == pytest.approx(one / 2)) is exact
    # Gate weights applied inside the SwiGLU: the experts' outputs are not kept for backward.
    kept = dataclasses.replace(MEGATRON_CORE_2025, moe_gate_in_activation=False)
    assert _moe_layer_bytes(kept, 1) > _moe_layer_bytes(MEGATRON_CORE_2025, 1)


def test_megatron_core_2025_gathers_nothing_over_tp_in_an_moe_layer_and_hides_all_to_alls():
    layout = Layout(dp=4, tp=2, ep=8, sequence_parallel=True, microbatches=4)
    cluster = Cluster(H100, 8, 8)
    work = _work(dataclasses.replace(MEGATRON_CORE_2025, ep_comm_overlap=True), seq=4096,
                 batch=16, model=QWEN3_30B_A3B)
    plain = _work(dataclasses.replace(MEGATRON_CORE_2025, ep_comm_overlap=False,
                                      tp_comm_overlap=False), seq=4096, batch=16,
                  model=QWEN3_30B_A3B)
    replicated = _work(dataclasses.replace(MEGATRON_CORE_2024, tp_comm_overlap=False),
                       seq=4096, batch=16, model=QWEN3_30B_A3B)
    hidden, exposed, gathered = (estimate(w, layout, cluster) for w in (work, plain, replicated))
    # The same all-to-all bytes, part of them hidden behind another micro-batch's compute.
    assert hidden["ep_comm_bytes"] == exposed["ep_comm_bytes"] > 0
    entry = hidden["overlap"]["ep"]
    assert entry["total_s"] == pytest.approx(exposed["overlap"]["ep"]["total_s"])
    assert 0 < entry["overlapped_s"] and entry["exposed_s"] < entry["total_s"]
    assert exposed["overlap"]["ep"]["overlapped_s"] == 0
    assert hidden["step_time_s"] < exposed["step_time_s"]
    # tp moves attention's activations only, not the MoE layer's gathered tokens and outputs.
    assert exposed["overlap"]["tp"]["total_s"] < 0.5 * gathered["overlap"]["tp"]["total_s"]


def test_without_ep_sequence_sharded_tp_ranks_split_the_experts_work_and_reduce_over_tp():
    # ep = 1: meshtrain's replicated region runs every assignment on every tp rank, so a tp 2
    # rank does more than half of a tp 1 rank's work; with each tp rank's own tokens
    # (Megatron-Core, expert tp 1) it does exactly half, and the experts' gradients, now
    # different on the tp ranks, reduce over dp x tp.
    from meshtrain.planner.cost.expert_parallel import expert_reduction_size
    from meshtrain.planner.cost.timing import block_cost

    cluster = Cluster(H100, 8, 8)
    one, two = Layout(dp=8, microbatches=2), Layout(dp=4, tp=2, sequence_parallel=True,
                                                    microbatches=4)
    for traits, halves in ((MEGATRON_CORE_2025, True), (MEGATRON_CORE_2024, False)):
        work = _work(traits, seq=4096, batch=16, model=QWEN3_30B_A3B)
        whole, half = (block_cost(work, lay, cluster, 0).flops for lay in (one, two))
        assert (half == pytest.approx(whole / 2)) is halves
    assert expert_reduction_size(two, True) == 8 and expert_reduction_size(two) == 4


def test_automodel_holds_bf16_parameters_where_torchtitan_holds_fp32():
    # NeMo AutoModel's Qwen3-30B-A3B run (8 H100, ep 8, FSDP 8, micro-batches of 4 x 4,096
    # tokens, full checkpointing, bf16 Adam moments, the loss on bf16 logits) ran; priced as
    # torchtitan runs (fp32 sharded parameters, fp32 moments, the eager fp32 loss) it could not
    # have. The parameters themselves: 2 bytes against 4 (a dp-th or ep-th on each rank).
    model = preset_config("qwen3-30b-a3b").model
    layout = Layout(dp=8, ep=8, zero=3, microbatches=16, activation_checkpointing="full")
    cluster = Cluster(H100, 8, 8)

    def priced(traits):
        return estimate(Workload(model, 4096, 512, "bf16", traits), layout, cluster)

    titan, stack, run = priced(TORCHTITAN_2025), priced(AUTOMODEL_2026), priced(QWEN3_TRAITS)
    assert not titan["fits"] and run["fits"]
    for t, a in zip(titan["per_rank"], stack["per_rank"], strict=True):
        assert a["param_bytes"] == pytest.approx(t["param_bytes"] / 2, rel=1e-6)
        assert a["optim_bytes"] == pytest.approx(t["optim_bytes"], rel=1e-6)  # fp32 moments
    for a, r in zip(stack["per_rank"], run["per_rank"], strict=True):
        assert r["optim_bytes"] == pytest.approx(a["optim_bytes"] / 2, rel=1e-6)  # bf16 moments
    assert run["step_time_s"] == pytest.approx(titan["step_time_s"], rel=0.1)
