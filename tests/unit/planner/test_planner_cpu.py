"""The CPU side of the cost model: calibrated rates, collective fits, no compute/comm overlap."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.config import load_config
from meshtrain.planner.calibrate.measure import fit_latency_bandwidth
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.tables.profiles import PROFILES
from meshtrain.replan.auto import BUILTIN_CPU
from meshtrain.validation.run_config import validate_config


def test_per_process_rates_solo_shared_and_saturated():
    p = BUILTIN_CPU  # 40 GFLOP/s alone, 20 per thread with 2 busy, calibrated with 2
    assert p.per_process(1, 1) == (p.solo_tflops, p.solo_hbm_gbps)
    assert p.per_process(2, 1)[0] == pytest.approx(p.peak_tflops)
    assert p.per_process(1, 2)[0] == pytest.approx(2 * p.peak_tflops)  # two threads, one proc
    assert p.per_process(4, 1)[0] == pytest.approx(p.peak_tflops / 2)  # cores are full
    gpu = PROFILES["h100-80g"]
    assert gpu.per_process(64, 1) == (gpu.peak_tflops, gpu.hbm_gbps)


def test_fit_recovers_latency_and_bandwidth():
    rows = [{"bus_bytes": b, "time_s": 50e-6 + b / 2e9, "bus_gbps": b / (50e-6 + b / 2e9) / 1e9}
            for b in (4096, 65536, 2**20, 2**24)]
    bandwidth, latency = fit_latency_bandwidth(rows)
    assert bandwidth == pytest.approx(2.0, rel=1e-6)
    assert latency == pytest.approx(50.0, rel=1e-6)
    noisy = [dict(rows[0], time_s=1.0), rows[-1]]  # slope < 0: fall back to the largest's rate
    assert fit_latency_bandwidth(noisy)[0] == pytest.approx(rows[-1]["bus_gbps"])


def _estimate(profile, *overrides, world=2):
    config = load_config(None, ["model.dim=256", "model.n_heads=8", "model.vocab_size=264",
                                "train.global_batch=16", *overrides])
    validate_config(config, world)
    return estimate(Workload.from_config(config), config.parallel.layout(),
                    Cluster(profile, world, world))


def test_calibrated_fp32_runs_at_the_measured_rate_and_dp_comm_is_exposed():
    halved = dataclasses.replace(BUILTIN_CPU, fp32_rate=0.5)
    one = _estimate(BUILTIN_CPU, world=1)["breakdown"]["compute_s"]
    assert _estimate(halved, world=1)["breakdown"]["compute_s"] > 1.5 * one  # GEMMs dominate
    result = _estimate(BUILTIN_CPU)["breakdown"]
    assert result["dp_comm_exposed_s"] == pytest.approx(result["dp_comm_total_s"])
    overlapping = dataclasses.replace(BUILTIN_CPU, comm_overlaps_compute=True)
    # One bucket: it fires when backward ends, nothing left to hide behind.
    one_bucket = _estimate(overlapping)["breakdown"]
    assert one_bucket["dp_comm_exposed_s"] == pytest.approx(one_bucket["dp_comm_total_s"])
    # Small buckets fire during backward: only what outlasts it is exposed.
    bucketed = _estimate(overlapping, "parallel.dp_bucket_mb=0.05")["breakdown"]
    assert 0 < bucketed["dp_comm_exposed_s"] < 0.5 * bucketed["dp_comm_total_s"]


def test_dp_gradients_priced_through_shared_memory_where_the_runtime_uses_it():
    shm = dataclasses.replace(BUILTIN_CPU, shared_memory_reduce_gbps=4.0,
                              shared_memory_reduce_latency_us=300.0)
    grads = 13e6
    one_host = Cluster(shm, 2, 2)
    expected = 2 * 0.5 * grads / 4e9 + 300e-6  # bus bytes / rate + fixed cost
    assert one_host.dp_gradient_reduce_time("all_reduce", grads, 2, 1, True) == pytest.approx(
        expected)
    assert one_host.dp_gradient_reduce_time("reduce_scatter", grads, 2, 1, True) == (
        pytest.approx(0.5 * grads / 4e9 + 300e-6))
    # bf16 buckets, two hosts, or a profile without the measurement: gloo's collective.
    gloo = one_host.collective_time("all_reduce", grads, 2, 1)
    assert one_host.dp_gradient_reduce_time("all_reduce", grads, 2, 1, False) == gloo
    two_hosts = Cluster(shm, 2, 1)
    assert two_hosts.dp_gradient_reduce_time("all_reduce", grads, 2, 1, True) == (
        two_hosts.collective_time("all_reduce", grads, 2, 1))
    assert Cluster(BUILTIN_CPU, 2, 2).dp_gradient_reduce_time("all_reduce", grads, 2, 1,
                                                               True) == gloo
    # In an estimate: fp32 gradient buckets at dp2 ZeRO 0 and 1 (fp32 runs, and bf16 runs with
    # their default fp32 gradients) are priced at the shared-memory rate; bf16 gradients are not.
    for zero in (0, 1):
        for precision in ("fp32", "bf16"):
            with_shm = _estimate(shm, f"train.precision={precision}", f"parallel.zero={zero}")
            without = _estimate(BUILTIN_CPU, f"train.precision={precision}",
                                f"parallel.zero={zero}")
            assert (with_shm["breakdown"]["dp_comm_total_s"]
                    < without["breakdown"]["dp_comm_total_s"])
    bf16 = [_estimate(p, "train.precision=bf16", "parallel.grad_reduce_dtype=bf16")
            ["breakdown"]["dp_comm_total_s"] for p in (shm, BUILTIN_CPU)]
    assert bf16[0] == bf16[1]


def test_attention_figures_by_nearest_head_width():
    profile = dataclasses.replace(BUILTIN_CPU, attention_by_head_dim={"16": [0.1, 3.0],
                                                                       "64": [0.3, 2.0]})
    assert profile.attention_figures(24, 2.5) == (0.1, 3.0)
    assert profile.attention_figures(128, 2.5) == (0.3, 2.0)
    gpu = PROFILES["h100-80g"]
    assert gpu.attention_figures(64, 2.5) == (gpu.attention_efficiency, 2.5)
    fast = dataclasses.replace(BUILTIN_CPU, attention_by_head_dim=None)
    slow = _estimate(profile, world=1)["breakdown"]["compute_s"]
    assert slow > _estimate(fast, world=1)["breakdown"]["compute_s"]


@pytest.mark.parametrize("speed", [0.5, 1.0, 1.6])
def test_fit_to_block_reproduces_the_measured_block_and_its_slowdown(speed):
    """Fitting to a measured reference block makes the cost model predict exactly that block's
    solo time, and the concurrent rates the solo ones over the measured slowdown."""
    from meshtrain.planner.calibrate.block import fit_to_block, predicted_block_seconds

    base = dataclasses.replace(BUILTIN_CPU, matmul_efficiency=1.0)
    solo_s = predicted_block_seconds(base) / speed  # a machine `speed` times the kernel model
    fitted = fit_to_block(base, solo_s, 1.25 * solo_s)
    assert predicted_block_seconds(fitted) == pytest.approx(solo_s, rel=0.02)
    # A faster machine than the kernel model fits a higher efficiency, a slower one a lower.
    if speed == 1.0:
        assert fitted.matmul_efficiency == pytest.approx(1.0, rel=0.02)
    else:
        assert (fitted.matmul_efficiency > 1.0) == (speed > 1.0)
    assert fitted.peak_tflops == pytest.approx(base.solo_tflops / 1.25)
    assert fitted.hbm_gbps == pytest.approx(base.solo_hbm_gbps / 1.25)
    block = fitted.measured["reference_block"]
    assert block["slowdown"] == pytest.approx(1.25) and block["solo_s"] == solo_s
    # A faster-than-solo concurrent reading (noise) is not a speed-up.
    assert fit_to_block(base, solo_s, 0.9 * solo_s).peak_tflops == pytest.approx(base.solo_tflops)


def test_two_block_sizes_recover_the_efficiency_and_the_per_kernel_overhead():
    """Block times made by the model itself at a known efficiency and per-kernel overhead are
    fitted back to those values (the small block separates overhead from rate)."""
    from meshtrain.planner.calibrate.block import (
        SMALL_BATCH,
        fit_to_block,
        predicted_block_seconds,
    )

    truth = dataclasses.replace(BUILTIN_CPU, matmul_efficiency=0.7, kernel_overhead_us=15.0)
    large, small = predicted_block_seconds(truth), predicted_block_seconds(truth, SMALL_BATCH)
    fitted = fit_to_block(dataclasses.replace(BUILTIN_CPU, kernel_overhead_us=2.0), large, large,
                          small)
    assert fitted.matmul_efficiency == pytest.approx(0.7, rel=0.03)
    assert fitted.kernel_overhead_us == pytest.approx(15.0, rel=0.03)
    assert predicted_block_seconds(fitted, SMALL_BATCH) == pytest.approx(small, rel=0.02)
