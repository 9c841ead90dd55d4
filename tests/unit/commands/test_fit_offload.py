"""The fit check with ``parallel.offload`` (:mod:`meshtrain.commands.fit_offload`): what lives in
the offload files (or, beside a GPU, in host memory) is left out of the memory checked, so a run
whose states only fit offloaded is not refused; on the CPU ``host`` offload is the same memory."""

from __future__ import annotations

import pytest

from meshtrain.commands import fit_check
from meshtrain.commands.fit_check import check_fits, estimate_ranks
from meshtrain.config import ConfigError
from tests.helpers import tiny_config

#: ~7.6M parameters of fp32 states: 16 bytes each over dp 2 is ~61 MB per rank.
WIDE = ("model.dim=256", "model.n_layers=4", "model.ffn_dim=2048", "parallel.zero=3")
NVME = ("parallel.offload=optimizer+params", "parallel.offload_device=nvme")


def test_nvme_leaves_the_states_out_and_host_on_the_cpu_does_not():
    plain = estimate_ranks(tiny_config(*WIDE, nproc=2), 2)[0].parts
    nvme = estimate_ranks(tiny_config(*WIDE, *NVME, nproc=2), 2)[0].parts
    assert plain["parameters"] > 0 and plain["gradients"] > 0 and plain["optimizer states"] > 0
    assert not {"parameters", "gradients", "optimizer states"} & set(nvme)
    assert nvme["activations"] == plain["activations"]
    host = estimate_ranks(tiny_config(*WIDE, "parallel.offload=optimizer+params", nproc=2),
                          2)[0].parts
    assert host == plain
    # fp32 at ZeRO-1: the offloaded fp32 master is a copy of the parameters' shard
    z1 = ("parallel.zero=1", "parallel.offload=optimizer")
    copy = estimate_ranks(tiny_config(*z1, nproc=2), 2)[0].parts
    assert copy["offloaded fp32 masters"] == pytest.approx(copy["optimizer states"] / 2)
    on_gpu = fit_check.offloaded_parts(plain, tiny_config(*WIDE, *NVME, nproc=2), "cuda")
    assert "gradients" in on_gpu and "parameters" not in on_gpu


def test_a_run_that_fits_only_offloaded_is_not_refused(monkeypatch):
    plain = tiny_config(*WIDE, nproc=2)
    total = sum(r.total * r.ranks for r in estimate_ranks(plain, 2))
    states = sum(estimate_ranks(plain, 2)[0].parts[k]
                 for k in ("parameters", "gradients", "optimizer states")) * 2
    available = (total - states / 2) / fit_check.FIT_MARGIN
    monkeypatch.setattr(fit_check, "host_available", lambda: (available, "MemAvailable"))
    monkeypatch.setattr(fit_check, "resolve_device_type", lambda device: "cpu")
    with pytest.raises(ConfigError):
        check_fits(plain, 2, verbose=False)
    check_fits(tiny_config(*WIDE, *NVME, nproc=2), 2, verbose=False)
