"""Energy of every training step: measured through NVML on NVIDIA GPUs, estimated elsewhere.

:class:`EnergyMeter` reports the joules one rank used since its previous reading:

- ``nvml``: the difference of ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since the
  driver loaded; Volta and later) of this rank's GPU. ``pynvml`` (package ``nvidia-ml-py``) is
  optional: without it, or when the counter is unsupported, the meter estimates.
- ``estimate``: a power model times the wall time between readings. CUDA devices: the board
  power limit (``gpu_tdp_w``) of the planner profile whose name matches the device. CPU: the
  ``power_w`` per process of the calibrated profile (``meshtrain calibrate --power-w``) when it
  has one, else :data:`CPU_WATTS_PER_CORE` times the worker's threads.

The trainer reads the meter once per step, just before the loss reduction, and adds the joules
to the values it already all-reduces over ``pp`` and ``dp × cp``; the tensor-parallel ranks of a
group do the same work, so the sum is scaled by ``tp``. Every rank's record therefore carries the
job's energy (all ranks) for the interval since the previous step's reduction. See
docs/energy.md.
"""

from __future__ import annotations

import os
import sys
import time

import torch

CPU_WATTS_PER_CORE = 10.0
"""Power of one busy server-CPU core: a 32-core server processor with a 320 W thermal design
power (AMD EPYC 9354 class) draws about 10 W per core under full load."""


def _nvml():
    """The ``pynvml`` module, initialised, or None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no GPU: estimate instead
        return None
    return pynvml


def _nvml_index(device: torch.device) -> int:
    """NVML's index of a CUDA device (CUDA_VISIBLE_DEVICES renumbers what CUDA sees)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if ids and all(v.isdigit() for v in ids) and index < len(ids):
        return int(ids[index])
    return index


def estimated_power_w(device: torch.device, threads: int) -> float:
    """Watts one rank is taken to draw when nothing measures it (see the module doc)."""
    from meshtrain.planner.tables.profiles import PROFILES

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key, profile in PROFILES.items():
            if key.split("-")[0] in name.replace(" ", "") and profile.gpu_tdp_w:
                return profile.gpu_tdp_w
        return PROFILES["h100-80g"].gpu_tdp_w
    from meshtrain.planner.calibrate.measure import default_profile_path
    from meshtrain.planner.tables.profiles import load_profile

    path = default_profile_path()
    if path.is_file():
        try:
            profile = load_profile(str(path))
        except Exception:  # noqa: BLE001 - a broken profile file is not the run's problem
            profile = None
        if profile is not None and profile.power_w > 0 and not profile.gpu_tdp_w:
            return profile.power_w
    return CPU_WATTS_PER_CORE * max(threads, 1)


class EnergyMeter:
    """Joules of one rank between successive :meth:`read` calls."""

    def __init__(self, device: torch.device, threads: int = 1):
        self.source = "estimate"
        self.power_w = 0.0
        self._handle = None
        self._nvml = _nvml() if device.type == "cuda" else None
        if self._nvml is not None:
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))
                self._last = self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                self._handle, self.source = handle, "nvml"
            except Exception as error:  # noqa: BLE001 - unsupported counter: estimate
                print(f"meshtrain: NVML energy counter unavailable ({error}); estimating "
                      "energy from the power model", file=sys.stderr)
        if self._handle is None:
            self.power_w = estimated_power_w(device, threads)
        self._time = time.perf_counter()

    def read(self) -> float:
        """Joules used since the previous reading (or since the meter was made)."""
        now = time.perf_counter()
        if self._handle is not None:
            total = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            joules, self._last = (total - self._last) / 1000.0, total
        else:
            joules = self.power_w * (now - self._time)
        self._time = now
        return joules


def summary_line(total_j: float, source: str, ranks: int, carbon_g_per_kwh: float = 0.0,
                 price_per_kwh: float = 0.0) -> str:
    """The run's energy line: kWh, and CO2 and cost when an intensity / price is given."""
    kwh = total_j / 3.6e6
    text = f"meshtrain: energy {kwh:.4g} kWh ({source}, {ranks} rank(s) summed)"
    if carbon_g_per_kwh > 0:
        text += f", {kwh * carbon_g_per_kwh:.4g} g CO2"
    if price_per_kwh > 0:
        text += f", cost {kwh * price_per_kwh:.4g}"
    return text


def apply_clock_limit(device: torch.device, clock_mhz: float) -> str:
    """Lock this rank's GPU clocks to at most ``clock_mhz`` through NVML (an energy schedule's
    clock for the rank). Returns what happened: applied, or why not (no pynvml, not an NVIDIA
    GPU, no permission: locking clocks needs administrator rights); the run goes on unchanged
    when it was not applied."""
    if device.type != "cuda":
        return f"not applied: {device.type} device has no NVML clocks"
    nvml = _nvml()
    if nvml is None:
        return "not applied: pynvml (nvidia-ml-py) is not installed or NVML did not start"
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))
        nvml.nvmlDeviceSetGpuLockedClocks(handle, 0, int(clock_mhz))
    except Exception as error:  # noqa: BLE001 - NVMLError_NoPermission and friends
        return f"not applied: {error}"
    return f"applied: GPU clocks locked to at most {int(clock_mhz)} MHz"
