"""``python benchmarks/layout_profile.py``: the grouping of operators, and one tiny suite's output.
Shape and bookkeeping only: no speed is checked."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

import meshtrain.commands.bench.layout_profile as layout_profile
from tests.helpers import load_benchmark

script = load_benchmark("layout_profile")  # the command a user runs

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64", "--set", "train.seq_len=32",
        "--set", "train.global_batch=4", "--set", "data.max_bytes=200000"]


def test_operators_fall_into_their_categories_and_the_rest_is_waiting():
    events = [SimpleNamespace(key=k, self_cpu_time_total=us) for k, us in (
        ("aten::mm", 6000), ("aten::_scaled_dot_product_flash_attention_for_cpu", 2000),
        ("aten::mul", 1000), ("aten::copy_", 400), ("c10d::allreduce_", 200),
        ("aten::_fused_adamw_", 200), ("SomethingElse", 200))]
    out = layout_profile.categorise(events, steps=2, wall_s=0.012)  # 6 ms of a step in ops
    assert out["matmul"] == 3.0 and out["attention"] == 1.0 and out["element-wise"] == 0.5
    assert out["copies"] == 0.2 and out["collectives"] == 0.1 and out["optimizer"] == 0.1
    assert out["other ops"] == 0.1
    assert out["step_ms"] == 6.0 and out[layout_profile.WAITS] == pytest.approx(1.0)


def test_a_tiny_dp_suite_prints_both_sides():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert script.main(["--suite", "dp", "--steps", "1", "--warmup", "0",
                                    *TINY]) == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["suite"], r["side"]) for r in lines] == [("dp", "meshtrain"), ("dp", "peer")]
    for r in lines:
        assert r["matmul"] > 0 and r["step_ms"] > 0
        parts = sum(v for k, v in r.items() if k not in ("suite", "side", "step_ms", "top"))
        assert parts == pytest.approx(r["step_ms"], abs=1.0)  # rounding of eight figures
        assert r["top"] and all(len(row) == 2 for row in r["top"])
