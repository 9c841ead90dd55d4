"""Qwen3-MoE and Qwen2-MoE conversions refuse what would drop or misplace an expert.

A tiny random checkpoint of each family (:mod:`tests.hf_families`) is edited: a missing expert
tensor, an extra one, a config that declares another number of experts, MoE tensors where the
config has a dense layer, ``mlp_only_layers`` meshtrain cannot express; each import must stop
with a ConfigError naming what is wrong and what would be valid (exit status 2 from the CLI).
Config-only checks cover the mapping both ways and the exports that have no family.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from meshtrain.checkpoint import load_hf  # noqa: E402
from meshtrain.checkpoint.hf.config import (  # noqa: E402
    check_exportable,
    hf_to_model_config,
    model_config_to_hf,
)
from meshtrain.cli import main  # noqa: E402
from meshtrain.config import ConfigError, ModelConfig  # noqa: E402
from tests.hf_families import make_hf_model  # noqa: E402

EXPERT = "model.layers.1.mlp.experts.{}.gate_proj.weight"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe")
    return {family: make_hf_model(family, root / family) for family in ("qwen3-moe", "qwen2-moe")}


def _edited(sources, tmp_path, family, tensors=None, name="edited", **config):
    """A copy of ``family``'s checkpoint with ``tensors(state)`` applied and ``config`` merged."""
    source, out = sources[family], tmp_path / f"{family}-{name}"
    out.mkdir()
    state = load_file(source / "model.safetensors")
    if tensors:
        tensors(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    doc = json.loads((source / "config.json").read_text())
    doc.update(config)
    (out / "config.json").write_text(json.dumps(doc))
    return out


def _refused(path, *fragments):
    with pytest.raises(ConfigError) as error:
        load_hf(path)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


def test_missing_expert_tensor_is_named_with_the_declared_experts(sources, tmp_path):
    path = _edited(sources, tmp_path, "qwen3-moe", lambda s: s.pop(EXPERT.format(3)))
    _refused(path, EXPERT.format(3), "declares 4 experts", "ids 0 to 3", "num_experts")


def test_extra_expert_tensor_is_refused_with_the_valid_ids(sources, tmp_path):
    def add(state):
        state[EXPERT.format(4)] = state[EXPERT.format(0)].clone()

    _refused(_edited(sources, tmp_path, "qwen2-moe", add), EXPERT.format(4),
             "expert 4 of layer 1", "valid ids 0 to 3")


@pytest.mark.parametrize("declared, fragments", [
    (3, ("moe.router.weight", "the weights hold 4 experts", "declares 3",
         "set num_experts / num_local_experts to 4")),
    (5, ("the weights hold 4 experts", "declares 5", "set num_experts / num_local_experts to 4")),
])
def test_expert_count_mismatch_is_refused(sources, tmp_path, declared, fragments):
    # transformers 5 writes Qwen3-MoE's count as num_local_experts, the Hub as num_experts.
    path = _edited(sources, tmp_path, "qwen3-moe", num_local_experts=declared)
    _refused(path, *fragments)
    _refused(_edited(sources, tmp_path, "qwen2-moe", num_experts=declared), *fragments)


def test_moe_tensors_in_a_dense_layer_are_refused(sources, tmp_path):
    # Layer 0 of the Qwen3-MoE model is dense; claim layer 1 is too, then that both are MoE.
    path = _edited(sources, tmp_path, "qwen3-moe", mlp_only_layers=[0, 1])
    with pytest.raises(ConfigError, match="leave no MoE layer"):
        load_hf(path)
    path = _edited(sources, tmp_path, "qwen2-moe", mlp_only_layers=[0])  # experts there
    _refused(path, "model.layers.0.mlp.gate_proj.weight is missing", "makes layer 0 dense",
             "it is an MoE layer in the weights")
    path = _edited(sources, tmp_path, "qwen3-moe", name="all-moe", mlp_only_layers=[])
    _refused(path, "model.layers.0.mlp.gate.weight is missing", "MoE layer",
             "list the layer in mlp_only_layers")


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe"])
def test_fused_qwen_moe_checkpoint_loads(sources, tmp_path, family):
    """transformers 5.x's in-memory layout (gate_up_proj / down_proj) saved as-is."""
    import torch
    import transformers

    from tests.hf_families import hf_logits

    model = transformers.AutoModelForCausalLM.from_pretrained(sources[family])
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((sources[family] / "config.json").read_text())
    tokens = torch.randint(0, 264, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = load_hf(tmp_path)(tokens)
    torch.testing.assert_close(logits, hf_logits(sources[family], tokens), atol=1e-5, rtol=1e-5)


def test_mlp_only_layers_meshtrain_cannot_express_are_refused_by_the_cli(sources, tmp_path,
                                                                        capsys):
    # Layer 0 MoE but layer 1 dense: meshtrain's dense blocks are the first ones.
    path = _edited(sources, tmp_path, "qwen2-moe", mlp_only_layers=[1])
    assert main(["convert", "--from-hf", str(path), "--out", str(tmp_path / "out")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "mlp_only_layers = [1]" in err and "valid here [], [0] (layers" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 264, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 2,
             "mlp_only_layers": [0, 1], "router_aux_loss_coef": 0.001}


def test_qwen_moe_config_mapping_round_trips():
    config = hf_to_model_config(QWEN3_MOE)
    assert (config.moe_every, config.moe_first_dense) == (2, 2)  # layers 3 and 5 are MoE
    assert [config.is_moe_layer(i) for i in range(6)] == [False, False, False, True, False, True]
    assert [config.moe_layer_count(r) for r in (range(6), range(3), [3, 4], [5])] == [2, 0, 1, 1]
    assert config.moe_aux_coef == pytest.approx(0.001 * 2 / 2)
    back = model_config_to_hf(config, base=QWEN3_MOE)
    assert back["mlp_only_layers"] == [0, 1] and back["architectures"] == ["Qwen3MoeForCausalLM"]
    assert hf_to_model_config(back) == config
    plain = model_config_to_hf(config)  # no base: the first moe_first_dense layers
    assert plain["mlp_only_layers"] == [0, 1] and hf_to_model_config(plain) == config
    qwen2 = {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48,
             "qkv_bias": False}
    config2 = hf_to_model_config(qwen2)
    assert (config2.shared_ffn_dim, config2.moe_shared_gate, config2.qkv_bias) == (48, True, False)
    assert not config2.qk_norm and hf_to_model_config(model_config_to_hf(config2)) == config2


@pytest.mark.parametrize("change, fragment", [
    ({"num_experts_per_tok": 1}, "num_experts_per_tok = 1 with norm_topk_prob = true"),
    ({"num_experts": 0}, "dense model"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0"),
    ({"mlp_only_layers": [7]}, "outside the 6 layers"),
    ({"mlp_only_layers": [3]}, "valid here [], [1], [1, 3] (layers"),
])
def test_qwen_moe_configs_meshtrain_cannot_express_are_refused(change, fragment):
    with pytest.raises(ConfigError) as error:
        hf_to_model_config({**QWEN3_MOE, **change})
    assert fragment in str(error.value)


MOE = dict(vocab_size=264, dim=64, n_layers=2, n_heads=4, ffn_dim=96, moe_experts=4,
           moe_top_k=2)


@pytest.mark.parametrize("change, family, fragment", [
    ({}, "mixtral", None),
    ({"qk_norm": True, "moe_every": 2}, "qwen3_moe", None),
    ({"moe_shared_experts": 1, "moe_shared_gate": True, "qkv_bias": True}, "qwen2_moe", None),
    ({"moe_shared_experts": 1}, None, "without moe_shared_gate"),
    ({"moe_norm_topk": False}, None, "moe_norm_topk = false (Mixtral"),
    ({"moe_every": 2}, None, "Qwen-MoE's decoder_sparse_step needs qk_norm"),
    ({"qk_norm": True, "moe_score": "sigmoid"}, None, "Qwen3-MoE routes by softmax"),
])
def test_moe_export_family_or_refusal(change, family, fragment):
    config = ModelConfig(**{**MOE, **change})
    if family:
        assert check_exportable(config) == family
    else:
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
            check_exportable(config)


# The fields that matter of two published configs (Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B).
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                 "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
                 "max_window_layers": 48, "rope_scaling": None, "rope_theta": 1000000.0,
                 "attention_bias": False, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
                 "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16"}
QWEN15_MOE_A27B = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                   "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                   "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
                   "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                   "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                   "sliding_window": 32768, "max_window_layers": 21, "rope_theta": 1000000.0,
                   "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
                   "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16"}


def test_published_qwen_moe_configs_map():
    big = hf_to_model_config(QWEN3_30B_A3B)
    assert (big.moe_experts, big.moe_top_k, big.moe_ffn_dim, big.head_dim) == (128, 8, 768, 128)
    assert big.qk_norm and big.moe_norm_topk and big.first_moe_layer == 0
    assert check_exportable(big) == "qwen3_moe"
    small = hf_to_model_config(QWEN15_MOE_A27B)
    assert (small.moe_experts, small.moe_top_k, small.shared_ffn_dim) == (60, 4, 5632)
    assert small.qkv_bias and small.moe_shared_gate and not small.moe_norm_topk
    assert check_exportable(small) == "qwen2_moe"
    for source, config in ((QWEN3_30B_A3B, big), (QWEN15_MOE_A27B, small)):
        assert hf_to_model_config(model_config_to_hf(config, base=source)) == config
