"""Offload priced by the planner: the store, the node's host memory and drives, the step's terms
(host AdamW, PCIe, NVMe, the overlap), the device memory it frees, and ``plan`` proposing it."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.config import ConfigError, ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.memory import GB
from meshtrain.planner.cost.offload import (
    NVME_FILE_BYTES,
    RANK_HOST_BYTES,
    SYSTEM_FRACTION,
    Offload,
    check_offload,
    offload_cost,
)
from meshtrain.planner.cost.workload import MEGATRON_2022, Workload
from meshtrain.planner.hardware.profile import Cluster, HardwareProfile
from meshtrain.planner.search.layouts import plan
from meshtrain.planner.tables.presets import preset_config
from meshtrain.planner.tables.profiles import PROFILES

ROUND = HardwareProfile(
    "round", peak_tflops=100.0, memory_gb=80.0, hbm_gbps=1000.0, matmul_efficiency=0.5,
    kernel_overhead_us=5.0, intra_node_gbps=100.0, inter_node_gbps=10.0,
    intra_node_latency_us=5.0, inter_node_latency_us=10.0, power_w=1000.0,
    host_memory_gb=1000.0, nvme_tb=1.0, nvme_read_gbps=20.0, nvme_write_gbps=10.0,
    pcie_gbps=10.0, host_adamw_gbps=28.0)
"""A GPU node of round numbers, two GPUs to a node."""
CPU = dataclasses.replace(ROUND, name="round-cpu", solo_tflops=1.0, host_adamw_gbps=0.0,
                          pcie_gbps=0.0, comm_overlaps_compute=False, calibrated_processes=2)
"""The same as a CPU profile (the device is the host), with its drives' bandwidth."""
SMALL = ModelConfig(dim=256, n_layers=2, n_heads=4, ffn_dim=1024, vocab_size=1000)


def _work(precision: str = "bf16") -> Workload:
    return Workload(SMALL, 128, 8, precision)


def _cost(offload: Offload, profile=ROUND, precision="bf16", k=4, zero=3, forward_s=1.0,
          replicas=1) -> dict:
    """The cost of ``offload`` for a rank whose shard holds 10^9 parameters."""
    layout = Layout(dp=2, zero=zero, microbatches=k)
    return offload_cost(_work(precision), layout, Cluster(profile, 2, 2), offload, 1e9,
                        forward_s, replicas)


def test_gpu_optimizer_and_params_on_nvme_by_hand():
    # bf16, G = 4, k = 4 micro-batches, S = 1e9, two ranks share the node.
    cost = _cost(Offload("optimizer+params", "nvme"))
    assert cost["store_bytes_per_param"] == {"master": 4.0, "moments": 8.0, "parameters": 2.0}
    assert cost["store_gb_per_rank"] == pytest.approx(14.0)
    files = 14 * NVME_FILE_BYTES  # 14e9 bytes in whole GiB files
    assert cost["nvme_gb_per_node"] == pytest.approx(2 * files / GB)
    assert cost["adamw_bytes"] == 28e9 and cost["adamw_s"] == pytest.approx(2.0)  # 28 / 14 GB/s
    assert cost["pcie_to_host_bytes"] == 4e9  # the fp32 gradient shard
    assert cost["pcie_to_device_bytes"] == 16e9  # 2 k gathers of the bf16 shard
    assert cost["pcie_s"] == pytest.approx(2.0)  # 20 GB at 10 GB/s
    assert cost["nvme_read_bytes"] == 28e9  # 12 step + 16 gathers
    assert cost["nvme_write_bytes"] == 14e9  # 12 step + 2 parameter shard
    assert cost["nvme_s"] == pytest.approx(2.8 + 2.8)  # 28 / 10 GB/s, 14 / 5 GB/s
    assert cost["exposed_s"] == pytest.approx(9.6) and cost["hidden_s"] == 0.0


def test_overlap_hides_the_step_behind_one_forward():
    cost = _cost(Offload("optimizer+params", "nvme", overlap=True), forward_s=1.0)
    # the background step: AdamW 2.0 + gradients over PCIe 0.4 + its NVMe 1.2 + 2.8 = 6.4 s,
    # of which one forward (1.0 s) is hidden; the gathers' transfers stay exposed.
    assert cost["hidden_s"] == pytest.approx(1.0)
    assert cost["exposed_s"] == pytest.approx(9.6 - 1.0)
    assert _cost(Offload("optimizer", "host", overlap=True), forward_s=60.0)["exposed_s"] == \
        pytest.approx(0.0)


def test_gpu_optimizer_on_host_by_hand():
    cost = _cost(Offload("optimizer"), precision="fp32")
    # fp32: the store adds a separate master to the moments; masters go back over PCIe.
    assert cost["store_gb_per_rank"] == pytest.approx(12.0)
    assert cost["pcie_to_device_bytes"] == 4e9 and cost["pcie_s"] == pytest.approx(0.8)
    assert cost["nvme_s"] == 0.0 and cost["nvme_gb_per_node"] is None
    per_rank = 12e9 + RANK_HOST_BYTES
    assert cost["host_gb_per_node"] == pytest.approx(2 * per_rank / GB)
    assert cost["host_limit_gb"] == pytest.approx(1000 * (1 - SYSTEM_FRACTION))
    assert cost["host_fits"] and cost["fits"]
    bf16 = _cost(Offload("optimizer", "host"), precision="bf16", k=8)
    assert bf16["pcie_to_device_bytes"] == 2e9  # bf16 masters written back
    with_bf16_grads = offload_cost(
        dataclasses.replace(_work(), traits=dataclasses.replace(_work().traits,
                                                                grad_reduce_bytes=2)),
        Layout(dp=2, zero=3), Cluster(ROUND, 2, 2), Offload("optimizer"), 1e9, 1.0)
    assert with_bf16_grads["pcie_to_host_bytes"] == 2e9
    assert with_bf16_grads["adamw_bytes"] == 26e9


def test_cpu_zero3_params_on_nvme_reads_and_writes_by_hand():
    # fp32, the gradient shard in the files: reads (8k + 4k + 4 + 16) S, writes (4k + 12 + 4) S.
    k = 3
    cost = _cost(Offload("optimizer+params", "nvme"), profile=CPU, precision="fp32", k=k)
    assert cost["nvme_read_bytes"] == (8 * k + 4 * k + 4 + 16) * 1e9
    assert cost["nvme_write_bytes"] == (4 * k + 12 + 4) * 1e9
    assert cost["pcie_s"] == 0.0  # no PCIe: the device is the host
    assert cost["host_gb_per_node"] is None  # the device check is the host check
    assert cost["store_bytes_per_param"]["gradients"] == 4


def test_diloco_outer_state_goes_to_the_host():
    cost = _cost(Offload("optimizer"), replicas=2)
    assert cost["store_bytes_per_param"]["outer state"] == 8.0
    assert cost["store_gb_per_rank"] == pytest.approx(20.0)


def test_too_small_host_or_drive_is_refused_with_the_numbers():
    small = dataclasses.replace(ROUND, host_memory_gb=20.0, nvme_tb=0.01)
    host = _cost(Offload("optimizer"), profile=small)
    assert not host["host_fits"] and not host["fits"]
    nvme = _cost(Offload("optimizer", "nvme"), profile=small)
    assert nvme["host_fits"] and not nvme["nvme_fits"] and not nvme["fits"]


def _70b() -> tuple[Workload, Cluster]:
    return Workload.from_config(preset_config("llama3-70b")), Cluster(PROFILES["h100-80g"], 8, 8)


ZERO3_TP2 = Layout(dp=4, tp=2, sequence_parallel=True, zero=3, microbatches=128,
                   activation_checkpointing="full")


def test_offload_lowers_device_memory_by_the_offloaded_components():
    work, cluster = _70b()
    plain = estimate(work, ZERO3_TP2, cluster, use_simulator=False)["per_rank"][0]
    opt = estimate(work, ZERO3_TP2, cluster, use_simulator=False,
                   offload=Offload("optimizer"))["per_rank"][0]
    both = estimate(work, ZERO3_TP2, cluster, use_simulator=False,
                    offload=Offload("optimizer+params"))["per_rank"][0]
    assert plain["optim_bytes"] > 0 and opt["optim_bytes"] == 0
    assert opt["param_bytes"] == plain["param_bytes"] and both["param_bytes"] == 0
    for mem in (opt, both):  # the gradient shard, activations and gathered units stay
        for key in ("grad_bytes", "activation_bytes", "buffer_bytes"):
            assert mem[key] == plain[key]
    # 12 bytes per shard parameter leave with the optimizer, 2 more with the parameters
    assert plain["optim_bytes"] == pytest.approx(6 * plain["param_bytes"], rel=1e-6)
    allocated = sum(both[k] for k in ("param_bytes", "grad_bytes", "optim_bytes",
                                      "activation_bytes", "buffer_bytes"))
    assert both["reserve_bytes"] == pytest.approx(0.082 * allocated, abs=1)


def test_fp32_zero1_offload_saves_only_the_moments():
    model = ModelConfig(dim=1024, n_layers=4, n_heads=16, ffn_dim=4096, vocab_size=1000)
    work = Workload(model, 512, 8, "fp32")
    cluster = Cluster(PROFILES["h100-80g"], 8, 8)
    layout = Layout(dp=8, zero=1)
    plain = estimate(work, layout, cluster, use_simulator=False)
    moved = estimate(work, layout, cluster, use_simulator=False, offload=Offload("optimizer"))
    before, after = plain["per_rank"][0], moved["per_rank"][0]
    assert after["param_bytes"] == before["param_bytes"]  # the fp32 parameters stay
    assert before["optim_bytes"] - after["optim_bytes"] == before["optim_bytes"]  # 8 P / N
    shard = before["optim_bytes"] / 8
    assert moved["offload"]["store_gb_per_rank"] == pytest.approx(12 * shard / GB)
    assert moved["breakdown"]["optimizer_s"] == 0.0 and moved["breakdown"]["offload_s"] > 0


def test_estimate_json_fields_and_step():
    work, cluster = _70b()
    result = estimate(work, ZERO3_TP2, cluster, offload=Offload("optimizer+params",
                                                                 overlap=True))
    cost = result["offload"]
    for key in ("kind", "device", "overlap", "store_gb_per_rank", "host_gb_per_node",
                "host_limit_gb", "host_fits", "nvme_gb_per_node", "nvme_limit_gb", "adamw_s",
                "pcie_s", "nvme_s", "hidden_s", "exposed_s", "fits"):
        assert key in cost
    assert result["fits"] and result["breakdown"]["offload_s"] == cost["exposed_s"] > 0
    plain = estimate(work, ZERO3_TP2, cluster)
    assert plain["offload"] is None and plain["breakdown"]["offload_s"] == 0.0
    extra = result["step_time_s"] - plain["step_time_s"]
    assert extra == pytest.approx(cost["exposed_s"] - plain["breakdown"]["optimizer_s"])


def test_offload_refusals_are_the_runtime_s():
    work, _ = _70b()
    with pytest.raises(ConfigError, match="parallel.zero = 1, 2 or 3"):
        check_offload(work, Layout(dp=8), Offload("optimizer"))
    with pytest.raises(ConfigError, match="needs parallel.zero = 3"):
        check_offload(work, Layout(dp=8, zero=2), Offload("optimizer+params"))
    with pytest.raises(ConfigError, match="replica"):
        check_offload(work, Layout(dp=8, zero=3), Offload("optimizer", overlap=True), 2)
    with pytest.raises(ConfigError, match="no offload"):
        check_offload(dataclasses.replace(work, traits=MEGATRON_2022), Layout(dp=8, zero=1),
                      Offload("optimizer"))


def test_nvme_file_size_is_the_store_s():
    pytest.importorskip("torch")
    from meshtrain.parallel.offload.store import ARENA_BYTES

    assert NVME_FILE_BYTES == ARENA_BYTES


def test_plan_70b_on_8_h100_proposes_offload_with_its_step_time():
    work, cluster = _70b()
    assert plan(work, cluster, top=3, offload="never").nothing_fits  # as before offload
    result = plan(work, cluster, top=3)
    assert result.nothing_fits is None and "nothing fits without offload" in result.offload
    for row in result.candidates:
        assert row["offload"] in ("optimizer", "optimizer+params")
        assert row["step_time_s"] > row["offload_s"] > 0 and row["host_gb_per_node"] < 2199
        assert "offload" in row["why"] and "per step" in row["why"]


def test_plan_refuses_when_the_host_is_too_small_naming_the_numbers():
    work, cluster = _70b()
    small = dataclasses.replace(cluster.profile, host_memory_gb=512.0, nvme_tb=0.0)
    result = plan(work, dataclasses.replace(cluster, profile=small), top=3)
    assert not result.candidates
    assert "512 GB" in result.nothing_fits and "461 GB usable" in result.nothing_fits
    assert "DOES NOT FIT" in result.nothing_fits


def test_auto_keeps_the_configured_offload_and_prices_it(tmp_path, capsys):
    import json

    from meshtrain.config import load_config
    from meshtrain.replan.auto import BUILTIN_CPU, choose_layout, predict
    from meshtrain.validation.run_config import validate_config

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(BUILTIN_CPU.to_dict()))
    tiny = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=64",
            "train.seq_len=16", "train.global_batch=8", "train.precision=fp32",
            "train.device=cpu", "parallel.auto=true", f"parallel.auto_profile={profile}",
            "parallel.offload=optimizer+params", "parallel.offload_device=nvme"]
    config = load_config(None, tiny)
    assert choose_layout(config, 2) == 2
    par = config.parallel
    assert (par.offload, par.offload_device, par.zero) == ("optimizer+params", "nvme", 3)
    assert validate_config(config, 2) == 2
    result = predict(config, 2, Cluster(BUILTIN_CPU, 2, 2))
    assert result["offload"]["kind"] == "optimizer+params"
    assert result["per_rank"][0]["param_bytes"] == 0  # in the files on a CPU with nvme
