"""``python benchmarks/side_by_side.py``: the phase clock, and tiny dp and pp runs' output.
Shape and bookkeeping only: no speed is checked."""

from __future__ import annotations

import contextlib
import io
import json
import time
import types

import pytest

from meshtrain.commands.bench.side_by_side import PhaseClock
from tests.helpers import load_benchmark

script = load_benchmark("side_by_side")  # the command a user runs

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64", "--set", "train.seq_len=32",
        "--set", "train.global_batch=4", "--set", "data.max_bytes=200000"]


class _Work:
    def outer(self):
        time.sleep(0.002)
        return self.inner()

    def inner(self):
        time.sleep(0.003)
        return "done"


def test_the_clock_counts_the_outermost_phase_and_restores_what_it_wrapped():
    work, module = _Work(), types.SimpleNamespace(helper=lambda: "module")
    original_helper = module.helper
    clock = PhaseClock()
    clock.wrap(work, "outer", "outer")
    clock.wrap(work, "inner", "inner")
    clock.wrap(module, "helper", "helper", action=True)
    clock.run_step(lambda: (work.outer(), module.helper()))
    clock.run_step(lambda: work.inner())
    first, second = clock.steps
    assert first["outer"] >= 0.005 and "inner" not in first  # inner ran inside outer: not twice
    assert second["inner"] >= 0.003 and "outer" not in second
    assert clock.summary()["phases"]["inner"] == pytest.approx(second["inner"] * 500, abs=0.01)
    assert first["step"] >= first["outer"] and first["rest"] >= 0  # the step holds its phases
    assert list(clock.summary()["actions"]) == ["helper"]
    clock.restore()
    assert "outer" not in vars(work) and "inner" not in vars(work)  # the class methods again
    assert module.helper is original_helper


def test_tiny_dp_and_pp_print_every_rank_and_side():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert script.main(["--rounds", "1", "--warmup", "1", *TINY]) == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sorted((r["suite"], r["rank"], r["side"]) for r in lines) == sorted(
        (suite, rank, side) for suite in ("dp", "pp") for rank in (0, 1)
        for side in ("meshtrain", "peer"))
    for r in lines:
        phases = r["phases"]
        assert phases["step"] > 0 and phases["cpu"] > 0
        parts = sum(v for k, v in phases.items() if k not in ("step", "cpu", "rest"))
        assert parts <= phases["step"] + 0.1  # medians of parts need not add up exactly
        if r["side"] == "meshtrain":
            assert {"AdamW", "clipping", "zero_grad", "straggler exchange"} <= set(phases)
            expected = "forward and backward" if r["suite"] == "dp" else "pipeline schedule"
            assert phases[expected] > 0
        else:
            assert {"AdamW", "clipping", "zero_grad"} <= set(phases)
            assert {"forward", "backward"} <= set(phases) if r["suite"] == "dp" \
                else phases["schedule"] > 0
        if r["suite"] == "pp":
            kinds = set(r["actions"])
            assert {"F", "B"} <= kinds
            if r["side"] == "meshtrain" and r["rank"] == 1:  # 1F1B's early gradient send
                assert {"I", "W"} <= kinds
            assert all(v > 0 for v in r["actions"].values())
        else:
            assert r["actions"] == {}


def test_a_suite_that_cannot_share_the_processes_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        script.main(["--suite", "tp"])
    assert stop.value.code == 2
    assert "invalid choice: 'tp'" in capsys.readouterr().err
