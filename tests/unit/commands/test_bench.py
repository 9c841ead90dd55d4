"""``meshtrain bench``: the JSON document of tiny runs of every suite, the summary arithmetic on
hand-made runs, argument errors, the suite registry, the tables. The runs check the output's
shape and that both sides train the same numbers, never the speed."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch

from meshtrain.cli import main
from meshtrain.commands.bench import SUITES, BenchOptions, Suite, format_table, register_suite
from meshtrain.commands.bench.base import bench_config, summarise_run
from meshtrain.commands.bench.roofline import GEMM_SIZES
from meshtrain.commands.bench.runner import median_interval, resolve_suites, suite_result
from meshtrain.config import ConfigError
from meshtrain.config.model_size import flops_per_token
from meshtrain.host.allocator import allocator_env

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64", "--set", "train.seq_len=32",
        "--set", "train.global_batch=4", "--set", "data.max_bytes=200000"]
ONE_QUICK_RUN = ["--steps", "2", "--warmup", "0", "--repeats", "1", "--json"]

SIDES = ("meshtrain", "peer")
PAIR_SUITES = ("dp", "dp-hf", "zero3", "tp", "pp")
"""The two-process meshtrain-vs-peer suites, run together in one ``meshtrain bench`` call."""


def _bench_json(*args: str) -> list[dict]:
    """``meshtrain bench ARGS`` in this process; its stdout parsed as JSON."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["bench", *args])
    assert status == 0
    results = json.loads(out.getvalue())
    assert isinstance(results, list)
    return results


@pytest.fixture(scope="module")
def pair_results() -> dict[str, dict]:
    """One call for every two-process pair suite (one warm parent, one JSON document), the
    peers with glibc's default malloc settings (``--no-same-allocator``)."""
    results = _bench_json("--suite", ",".join(PAIR_SUITES), "--no-same-allocator",
                          *ONE_QUICK_RUN, *TINY)
    assert [r["suite"] for r in results] == list(PAIR_SUITES)
    return {r["suite"]: r for r in results}


def _check_result(result: dict, suite: str, world: int, same_allocator: bool = True,
                  bf16: bool = False) -> None:
    assert result["suite"] == suite
    assert result["world_size"] == world
    assert isinstance(result["peer"], str) and result["peer"]
    for side in SIDES:
        assert isinstance(result[f"{side}_tokens_per_s"], float)
        assert result[f"{side}_tokens_per_s"] > 0
        assert isinstance(result[f"{side}_peak_bytes"], int) and result[f"{side}_peak_bytes"] > 0
        assert len(result[f"{side}_peak_bytes_per_rank"]) == world
        assert len(result[f"{side}_runs_tokens_per_s"]) == 1
        assert result[f"{side}_cpu_tokens_per_s"] > 0
    assert result["ratio"] > 0 and result["cpu_ratio"] > 0  # arithmetic: test_summary_*
    assert result["memory_ratio"] == result["meshtrain_peak_bytes"] / result["peer_peak_bytes"]
    # One run per side: the median of run-by-run quotients is the quotient of the medians.
    assert result["paired_ratio"] == pytest.approx(result["ratio"])
    assert result["paired_ratio_interval"] == [result["paired_ratio"]] * 2
    assert result["paired_ratio_confidence"] == 0.0  # one run says nothing of the spread
    assert (result["steps"], result["warmup"], result["repeats"]) == (2, 0, 1)
    assert result["tokens_per_step"] == 4 * 32
    assert result["threads_per_process"] == 1
    assert result["shape"]["dim"] == 32 and result["shape"]["n_kv_heads"] == 2
    assert result["shape"]["seq_len"] == 32 and result["shape"]["global_batch"] == 4
    # Same data, same initial weights, same optimizer: both sides train the same numbers (in
    # bf16 against autocast, to meshtrain verify's bf16 tolerance, 5e-2 on the loss).
    near = dict(abs=5e-2) if bf16 else dict(rel=1e-4)
    assert result["meshtrain_first_loss"] == pytest.approx(result["peer_first_loss"], **near)
    near = dict(abs=5e-2) if bf16 else dict(rel=1e-3)
    assert result["meshtrain_last_loss"] == pytest.approx(result["peer_last_loss"], **near)
    # meshtrain's side starts with its launcher's malloc settings; the peer with the same ones
    # unless --no-same-allocator.
    assert result["meshtrain_allocator_env"] == allocator_env()
    assert result["peer_allocator_env"] == (allocator_env() if same_allocator else {})


def test_single_suite_json():
    pytest.importorskip("transformers")
    [result] = _bench_json("--suite", "single", *ONE_QUICK_RUN, *TINY)
    _check_result(result, "single", 1)
    # The CPU's measured fp32 product rate, and the share of it each side's step delivers.
    assert result["gemm_flops_per_s"] > 1e8 and result["gemm_size"] in GEMM_SIZES
    config, _ = bench_config(SUITES["single"], TINY[1::2], 1)
    flops = flops_per_token(config.model, config.train.seq_len)
    assert result["model_flops_per_token"] == flops
    for side in SIDES:
        assert result[f"{side}_roofline_fraction"] == pytest.approx(
            flops * result[f"{side}_tokens_per_s"] / result["gemm_flops_per_s"])
    assert "fp32 GEMM roofline" in format_table([result])


def test_peers_names_every_dense_layout_once():
    assert [s.name for s in resolve_suites(["peers"])] == ["single", "dp", "zero3", "tp", "pp"]
    assert [s.name for s in resolve_suites(["dp,peers", "tp"])] == ["dp", "single", "zero3",
                                                                   "tp", "pp"]
    with pytest.raises(ConfigError, match='Did you mean "peers"'):
        resolve_suites(["peer"])


@pytest.mark.parametrize("suite", PAIR_SUITES)
def test_pair_suite_json(pair_results, suite):
    result = pair_results[suite]
    _check_result(result, suite, 2, same_allocator=False)
    assert result["peer"] == SUITES[suite].peer
    # pp: the same micro-batches on both sides (2 x pp of them unless --set)
    assert result["shape"]["microbatches"] == (4 if suite == "pp" else 1)


def test_moe_suites_json():
    # moe: meshtrain's MoE model against HF Mixtral holding the same weights (the same first and
    # last losses are the parity check); moe-ep: ep 2 against dp 2 of the same model.
    pytest.importorskip("transformers")
    results = _bench_json("--suite", "moe,moe-ep", *ONE_QUICK_RUN, *TINY)
    assert [r["suite"] for r in results] == ["moe", "moe-ep"]
    _check_result(results[0], "moe", 1)
    _check_result(results[1], "moe-ep", 2)
    assert all(r["shape"]["moe_experts"] == 8 for r in results)


def test_one_process_suites_compare_bf16_training():
    # meshtrain's bf16 (bf16 weights, fp32 masters) against the peers' torch.autocast: the same
    # first loss to bf16's precision, which shows the same model, data and weights.
    pytest.importorskip("transformers")
    results = _bench_json("--suite", "single,moe", *ONE_QUICK_RUN, *TINY,
                          "--set", "train.precision=bf16")
    for result, suite in zip(results, ("single", "moe"), strict=True):
        _check_result(result, suite, 1, bf16=True)
        assert result["shape"]["precision"] == "bf16"
    assert "the peers run torch.autocast(bf16)" in " ".join(format_table(results).split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert main(["bench", "--suite", "moe", "--set", "train.device=cuda"]) == 2
    assert "sees no CUDA device" in " ".join(capsys.readouterr().err.split())


def test_allocator_suite_is_meshtrain_with_and_without_its_malloc_settings():
    [result] = _bench_json("--suite", "allocator", *ONE_QUICK_RUN, *TINY)
    _check_result(result, "allocator", 1, same_allocator=False)  # its peer never gets them
    # Both sides are the same meshtrain run: bit for bit the same losses.
    assert result["meshtrain_first_loss"] == result["peer_first_loss"]
    assert result["meshtrain_last_loss"] == result["peer_last_loss"]
    assert "allocator: meshtrain with its malloc settings" in format_table([result])


def _rank(step_times, cpu_times, peak, base):
    return {"step_times": step_times, "step_cpu_times": cpu_times, "tokens_per_step": 128,
            "peak_bytes": peak, "base_bytes": base, "losses": [5.0, 4.0], "threads": 1}


def test_summary_of_one_run_by_hand():
    run = summarise_run([_rank([0.5, 0.25, 1.0], [0.2, 0.4, 0.3], 100, 40),
                         _rank([0.4, 0.5, 0.2], [0.1, 0.8, 0.5], 120, 50)])
    # A step lasts as long as its slowest rank: 0.5, 0.5, 1.0 s; median 0.5 s, 128 tokens a step.
    assert run["step_time_s"] == 0.5 and run["tokens_per_s"] == 256.0
    assert run["mean_tokens_per_s"] == 3 * 128 / 2.0
    # CPU: each rank's median (0.3 s, 0.5 s), the slower one.
    assert run["cpu_tokens_per_s"] == 128 / 0.5
    assert run["peak_bytes"] == [100, 120] and run["train_bytes"] == [60, 70]


def _run(tokens_per_s: float, cpu_tokens_per_s: float) -> dict:
    return {"tokens_per_s": tokens_per_s, "cpu_tokens_per_s": cpu_tokens_per_s,
            "mean_tokens_per_s": tokens_per_s, "peak_bytes": [1, 2], "train_bytes": [1, 1],
            "losses": [5.0, 4.0], "threads": 1}


def test_summary_ratios_of_three_repeats_by_hand():
    options = BenchOptions(steps=2, warmup=0, repeats=3, overrides=TINY[1::2])
    config, world = bench_config(SUITES["dp"], options.overrides, 2)
    runs = {"meshtrain": [_run(100, 90), _run(300, 110), _run(200, 100)],
            "peer": [_run(150, 50), _run(100, 80), _run(400, 60)]}
    result = suite_result(SUITES["dp"], config, world, options, runs)
    # Medians 200 and 150 tokens/s; run by run 100/150, 300/100, 200/400 -> median 2/3.
    assert result["meshtrain_tokens_per_s"] == 200 and result["peer_tokens_per_s"] == 150
    assert result["ratio"] == pytest.approx(4 / 3)
    assert result["paired_ratio"] == pytest.approx(2 / 3)
    # Three run-by-run ratios: their range, which holds their median 75 % of the time.
    assert result["paired_ratio_interval"] == pytest.approx([1 / 2, 3])
    assert result["paired_ratio_confidence"] == pytest.approx(0.75)
    # CPU medians 100 and 60.
    assert result["cpu_ratio"] == pytest.approx(5 / 3)
    assert result["meshtrain_runs_tokens_per_s"] == [100, 300, 200]


@pytest.mark.parametrize("n", [1, 3, 5, 9, 20])
def test_paired_interval_holds_the_median_as_often_as_it_says(n):
    # Skewed noise with a known median (exp(0) = 1): the interval of n draws must contain it
    # in the stated share of trials, whatever the distribution.
    generator = torch.Generator().manual_seed(n)
    trials, hits, confidence = 4000, 0, None
    for _ in range(trials):
        draws = torch.randn(n, generator=generator).exp().tolist()
        low, high, confidence = median_interval(draws)
        hits += low <= 1.0 <= high
    assert hits / trials == pytest.approx(confidence, abs=0.025)
    assert confidence >= 0.9 or n < 5  # five runs are the fewest that reach 90 %
    assert median_interval([4.0, 1.0, 3.0, 2.0, 5.0]) == (1.0, 5.0, pytest.approx(0.9375))


def test_scaling_suite_json_and_plot(tmp_path):
    plot = tmp_path / "scaling.png"
    [result] = _bench_json("--suite", "scaling", "--procs", "1,2", "--plot", str(plot),
                           *ONE_QUICK_RUN, *TINY)
    assert result["suite"] == "scaling" and result["world_size"] == 2
    assert result["skipped"] == [] and result["cpu_count"] >= 1
    assert result["threads_per_process"] == 1 and result["tokens_per_step"] == 4 * 32
    base = result["axes"]["dp"][0]
    assert base["procs"] == 1 and base["efficiency"] == 1.0
    for axis in ("dp", "tp", "pp"):
        points = result["axes"][axis]
        assert [p["procs"] for p in points] == [1, 2]
        assert points[0] == base  # one shared one-process run
        two = points[1]
        assert two["layout"][axis] == 2 and len(two["peak_bytes_per_rank"]) == 2
        assert two["tokens_per_s"] > 0 and len(two["runs_tokens_per_s"]) == 1
        assert two["efficiency"] == pytest.approx(two["tokens_per_s"] / (2 * base["tokens_per_s"]))
        assert two["cpu_efficiency"] > 0
        assert result["efficiency"][axis] == {"2": two["efficiency"]}
        # Every layout trains the same numbers as one process.
        assert two["first_loss"] == pytest.approx(base["first_loss"], rel=1e-4)
        assert two["last_loss"] == pytest.approx(base["last_loss"], rel=1e-3)
    assert result["axes"]["pp"][1]["layout"]["microbatches"] == 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["plot"] == str(plot)
    table = format_table([result])
    assert "scaling" in table and "efficiency" in table and "tp" in table


def test_diloco_suite_json_and_plot(tmp_path):
    """Both runs see the same tokens from the same weights (equal first loss), DiLoCo with H = 3
    moves about a third of dp's bytes, and the plot is a PNG."""
    plot = tmp_path / "diloco.png"
    steps = 6
    [result] = _bench_json("--suite", "diloco", "--plot", str(plot), "--json", *TINY,
                           "--set", f"train.steps={steps}", "--set", "train.eval_every=3",
                           "--set", "parallel.replicas=2", "--set", "parallel.sync_every=3",
                           "--set", "diloco.warm_start_steps=0")
    assert result["suite"] == "diloco" and result["replicas"] == 2
    sync, diloco = result["synchronous"], result["diloco"]
    for run in (sync, diloco):
        assert run["curve"]["step"] == list(range(1, steps + 1))
        assert [s for s, _ in run["curve"]["eval"]] == [3, 6]
        assert run["tokens"] == steps * 4 * 32
    assert diloco["curve"]["loss"][0] == pytest.approx(sync["curve"]["loss"][0], rel=1e-5)
    assert 0.25 < result["bytes_ratio"] < 0.45
    assert result["train_loss_gap"] == pytest.approx(
        diloco["final_train_loss"] / sync["final_train_loss"] - 1)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["plot"] == str(plot)
    assert "diloco" in format_table([result])


def test_diloco_warm_start_sides_continue_from_the_same_trained_weights(tmp_path):
    """With ``diloco.warm_start_steps = W`` dp trains W steps first; both sides then start from
    its weights at step W + 1 on batch W + 1: their first loss is step W + 1's loss of one cold
    dp run of W + N steps (the same weights after W steps, the same schedule and data), only
    their own steps' tokens and bytes are counted, and the plot draws."""
    warm, steps = 4, 4
    common = ["--suite", "diloco", "--json", *TINY, "--set", "train.eval_every=0",
              "--set", "parallel.replicas=2", "--set", "parallel.sync_every=2"]
    plot = tmp_path / "warm.png"
    [result] = _bench_json(*common, "--set", f"train.steps={steps}",
                           "--set", f"diloco.warm_start_steps={warm}", "--plot", str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [cold] = _bench_json(*common, "--set", f"train.steps={warm + steps}",
                         "--set", "diloco.warm_start_steps=0")
    assert result["warm_start_steps"] == warm and cold["warm_start"] is None
    warm_curve, cold_curve = result["warm_start"]["curve"], cold["synchronous"]["curve"]
    assert warm_curve["step"] == list(range(1, warm + 1))
    # the same fp32 arithmetic on the same ranks: equal up to summation-order noise
    assert warm_curve["loss"] == pytest.approx(cold_curve["loss"][:warm], rel=1e-5)
    sync, diloco = result["synchronous"], result["diloco"]
    for run in (sync, diloco):
        assert run["curve"]["step"] == list(range(warm + 1, warm + steps + 1))
        assert run["tokens"] == steps * 4 * 32
        assert run["curve"]["loss"][0] == pytest.approx(cold_curve["loss"][warm], rel=1e-5)
    assert 0.4 < result["bytes_ratio"] < 0.6


@pytest.mark.parametrize("args, message", [
    (["--suite", "singel"], 'Did you mean "single"'),
    (["--steps", "0"], "--steps = 0"),
    (["--repeats", "0"], "--repeats = 0"),
    (["--set", "model.dimm=8"], 'Did you mean "dim"'),
    (["--suite", "dp", "--set", "train.precision=bf16"],
     'the dp suite compares fp32 training only; valid: train.precision = "fp32"'),
    (["--suite", "moe", "--set", "train.precision=fp16"], '"fp32" or "bf16"'),
    (["--suite", "pp", "--set", "train.device=cuda"], "(on a GPU: --suite single,moe)"),
    (["--suite", "single", "--set", "model.mlp=gelu"], "SwiGLU"),
    (["--suite", "tp", "--set", "model.n_kv_heads=1"], "divisible by 2"),
    (["--suite", "dp", "--plot", "x.png"], "--suite scaling"),
    (["--suite", "diloco", "--set", "parallel.replicas=1"], "replicas = 1"),
    (["--suite", "diloco", "--plot", "no/such/dir/x.png"], "does not exist"),
    (["--suite", "diloco", "--set", "diloco.warm_start=5"], "diloco.warm_start_steps"),
    (["--suite", "diloco", "--set", "diloco.warm_start_steps=-1"], "whole number"),
    (["--suite", "diloco", "--set", "diloco.warm_start_steps=30"], "e.g. 40"),
    (["--suite", "diloco", "--set", "parallel.sync_every=30"], "diloco.warm_start_steps=N"),
    (["--suite", "single", "--set", "diloco.warm_start_steps=0"], "--suite diloco alone"),
    (["--suite", "scaling", "--plot", "no/such/dir/x.png"], "does not exist"),
    (["--suite", "scaling", "--procs", "0,2"], "--procs"),
    (["--suite", "scaling", "--procs", "two"], "--procs"),
    (["--suite", "scaling", "--set", "model.n_heads=5"], "n_heads"),
])
def test_usage_errors_exit_2(capsys, args, message):
    assert main(["bench", *args]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the message is wrapped at 100 columns
    assert message in err
    assert "Traceback" not in err


def test_missing_peer_package_says_how_to_install(capsys, monkeypatch):
    missing = dataclasses.replace(SUITES["single"], requires=("meshtrain_no_such_module",))
    monkeypatch.setitem(SUITES, "single", missing)
    assert main(["bench", "--suite", "single"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the message is wrapped at 100 columns
    assert "meshtrain_no_such_module" in err and "pip install -e '.[bench]'" in err


def test_registry_refuses_a_duplicate_name():
    with pytest.raises(ValueError, match="already registered"):
        register_suite(dataclasses.replace(SUITES["dp"]))
    assert all(isinstance(suite, Suite) for suite in SUITES.values())


def test_format_table_shows_every_suite():
    row = {"suite": "single", "world_size": 1, "peer": "peer X", "meshtrain_tokens_per_s": 900.0,
           "peer_tokens_per_s": 1000.0, "ratio": 0.9, "cpu_ratio": 0.95,
           "paired_ratio": 0.925, "paired_ratio_interval": [0.875, 0.975],
           "paired_ratio_confidence": 0.75,
           "meshtrain_peak_bytes": 2 << 20, "peer_peak_bytes": 3 << 20, "repeats": 3,
           "steps": 20, "warmup": 2, "threads_per_process": 1}
    table = format_table([row, {**row, "suite": "dp", "world_size": 2}])
    assert "single" in table and "dp" in table and "0.900" in table and "2/3" in table
    assert "0.667" in table  # memory: 2 MiB against 3
    assert "0.950" in table and "0.925" in table and "0.875-0.975 75%" in table
