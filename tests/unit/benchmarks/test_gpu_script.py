"""``benchmarks/gpu.py``: its JSON document (``--device cpu --tiny``), the default ~1B shape and
the peak-FLOP/s lookup. Shape-only: no GPU is needed and no speed is checked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu_script():
    """The script imported as a module (it is not part of the package)."""
    spec = importlib.util.spec_from_file_location("meshtrain_gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The --tiny shape's training FLOPs per token, counted by hand (PaLM's convention, as the script's
# docstring states it): per layer q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12,288 and the SwiGLU
# FFN 3 x 64x128 = 24,576, so 2 layers = 73,728; the untied LM head 64x512 = 32,768. Six FLOPs per
# matmul parameter: 6 x 106,496 = 638,976; attention scores and AV: 12 x 2 layers x 64 x seq 64 =
# 98,304. Total 737,280.
TINY_FLOPS_PER_TOKEN = 737_280
TINY_TOKENS_PER_STEP = 2 * 64  # --micro-batch 2 (the --tiny default) x seq_len 64


def test_tiny_cpu_run_prints_the_json_fields():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--steps",
                           "3", "--warmup", "1", "--peak-tflops", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["device"] == "cpu" and result["precision"] == "bf16"
    assert result["shape"]["dim"] == 64 and result["shape"]["vocab_size"] == 512
    assert result["tokens_per_step"] == TINY_TOKENS_PER_STEP
    assert len(result["step_times_s"]) == 3 and len(result["losses"]) == 4
    assert result["peak_memory_bytes"] > 0
    # The step time is the median (the middle one of three) of the measured steps.
    assert result["step_time_s"] == sorted(result["step_times_s"])[1] > 0
    assert result["flops_per_token"] == TINY_FLOPS_PER_TOKEN
    # MFU from the hand count, the measured median step and the 2 TFLOP/s peak given above.
    step_flops = TINY_FLOPS_PER_TOKEN * TINY_TOKENS_PER_STEP
    assert result["tokens_per_s"] == pytest.approx(128 / result["step_time_s"])
    assert result["model_tflops_per_s"] == pytest.approx(step_flops / result["step_time_s"] / 1e12)
    assert result["peak_tflops"] == 2.0 and result["peak_source"] == "--peak-tflops"
    assert result["mfu"] == pytest.approx(step_flops / result["step_time_s"] / 2e12)
    assert set(result["model_state_bytes"]) == {"param_bytes", "grad_bytes", "optim_bytes"}
    assert all(isinstance(x, float) for x in result["losses"])


def test_default_shape_is_about_one_billion_parameters(gpu_script):
    from meshtrain.model import count_parameters, flops_per_token

    config = gpu_script.build_config(gpu_script.parse_args(["--device", "cpu"]), "unused")
    m, t = config.model, config.train
    assert (m.dim, m.n_heads, m.ffn_dim, m.vocab_size, t.seq_len) == (2048, 16, 5632, 32000, 2048)
    assert 16 <= m.n_layers <= 18 and t.precision == "bf16"
    assert 0.9e9 < count_parameters(m)["total"] < 1.1e9
    assert flops_per_token(m, t.seq_len) > 6 * 0.9e9


def test_peak_lookup(gpu_script, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak, source = gpu_script.peak_flops(torch.device("cuda", 0), 0.0)
    assert peak == 989e12 and "H200" in source
    assert gpu_script.peak_flops(torch.device("cuda", 0), 500.0) == (500e12, "--peak-tflops")
    peak, source = gpu_script.peak_flops(torch.device("cpu"), 0.0)
    assert peak is None and "--peak-tflops" in source


def test_refuses_bad_counts(gpu_script):
    with pytest.raises(SystemExit):
        gpu_script.parse_args(["--steps", "0"])
