"""The attention options (``qkv_bias``, ``wo_bias``, ``qk_norm``, ``head_width``,
``rope_scaling``) under every axis against one process (fp32).

Tolerances: meshtrain.commands.verify's (2e-4 absolute on the loss, 1e-3 relative on the gradient
norm); the layouts differ from one process only in the summation order of split matmuls and reduced
gradients. The cases cover each place the options meet an axis: column-split biases (tp), kv
biases and k_norm on replicated kv heads (n_kv_heads < tp: each rank's share of the gradient
summed over tp), the output bias added after the row-parallel reduce (partial over tp with
sequence parallelism), QK-norm weights summed over tp, ZeRO-3 gathering them with their block,
and the zero-bubble pipeline deferring the bias gradients of its W pass.
"""

from __future__ import annotations

from tests.helpers import assert_layouts_match_one_process, tiny_config

STEPS = 3
OPTIONS = ("model.qkv_bias=true", "model.wo_bias=true", "model.qk_norm=true",
           "model.rope_scaling={rope_type = \"yarn\", factor = 4.0, "
           "original_max_position_embeddings = 8}")


def test_options_under_tp2_sp_replicated_kv_and_pp2():
    cases = [tiny_config(*OPTIONS, "parallel.tp=2", nproc=2),
             tiny_config(*OPTIONS, "parallel.tp=2", "parallel.sequence_parallel=true", nproc=2),
             tiny_config(*OPTIONS, "model.n_kv_heads=1", "model.head_width=16", "parallel.tp=2",
                         nproc=2),
             tiny_config(*OPTIONS, "parallel.pp=2", "parallel.microbatches=2", nproc=2)]
    assert_layouts_match_one_process(2, cases, STEPS)


def test_options_under_dp2_tp2_zero3_and_tp2_pp2_zero_bubble():
    cases = [tiny_config(*OPTIONS, "parallel.tp=2", "parallel.zero=3",
                         "parallel.sequence_parallel=true", nproc=4),
             tiny_config(*OPTIONS, "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2",
                         "parallel.pp_schedule=zb-h1", nproc=4)]
    assert_layouts_match_one_process(4, cases, STEPS)
