"""``python benchmarks/kernel_floor.py``: which calls it records and replays, its output on a
tiny shape, its refusal of other suites. Shape and bookkeeping only: no speed is checked."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from meshtrain.config import ConfigError
from tests.helpers import load_benchmark

kernel_floor = load_benchmark("kernel_floor")
KernelRecorder, main, measure_sides = (kernel_floor.KernelRecorder, kernel_floor.main,
                                       kernel_floor.measure_sides)

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64", "--set", "train.seq_len=32",
        "--set", "train.global_batch=4", "--set", "data.max_bytes=200000"]


def test_the_recorder_keeps_matrix_products_and_attention_with_copies_of_their_inputs():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    product = a @ b  # (outside the recorder: not kept)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    recorder = KernelRecorder()
    with recorder:
        (a @ b).relu().add(1)  # one mm; relu and add are not kept
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
        a.add_(1.0)  # the kept copy of ``a`` is not changed by later in-place work
    names = [str(func.overloadpacket) for func, _, _ in recorder.calls]
    assert names[0] == "aten.mm" and len(names) == 3
    assert all("attention" in n for n in names[1:])  # forward and backward
    func, args, kwargs = recorder.calls[0]
    torch.testing.assert_close(func(*args, **kwargs), product)


def test_measure_sides_times_both_and_replays_only_the_kernels():
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    sides = {"two": lambda i: (x @ w @ w).sum(), "one": lambda i: (x @ w).exp().sum()}
    result = measure_sides(sides, steps=3, replays=2)
    assert result["two"]["calls"] == 2 and result["one"]["calls"] == 1
    for side in result.values():
        assert len(side["step_times_s"]) == 3 and len(side["replay_times_s"]) == 2
        assert side["kernels_s"] > 0


def test_tiny_moe_run_prints_both_sides_and_the_ceiling():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--suite", "moe", "--steps", "1", *TINY]) == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line.get("side") for line in lines[:2]] == ["meshtrain", "peer"]
    # Each side's step: MoE experts as grouped products, attention fused, the rest dense.
    assert all(line["calls"] > 10 and line["kernels_s"] > 0 for line in lines[:2])
    pair = lines[2]
    assert pair["suite"] == "moe"
    assert pair["ceiling"] == pytest.approx(lines[1]["step_s"] / lines[0]["kernels_s"], rel=1e-2)


def test_other_suites_and_devices_are_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match="valid: moe, single"):
        main(["--suite", "dp", "--steps", "1"])
    with pytest.raises(ConfigError, match='on the CPU only; valid: train.device = "cpu"'):
        main(["--suite", "moe", "--steps", "1", "--set", "train.device=cuda"])
