"""Planner against published runs: recompute pricing, activation memory, the MFU cap."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.memory import korthikanti_layer_bytes, layer_activation_bytes
from meshtrain.planner.cost.workload import MEGATRON_2021, TORCHTITAN_2024, Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.presets import preset_config
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.planner.tables.published import published_rows
from meshtrain.planner.tables.ranks import rank_among_searched, ranked_rows
from meshtrain.planner.tables.runs_megatron import KORTHIKANTI_TABLE_5


@pytest.mark.parametrize("row", KORTHIKANTI_TABLE_5, ids=lambda r: r[0])
def test_selective_over_full_recompute_speedup_matches_table_5(row):
    # Korthikanti et al. 2022, Table 5, with the paper's micro-batch and schedule (Table 3).
    name, full_s, selective_s = row[0], row[-2], row[-1]
    rows = {r.layout.activation_checkpointing: r for r in published_rows()
            if r.name.startswith(f"GPT {name} ")}
    full, selective = (estimate(rows[m].workload, rows[m].layout,
                                Cluster(PROFILES["a100-80g"], rows[m].layout.world_size, 8))
                       for m in ("full", "selective"))
    # The paper: full recompute adds ~33 % (a whole forward), selective 2-4 %: 1.29-1.32x.
    ratio = full["step_time_s"] / selective["step_time_s"]
    assert ratio == pytest.approx(full_s / selective_s, rel=0.04)
    # Selective recompute costs a few per cent of the step's compute (the 22B's 64 heads on
    # 2048 tokens make its unfused attention heavier than the larger models').
    assert selective["breakdown"]["recompute_s"] < 0.07 * selective["breakdown"]["compute_s"]


def test_korthikanti_table_2_formulas():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert korthikanti_layer_bytes(s, b, h, a, t) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True) == pytest.approx(
        sbh / t * (34 + 5 * a * s / h))
    assert korthikanti_layer_bytes(s, b, h, a, t, True, "selective") == pytest.approx(
        sbh * 34 / t)
    assert korthikanti_layer_bytes(s, b, h, a, mode="full") == pytest.approx(2 * sbh)


def test_block_accounting_matches_korthikanti_for_a_gpt_layer():
    # The planner's block accounting of a GPT layer without dropout is Korthikanti's minus what
    # dropout saves: two 1-byte masks in the 34, and in the 5as/h the 1-byte attention mask
    # and the dropout output (2as/h: without dropout it is the softmax output, kept once).
    model = ModelConfig(vocab_size=51200, dim=6144, n_layers=2, n_heads=64, ffn_dim=4 * 6144,
                        mlp="gelu")
    w = Workload(model, 2048, 8, "bf16", MEGATRON_2021)
    sbh = 2048 * 6144
    for mode, masks in (("none", 2 + 3 * 64 * 2048 / 6144), ("selective", 2)):
        lay = Layout(dp=1, tp=8, sequence_parallel=True, microbatches=8,
                     activation_checkpointing=mode)
        paper = korthikanti_layer_bytes(2048, 1, 6144, 64, 8, True, mode)
        ours = layer_activation_bytes(w, lay, 0)
        assert ours == pytest.approx(paper - masks * sbh / 8, rel=0.01)


def test_torchtitan_llama31_8b_fsdp_selective_fits_where_it_ran():
    # torchtitan docs/performance.md, Table 1: Llama 3.1 8B, FSDP on 8 H100 (96 GB HBM2e),
    # local batch 2, seq 8192, selective (per-op) activation checkpointing: 82.4 GiB reserved.
    work = Workload(preset_config("llama3-8b").model, 8192, 16, "bf16", TORCHTITAN_2024)
    cluster = Cluster(PROFILES["h100-96g-hbm2e-500w"], 8, 8)
    measured_gb = 82.4 * 2**30 / 1e9
    result = {ck: estimate(work, Layout(dp=8, zero=3, activation_checkpointing=ck), cluster)
              for ck in ("none", "selective", "full")}
    selective = result["selective"]
    assert selective["fits"]
    assert selective["memory_gb_per_gpu"] == pytest.approx(measured_gb, rel=0.08)
    assert not result["none"]["fits"]  # why the run checkpoints at all
    rank = selective["per_rank"][0]
    # Per-op SAC keeps 15.5 sbh per block (input, wq, wv, SDPA, w1, w2 outputs): 33 GB.
    blocks = 32 * 15.5 * 2 * 8192 * 4096
    logits = 12 * 2 * 8192 * 128256
    assert rank["activation_bytes"] == pytest.approx(blocks + logits, rel=0.1)
    # FSDP2 keeps fp32 sharded parameters and no separate master copy: 4 + 4 + 8 bytes.
    params = selective["params"]
    assert rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"] == pytest.approx(
        16 * params / 8, rel=1e-6)
    assert (result["full"]["tokens_per_s"] < selective["tokens_per_s"]
            < result["none"]["tokens_per_s"])


def test_plans_on_a100_never_promise_more_than_the_best_published_mfu():
    from meshtrain.planner.search.layouts import plan
    from meshtrain.planner.tables.profiles import PUBLISHED_MFU_CAPS

    cap = PUBLISHED_MFU_CAPS["a100"][0]
    assert cap == pytest.approx(0.604)  # torchtitan docs/performance.md, Llama 2 13B on A100
    # Kernels better than any published A100 run: the uncapped model would promise more.
    optimistic = dataclasses.replace(PROFILES["a100-80g"], matmul_efficiency=0.95)
    uncapped = dataclasses.replace(optimistic, max_mfu=0.0)
    work = Workload.from_config(preset_config("llama3-70b"))
    assert plan(work, Cluster(uncapped, 64, 8), top=1).candidates[0]["mfu"] > cap
    result = plan(work, Cluster(optimistic, 64, 8), top=5)
    assert result.candidates
    for c in result.candidates:
        assert c["mfu"] <= cap + 1e-9
    # The cap shows as lost time, not as a silently shorter step.
    layout = Layout(dp=16, tp=4, zero=3, sequence_parallel=True,
                    activation_checkpointing="selective")
    free = estimate(work, layout, Cluster(uncapped, 64, 8))
    capped = estimate(work, layout, Cluster(optimistic, 64, 8))
    assert free["mfu"] > cap >= capped["mfu"] - 1e-9
    assert capped["breakdown"]["mfu_cap_s"] == pytest.approx(
        capped["step_time_s"] - free["step_time_s"])


@pytest.mark.parametrize("profile", ["h100-80g", "h100-96g", "h100-96g-hbm2e-500w", "h800",
                                     "h200"])
def test_h100_family_plans_never_promise_more_than_the_best_published_h100_mfu(profile):
    from meshtrain.planner.search.layouts import plan
    from meshtrain.planner.tables.profiles import PUBLISHED_MFU_CAPS

    cap = PUBLISHED_MFU_CAPS["h100"][0]
    # The best MFU of an H100 train row (dgxc-benchmarking's Llama 3.1 8B, NeMo 24.09).
    assert PROFILES[profile].max_mfu == cap == pytest.approx(0.595)
    # Kernels far better than any published H100 run: the uncapped model would promise more.
    optimistic = dataclasses.replace(PROFILES[profile], matmul_efficiency=0.99,
                                     attention_efficiency=0.99, kernel_overhead_us=0.0,
                                     hbm_gbps=4 * PROFILES[profile].hbm_gbps)
    work = Workload.from_config(preset_config("llama3-8b"))
    uncapped = plan(work, Cluster(dataclasses.replace(optimistic, max_mfu=0.0), 8, 8), top=3)
    assert uncapped.candidates[0]["mfu"] > cap
    result = plan(work, Cluster(optimistic, 8, 8), top=3)
    assert result.candidates
    assert all(c["mfu"] <= cap + 1e-9 for c in result.candidates)


_RANKS: dict[str, dict] = {}


def _ranked(row) -> dict:
    """:func:`rank_among_searched`, once per row for the whole module (it searches 30 to
    3,900 layouts)."""
    if row.name not in _RANKS:
        _RANKS[row.name] = rank_among_searched(row)
    return _RANKS[row.name]


def _rank_among_searched(row) -> int:
    return _ranked(row)["rank"]


OUTSIDE_TOP_10 = {
    "GPT 39.1B tp8 pp2 dp32", "GPT 174.6B tp8 pp12 dp4", "GPT 174.6B tp8 pp12 dp8",
    "GPT 174.6B tp8 pp12 dp16", "GPT 175B tp8 pp8 full", "GPT 1T tp8 pp64 full",
}
"""Published Megatron-LM layouts the cost model still ranks below 10th (docs/planner.md, Known
limits): it prices tp 2-4 with an interleaved pipeline, or (megatron-2022, with the distributed
optimizer) fewer pipeline stages and dp 2-4, faster than the papers' layouts;
``plan --explain`` shows what each claimed gain rests on."""

_RANKED = ranked_rows(published_rows())
_MEGATRON_ROWS = [r for r in _RANKED if r.source.startswith(("Narayanan", "Korthikanti"))]


@pytest.mark.parametrize(
    "row", [pytest.param(r, id=r.name, marks=pytest.mark.xfail(
        strict=True, reason="ranks below 10th (docs/planner.md, Known limits)"))
        if r.name in OUTSIDE_TOP_10 else pytest.param(r, id=r.name) for r in _MEGATRON_ROWS])
def test_megatron_layouts_rank_in_plans_top_10(row):
    """Narayanan 2021 Tables 1-2 and Korthikanti 2022 Table 5, each searched with its own stack
    (megatron-2021, megatron-2022) on its cluster and batch: 30 to 730 layouts each. A row listed
    in OUTSIDE_TOP_10 must still rank below 10th (strict xfail), so the list stays true."""
    assert _rank_among_searched(row) <= 10


MEGATRON_CORE_OUTSIDE_TOP_10 = {"Nemotron-4 15B 16 H100"}
"""The dgxc-benchmarking layout the search ranks below 10th: tp 4 × dp 4 at micro-batch 4,
5.4 % behind tp 2 × dp 8 at micro-batch 2 in the cost model (docs/planner.md, Known limits)."""

_CORE_ROWS = [r for r in _RANKED if r.source.startswith("NVIDIA")]


@pytest.mark.parametrize(
    "row", [pytest.param(r, id=r.name, marks=pytest.mark.xfail(
        strict=True, reason="ranks below 10th (docs/planner.md, Known limits)"))
        if r.name in MEGATRON_CORE_OUTSIDE_TOP_10 else pytest.param(r, id=r.name)
        for r in _CORE_ROWS])
def test_megatron_core_layouts_rank_in_plans_top_10(row):
    """The dgxc-benchmarking recipes' layouts (NeMo 24.09 on H100), searched with the
    megatron-core-2024 stack at each recipe's smallest scale."""
    assert _rank_among_searched(row) <= 10


def test_megatron_core_layouts_are_within_5_percent_of_the_fastest():
    behind = {row.name: _ranked(row)["behind"] for row in _CORE_ROWS}
    assert len(behind) == 6
    ranked_in = {name: b for name, b in behind.items()
                 if name not in MEGATRON_CORE_OUTSIDE_TOP_10}
    assert all(b <= 0.05 for b in ranked_in.values()), ranked_in
    # The one below 10th (Known limits) is 5.4 % behind: within the cost model's error, and
    # still outside 5 % (fixing it means taking it off the list).
    outside = {name: behind[name] for name in MEGATRON_CORE_OUTSIDE_TOP_10}
    assert all(0.05 < b <= 0.06 for b in outside.values()), outside


def test_torchtitan_h100_layout_ranks_in_plans_top_10():
    rows = [r for r in _RANKED if r.profile == "h100-96g-hbm2e-500w"]
    ranks = {row.name: _rank_among_searched(row) for row in rows}
    assert len(ranks) == 1 and all(rank <= 10 for rank in ranks.values()), ranks


def test_a_power_limit_below_tdp_slows_compute_on_the_energy_models_curve():
    from meshtrain.planner.energy.schedule import power_curve

    grand_teton = PROFILES["h100-96g-hbm2e-500w"]
    # The clock it computes at draws the 500 W limit on the energy schedule's power curve.
    clock = grand_teton.clock_ratio() * grand_teton.max_clock_mhz
    assert power_curve(grand_teton).busy_power(clock) == pytest.approx(500.0)
    assert 0.5 < grand_teton.clock_ratio() < 1.0
    assert PROFILES["h100-80g"].clock_ratio() == 1.0
    assert Cluster(grand_teton, 8, 8).process_rates()[0] == pytest.approx(
        989.0 * grand_teton.clock_ratio())


def test_torchtitan_a100_layouts_rank_first_in_plans_search():
    """torchtitan's FSDP2 runs on 64 A100: 2,800-4,100 layouts searched each."""
    rows = [r for r in _RANKED if r.source == "torchtitan docs/performance.md (A100)"]
    ranks = {row.name: _rank_among_searched(row) for row in rows}
    assert len(ranks) == 6 and all(rank <= 10 for rank in ranks.values()), ranks


def _planner_doc() -> str:
    return (Path(__file__).parents[3] / "docs" / "planner.md").read_text()


def test_planner_doc_rank_table_is_what_the_code_prints(capsys):
    """docs/planner.md's table of published layouts in ``plan``'s ranking is the current
    output of ``python -m meshtrain.planner.tables.published --ranks``, line for line."""
    from meshtrain.planner.tables.ranks import print_ranks

    print_ranks(_RANKED, rank=_ranked)
    printed = capsys.readouterr().out.splitlines()
    doc = _planner_doc().splitlines()
    start = doc.index(printed[0])
    assert doc[start:start + len(printed)] == printed
