"""Energy of training steps: NVML's counter (a fake module) and the CPU estimate (for real)."""

from __future__ import annotations

import json
import sys
import time
import types

import pytest
import torch

from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.training import energy
from meshtrain.training.energy import CPU_WATTS_PER_CORE, EnergyMeter, summary_line
from meshtrain.training.trainer import Trainer
from tests.helpers import tiny_config


def _fake_pynvml(readings: list[int], locked: list | None = None, deny: bool = False):
    """A stand-in for pynvml whose energy counter returns ``readings`` (mJ) in turn."""
    module = types.ModuleType("pynvml")
    counter = iter(readings)
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetHandleByIndex = lambda index: ("gpu", index)
    module.nvmlDeviceGetTotalEnergyConsumption = lambda handle: next(counter)

    def set_clocks(handle, low, high):
        if deny:
            raise RuntimeError("Insufficient Permissions")
        locked.append((handle, low, high))

    module.nvmlDeviceSetGpuLockedClocks = set_clocks
    return module


def test_nvml_counter_differences_in_joules(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([1_000_000, 1_250_500, 1_400_000]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    meter = EnergyMeter(torch.device("cuda", 1))
    assert meter.source == "nvml"
    assert meter._handle == ("gpu", 5)  # CUDA device 1 is NVML device 5
    assert meter.read() == pytest.approx(250.5)  # millijoules -> joules
    assert meter.read() == pytest.approx(149.5)


def test_without_pynvml_a_cuda_device_is_estimated(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB")
    meter = EnergyMeter(torch.device("cuda", 0))
    assert meter.source == "estimate"
    assert meter.power_w == 700.0  # the h100 profile's board power


def test_cpu_estimate_is_power_times_time(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHTRAIN_PROFILE", str(tmp_path / "absent.json"))
    clock = iter([100.0, 102.5, 103.0])
    monkeypatch.setattr(energy.time, "perf_counter", lambda: next(clock))
    meter = EnergyMeter(torch.device("cpu"), threads=2)
    assert meter.source == "estimate" and meter.power_w == 2 * CPU_WATTS_PER_CORE
    assert meter.read() == pytest.approx(2.5 * 20)
    assert meter.read() == pytest.approx(0.5 * 20)


def test_calibrated_cpu_profile_power_is_used(monkeypatch, tmp_path):
    from meshtrain.planner.hardware.profile import HardwareProfile

    path = tmp_path / "profile.json"
    profile = HardwareProfile("measured", 0.1, 16, 10, 1, 1, 1, 1, 1, 1, power_w=35.0)
    path.write_text(json.dumps(profile.to_dict()))
    monkeypatch.setenv("MESHTRAIN_PROFILE", str(path))
    assert EnergyMeter(torch.device("cpu"), threads=4).power_w == 35.0


def test_summary_line_by_hand():
    # 7.2 MJ = 2 kWh; 400 g/kWh -> 800 g; 0.25 per kWh -> 0.5
    assert summary_line(7.2e6, "estimate", 4) == \
        "meshtrain: energy 2 kWh (estimate, 4 rank(s) summed)"
    assert summary_line(7.2e6, "nvml", 8, 400, 0.25).endswith("800 g CO2, cost 0.5")


def test_clock_limit_through_nvml(monkeypatch):
    locked: list = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], locked))
    assert energy.apply_clock_limit(torch.device("cuda", 0), 1650.0).startswith("applied")
    assert locked == [(("gpu", 0), 0, 1650)]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], deny=True))
    assert "Insufficient Permissions" in energy.apply_clock_limit(torch.device("cuda", 0), 1650)
    assert energy.apply_clock_limit(torch.device("cpu"), 1650).startswith("not applied")


def test_every_step_records_energy_and_the_summary_prints_kwh(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MESHTRAIN_PROFILE", str(tmp_path / "absent.json"))
    config = tiny_config("train.steps=3", "train.carbon_g_per_kwh=400",
                         "train.price_per_kwh=0.2", run_dir=str(tmp_path))
    trainer = Trainer(config, ParallelMesh())
    start = time.perf_counter()
    trainer.fit()
    elapsed = time.perf_counter() - start
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    watts = CPU_WATTS_PER_CORE * torch.get_num_threads()
    total = 0.0
    for record in lines:
        assert record["energy_source"] == "estimate"
        assert record["energy_j"] > 0
        total += record["energy_j"]
        assert record["energy_total_j"] == pytest.approx(total)
    # Each record covers the time since the previous step's reading (taken before the update),
    # so together they cover every step but the last one's update, at the estimated power, and
    # no more than the run took.
    steps = [record["step_time_s"] for record in lines]
    assert watts * (sum(steps) - steps[-1]) * 0.99 <= total <= watts * elapsed
    out = capsys.readouterr().err
    kwh = total / 3.6e6
    assert f"energy {kwh:.4g} kWh (estimate, 1 rank(s) summed)" in out
    assert f"{kwh * 400:.4g} g CO2, cost {kwh * 0.2:.4g}" in out


def _energy_of_steps(config_dict: dict, steps: int, profile: str) -> dict:
    """One rank: train ``steps`` steps with the CPU estimate; its power, elapsed time and (on
    rank 0) the metric records."""
    import os

    from meshtrain.config import config_from_dict
    from meshtrain.run.worker import build_mesh

    os.environ["MESHTRAIN_PROFILE"] = profile  # absent: the per-core estimate
    config = config_from_dict(config_dict)
    mesh = build_mesh(config)
    trainer = Trainer(config, mesh)
    trainer.energy.read()
    start = time.perf_counter()
    records = [trainer.train_step() for _ in range(steps)]
    return {"records": records, "elapsed": time.perf_counter() - start,
            "watts": trainer.energy.power_w, "logging": mesh.is_logging_rank}


def test_energy_is_summed_over_every_rank(tmp_path):
    # dp 2 x tp 2: the step's energy is every rank's, summed over dp and counted tp times
    # (tp ranks do the same work), so it lies between 4 ranks' power over the steps rank 0
    # timed and 4 ranks' power over the whole time they ran; one rank's or two ranks' energy
    # (a missing sum or a missing tp factor) falls below the lower bound.
    from tests.distributed import run_distributed

    config = tiny_config("parallel.dp=2", "parallel.tp=2", nproc=4)
    out = run_distributed(4, _energy_of_steps, config.to_dict(), 4, str(tmp_path / "absent"))
    rank0 = next(r for r in out if r["logging"])
    records = rank0["records"]
    total = sum(r["energy_j"] for r in records)
    assert records[-1]["energy_total_j"] == pytest.approx(total)
    assert all(r["energy_source"] == "estimate" for r in records)
    # tp ranks are counted as their tp rank 0's twin, so bound by the longest-running rank.
    upper = len(out) * max(r["watts"] for r in out) * max(r["elapsed"] for r in out)
    steps = [r["step_time_s"] for r in records]
    lower = 0.9 * len(out) * min(r["watts"] for r in out) * (sum(steps) - steps[-1])
    assert lower <= total <= upper * 1.01, (lower, total, upper)
