"""The per-parameter gradient comparison of ``meshtrain verify`` (single process)."""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.commands.verify_grads import compare_gradients, describe_failures

RNG = np.random.default_rng(0)
REFERENCE = [("a.weight", 0, RNG.standard_normal((4, 3)).astype(np.float32)),
             ("b.bias", 0, RNG.standard_normal(3).astype(np.float32) * 1e-3),
             ("idle.expert", 0, np.zeros((2, 2), dtype=np.float32))]


def test_rounding_passes_and_a_small_scale_error_is_named():
    rounded = [(n, t, g * np.float32(1 + 3e-7)) for n, t, g in REFERENCE]
    assert compare_gradients(rounded, REFERENCE, 1e-5, 1e-9)["ok"]

    # A 1e-4 error on one small tensor: invisible in a norm dominated by the others.
    scaled = [(n, t, g * np.float32(1 + 1e-4) if n == "b.bias" else g)
              for n, t, g in REFERENCE]
    report = compare_gradients(scaled, REFERENCE, 1e-5, 1e-9)
    assert not report["ok"] and [f["name"] for f in report["failures"]] == ["b.bias"]
    assert report["failures"][0]["rel_diff"] == pytest.approx(1e-4, rel=1e-2)
    assert "gradient of b.bias (tp rank 0): relative difference 1.00e-04 > 1e-05" in \
        describe_failures(report)


def test_every_copy_is_checked_and_missing_parameters_are_named():
    drifted = [*REFERENCE, ("a.weight", 1, REFERENCE[0][2] + 1e-3)]  # tp rank 1's replica
    report = compare_gradients(drifted, REFERENCE, 1e-5, 1e-9)
    assert [(f["name"], f["tp_rank"]) for f in report["failures"]] == [("a.weight", 1)]
    missing = compare_gradients(REFERENCE[:2], REFERENCE, 1e-5, 1e-9)
    assert [f["name"] for f in missing["failures"]] == ["idle.expert"]
    assert "no gradient gathered" in describe_failures(missing)

