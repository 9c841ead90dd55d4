"""Planner time model against published measurements, and the layout search."""

from __future__ import annotations

import pytest

from meshtrain.config import ConfigError, ModelConfig
from meshtrain.layout import Layout
from meshtrain.planner.estimate import estimate
from meshtrain.planner.hardware import PROFILES, Cluster, load_profile
from meshtrain.planner.presets import preset_config
from meshtrain.planner.published import NARAYANAN_TABLE_1
from meshtrain.planner.search import plan
from meshtrain.planner.workload import MEGATRON_2021, Workload

# Narayanan et al. 2021 (SC21), Table 1 (rows in meshtrain.planner.published).


def megatron_2021_estimate(heads, hidden, layers, tp, pp, gpus, batch, **layout):
    """Price one Table 1 row as Megatron-LM ran it (micro-batch 1, 1F1B, full recompute)."""
    model = ModelConfig(vocab_size=51200, dim=hidden, n_layers=layers, n_heads=heads,
                        ffn_dim=4 * hidden, mlp="gelu")
    dp = gpus // (tp * pp)
    options = dict(dp=dp, tp=tp, pp=pp, microbatches=batch // dp,
                   activation_checkpointing="full")
    options.update(layout)
    return estimate(Workload(model, 2048, batch, "bf16", MEGATRON_2021), Layout(**options),
                    Cluster(PROFILES["a100-80g"], gpus, 8))


@pytest.mark.parametrize("row", NARAYANAN_TABLE_1, ids=lambda r: f"{r[0]}B")
def test_narayanan_table_1_within_15_percent(row):
    *shape, published = row[1:]
    result = megatron_2021_estimate(*shape)
    assert result["hardware_tflops_per_gpu"] == pytest.approx(published, rel=0.15)


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
        assert c["memory_gb_per_gpu"] <= 80
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
