"""meshtrain's glibc ``malloc`` settings: which variables are added, the opt-out, none for a job
on a GPU, and the re-exec that puts them into a process before it starts for real."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshtrain.config import ConfigError
from meshtrain.host.allocator import (
    ALLOCATOR_ENV,
    OPT_OUT_ENV,
    ZERO3_MMAP_THRESHOLD,
    allocator_env,
    allocator_environment,
    gpu_visible,
    job_uses_gpu,
    uses_glibc,
)

needs_glibc = pytest.mark.skipif(not uses_glibc(), reason="the settings are glibc's")


@needs_glibc
def test_adds_every_missing_variable():
    assert allocator_env({}) == ALLOCATOR_ENV
    assert allocator_env({OPT_OUT_ENV: "tuned"}) == ALLOCATOR_ENV


@needs_glibc
def test_a_users_own_value_wins():
    user = {"MALLOC_TRIM_THRESHOLD_": "0"}
    added = allocator_env(user)
    assert "MALLOC_TRIM_THRESHOLD_" not in added
    assert added == {k: v for k, v in ALLOCATOR_ENV.items() if k != "MALLOC_TRIM_THRESHOLD_"}


@needs_glibc
def test_zero3_maps_blocks_from_one_mib_and_a_users_value_still_wins():
    """A ZeRO-3 job (memory is what it is for) maps blocks from 1 MiB; the rest is the same."""
    added = allocator_env({}, zero=3)
    assert added["MALLOC_MMAP_THRESHOLD_"] == ZERO3_MMAP_THRESHOLD == str(2**20)
    assert added["MALLOC_TRIM_THRESHOLD_"] == ALLOCATOR_ENV["MALLOC_TRIM_THRESHOLD_"]
    assert allocator_env({}, zero=2) == ALLOCATOR_ENV
    assert "MALLOC_MMAP_THRESHOLD_" not in allocator_env({"MALLOC_MMAP_THRESHOLD_": "4096"},
                                                         zero=3)
    assert allocator_env({}, device="cuda", zero=3) == {}


def test_opt_out_keeps_glibc_defaults():
    assert allocator_env({OPT_OUT_ENV: "default"}) == {}
    assert allocator_env({OPT_OUT_ENV: " Default "}) == {}


def test_a_bad_choice_is_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match='"tuned".*"default"'):
        allocator_env({OPT_OUT_ENV: "jemalloc"})


@needs_glibc
def test_environment_block_adds_then_removes(monkeypatch):
    for key in ALLOCATOR_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(OPT_OUT_ENV, raising=False)
    with allocator_environment() as added:
        assert added == ALLOCATOR_ENV
        assert all(os.environ[k] == v for k, v in ALLOCATOR_ENV.items())
    assert not any(k in os.environ for k in ALLOCATOR_ENV)


def _dev(tmp_path, *nodes: str) -> str:
    """A stand-in for ``/dev`` holding ``nodes``."""
    for node in nodes:
        (tmp_path / node).touch()
    return str(tmp_path)


def test_a_gpu_is_seen_from_its_device_node_unless_cuda_visible_devices_hides_it(tmp_path):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "none").mkdir()
    gpu = _dev(tmp_path / "gpu", "nvidia0", "nvidiactl")
    none = _dev(tmp_path / "none", "nvidiactl", "null")  # the control node alone is no GPU
    assert gpu_visible({}, gpu)
    assert gpu_visible({"CUDA_VISIBLE_DEVICES": "0,1"}, gpu)
    assert not gpu_visible({"CUDA_VISIBLE_DEVICES": ""}, gpu)
    assert not gpu_visible({"CUDA_VISIBLE_DEVICES": "-1"}, gpu)
    assert not gpu_visible({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, gpu)  # SLURM, no GPU gres
    assert gpu_visible({"CUDA_VISIBLE_DEVICES": "GPU-8f3a,GPU-11c2"}, gpu)
    assert not gpu_visible({}, none)


def test_the_device_setting_decides_before_the_visible_gpus(tmp_path):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "none").mkdir()
    gpu, none = _dev(tmp_path / "gpu", "nvidia0"), _dev(tmp_path / "none")
    assert job_uses_gpu("cuda", {}, none) and job_uses_gpu("cuda:1", {}, none)
    assert not job_uses_gpu("cpu", {}, gpu)
    assert job_uses_gpu("auto", {}, gpu) and not job_uses_gpu("auto", {}, none)
    assert not job_uses_gpu("auto", {"CUDA_VISIBLE_DEVICES": ""}, gpu)


def test_no_settings_for_a_job_on_a_gpu():
    assert allocator_env({}, device="cuda") == {}
    assert allocator_env({"CUDA_VISIBLE_DEVICES": ""}, device="auto") == (
        ALLOCATOR_ENV if uses_glibc() else {})  # no GPU visible: a CPU job


PROBE = """
import os, sys
from meshtrain.host.allocator import reexec_with_allocator_env
print("start", os.getpid(), flush=True)
reexec_with_allocator_env(os.environ.get("PROBE_DEVICE", "cpu"))
print("run", os.getpid(), os.environ.get("MALLOC_MMAP_THRESHOLD_"),
      os.environ.get("MALLOC_TRIM_THRESHOLD_"), sys.argv[1:], flush=True)
"""


def _probe(extra_env: dict[str, str]) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    env.pop(OPT_OUT_ENV, None)
    env.pop("MESHTRAIN_ALLOCATOR_REEXEC", None)
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", PROBE, "a", "b c"], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return [line.split(" ", 2) for line in out.splitlines()]


@needs_glibc
def test_reexec_restarts_the_same_process_with_the_settings():
    lines = _probe({})
    # The first start prints "start", re-executes (same pid), and the second start runs on.
    assert [line[0] for line in lines] == ["start", "start", "run"]
    assert len({line[1] for line in lines}) == 1
    threshold, trim, args = lines[2][2].split(" ", 2)
    assert (threshold, trim) == (ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"],
                                 ALLOCATOR_ENV["MALLOC_TRIM_THRESHOLD_"])
    assert args == "['a', 'b c']"  # the command line survives the re-exec


def test_no_reexec_when_opted_out():
    lines = _probe({OPT_OUT_ENV: "default"})
    assert [line[0] for line in lines] == ["start", "run"]
    assert lines[1][2].startswith("None None")


def test_no_reexec_for_a_job_on_a_gpu():
    lines = _probe({"PROBE_DEVICE": "cuda"})
    assert [line[0] for line in lines] == ["start", "run"]
    assert lines[1][2].startswith("None None")


def test_train_reads_the_device_from_its_config_and_overrides(tmp_path):
    from meshtrain.cli import build_parser
    from meshtrain.commands.train import requested_allocator_job, requested_device

    config = tmp_path / "run.toml"
    config.write_text('[train]\ndevice = "cuda"\n')
    parse = build_parser().parse_args
    assert requested_device(parse(["train", "--config", str(config)])) == "cuda"
    assert requested_device(parse(["train", "--config", str(config),
                                   "--set", "train.device=cpu"])) == "cpu"
    assert requested_device(parse(["train"])) == "auto"  # the built-in demo's
    assert requested_allocator_job(parse(["train", "--config", str(config), "--set",
                                          "parallel.zero=3"])) == ("cuda", 3)


def test_glibc_default_environment_hides_the_settings_from_children(monkeypatch):
    """The bench's untuned side: children get none of the variables, whoever set them."""
    from meshtrain.host.allocator import ALLOCATOR_ENV, glibc_default_environment

    for key, value in ALLOCATOR_ENV.items():
        monkeypatch.setenv(key, value)
    probe = [sys.executable, "-c",
             "import os; print(sorted(k for k in os.environ if k.startswith('MALLOC_')))"]
    with glibc_default_environment():
        inside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert inside.strip() == "[]"
    assert all(os.environ[key] == value for key, value in ALLOCATOR_ENV.items())
