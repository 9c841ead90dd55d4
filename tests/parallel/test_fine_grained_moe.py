"""Fine-grained MoE shapes (dense first blocks, many small experts, top-4, a shared expert (also
wider than an expert and sigmoid-gated, with raw top-k gates: Qwen2-MoE),
node-limited routing over expert groups) match one process under expert, data and pipeline
parallelism (fp32; meshtrain.commands.verify's tolerances: 2e-4 on the loss, 1e-3 relative on the
gradient norm)."""

from __future__ import annotations

from tests.helpers import assert_layouts_match_one_process, tiny_config

STEPS = 2
# DeepSeek-V3 in miniature: first block dense, 16 experts of width 8, top-4, one shared
# expert, sigmoid scores with bias balancing, each token's experts from at most 2 of 4 groups.
DEEPSEEK = ("model.moe_experts=16", "model.moe_top_k=4", "model.moe_ffn_dim=8",
            "model.moe_shared_experts=1", "model.moe_first_dense=1", "model.moe_score=sigmoid",
            "model.moe_balance=bias", "model.moe_bias_rate=0.01", "model.moe_groups=4",
            "model.moe_max_groups=2")


def test_node_limited_routing_and_dense_first_block_at_dp2_ep2():
    """With ep = moe_groups = 2 and one group per token, every token's experts sit on one ep
    rank; with 4 groups over 2 ep ranks, at most 2 groups."""
    cases = [
        tiny_config("model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn_dim=16",
                    "model.moe_groups=2", "model.moe_max_groups=1", "model.moe_first_dense=1",
                    "model.n_layers=3", "parallel.ep=2", nproc=2),
        tiny_config(*DEEPSEEK, "parallel.ep=2", "parallel.microbatches=2", nproc=2),
        # many small experts, top-8 from at most 4 of 8 groups (DeepSeek-V3's ratios)
        tiny_config(*DEEPSEEK, "model.moe_experts=64", "model.moe_top_k=8",
                    "model.moe_ffn_dim=4", "model.moe_groups=8", "model.moe_max_groups=4",
                    "parallel.ep=2", nproc=2),
    ]
    results = assert_layouts_match_one_process(2, cases, STEPS)
    # the first block is dense: only layers 1.. report MoE load
    assert set(results[1][0]["moe"]["layers"]) == {"1"}


def test_deepseek_style_at_dp2_ep2_pp2():
    config = tiny_config(*DEEPSEEK, "parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2",
                         "model.n_layers=4", "parallel.zero=1", nproc=4)
    assert_layouts_match_one_process(4, [config], STEPS)


# Qwen2-MoE in miniature: raw top-2 gates, a sigmoid-gated shared expert wider than one expert,
# the first block dense.
QWEN2_MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=16",
             "model.moe_norm_topk=false", "model.moe_shared_experts=1",
             "model.moe_shared_ffn_dim=40", "model.moe_shared_gate=true",
             "model.moe_first_dense=1", "model.n_layers=4")


def test_gated_shared_expert_at_pp2_ep2_ep2_zero2_zero3_and_tp2_ep2():
    """The shared-expert gate is a replicated [1, dim] weight: on its block's pipeline stage,
    sharded by ZeRO-2 over dp while experts shard over the expert-data ranks, gathered by ZeRO-3
    (which ep does not combine with), whole on every tp rank, never split over ep."""
    cases = [
        tiny_config(*QWEN2_MOE, "parallel.ep=2", "parallel.pp=2", "parallel.zero=1",
                    "parallel.microbatches=2", nproc=4),
        tiny_config(*QWEN2_MOE, "parallel.ep=2", "parallel.zero=2", nproc=4),
        tiny_config(*QWEN2_MOE, "parallel.zero=3", nproc=4),
        tiny_config(*QWEN2_MOE, "parallel.ep=2", "parallel.tp=2", nproc=4),
    ]
    assert_layouts_match_one_process(4, cases, STEPS)
