"""MoE numbers that hold on every layout: per-parameter gradients at the first step under every
expert layout, an exact gradient norm, and the global-batch load balance.

* Every parameter's full gradient, gathered from its shards at step 1, matches one process within
  :data:`meshtrain.commands.verify_grads.GRAD_RTOL_FP32` (1e-5 relative per tensor), and the
  step-1 gradient norm within 1e-5 relative.
* The gradient norm of a model with long gradient runs is the fp64 norm of its gradients to
  1e-6 (torch's fp32 CPU norm over a run of millions of elements is off by ~1e-4, and by a
  different amount for every layout).
* ``model.moe_balance_scope = "global-batch"`` (aux loss, coefficient 0.01, capacity 1.0): dp 2,
  dp 2 × ep 2, dp 2 with 2 micro-batches each, pp 2 and one process with 2 micro-batches give one
  process's (one micro-batch) losses to 2e-4 and gradient norms to 1e-5 relative over 4 steps;
  the micro-batch scope does not. Its all-reduces add what the planner prices to ``comm_bytes.dp``.

Each test runs its cases in one launch (start-up dominates on 2 cores).
"""

from __future__ import annotations

import numpy as np
import pytest

from meshtrain.commands.verify import reference_config, run_layout_with_gradients
from meshtrain.config import Config
from tests.helpers import assert_gradients_match, run_with_gradients, tiny_config

MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32")
AUX = ("model.moe_balance=aux-loss", "model.moe_aux_coef=0.5")  # large: a missed term shows
BIAS = ("model.moe_balance=bias", "model.moe_bias_rate=0.01")
DEEPSEEK = ("model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn_dim=16",
            "model.moe_shared_experts=1", "model.moe_first_dense=1", "model.n_layers=3",
            "model.moe_score=sigmoid", "model.moe_groups=4", "model.moe_max_groups=2", *BIAS)
NORM_RTOL = 1e-5


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_step_one(config: Config, records: list[dict], gradients: list,
                     reference: Config | None = None) -> tuple[list[dict], list]:
    """Per-parameter gradients and the step-1 gradient norm against one process."""
    expected, expected_grads = run_layout_with_gradients(reference or reference_config(config),
                                                         1, len(records))
    assert_gradients_match(gradients, expected_grads, config.parallel)
    assert _relative(records[0]["grad_norm"], expected[0]["grad_norm"]) <= NORM_RTOL
    return expected, expected_grads


def test_expert_gradients_match_one_process_parameter_by_parameter():
    cases = [
        tiny_config(*MOE, *AUX, "parallel.ep=2", "parallel.microbatches=2", nproc=4),  # dp × ep
        tiny_config(*MOE, *AUX, "parallel.tp=2", "parallel.ep=2",
                    "parallel.sequence_parallel=true", nproc=4),  # tp 2 × ep 2
        tiny_config(*MOE, *BIAS, "parallel.tp=2", "parallel.ep=4", nproc=4),  # folded over tp
        tiny_config(*MOE, *AUX, "parallel.tp=2", nproc=4),  # MoE replicated over tp
        tiny_config(*MOE, *AUX, "parallel.pp=2", "parallel.ep=2", "parallel.microbatches=2",
                    "model.n_layers=4", nproc=4),  # pp 2 × ep 2
        tiny_config(*DEEPSEEK, "parallel.ep=4", "parallel.zero=1", nproc=4),
        tiny_config(*MOE, *AUX, "parallel.ep=2", "parallel.zero=2",
                    "model.moe_capacity_factor=1.0", nproc=4),  # drops
    ]
    results = run_with_gradients(4, cases, 1)
    for config, (records, gradients) in zip(cases, results, strict=True):
        _assert_step_one(config, records, gradients)
    names = {name for name, _, _ in results[5][1]}
    assert "layers.0.feed_forward.w1.weight" in names  # the dense first block
    assert {"layers.1.moe.shared_experts.w1.weight", "layers.1.moe.experts.w1"} <= names
    assert results[6][0][0]["moe"]["dropped"] > 0


def _fp64_norm(gradients: list) -> float:
    first = {}
    for name, _, grad in gradients:
        first.setdefault(name, grad)
    return float(np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in first.values())))


WIDE = ("model.dim=128", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=256",
        "model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=1024",
        "model.moe_aux_coef=0", "train.global_batch=4")


def test_gradient_norm_is_exact_whatever_the_bucket_runs():
    """One process holds each bucket as one run of millions of elements, the layouts shorter
    runs: the reported norms agree with the fp64 norm of the gathered gradients, hence with each
    other (they differed by 1.4e-4 relative when each run's norm was one fp32 reduction)."""
    config = tiny_config(*WIDE, "parallel.ep=2", nproc=2)
    (records, gradients), = run_with_gradients(2, [config], 1)
    expected, expected_grads = _assert_step_one(config, records, gradients)
    assert _relative(expected[0]["grad_norm"], _fp64_norm(expected_grads)) < 1e-6
    assert _relative(records[0]["grad_norm"], _fp64_norm(gradients)) < 1e-6


GLOBAL = (*MOE, "model.moe_balance=aux-loss", "model.moe_aux_coef=0.01",
          "model.moe_capacity_factor=1.0")
STEPS = 4


def _one_micro_batch(config: Config) -> Config:
    reference = reference_config(config)
    reference.parallel.microbatches = 1
    return reference


def _assert_one_process_numbers(config: Config, records: list[dict], gradients: list,
                                expected: tuple[list[dict], list]) -> None:
    """Losses to 2e-4, gradient norms to 1e-5 relative over every step, step-1 gradients."""
    reference, reference_grads = expected
    for got, want in zip(records, reference, strict=True):
        assert abs(got["loss"] - want["loss"]) <= 2e-4, (config.parallel, got, want)
        assert _relative(got["grad_norm"], want["grad_norm"]) <= NORM_RTOL, config.parallel
    assert_gradients_match(gradients, reference_grads, config.parallel)


def test_global_batch_balance_gives_one_process_numbers_on_every_split():
    scope = "model.moe_balance_scope=global-batch"
    cases = [
        tiny_config(*GLOBAL, scope, nproc=2),  # dp 2: counts summed in the forward
        tiny_config(*GLOBAL, scope, "parallel.ep=2", nproc=2),  # dp 2 × ep 2
        tiny_config(*GLOBAL, scope, "parallel.microbatches=2", nproc=2),  # routing pre-pass
        tiny_config(*GLOBAL, scope, "parallel.pp=2", "parallel.microbatches=2", nproc=2),
        tiny_config(*GLOBAL, "model.moe_balance_scope=sequence", nproc=2),
        tiny_config(*GLOBAL, nproc=2),  # micro-batch scope: depends on the split
        tiny_config(*GLOBAL, "parallel.microbatches=2", nproc=2),
    ]
    results = run_with_gradients(2, cases, STEPS)
    expected = run_layout_with_gradients(_one_micro_batch(cases[0]), 1, STEPS)
    for config, (records, gradients) in zip(cases[:4], results[:4], strict=True):
        _assert_one_process_numbers(config, records, gradients, expected)
    one_process = tiny_config(*GLOBAL, scope, "parallel.microbatches=2")
    _assert_one_process_numbers(one_process, *run_layout_with_gradients(one_process, 1, STEPS),
                                expected)
    sequence = run_layout_with_gradients(_one_micro_batch(cases[4]), 1, STEPS)
    _assert_one_process_numbers(cases[4], *results[4], sequence)

    # The micro-batch scope's aux loss is each rank's own: the numbers move with the split.
    local = run_layout_with_gradients(_one_micro_batch(cases[5]), 1, STEPS)
    with pytest.raises(AssertionError):
        _assert_one_process_numbers(cases[5], *results[5], local)

    # Metrics: the balance loss at every scope; the global one is the same on every split.
    layer = [records[0]["moe"]["layers"]["0"]["balance_loss"] for records, _ in results]
    assert set(layer[0]) == {"micro-batch", "sequence", "global-batch"}
    assert layer[0]["global-batch"] == pytest.approx(layer[3]["global-batch"], rel=1e-6)
    assert layer[0]["global-batch"] == pytest.approx(
        expected[0][0]["moe"]["layers"]["0"]["balance_loss"]["global-batch"], rel=1e-6)
    assert records_aux(results[0]) == pytest.approx(records_aux(expected), rel=1e-5)

    # comm_bytes.dp: the global-batch runs add exactly the planner's all-reduces over dp.
    from meshtrain.planner.hardware.profile import Cluster
    from meshtrain.replan.auto import BUILTIN_CPU, predict

    for with_scope, without in ((0, 5), (2, 6)):
        config = cases[with_scope]
        added = (results[with_scope][0][0]["comm_bytes"]["dp"]
                 - results[without][0][0]["comm_bytes"]["dp"])
        priced = predict(config, 2, Cluster(BUILTIN_CPU, 2, 2))
        assert added == priced["balance_comm_bytes"] > 0, (config.parallel, added)
        assert (priced["breakdown"]["balance_prepass_s"] > 0) == (with_scope == 2)


def records_aux(result) -> list[float]:
    """The aux loss in the objective, step by step."""
    return [r["moe"]["aux_loss"] for r in result[0]]
