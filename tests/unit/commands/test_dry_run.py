"""``meshtrain train --dry-run``: one rank's real objects on meta over torch's fake process group.

(a) a Llama-3-70B shape on 64 ranks through the CLI, fast, model states within 2 % of the
planner; (b) on a tiny model the dry run's bytes equal a real run's, rank by rank; (c) bad input
exits 2 with a message.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain import cli
from meshtrain.commands import dry_run
from tests.distributed import run_distributed
from tests.helpers import tiny_config

MESHTRAIN = Path(sys.executable).with_name("meshtrain")
LLAMA3_70B = ["model.dim=8192", "model.n_layers=80", "model.n_heads=64", "model.n_kv_heads=8",
              "model.ffn_dim=28672", "model.vocab_size=128256", "train.precision=bf16",
              "train.seq_len=8192", "train.global_batch=64"]
TP8_PP4_DP2 = ["parallel.tp=8", "parallel.pp=4", "parallel.zero=1", "parallel.microbatches=8"]
MEM_KEYS = ("param_bytes", "grad_bytes", "optim_bytes")


def _dry_run_cli(overrides: list[str], world: int, rank: int) -> tuple[dict, float]:
    """The ``--json`` document of a dry run through the installed command, and its wall time."""
    args = [str(MESHTRAIN), "train", "--dry-run", "--world", str(world), "--rank", str(rank),
            "--json"]
    for text in overrides:
        args += ["--set", text]
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), elapsed


def _model_states_diff(report: dict) -> float:
    return report["estimate"]["rel_diff"]["model_states"]


# ---------------------------------------------------------------------------- (a) 70B, 64 ranks
@pytest.mark.parametrize("rank", [0, 63])
def test_70b_tp8_pp4_dp2_zero1_matches_planner(rank):
    """Even pipeline split (the planner's placement): every model state within 2 %."""
    report, elapsed = _dry_run_cli(LLAMA3_70B + TP8_PP4_DP2 + ["parallel.pp_split=20,20,20,20"],
                                   64, rank)
    assert elapsed < 60
    lay = report["layout"]
    assert (lay["dp"], lay["tp"], lay["pp"], lay["zero"]) == (2, 8, 4, 1)
    assert lay["coords"]["pp"] == rank // 16 and lay["coords"]["tp"] == rank % 8
    assert abs(_model_states_diff(report)) < 0.02
    for key in ("param", "grad", "optim"):
        assert abs(report["estimate"]["rel_diff"][key]) < 0.02, key
    b = report["bytes"]
    assert b["total"] == sum(b[k] for k in ("param", "grad", "optim", "buffers",
                                            "largest_transient"))
    axes = report["collectives"]["axes"]
    assert report["collectives"]["source"].startswith("measured")
    assert {"dp", "tp", "pp"} <= set(axes)
    assert axes["pp"]["ops"]["send"]["calls"] == 8 and axes["pp"]["ops"]["recv"]["calls"] == 8
    # ZeRO-1: one reduce-scatter of every bucket's fp32 gradients and one all-gather of its
    # bf16 parameters: the all-gather moves half the reduce-scatter's bytes.
    dp = axes["dp"]["ops"]
    assert dp["reduce_scatter"]["calls"] == dp["all_gather"]["calls"] == report["detail"]["buckets"]
    assert dp["all_gather"]["bytes"] * 2 == pytest.approx(dp["reduce_scatter"]["bytes"], rel=1e-6)


def test_70b_dp64_zero3_matches_planner():
    report, elapsed = _dry_run_cli(LLAMA3_70B + ["parallel.zero=3"], 64, 5)
    assert elapsed < 60
    assert report["layout"]["dp"] == 64 and report["layout"]["coords"]["dp"] == 5
    assert abs(_model_states_diff(report)) < 0.02
    assert report["detail"]["largest_transient_kind"] == "zero3_gather"
    dp = report["collectives"]["axes"]["dp"]["ops"]
    # Each block (~3.4 GB in bf16) exceeds the 25 MiB bucket: its seven projections are units,
    # its norm weights join the root unit (embedding, final norm, head).
    # Every bucket gathered for forward and again for backward, but the last unit (the last
    # block's w2, a bucket of its own) stays gathered for its backward.
    assert dp["reduce_scatter"]["calls"] == 80 * 7 + 1
    assert dp["all_gather"]["calls"] == 2 * (80 * 7 + 1) - 1


def test_70b_uneven_stage_is_priced_as_the_runtime_splits_it():
    """The runtime balances stages by cost (the head included), giving pp stage 2 of 4 21 of the
    80 layers; the planner prices the same 21, and the states agree within 2 %."""
    report, _ = _dry_run_cli(LLAMA3_70B + TP8_PP4_DP2, 64, 32)
    assert len(report["layout"]["layers"]) == 21 and report["estimate"]["layers"] == 21
    states = sum(report["bytes"][k] for k in ("param", "grad", "optim"))
    assert states == pytest.approx(report["estimate"]["model_states"], rel=1e-3)


# ---------------------------------------------------------------------------- (b) equals real
def _real_memory(config_dicts: list[dict]) -> list[dict]:
    """On every rank: one real training step of each config; its ``mem`` record."""
    from meshtrain.config import config_from_dict
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    out = []
    for data in config_dicts:
        config = config_from_dict(data)
        trainer = Trainer(config, build_mesh(config))
        out.append({k: trainer.train_step()["mem"][k] for k in MEM_KEYS})
    return out


def _dry_memory(config, world: int, rank: int) -> dict:
    report = dry_run.report(config, world, rank)
    return {f"{k}_bytes": report["bytes"][k] for k in ("param", "grad", "optim")}


TWO_RANK_CASES = [("parallel.zero=0",), ("parallel.zero=1",), ("parallel.zero=2",),
                  ("parallel.zero=3",), ("parallel.zero=1", "train.precision=bf16"),
                  # ranks that hold different pieces: tp halves, pipeline stages
                  ("parallel.tp=2", "parallel.dp=1"),
                  ("parallel.pp=2", "parallel.dp=1", "parallel.microbatches=2")]


def test_two_ranks_equal_real_run_rank_by_rank(tmp_path):
    """dp2 with ZeRO 0-3 (and bf16 masters), tp2, pp2: the dry run of rank r reports the
    param/grad/optim bytes that the real rank r's trainer reports after one step."""
    configs = [tiny_config(*case, run_dir=str(tmp_path / str(i)), nproc=2)
               for i, case in enumerate(TWO_RANK_CASES)]
    real = run_distributed(2, _real_memory, [c.to_dict() for c in configs], timeout=600)
    for i, case in enumerate(TWO_RANK_CASES):
        for rank in (0, 1):
            assert _dry_memory(tiny_config(*case, nproc=2), 2, rank) == real[rank][i], \
                (case, rank)
    assert real[0][5] == real[1][5] and real[0][6] != real[1][6]  # pp stages differ


def test_one_process_equals_metrics_jsonl(tmp_path):
    """A real one-process ``meshtrain train`` step's ``mem`` in metrics.jsonl, and the CLI's
    dry run of rank 0 of 1, for bf16 (separate fp32 masters and gradients)."""
    sets = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_dim=64", "train.seq_len=16", "train.global_batch=8",
            "data.max_bytes=200000", "train.precision=bf16", "parallel.zero=1",
            f"train.run_dir={tmp_path}"]
    args = [str(MESHTRAIN), "train", "--steps", "1"] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    mem = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["mem"]
    report, _ = _dry_run_cli(sets, 1, 0)
    assert {f"{k}_bytes": report["bytes"][k] for k in ("param", "grad", "optim")} == \
        {k: mem[k] for k in MEM_KEYS}


def test_derived_collectives_agree_with_measured_ones():
    """The fallback (for steps that cannot run on meta, e.g. MoE routing) derives the dp and pp
    traffic from the buckets and the schedule; on a dense model it matches the measured step
    (less the scalar all-reduces it does not derive)."""
    from meshtrain.parallel.mesh import shutdown_distributed

    for case in (("parallel.zero=2", "parallel.microbatches=2"),
                 ("parallel.zero=3", "parallel.microbatches=2"),
                 ("parallel.pp=2", "parallel.zero=1", "parallel.microbatches=4")):
        config = tiny_config(*case, nproc=4)
        measured = dry_run.report(config, 4, 3)["collectives"]["axes"]
        try:
            derived = dry_run.derived_collectives(dry_run.build_rank(
                tiny_config(*case, nproc=4), 4, 3), "test")["axes"]
        finally:
            shutdown_distributed()
        for axis, entry in derived.items():
            for op, per in entry["ops"].items():
                assert measured[axis]["ops"][op] == per, (case, axis, op)


def test_moe_falls_back_to_derived_collectives():
    config = tiny_config("model.moe_experts=4", "parallel.ep=2", "parallel.zero=1", nproc=2)
    report = dry_run.report(config, 2, 1)
    assert report["collectives"]["source"].startswith("derived")
    assert report["bytes"]["param"] > 0 and "dp" in report["collectives"]["axes"]


def test_buffers_and_transients_follow_the_engine():
    """ZeRO-0 reduces in place; ZeRO-1 keeps every bucket's reduce-scatter output (one gradient
    shard in all) until the micro-batch ends; ZeRO-3 gathers the root unit plus two blocks."""
    zero0 = dry_run.report(tiny_config("parallel.zero=0", nproc=2), 2, 0)
    assert zero0["bytes"]["buffers"] == 0 and zero0["bytes"]["largest_transient"] == 0
    zero1 = dry_run.report(tiny_config("parallel.zero=1", nproc=2), 2, 1)
    assert zero1["detail"]["grad_reduce_outputs"] * 2 == zero1["bytes"]["grad"]
    zero3 = dry_run.report(tiny_config("parallel.zero=3", nproc=2), 2, 0)
    # fp32, dim 32, ffn 64, 4 heads / 2 kv heads of 8, vocab 264: blocks and root, padded to 2
    block = 32 * 32 * 2 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
    root = 2 * 264 * 32 + 32
    assert zero3["detail"]["transients"]["zero3_gather"] == 4 * (2 * block + root)


def test_table_output(capsys):
    assert cli.main(["train", "--dry-run", "--world", "2", "--rank", "1", "--set",
                     "parallel.zero=2", "--set", "model.n_layers=2"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 of 2" in out and "model states" in out and "reduce_scatter" in out


# ---------------------------------------------------------------------------- (c) bad input
@pytest.mark.parametrize("argv, message", [
    (["--dry-run"], "--dry-run needs --world"),
    (["--dry-run", "--world", "4", "--rank", "4"], "outside a world of 4"),
    (["--world", "4"], "only apply with --dry-run"),
    (["--dry-run", "--world", "6", "--set", "parallel.tp=4"], "not a multiple of tp"),
    (["--dry-run", "--world", "3", "--set", "parallel.tp=3"], "parallel.tp = 3"),
])
def test_bad_input_exits_2(argv, message, capsys):
    assert cli.main(["train", *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_pipeline_message_peak_is_bounded_by_the_schedule_not_the_step():
    """1F1B holds a bounded number of messages whatever the micro-batch count; GPipe, which runs
    every forward first, holds each micro-batch's received activation until its backward."""
    from meshtrain.parallel.pipeline import build_schedule

    one_f_one_b = [[dry_run.pipeline_message_peak(build_schedule("1f1b", 4, m, 1), r)
                    for r in range(4)] for m in (8, 32)]
    assert one_f_one_b[0] == one_f_one_b[1] and max(one_f_one_b[0]) <= 2 * 4
    gpipe = build_schedule("gpipe", 4, 16, 1)
    assert all(dry_run.pipeline_message_peak(gpipe, r) >= 16 for r in (1, 2, 3))


def test_zero3_sub_block_units_reduce_in_the_order_they_ran():
    """Blocks over ``dp_bucket_mb`` are split into single projections; after the first forward
    the engine reduces them in the reverse of the order they ran (``w2`` before ``w3`` before
    ``w1``), not of their registration, and the step's collectives are one per unit."""
    from meshtrain.parallel.mesh import shutdown_distributed

    config = tiny_config("parallel.zero=3", "parallel.dp_bucket_mb=0.005", nproc=2)
    try:
        dry = dry_run.build_rank(config, 2, 0)
        engine = dry.trainer.engine
        collectives = dry_run.measured_collectives(dry)
    finally:
        shutdown_distributed()  # the fake process group must not outlive the test
    names = [engine.buckets[i].slots[0].name.split(".", 2)[2] for i in engine.launch_order[:7]]
    assert names == ["feed_forward.w2.weight", "feed_forward.w3.weight",
                         "feed_forward.w1.weight", "attention.wo.weight", "attention.wv.weight",
                         "attention.wk.weight", "attention.wq.weight"]
    assert len(engine.buckets) == 2 * 7 + 1  # the root: embedding, norms, head
    dp = collectives["axes"]["dp"]["ops"]
    assert dp["reduce_scatter"]["calls"] == len(engine.buckets)


def test_mixtral_zero3_shards_experts_over_their_expert_group_as_the_planner_prices():
    """Mixtral-8x7B's shape at dp 16 × ep 8, ZeRO-3 (16 ranks, rank 5 built on meta tensors):
    the experts are sharded over their edp group of 2 ranks, the rest over dp 16, and every
    model state equals the planner's; each MoE layer's experts are one bucket of their own,
    gathered (forward and backward) and reduce-scattered over ``edp`` only."""
    from meshtrain.config import load_config
    from meshtrain.validation.run_config import validate_config

    config = load_config(None, [
        "model.dim=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8",
        "model.ffn_dim=14336", "model.moe_experts=8", "model.moe_top_k=2",
        "model.moe_ffn_dim=14336", "model.vocab_size=32000", "train.precision=bf16",
        "train.seq_len=4096", "train.global_batch=16", "parallel.dp=16", "parallel.ep=8",
        "parallel.zero=3"])
    validate_config(config, 16)
    report = dry_run.report(config, 16, 5)
    for key in ("param", "grad", "optim", "model_states"):
        assert abs(report["estimate"]["rel_diff"][key]) < 0.02, key
    # At rest a rank holds half of its one expert per layer (3 × 4096 × 14336) and 1/16 of
    # the rest (attention, norms, router; embedding, final norm, untied head), in bf16.
    expert = 32 * 3 * 4096 * 14336
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 8 * 4096
    dense = 32 * layer + 2 * 32000 * 4096 + 4096
    held = report["bytes"]["param"] / 2
    assert held == pytest.approx(expert / 2 + dense / 16, rel=1e-5)  # buckets' padding aside
    edp = report["collectives"]["axes"]["edp"]["ops"]
    # The last block's experts stay gathered from its forward to its backward.
    assert edp["reduce_scatter"]["calls"] == 32 and edp["all_gather"]["calls"] == 2 * 32 - 1
