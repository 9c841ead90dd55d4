"""Planner memory model: the ZeRO paper's model-state formulas and activation accounting."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.memory import layer_activation_bytes, zero_paper_model_states
from meshtrain.planner.cost.pipeline import pipeline_estimate
from meshtrain.planner.cost.workload import MESHTRAIN, Workload, stage_layers
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.profiles import PROFILES

P = 7.5e9


@pytest.mark.parametrize("stage, expected", [
    (0, 16 * P), (1, 4 * P + 12 * P / 64), (2, 2 * P + 14 * P / 64), (3, 16 * P / 64)])
def test_zero_paper_formulas(stage, expected):
    assert zero_paper_model_states(P, stage, 64) == pytest.approx(expected, rel=0.01)


def test_zero_paper_table_1_7_5b_on_64():
    # Rajbhandari et al. 2020, Table 1: 7.5B parameters, N_d = 64 -> 120, 31.4, 16.6, 1.88 GB.
    got = [zero_paper_model_states(P, stage, 64) / 1e9 for stage in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.88], rel=0.01)


def test_estimate_reports_zero_model_states_per_rank():
    from meshtrain.planner.cost.estimate import estimate

    # 7.5B-parameter GPT (Megatron's 7.5B shape) at dp = 64: the estimate's model states match.
    model = ModelConfig(vocab_size=51200, dim=4096, n_layers=36, n_heads=32, ffn_dim=16384,
                        mlp="gelu")
    cluster = Cluster(PROFILES["a100-80g"], 64, 8)
    # The paper counts fp16 gradients (2 bytes): parallel.grad_reduce_dtype = bf16.
    work = Workload(model, 2048, 64, traits=dataclasses.replace(MESHTRAIN, grad_reduce_bytes=2))
    for stage in range(4):
        result = estimate(work, Layout(dp=64, zero=stage), cluster)
        rank = result["per_rank"][0]
        states = rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]
        assert states == pytest.approx(zero_paper_model_states(result["params"], stage, 64),
                                       rel=0.01)


def test_activation_accounting_checkpointing_and_sequence_parallel():
    model = ModelConfig(vocab_size=1000, dim=1024, n_layers=4, n_heads=16, ffn_dim=4096,
                        mlp="gelu")
    work = Workload(model, 2048, 8)
    s_b_h = 2048 * 1 * 1024
    full = layer_activation_bytes(work, Layout(dp=8, activation_checkpointing="full"), 0)
    assert full == pytest.approx(2 * s_b_h)  # only the block input (2 bytes)
    none = layer_activation_bytes(work, Layout(dp=8), 0)
    # Korthikanti's 34 sbh includes 2 sbh of dropout masks; without dropout: 32.
    assert none == pytest.approx(32 * s_b_h)
    sp_layout = Layout(dp=2, tp=4, sequence_parallel=True, microbatches=4)
    tp_sp = layer_activation_bytes(work, sp_layout, 0)
    assert tp_sp == pytest.approx(none / 4)
    tp = layer_activation_bytes(work, Layout(dp=2, tp=4, microbatches=4), 0)
    assert tp == pytest.approx((8 + 24 / 4) * s_b_h)  # norm/matmul inputs replicated


def test_pipeline_closed_forms_and_inflight():
    paper = pipeline_estimate("1f1b", 4, 8, 1, 1.0, 1.0, 1.0, use_simulator=False,
                              early_grad_sends=False)  # Megatron-LM, torchtitan
    assert paper.bubble_fraction == pytest.approx(3 / (8 + 3))
    assert paper.peak_inflight == [4, 3, 2, 1]
    one = pipeline_estimate("1f1b", 4, 8, 1, 1.0, 1.0, 1.0, use_simulator=False)
    assert one.bubble_fraction == pytest.approx(3 * 2 / (3 * 8 + 3 * 2))  # a W off each hand-over
    assert one.peak_inflight == [4, 3, 2, 1]
    for early in (True, False):  # the closed forms are the runtime's simulated schedules
        for f, b, w in [(1.0, 1.0, 1.0), (1.5, 1.0, 0.5), (1.0, 2.0, 0.8)]:
            closed, simulated = (pipeline_estimate("1f1b", 4, 8, 1, f, b, w, use_simulator=sim,
                                                   early_grad_sends=early)
                                 for sim in (False, True))
            assert simulated.source == "simulator"
            assert closed.bubble_fraction == pytest.approx(simulated.bubble_fraction)
    inter = pipeline_estimate("interleaved-1f1b", 4, 8, 2, 1.0, 1.0, 1.0, use_simulator=False)
    assert inter.bubble_fraction == pytest.approx(3 / (2 * 8 + 3))
    assert inter.peak_inflight[0] == pytest.approx(4 * (1 + 3 / 8))  # Korthikanti 4.2.3
    zb = pipeline_estimate("zb-h1", 4, 8, 1, 1.0, 1.0, 1.0, use_simulator=False)
    assert zb.bubble_fraction == pytest.approx(3 / (3 * 8 + 3))
    gpipe = pipeline_estimate("gpipe", 4, 8, 1, 1.0, 1.0, 1.0, use_simulator=False)
    assert gpipe.peak_inflight == [8] * 4


@pytest.mark.parametrize("schedule,pp,v,split", [
    ("1f1b", 2, 1, ""), ("1f1b", 4, 1, ""), ("interleaved-1f1b", 2, 2, ""),
    ("zb-v", 2, 2, ""), ("1f1b", 2, 1, "5,3"), ("interleaved-1f1b", 2, 2, "1,3,2,2")])
def test_planner_places_layers_as_the_pipeline_runtime_does(schedule, pp, v, split):
    """The planner prices the layers each rank really holds: the runtime's cost-balanced (or
    explicit) split, each stage on the rank the built schedule puts it on."""
    from meshtrain.config.layout import Layout
    from meshtrain.parallel.pipeline import build_schedule
    from meshtrain.parallel.pipeline.stage_split import stage_layers as runtime_stage_layers

    model = ModelConfig(vocab_size=32000, dim=256, n_layers=8, n_heads=4, ffn_dim=512)
    layout = Layout(pp=pp, pp_schedule=schedule, virtual_stages=v, pp_split=split,
                    microbatches=2 * pp)
    built = build_schedule(schedule, pp, 2 * pp, v)
    per_stage = runtime_stage_layers(model, model.vocab_size, built.num_stages, split)
    held = [sorted(sum((per_stage[s] for s in built.stages_of(r)), [])) for r in range(pp)]
    assert stage_layers(model, layout) == held
    # The head (dim × 32000) costs about as much as a dozen of these blocks: the last stage
    # keeps one layer; zb-v's V puts stages 0 and 3 on rank 0.
    literal = {("1f1b", 2, ""): [[0, 1, 2, 3, 4, 5, 6], [7]],
               ("zb-v", 2, ""): [[0, 1, 7], [2, 3, 4, 5, 6]],
               ("1f1b", 2, "5,3"): [[0, 1, 2, 3, 4], [5, 6, 7]]}
    if (schedule, pp, split) in literal:
        assert held == literal[(schedule, pp, split)]


@pytest.mark.parametrize("bucket_mb", [100.0, 25.0, 8.0])
def test_zero3_units_are_priced_as_the_runtime_splits_them(bucket_mb):
    """The planner's ZeRO-3 units (whole block, attention + MLP, or single projections) hold
    the same parameters as the units the data-parallel engine builds, for each bucket size."""
    import torch

    from meshtrain.model.transformer import Transformer
    from meshtrain.parallel.data import _zero3_units
    from meshtrain.planner.cost.memory import zero3_units

    model_cfg = ModelConfig(dim=768, n_layers=2, n_heads=12, n_kv_heads=12, ffn_dim=2048,
                            vocab_size=264)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    units, _ = _zero3_units(model, int(bucket_mb * 2**20))
    runtime = [sum(p.numel() for _, p in params) for _, params in units]
    planned = [u for layer in range(2) for u in zero3_units(model_cfg, layer, 1,
                                                             bucket_mb * 2**20, 4)]
    assert planned == runtime
    assert len(runtime) == {100.0: 2, 25.0: 4, 8.0: 14}[bucket_mb]


def test_pytorch_ddp_holds_a_bucket_copy_of_the_gradients_with_data_parallelism_only():
    """Megatron-LM 2021 under PyTorch DDP (no ``gradient_as_bucket_view``) keeps its fp16
    gradients twice, as ``.grad`` and in DDP's buckets; its local DDP reduces in place."""
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.planner.cost.workload import MEGATRON_2021_TORCH_DDP

    model = ModelConfig(vocab_size=51200, dim=4096, n_layers=32, n_heads=32, ffn_dim=16384,
                        mlp="gelu")
    in_place = dataclasses.replace(MEGATRON_2021_TORCH_DDP, ddp_bucket_copy=False)

    def stage0(traits, dp):
        layout = Layout(dp=dp, tp=2, activation_checkpointing="full")
        result = estimate(Workload(model, 2048, 8 * dp, "bf16", traits), layout,
                          Cluster(PROFILES["a100-80g"], 2 * dp, 8))
        return result["per_rank"][0]

    torch_ddp, local = stage0(MEGATRON_2021_TORCH_DDP, 4), stage0(in_place, 4)
    assert torch_ddp["buffer_bytes"] - local["buffer_bytes"] == pytest.approx(
        torch_ddp["grad_bytes"], rel=1e-9)
    assert stage0(MEGATRON_2021_TORCH_DDP, 1) == stage0(in_place, 1)  # no DDP, no buckets


@pytest.mark.parametrize("pp,v", [(2, 2), (3, 4), (4, 3), (8, 2), (16, 8)])
def test_uneven_interleaved_chunks_hold_what_the_runtime_schedule_holds(pp, v):
    """The layer-microbatches a rank holds at its peak under interleaved 1F1B with chunks of
    unequal size, against a walk of the order of work the pipeline runtime really builds."""
    import random

    from meshtrain.parallel.pipeline import build_schedule
    from meshtrain.planner.cost.pipeline import interleaved_peak_layers

    rng = random.Random(pp * 100 + v)
    for m in (pp, 2 * pp, 3 * pp):
        schedule = build_schedule("interleaved-1f1b", pp, m, v)
        stages = pp * v
        splits = [[0] + [1] * (stages - 2) + [0]]  # Llama 3's: embedding and loss alone
        splits += [[rng.randint(0, 3) for _ in range(stages)] for _ in range(3)]
        for layers in splits:
            for rank in range(pp):
                held = peak = 0
                for action in schedule.compute_actions(rank):
                    if action.kind.value == "F":
                        held += layers[action.stage]
                    elif action.kind.value in ("B", "I"):
                        held -= layers[action.stage]
                    peak = max(peak, held)
                chunks = tuple(layers[s] for s in range(rank, stages, pp))
                assert interleaved_peak_layers(pp, m, v, rank, chunks) == peak, (m, layers, rank)


def test_an_embedding_only_first_chunk_holds_no_activations_in_flight():
    """Llama 3 405B's split (126 layers over 16 ranks × 8 chunks, the first chunk only the
    embedding, the last only the head): rank 0 holds activations of its 7 layers only."""
    from meshtrain.planner.cost.estimate import estimate
    from meshtrain.planner.search.explain import parse_layout

    model = ModelConfig(vocab_size=128256, dim=1024, n_layers=126, n_heads=16, n_kv_heads=8,
                        ffn_dim=3328)
    work = Workload(model, seq_len=2048, global_batch=128, traits=MESHTRAIN)
    split = ":".join(["0"] + ["1"] * 126 + ["0"])
    uneven = parse_layout(f"tp=1,pp=16,schedule=interleaved-1f1b,v=8,mbs=1,pp_split={split}",
                          work, 64)
    assert uneven.pp_split.count(",") == 127 and uneven.dp == 4
    per_rank = estimate(work, uneven, Cluster(PROFILES["h100-80g"], 64, 8))["per_rank"]
    first, middle = per_rank[0]["activation_bytes"], per_rank[1]["activation_bytes"]
    # 32 micro-batches on 16 ranks. Rank 0's 142 warm-up forwards run 16 micro-batches through
    # each chunk in turn: its 7 one-layer chunks hold 112 layer-microbatches at the peak (the
    # embedding chunk none), not 7/8 of its 143 chunk-microbatches; rank 1's 140 warm-up
    # forwards and the first steady one hold 141. Each also holds what one block's backward
    # makes beyond its saved activations (the stack's backward_transient_blocks of a block).
    extra = MESHTRAIN.backward_transient_blocks
    assert first / middle == pytest.approx((112 + extra) / (141 + extra))
    # the comma form reads the same layout
    assert parse_layout(f"tp=1,pp=16,schedule=interleaved-1f1b,v=8,pp_split={split}".replace(
        ":", ","), work, 64) == uneven


def test_zero3_prefetch_depth_is_priced_as_the_units_it_holds():
    """``parallel.zero3_prefetch`` k: the running unit and the k after it are gathered, so the
    priced ZeRO-3 buffers grow by the largest run of k + 1 consecutive units (here every unit
    of a layer is one block: equal units)."""
    from meshtrain.config import load_config
    from meshtrain.planner.cost.memory import zero3_transient_bytes, zero3_units

    buffers = {}
    for depth in (0, 1, 3):
        config = load_config(None, ["model.dim=256", "model.n_layers=6", "model.n_heads=4",
                                    "model.n_kv_heads=4", "model.ffn_dim=704",
                                    "model.vocab_size=512", "parallel.zero=3",
                                    f"parallel.zero3_prefetch={depth}"])
        work = Workload.from_config(config)
        assert work.traits.zero3_prefetch == depth
        buffers[depth] = zero3_transient_bytes(work, Layout(dp=2, zero=3), list(range(6)),
                                               1e7)
    unit = zero3_units(config.model, 0, 1, 25 * 2**20, 4)
    assert len(unit) == 1  # one unit per block at this size
    assert buffers[1] - buffers[0] == pytest.approx(unit[0] * 4)
    assert buffers[3] - buffers[1] == pytest.approx(2 * unit[0] * 4)
