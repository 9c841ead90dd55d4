"""The layout rules (:mod:`meshtrain.config.layout_rules`): each rule's accepted and refused
cases and its message, the callers agreeing with it, and the expert-degree arithmetic written
nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshtrain
from meshtrain.config import ConfigError, ModelConfig, load_config
from meshtrain.config import layout_rules as rules

PACKAGE_DIR = Path(meshtrain.__file__).resolve().parent


# ---------------------------------------------------------------- world size
def test_world_size_is_the_product_of_every_axis():
    assert rules.world_size() == 1
    assert rules.world_size(dp=2, tp=3, pp=5, cp=7, replicas=11) == 2 * 3 * 5 * 7 * 11
    assert rules.model_parallel_size(tp=2, pp=3, cp=2, replicas=2) == 24
    assert rules.world_fits(48, tp=2, pp=3, cp=2, replicas=2)
    assert not rules.world_fits(36, tp=2, pp=3, cp=2, replicas=2)


def test_dp_fills_the_world_or_is_refused_naming_the_multiples():
    assert rules.dp_for_world(12, tp=2, pp=3) == 2
    assert rules.dp_for_world(8, tp=2, replicas=2) == 2
    with pytest.raises(ConfigError) as error:
        rules.dp_for_world(10, tp=2, pp=2, cp=2, replicas=3)
    message = str(error.value)
    assert "--nproc 10 is not a multiple of replicas × cp × tp × pp = 3 × 2 × 2 × 2 = 24" in message
    assert "valid process counts are multiples of 24" in message
    with pytest.raises(ConfigError, match="--gpus 3 is not a multiple of tp × pp = 2 × 1"):
        rules.dp_for_world(3, tp=2, what="--gpus")


def test_world_size_must_equal_the_processes():
    rules.check_world_size(8, dp=2, tp=2, pp=2)
    with pytest.raises(ConfigError) as error:
        rules.check_world_size(6, dp=2, tp=2, pp=2)
    assert str(error.value).startswith("dp × tp × pp = 2 × 2 × 2 = 8 does not equal --nproc 6;")
    assert "set --nproc 8, or leave parallel.dp at 0" in str(error.value)


# ---------------------------------------------------------------- batch, ZeRO, sequence parallel
def test_global_batch_splits_over_readers_and_microbatches():
    assert rules.batch_readers(dp=3, replicas=2) == 6
    rules.check_global_batch(24, dp=3, microbatches=4, replicas=2)
    with pytest.raises(ConfigError) as error:
        rules.check_global_batch(24, dp=3, microbatches=3, replicas=2)
    message = str(error.value)
    assert "train.global_batch = 24 is not divisible by replicas × dp × microbatches" in message
    assert "valid parallel.microbatches for replicas × dp=6: 1, 2, 4" in message
    with pytest.raises(ConfigError, match="choose a global_batch that is a multiple of 6"):
        rules.check_global_batch(8, dp=3, microbatches=2)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages(zero):
    rules.check_zero_stage(zero)


@pytest.mark.parametrize("zero", [-1, 4])
def test_other_zero_stages_are_refused(zero):
    with pytest.raises(ConfigError, match=rf"parallel.zero = {zero} .*valid: 0, 1, 2, 3"):
        rules.check_zero_stage(zero)


def test_sequence_parallel_needs_tensor_parallel():
    rules.check_sequence_parallel(False, 1)
    rules.check_sequence_parallel(True, 2)
    with pytest.raises(ConfigError, match="sequence_parallel = true needs parallel.tp > 1"):
        rules.check_sequence_parallel(True, 1)


# ---------------------------------------------------------------- tensor parallelism
SHAPE = {"n_heads": 8, "kv_heads": 2, "ffn_dim": 96}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_that_splits_heads_and_width_or_replicates_kv_heads(tp):
    assert rules.tp_fits(tp, **SHAPE)  # tp 4 and 8: the 2 kv heads are replicated
    rules.check_tensor_parallel(tp, **SHAPE)


@pytest.mark.parametrize("tp, shape, problem", [
    (3, SHAPE, "n_heads = 8"),
    (8, dict(SHAPE, ffn_dim=100), "ffn_dim = 100"),
    (4, dict(SHAPE, kv_heads=6, n_heads=12), "n_kv_heads = 6 (must divide tp"),
    (4, dict(SHAPE, vocab=258), "vocabulary 258"),
    (4, dict(SHAPE, expert_ffn_dim=10), "the experts' hidden size 10"),
    (4, dict(SHAPE, seq_len=30), "seq_len = 30 (sequence parallel)"),
])
def test_tp_that_cannot_split_is_refused_naming_the_valid_degrees(tp, shape, problem):
    assert not rules.tp_fits(tp, **shape)
    with pytest.raises(ConfigError) as error:
        rules.check_tensor_parallel(tp, **shape)
    message = str(error.value)
    assert message.startswith(f"parallel.tp = {tp} does not evenly split") and problem in message
    valid = [t for t in (1, 2, 3, 4, 6, 8, 12) if shape["n_heads"] % t == 0
             and rules.tp_fits(t, **shape)]
    assert message.endswith(f"Valid tp for this model: {', '.join(map(str, valid))}.")


def test_sizes_not_given_are_not_checked():
    assert rules.tp_fits(4, **SHAPE)  # no vocabulary, experts or sequence given
    assert rules.tp_problems(4, **SHAPE, vocab=None, expert_ffn_dim=None, seq_len=None) == []


# ---------------------------------------------------------------- context parallelism
@pytest.mark.parametrize("seq_len, cp, sp, fits", [
    (16, 2, 1, True), (16, 8, 1, True), (18, 2, 1, False), (20, 4, 1, False),
    (24, 3, 1, True), (24, 2, 4, True), (24, 2, 8, False),
])
def test_cp_splits_each_sequence_into_2cp_chunks(seq_len, cp, sp, fits):
    """2 × cp equal chunks, each rank's seq_len / cp splitting over sp (sequence parallel)."""
    assert rules.context_parallel_fits(seq_len, cp, sp) is fits
    if fits:
        rules.check_context_parallel(seq_len, cp, sp)
    else:
        with pytest.raises(ConfigError, match=f"train.seq_len = {seq_len} is not divisible"):
            rules.check_context_parallel(seq_len, cp, sp)


def test_cp_refusal_names_the_valid_degrees():
    with pytest.raises(ConfigError) as error:
        rules.check_context_parallel(20, 4)
    assert "2 × cp = 8" in str(error.value) and "valid cp for seq_len 20: 2, 5, 10" in str(
        error.value)
    rules.check_context_parallel(7, 1)  # cp 1 splits nothing


def test_cp_chunks_hold_whole_routing_groups_under_capacity():
    moe = ModelConfig(moe_experts=4, moe_capacity_factor=1.25, moe_capacity_group=0)
    rules.check_context_parallel(16, 2, model=ModelConfig())  # dense: nothing to route
    words = (r"routing groups inside one context-parallel chunk of seq_len / \(2 × cp\) = 4 "
             r"tokens.*divisor of 4: 1, 2, 4")
    with pytest.raises(ConfigError, match=words):
        rules.check_context_parallel(16, 2, model=moe)
    moe.moe_capacity_group = 2
    rules.check_context_parallel(16, 2, model=moe)


# ---------------------------------------------------------------- pipeline parallelism
def test_pipeline_stages_need_a_layer_each():
    assert rules.pipeline_stages_fit(4, 4) and not rules.pipeline_stages_fit(5, 4)
    rules.check_pipeline_stages(4, 4)
    with pytest.raises(ConfigError, match="model.n_layers = 2 is fewer than the 4 pipeline "
                                          "stages.*use pp × virtual_stages <= 2, or give "
                                          "parallel.pp_split: 4 layer counts adding up to 2"):
        rules.check_pipeline_stages(4, 2)


def test_interleaving_needs_a_multiple_of_pp_microbatches():
    assert rules.interleaving_fits(2, 4) and not rules.interleaving_fits(4, 6)
    rules.check_interleaved_microbatches(4, 8)
    with pytest.raises(ConfigError, match="divisible by pp.*6 is not a multiple of pp = 4; "
                                          "valid: 4, 8, 12, 16"):
        rules.check_interleaved_microbatches(4, 6)


# ---------------------------------------------------------------- expert parallelism
def _by_definition(ep: int, dp: int, tp: int, experts: int) -> bool:
    """The folded expert layout's rule, as docs/ and the mesh's doc state it."""
    return (ep >= 1 and (ep == 1 or experts > 0) and dp * tp % ep == 0
            and (tp % ep == 0 or ep % tp == 0) and experts % ep == 0)


def test_expert_degree_matches_its_definition_on_a_grid():
    for dp in range(1, 7):
        for tp in (1, 2, 3, 4, 8):
            for experts in (0, 4, 6, 8, 12):
                valid = rules.valid_expert_degrees(dp, tp, experts)
                assert valid == [e for e in range(1, dp * tp + 1)
                                 if _by_definition(e, dp, tp, experts)], (dp, tp, experts)
                for ep in range(0, dp * tp + 2):
                    ok = _by_definition(ep, dp, tp, experts)
                    assert rules.expert_degree_ok(ep, dp, tp, experts) is ok
                    if ok:
                        rules.check_expert_degree(ep, dp, tp, experts)
                    else:
                        with pytest.raises(ConfigError, match="valid ep|Valid ep|dense model"):
                            rules.check_expert_degree(ep, dp, tp, experts)


@pytest.mark.parametrize("ep, dp, tp, experts, words", [
    (0, 2, 1, 4, "parallel.ep = 0 is too small; it must be at least 1 (valid ep: 1, 2)"),
    (2, 2, 1, 0, "parallel.ep = 2 needs a Mixture-of-Experts model (model.moe_experts > 0); "
                 "use parallel.ep = 1"),
    (3, 4, 1, 6, "parallel.ep = 3 does not divide parallel.dp × parallel.tp = 4 × 1 = 4 (ep must "
                 "divide dp × tp"),
    (6, 3, 4, 12, "parallel.ep = 6 neither divides parallel.tp = 4 nor is a multiple of it (ep "
                  "must divide tp or be a multiple of it"),
    (4, 2, 2, 6, "model.moe_experts = 6 is not divisible by parallel.ep = 4; every "
                 "expert-parallel rank"),
])
def test_expert_degree_refusals_name_the_key_and_the_valid_degrees(ep, dp, tp, experts, words):
    with pytest.raises(ConfigError) as error:
        rules.check_expert_degree(ep, dp, tp, experts)
    assert words in str(error.value)
    if experts:
        valid = ", ".join(map(str, rules.valid_expert_degrees(dp, tp, experts)))
        assert f"alid ep: {valid}" in str(error.value)


def test_expert_degree_with_parts_unknown():
    rules.check_expert_degree(12, 3, 4)  # the mesh knows no expert count
    with pytest.raises(ValueError, match="divide tp"):  # ConfigError is a ValueError
        rules.check_expert_degree(6, 3, 4)
    rules.check_expert_degree(4, experts=8)  # an expert layer knows no dp, tp
    with pytest.raises(ConfigError, match="model.moe_experts = 6 is not divisible by "
                                          "parallel.ep = 4.*Valid ep: 1, 2, 3, 6"):
        rules.check_expert_degree(4, experts=6)


def test_every_caller_refuses_the_same_expert_degrees():
    """The run config's validation, the planner's cost model and the mesh ask the same rule."""
    from meshtrain.config.layout import Layout
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.planner.cost.workload import Workload, check_layout
    from meshtrain.validation.run_config import validate_config

    model = ModelConfig(dim=32, n_heads=4, ffn_dim=64, n_layers=2, moe_experts=6, vocab_size=512)
    for dp, tp, ep in [(2, 2, 2), (2, 2, 4), (2, 2, 3), (3, 2, 6), (4, 1, 3), (1, 4, 2),
                       (3, 4, 6), (2, 1, 1)]:
        expected = rules.expert_degree_ok(ep, dp, tp, model.moe_experts)
        config = load_config(None, [f"parallel.dp={dp}", f"parallel.tp={tp}",
                                    f"parallel.ep={ep}", "model.dim=32", "model.n_heads=4",
                                    "model.ffn_dim=64", "model.n_layers=2",
                                    "model.moe_experts=6", "model.vocab_size=512",
                                    f"train.global_batch={4 * dp}"])
        workload = Workload(model, seq_len=16, global_batch=4 * dp)
        layout = Layout(dp=dp, tp=tp, ep=ep)
        for call, args in ((validate_config, (config,)), (check_layout, (workload, layout))):
            if expected:
                call(*args)
            else:
                with pytest.raises(ConfigError):
                    call(*args)
        mesh_ok = rules.expert_degree_ok(ep, dp, tp)  # the mesh knows no expert count
        if mesh_ok:
            ParallelMesh(dp=dp, tp=tp, ep=ep)
        else:
            with pytest.raises(ValueError):
                ParallelMesh(dp=dp, tp=tp, ep=ep)


# ---------------------------------------------------------------- DiLoCo replica groups
DILOCO = dict(replicas=2, sync_every=4, sync_fragments=2, outer_grad_dtype="bf16",
              sync_overlap=3, n_layers=8)


def test_diloco_keys_accepted_together():
    rules.check_replica_keys(**DILOCO)
    rules.check_replica_keys(**dict(DILOCO, outer_grad_dtype="int8", sync_overlap=0))
    rules.check_replica_keys(**dict(DILOCO, replicas=1, sync_fragments=1, sync_overlap=0))
    assert rules.max_sync_fragments(4, 8) == 4 and rules.max_sync_fragments(10, 3) == 3
    rules.check_replica_groups_needed(2, 4, 1)
    rules.check_replica_groups_needed(1, 1, 0)


@pytest.mark.parametrize("change, words", [
    ({"replicas": 0}, "parallel.replicas = 0 is too small; it must be at least 1"),
    ({"sync_every": 0}, "parallel.sync_every = 0 is too small"),
    ({"outer_grad_dtype": "fp16"}, "choose one of: fp32, bf16, int8, fp8"),
    ({"sync_fragments": 0}, "parallel.sync_fragments = 0 is too small"),
    ({"sync_fragments": 5}, "parallel.sync_fragments = 5 is more than parallel.sync_every = 4 "
                            "or model.n_layers = 8 allow"),
    ({"sync_fragments": 4, "n_layers": 3}, "valid: 1 to 3"),
    ({"sync_overlap": -1}, "parallel.sync_overlap = -1 is too small; it must be at least 0"),
    ({"sync_overlap": 4}, "must be below parallel.sync_every = 4"),
    ({"outer_grad_dtype": "fp8"}, "with parallel.sync_overlap > 0 the valid values are fp32 and "
                                  "bf16"),
])
def test_diloco_keys_refused_naming_the_valid_values(change, words):
    with pytest.raises(ConfigError) as error:
        rules.check_replica_keys(**dict(DILOCO, **change))
    assert words in str(error.value)


@pytest.mark.parametrize("fragments, overlap, words", [
    (2, 0, "parallel.sync_fragments > 1 needs parallel.replicas > 1"),
    (1, 1, "parallel.sync_overlap > 0 needs parallel.replicas > 1"),
])
def test_fragments_and_overlap_need_replica_groups(fragments, overlap, words):
    with pytest.raises(ConfigError, match=words.replace(">", ".")):
        rules.check_replica_groups_needed(1, fragments, overlap)


# ---------------------------------------------------------------- written once
EP_NAMES = {"ep", "ep_size", "e"}
"""Names an expert-parallel degree goes by in the code (``e``: a candidate degree)."""


def _identifiers(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _is_ep(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id in EP_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in EP_NAMES))


def _is_partner(node: ast.AST) -> bool:
    names = _identifiers(node)
    return bool(names & {"dp", "tp"}) or any("expert" in name for name in names)


def expert_degree_arithmetic(source: str) -> list[str]:
    """Every ``a % b`` of ``source`` that is expert-degree arithmetic: an expert-parallel degree
    on one side (the whole operand) and tp, dp or an expert count on the other, e.g.
    ``(dp * tp) % ep``, ``tp % e``, ``par.ep % tp``, ``m.moe_experts % lay.ep``. Rank arithmetic
    (``dp_tp_rank % ep``, ``(x0 + e) % tp``) is not."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
            and ((_is_ep(node.left) and _is_partner(node.right))
                 or (_is_ep(node.right) and _is_partner(node.left)))]


@pytest.mark.parametrize("source", [
    "if (dp * tp) % ep: pass",
    "if tp % par.ep and par.ep % tp: pass",
    "bad = m.moe_experts % par.ep",
    "bad = (lay.dp * lay.tp) % lay.ep or m.moe_experts % lay.ep",
    "eps = [e for e in ds if model.moe_experts % e == 0 and (tp % e == 0 or e % tp == 0)]",
    "if num_experts % ep_size: pass",
])
def test_the_detector_finds_the_forms_the_rule_was_restated_in(source):
    assert expert_degree_arithmetic(source)


@pytest.mark.parametrize("source", [
    "self.ep_rank = self.dp_tp_rank % ep",
    "r = (x0 + e) % tp",
    "dst_ep = dst % ep",
    "step % self.every == 0",
    "text = 'ep=%d' % ep",
])
def test_the_detector_leaves_rank_arithmetic_alone(source):
    assert not expert_degree_arithmetic(source)


def test_the_expert_degree_arithmetic_is_written_only_in_layout_rules():
    home = PACKAGE_DIR / "config" / "layout_rules.py"
    # the detector sees the rule where it lives, so it would see a copy elsewhere too
    assert len(expert_degree_arithmetic(home.read_text())) >= 4
    found = {str(path.relative_to(PACKAGE_DIR)): hits
             for path in sorted(PACKAGE_DIR.rglob("*.py")) if path != home
             for hits in [expert_degree_arithmetic(path.read_text())] if hits}
    assert not found, ("expert-degree arithmetic restated; call meshtrain.config.layout_rules "
                       f"(check_expert_degree, expert_degree_ok, valid_expert_degrees): {found}")
