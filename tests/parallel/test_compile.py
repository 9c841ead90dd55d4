"""``train.compile``: compiled blocks train to the same numbers as eager ones (fp32).

Tolerance: meshtrain.verify's fp32 one (2e-4 absolute on the loss, 1e-3 relative on the gradient
norm): inductor may fuse and reorder fp32 element-wise arithmetic, which moves the last bits.
"""

from __future__ import annotations

import pytest

from meshtrain.config import ConfigError
from meshtrain.distributed_run import run_distributed
from meshtrain.verify import GRAD_NORM_RTOL_FP32, LOSS_TOLERANCE_FP32, compare, run_layout
from tests.helpers import tiny_config, train_many

STEPS = 3


def _assert_same(records: list[dict], reference: list[dict]) -> None:
    report = compare(records, reference, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
    assert report["ok"], report


def test_compiled_blocks_match_eager_on_one_process_zero3_checkpointing_and_pp():
    eager = run_layout(tiny_config(), 1, STEPS)
    _assert_same(run_layout(tiny_config("train.compile=true"), 1, STEPS), eager)
    # ZeRO-3's gather / free hooks stay outside the compiled forward; full checkpointing
    # recomputes the compiled forward; pipeline stages compile only the blocks they hold.
    cases = [tiny_config("train.compile=true", "parallel.zero=3", nproc=2),
             tiny_config("train.compile=true", "parallel.activation_checkpointing=full",
                         nproc=2),
             tiny_config("train.compile=true", "parallel.pp=2", "parallel.microbatches=2",
                         nproc=2)]
    results = run_distributed(2, train_many, [c.to_dict() for c in cases], STEPS,
                              timeout=900)[0]
    for records in results:
        _assert_same(records, eager)


@pytest.mark.parametrize("overrides, named", [
    (["parallel.tp=2"], "parallel.tp = 2"),
    (["model.moe_experts=4"], "model.moe_experts = 4"),
    (["parallel.activation_checkpointing=selective"], "selective"),
])
def test_compile_refuses_what_it_does_not_cover(overrides, named):
    with pytest.raises(ConfigError, match="train.compile") as error:
        tiny_config("train.compile=true", *overrides, nproc=2)
    assert named in str(error.value) and "Set train.compile = false" in str(error.value)
