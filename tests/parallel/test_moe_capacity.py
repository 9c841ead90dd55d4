"""Layout-free token dropping: with a capacity factor, every layout drops the same assignments
as one process with one micro-batch (capacity is decided per routing group of one sequence,
``model.moe_capacity_group``), so losses and gradient norms match it within
meshtrain.commands.verify's
fp32 tolerances (2e-4 on the loss, 1e-3 relative on the gradient norm) and the dropped counts
are equal.

Bias balancing (its load is the global batch's) is used rather than the aux loss, whose
statistics are per micro-batch by definition.
"""

from __future__ import annotations

import pytest

from meshtrain.commands.verify import (
    GRAD_NORM_RTOL_FP32,
    LOSS_TOLERANCE_FP32,
    compare,
    reference_config,
    run_layout,
)
from meshtrain.config import ConfigError
from tests.distributed import run_distributed
from tests.helpers import tiny_config, train_many

STEPS = 2
CAPACITY = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32",
            "model.moe_capacity_factor=1.0", "model.moe_balance=bias", "model.moe_bias_rate=0.01")


def _one_micro_batch(config):
    reference = reference_config(config)
    reference.parallel.microbatches = 1
    return reference


def _assert_same_as_one_micro_batch(config, records):
    expected = run_layout(_one_micro_batch(config), 1, STEPS)
    report = compare(records, expected, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
    assert report["ok"], (config.parallel, report)
    assert [r["moe"]["dropped"] for r in records] == [r["moe"]["dropped"] for r in expected]
    assert all(r["moe"]["dropped"] > 0 for r in expected)  # capacity 1.0 does drop here


def test_two_micro_batches_on_one_process_drop_as_one():
    for group in ("0", "4"):
        config = tiny_config(*CAPACITY, "parallel.microbatches=2",
                             f"model.moe_capacity_group={group}")
        _assert_same_as_one_micro_batch(config, run_layout(config, 1, STEPS))


def test_capacity_matches_one_process_at_dp2_ep2_tp2_pp2_and_cp2():
    cases = [
        tiny_config(*CAPACITY, nproc=2),  # dp 2
        tiny_config(*CAPACITY, "parallel.ep=2", "parallel.microbatches=2", nproc=2),
        tiny_config(*CAPACITY, "parallel.tp=2", "parallel.sequence_parallel=true", nproc=2),
        tiny_config(*CAPACITY, "parallel.pp=2", "parallel.microbatches=2", "model.n_layers=4",
                    nproc=2),
        tiny_config(*CAPACITY, "parallel.cp=2", "model.moe_capacity_group=4", nproc=2),
    ]
    results = run_distributed(2, train_many, [c.to_dict() for c in cases], STEPS, timeout=900)[0]
    for config, records in zip(cases, results, strict=True):
        _assert_same_as_one_micro_batch(config, records)


def test_dp2_ep2_over_four_ranks_with_micro_batches():
    config = tiny_config(*CAPACITY, "parallel.ep=2", "parallel.microbatches=2",
                         "parallel.zero=1", nproc=4)
    records = run_distributed(4, train_many, [config.to_dict()], STEPS, timeout=900)[0][0]
    _assert_same_as_one_micro_batch(config, records)


@pytest.mark.parametrize("overrides, fragment", [
    (["model.moe_capacity_group=5"], r"moe_capacity_group = 5 does not divide train.seq_len = "
                                     r"16.*Valid: 0 \(the whole sequence\) or a divisor of "
                                     r"seq_len: 1, 2, 4, 8, 16"),
    (["model.moe_capacity_group=32"], "moe_capacity_group = 32 does not divide"),
    (["model.moe_capacity_group=-1"], "moe_capacity_group"),
    (["parallel.cp=2"], r"cp = 2 needs routing groups inside one context-parallel chunk of "
                        r"seq_len / \(2 × cp\) = 4 tokens.*divisor of 4: 1, 2, 4"),
    (["parallel.cp=2", "model.moe_capacity_group=8"], "moe_capacity_group = 8\\)"),
])
def test_bad_capacity_groups_are_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny_config(*CAPACITY, *overrides, nproc=2)
