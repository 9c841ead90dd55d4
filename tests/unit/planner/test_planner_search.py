"""Planner time model against published measurements, and the layout search."""

from __future__ import annotations

import pytest

from meshtrain.config import ConfigError, ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.workload import LLAMA3_2024, MEGATRON_2021, MEGATRON_2022, Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.search.layouts import enumerate_layouts, plan, price_layouts
from meshtrain.planner.tables.presets import preset_config
from meshtrain.planner.tables.profiles import PROFILES, load_profile
from meshtrain.planner.tables.published import evaluate, published_rows
from meshtrain.planner.tables.runs_megatron import NARAYANAN_TABLE_1, NARAYANAN_TABLE_1_RUN

# Narayanan et al. 2021 (SC21), Table 1 (rows in meshtrain.planner.tables.runs_megatron).


def megatron_2021_estimate(heads, hidden, layers, tp, pp, gpus, batch, **layout):
    """Price a GPT layout with the megatron-2021 stack (micro-batch 1, 1F1B and full recompute
    unless ``layout`` says otherwise)."""
    model = ModelConfig(vocab_size=51200, dim=hidden, n_layers=layers, n_heads=heads,
                        ffn_dim=4 * hidden, mlp="gelu")
    dp = gpus // (tp * pp)
    options = dict(dp=dp, tp=tp, pp=pp, microbatches=batch // dp,
                   activation_checkpointing="full")
    options.update(layout)
    return estimate(Workload(model, 2048, batch, "bf16", MEGATRON_2021), Layout(**options),
                    Cluster(PROFILES["a100-80g"], gpus, 8))


@pytest.mark.parametrize("row", [r for r in published_rows() if r.source.endswith("Table 1")
                                 and r.source.startswith("Narayanan")], ids=lambda r: r.name)
def test_narayanan_table_1_within_15_percent(row):
    # As the paper's reproduction script ran each model (micro-batch, chunks, DDP).
    result = evaluate(row)
    assert abs(result["error"]) <= 0.15


def test_narayanan_table_1_run_settings_cover_the_table():
    assert sorted(NARAYANAN_TABLE_1_RUN) == sorted(row[0] for row in NARAYANAN_TABLE_1)
    for size, _, _, layers, tp, pp, gpus, batch, _ in NARAYANAN_TABLE_1:
        micro, chunks, _ = NARAYANAN_TABLE_1_RUN[size]
        assert batch % (gpus // (tp * pp) * micro) == 0 and (layers // pp) % chunks == 0


def test_korthikanti_selective_recompute_mfu():
    # Korthikanti et al. 2022: 175B, tp 8, pp 8, 64 GPUs, batch 64, SP + selective: MFU 51.4 %.
    result = megatron_2021_estimate(96, 12288, 96, 8, 8, 64, 64, sequence_parallel=True,
                                    activation_checkpointing="selective")
    assert result["mfu"] == pytest.approx(0.514, rel=0.15)
    assert result["hfu"] >= result["mfu"]


def test_plan_llama3_70b_on_64_h100_has_credible_candidates():
    work = Workload.from_config(preset_config("llama3-70b"))
    result = plan(work, Cluster(PROFILES["h100-80g"], 64, 8), top=5)
    assert result.candidates and result.nothing_fits is None
    for c in result.candidates:
        assert c["memory_gb_per_gpu"] <= PROFILES["h100-80g"].memory_gb - 3.0
        assert 0.30 <= c["mfu"] <= 0.60
        assert c["dp"] * c["cp"] * c["tp"] * c["pp"] == 64
    speeds = [c["tokens_per_s"] for c in result.candidates]
    assert speeds == sorted(speeds, reverse=True)


def test_plan_llama3_405b_on_8_h100_says_nothing_fits_and_why():
    work = Workload.from_config(preset_config("llama3-405b"))
    result = plan(work, Cluster(PROFILES["h100-80g"], 8, 8))
    assert result.candidates == [] and result.feasible == 0
    assert "nothing fits" in result.nothing_fits
    assert "model states" in result.nothing_fits
    assert "would fit on" in result.nothing_fits  # names a GPU count that would


def test_bad_inputs_raise_config_errors():
    with pytest.raises(ConfigError, match="known profiles"):
        load_profile("z80")
    with pytest.raises(ConfigError, match="presets"):
        preset_config("llama9-1t")
    work = Workload.from_config(preset_config("llama3-8b"))
    with pytest.raises(ConfigError, match="tp"):
        estimate(work, Layout(dp=1, tp=3), Cluster(PROFILES["h100-80g"], 3, 8))


def test_megatron_2021_search_offers_only_what_megatron_lm_2021_ran():
    # Megatron-LM's checks: num_layers divisible by pp (megatron/model/transformer.py), the
    # interleaved schedule only with pp > 2 and a stage's layers divisible by the chunk count
    # (megatron/arguments.py); no sequence parallelism or selective recompute before 2022.
    from meshtrain.planner.cost.workload import MEGATRON_2022
    from meshtrain.planner.search.layouts import enumerate_layouts

    model = ModelConfig(vocab_size=51200, dim=6144, n_layers=40, n_heads=48, ffn_dim=4 * 6144,
                        mlp="gelu")
    cluster = Cluster(PROFILES["a100-80g"], 64, 8)
    layouts = enumerate_layouts(Workload(model, 2048, 512, "bf16", MEGATRON_2021), cluster)
    assert layouts
    assert not any(lay.sequence_parallel for lay in layouts)
    assert {lay.activation_checkpointing for lay in layouts} == {"none", "full"}
    assert {lay.pp for lay in layouts} == {1, 2, 4, 8}  # 16, 32, 64 do not divide 40 layers
    interleaved = {(lay.pp, lay.virtual_stages) for lay in layouts
                   if lay.pp_schedule == "interleaved-1f1b"}
    assert interleaved == {(4, 2), (4, 5), (8, 5)}  # 10 and 5 layers per stage; pp 2 none
    # Korthikanti et al. 2022's stack adds both of that paper's contributions.
    later = enumerate_layouts(Workload(model, 2048, 512, "bf16", MEGATRON_2022), cluster)
    assert any(lay.sequence_parallel for lay in later)
    assert "selective" in {lay.activation_checkpointing for lay in later}
    # Equal layers per stage, the LM head riding on the last; meshtrain balances by cost.
    from meshtrain.planner.cost.workload import MESHTRAIN, stack_split, stage_layers

    small = ModelConfig(vocab_size=51200, dim=2304, n_layers=24, n_heads=24, ffn_dim=4 * 2304,
                        mlp="gelu")
    lay = Layout(pp=4, microbatches=8)
    counts = {name: [len(layers) for layers in stage_layers(
        small, stack_split(Workload(small, 2048, 8, "bf16", traits), lay))]
        for name, traits in (("megatron", MEGATRON_2021), ("meshtrain", MESHTRAIN))}
    assert counts["megatron"] == [6, 6, 6, 6]
    assert counts["meshtrain"][-1] < 6 and sum(counts["meshtrain"]) == 24


def test_pipelined_layouts_are_priced_with_the_least_zero_sharding_that_fits():
    import dataclasses

    work = Workload.from_config(preset_config("llama3-70b"))
    cluster = Cluster(PROFILES["a100-80g"], 32, 8)

    def zeros(layout, workload=work):
        return [(lay.zero, r["fits"]) for lay, r in price_layouts(workload, cluster, [layout])]

    full = Layout(dp=4, tp=4, pp=2, zero=1, sequence_parallel=True, microbatches=128,
                  activation_checkpointing="full")
    assert zeros(full) == [(1, False), (2, True)]  # sharded gradients suffice: no ZeRO-3
    none = Layout(dp=2, tp=4, pp=2, cp=2, zero=1, sequence_parallel=True, pp_schedule="zb-h1",
                  microbatches=256)
    assert zeros(none) == [(1, False), (2, False), (3, True)]
    fitting = dataclasses.replace(full, dp=2, pp=4, microbatches=256)
    assert zeros(fitting) == [(1, True)]
    # Megatron-LM has no ZeRO-2/3 to offer; a variant over the limit at any sharding is skipped.
    assert zeros(none, dataclasses.replace(work, traits=MEGATRON_2022)) == [(1, False)]
    assert zeros(dataclasses.replace(none, cp=1, dp=4, microbatches=128)) == [(1, False)]
    # Meta's FSDP (llama3-2024) has no ZeRO-1: its pipelines start at ZeRO-2 and grow to 3.
    meta = dataclasses.replace(work, traits=LLAMA3_2024)
    assert zeros(dataclasses.replace(none, tp=2, cp=4, zero=2), meta) == [(2, False), (3, True)]
    assert zeros(dataclasses.replace(full, zero=2), meta) == [(2, True)]


def test_a_stack_without_zero_1_searches_its_pipelines_at_zero_2():
    import dataclasses

    work = dataclasses.replace(Workload.from_config(preset_config("llama3-70b")),
                               traits=LLAMA3_2024)
    layouts = enumerate_layouts(work, Cluster(PROFILES["h100-80g"], 32, 8))
    pipelined = {lay.zero for lay in layouts if lay.pp > 1}
    assert pipelined == {0, 2}
    assert {lay.zero for lay in layouts if lay.pp == 1} == {0, 2, 3}
    result = plan(work, Cluster(PROFILES["h100-80g"], 32, 8), top=40)
    variants = [c for c in result.candidates if c["pp"] > 1 and c["zero"] == 3]
    assert variants, "no pipelined ZeRO-3 variant among the first 40"
    assert all(c["why"].endswith("ZeRO-3 as this pipeline does not fit at ZeRO-2")
               for c in variants)
    assert not any("does not fit at ZeRO" in c["why"] for c in result.candidates
                   if c["zero"] == 2)


def test_plan_finds_a_pipeline_that_only_zero_3_makes_fit():
    # Llama 3 70B on 64 A100 40 GB: the fastest layouts are pipelines that fit only with their
    # gradients (ZeRO-2) or also their weights (ZeRO-3) sharded, ahead of every layout that
    # fits without sharding the weights under a pipeline.
    result = plan(Workload.from_config(preset_config("llama3-70b")),
                  Cluster(PROFILES["a100-40g"], 64, 8), top=3)
    best = result.candidates[0]
    assert best["pp"] > 1 and best["zero"] == 2
    assert best["why"].endswith("ZeRO-2 as this pipeline does not fit at ZeRO-1")
    sharded = [c for c in result.candidates if c["pp"] > 1 and c["zero"] == 3]
    assert sharded and all(c["why"].endswith("ZeRO-3 as this pipeline does not fit at ZeRO-1")
                           for c in sharded)
    unsharded = [r for r in result.priced if r["fits"]
                 and (r["layout"]["pp"] == 1 or r["layout"]["zero"] < 2)]
    assert min(c["tokens_per_s"] for c in result.candidates) > max(
        r["tokens_per_s"] for r in unsharded)
    assert result.searched == len(result.priced)


def test_plans_feasible_count_is_the_searchs_whatever_top_is():
    # `feasible` counts every searched layout that fits as the closed forms price them; the
    # front runners re-priced with the schedule simulator (3 x top of them) change only what
    # is listed, and how many of them no longer fit is said apart.
    work = Workload.from_config(preset_config("llama3-8b"))
    cluster = Cluster(PROFILES["h100-80g"], 16, 8)
    few, many = plan(work, cluster, top=1), plan(work, cluster, top=8)
    fitting = sum(1 for r in few.priced if r["fits"])
    assert few.feasible == many.feasible == fitting > len(many.candidates)
    for result, top in ((few, 1), (many, 8)):
        assert 0 <= result.resimulated_not_fitting <= 3 * top
        assert len(result.candidates) == min(top, 3 * top - result.resimulated_not_fitting)


def test_plan_report_says_how_many_front_runners_the_simulator_dropped():
    from meshtrain.commands.planner_report import format_plan

    work = Workload.from_config(preset_config("llama3-8b"))
    found = plan(work, Cluster(PROFILES["h100-80g"], 16, 8), top=2).to_dict()
    assert "resimulated_not_fitting" in found
    found.update(resimulated_not_fitting=0)
    assert "re-priced" not in format_plan(found, "plan")
    found.update(resimulated_not_fitting=3)
    line = format_plan(found, "plan").splitlines()[1]
    assert line.startswith(f"{found['searched']} layouts searched, {found['feasible']} fit in "
                           "memory (3 of the front runners do not once re-priced")
