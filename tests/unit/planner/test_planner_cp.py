"""Context parallelism in the planner: memory, communication, search, the CLI's checks.

The expected figures are worked out by hand in each test (not with the planner's own helpers).
"""

from __future__ import annotations

import json

import pytest

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.search.layouts import enumerate_layouts, plan
from meshtrain.planner.tables.presets import preset_config
from meshtrain.planner.tables.profiles import PROFILES

H100 = PROFILES["h100-80g"]

# dim 256, 8 heads of 32, 2 key/value heads: K (or V) is 64 features wide, 32 per rank at tp 2.
TINY = ModelConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=704)


def _estimate(workload: Workload, gpus_per_node: int = 8, **layout) -> dict:
    lay = Layout(**layout)
    return estimate(workload, lay, Cluster(H100, lay.world_size, gpus_per_node))


def test_cp_comm_bytes_match_the_hand_count():
    work = Workload(TINY, seq_len=1024, global_batch=8)
    # dp 2 x 2 micro-batches: 2 sequences per micro-batch. One full-sequence K on a tp rank:
    # 2 seq x 1024 tokens x 32 features x 2 bytes = 131,072 bytes; an all-gather or
    # reduce-scatter over 4 ranks moves 3/4 of it: 98,304 bus bytes.
    # Without checkpointing, per layer and micro-batch: AG(K), AG(V), RS(dK), RS(dV) = 4.
    # 4 layers x 2 micro-batches x 4 x 98,304 = 3,145,728.
    result = _estimate(work, dp=2, tp=2, cp=4, microbatches=2)
    assert result["cp_comm_bytes"] == 3_145_728
    assert result["layout"]["cp"] == 4
    # Full checkpointing gathers K and V again in the recompute: 6 per layer, 4,718,592.
    full = _estimate(work, dp=2, tp=2, cp=4, microbatches=2, activation_checkpointing="full")
    assert full["cp_comm_bytes"] == 4_718_592
    # Two pipeline stages: 2 layers on the rank, half the bytes.
    piped = _estimate(work, dp=2, tp=2, cp=4, pp=2, microbatches=2)
    assert piped["cp_comm_bytes"] == 1_572_864
    assert _estimate(work, dp=2, tp=2, microbatches=2)["cp_comm_bytes"] == 0


def test_cp_comm_time_uses_the_link_the_group_spans():
    work = Workload(TINY, seq_len=1024, global_batch=8)
    # 32 collectives of 98,304 bus bytes over 4 ranks (steps: max(2 log2 4, 4 - 1) = 4).
    # tp 2 x cp 4 = 8 ranks fit in an 8-GPU node: NVLink, 370 GB/s, 6 us per step.
    inside = _estimate(work, dp=2, tp=2, cp=4, microbatches=2)
    assert inside["breakdown"]["cp_comm_s"] == pytest.approx(32 * (98_304 / 370e9 + 4 * 6e-6))
    # With 4 GPUs per node the cp group (ranks 2 apart) spans 2 nodes, 2 ranks on each: the
    # network at 2 x 45 GB/s, 12 us per step.
    across = _estimate(work, gpus_per_node=4, dp=2, tp=2, cp=4, microbatches=2)
    assert across["breakdown"]["cp_comm_s"] == pytest.approx(32 * (98_304 / 90e9 + 4 * 12e-6))


def test_memory_per_rank_falls_with_cp():
    model = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        ffn_dim=14336)
    work = Workload(model, seq_len=32768, global_batch=4)
    base = _estimate(work, dp=4)
    act1 = base["per_rank"][0]["activation_bytes"]
    previous = base["memory_gb_per_gpu"]
    for cp in (2, 4, 8):
        result = _estimate(work, dp=4, cp=cp)
        rank = result["per_rank"][0]
        # Activations of S / cp tokens, plus every layer's gathered K and V:
        # 32 layers x 2 x (1 seq x 32768 tokens x 8 heads x 128 x 2 bytes) = 4,294,967,296.
        assert rank["activation_bytes"] == pytest.approx(act1 / cp + 4_294_967_296, rel=1e-6)
        assert rank["param_bytes"] == base["per_rank"][0]["param_bytes"]
        assert result["memory_gb_per_gpu"] < previous
        previous = result["memory_gb_per_gpu"]


def test_zero_shards_and_gradients_reduce_over_dp_times_cp():
    work = Workload(TINY, seq_len=1024, global_batch=8)
    with_cp = _estimate(work, dp=2, cp=4, zero=1)
    plain = _estimate(work, dp=8, cp=1, zero=1)
    # The same 8-rank group (1 apart) shards the optimizer state and reduces the gradients.
    assert with_cp["per_rank"][0]["optim_bytes"] == plain["per_rank"][0]["optim_bytes"]
    assert (with_cp["breakdown"]["dp_comm_total_s"]
            == pytest.approx(plain["breakdown"]["dp_comm_total_s"]))
    alone = _estimate(work, dp=2, cp=1, zero=1)
    assert alone["per_rank"][0]["optim_bytes"] == 4 * with_cp["per_rank"][0]["optim_bytes"]


#: A small model for the CLI cases (estimate needs --set to define the model).
_SHAPE = ["--set", "model.dim=512", "--set", "model.n_layers=4", "--set", "model.n_heads=8",
          "--set", "model.ffn_dim=1408", "--set", "model.vocab_size=1024",
          "--set", "train.global_batch=8", "--set", "train.precision=bf16"]


def test_estimate_cli_accepts_cp_and_fills_dp(meshtrain):
    run = meshtrain("estimate", "--hardware", "h100-80g", "--gpus", "16", "--json", *_SHAPE,
                    "--set", "train.seq_len=4096", "--set", "parallel.tp=2",
                    "--set", "parallel.cp=4")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert (out["layout"]["dp"], out["layout"]["cp"], out["layout"]["tp"]) == (2, 4, 2)
    assert out["cp_comm_bytes"] > 0 and out["breakdown"]["cp_comm_s"] > 0
    text = meshtrain("estimate", "--hardware", "h100-80g", "--gpus", "16", *_SHAPE,
                     "--set", "train.seq_len=4096", "--set", "parallel.cp=4")
    assert text.returncode == 0 and "cp=4" in text.stdout


def test_estimate_cli_refuses_a_cp_the_sequence_cannot_split(meshtrain):
    run = meshtrain("estimate", "--hardware", "h100-80g", "--gpus", "5", *_SHAPE,
                    "--set", "train.seq_len=96", "--set", "parallel.cp=5")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    message = " ".join(run.stderr.split())
    assert "2 × cp = 10" in message
    assert "valid cp for seq_len 96: 2, 3, 4, 6, 8, 12, 16, 24, 48" in message


def test_search_offers_only_cp_that_split_the_sequence():
    work = Workload(TINY, seq_len=24, global_batch=8)
    # 24 tokens in 2 cp chunks: cp 2, 3, 4, 6, 12; of the divisors of 16 GPUs, 2 and 4
    # (cp 4 with sequence parallel over tp 2: 24 / 4 = 6 tokens per rank, divisible by 2).
    cps = {lay.cp for lay in enumerate_layouts(work, Cluster(H100, 16, 8))}
    assert cps == {1, 2, 4}


def test_plan_picks_cp_for_llama3_405b_at_128k_on_16k_h100():
    config = preset_config("llama3-405b")
    config.train.seq_len, config.train.global_batch = 131072, 128  # 16M tokens, as at 8K
    result = plan(Workload.from_config(config), Cluster(H100, 16384, 8), top=3)
    best = result.candidates[0]
    assert best["cp"] > 1
    # Llama 3 used tp 8, pp 16 (cp 16, dp 8). pp 8 with 8 chunks per rank has the same bubble
    # as pp 16 with 4 and is priced within 2 % of it, so either may come first.
    assert best["tp"] == 8 and best["pp"] in (8, 16)
    assert best["pp"] * best["virtual_stages"] == 64
    assert 0.30 <= best["mfu"] <= 0.50  # published: 38 %


def test_plan_at_8k_picks_cp_only_when_it_is_faster():
    work = Workload.from_config(preset_config("llama3-70b"))
    cluster = Cluster(H100, 1024, 8)
    result = plan(work, cluster, top=1)
    best = result.candidates[0]
    without = [r for r in result.priced if r["layout"]["cp"] == 1]
    base = [r for r in without if r["layout"]["pp"] == 1 or r["layout"]["zero"] < 2]
    assert len(base) == len(enumerate_layouts(work, cluster, cps=(1,)))  # (and sharded variants)
    fastest_plain = max(r["tokens_per_s"] for r in without if r["fits"])
    if best["cp"] > 1:
        assert best["tokens_per_s"] > fastest_plain
    small = plan(Workload.from_config(preset_config("llama3-8b")), Cluster(H100, 64, 8), top=1)
    assert small.candidates[0]["cp"] == 1  # 8B at 8K on 64 GPUs: plain data parallelism


def test_auto_keeps_the_configured_cp(tmp_path, capsys):
    from meshtrain.config import load_config
    from meshtrain.replan.auto import BUILTIN_CPU, choose_layout
    from meshtrain.validation.run_config import validate_config

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(BUILTIN_CPU.to_dict()))
    tiny = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_dim=64", "train.seq_len=16",
            "train.global_batch=8", "parallel.auto=true", f"parallel.auto_profile={profile}"]
    config = load_config(None, tiny + ["parallel.cp=2"])
    assert choose_layout(config, 4) == 4
    par = config.parallel
    assert par.cp == 2 and par.dp * par.tp * par.pp == 2
    assert validate_config(config, 4) == 4
    assert " cp=2 " in capsys.readouterr().err
    plain = load_config(None, tiny)
    choose_layout(plain, 4)
    assert plain.parallel.cp == 1
