"""The model options of the Llama 3.x / Qwen2.5 / Qwen3 families on one device: RoPE scaling
against transformers' own frequency functions, the config keys and their refusals, parameter
counts of the built model, and the presets against the published parameter totals."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from meshtrain.cli import main
from meshtrain.config import ConfigError, ModelConfig, load_config
from meshtrain.config.layout import Layout
from meshtrain.model import build_model, count_parameters, flops_per_token
from meshtrain.model.rope import rope_frequencies
from meshtrain.model.transformer import rope_cos_sin
from meshtrain.planner.cost.memory import stage_params
from meshtrain.planner.tables.presets import PRESETS, preset_config
from meshtrain.validation.run_config import validate_config

HEAD_DIM, THETA = 64, 500000.0
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.8},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 2.0, "truncate": False,
                         "original_max_position_embeddings": 2048},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 4096},
}
# Published totals (the model cards' parameter counts), to 0.5 %.
PUBLISHED = {"llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9, "llama3.1-405b": 405.9e9,
             "llama3.2-1b": 1.24e9, "llama3.2-3b": 3.21e9, "qwen2.5-7b": 7.62e9,
             "qwen2.5-72b": 72.7e9, "qwen3-8b": 8.19e9, "qwen3-32b": 32.8e9,
             "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235.1e9}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_frequencies_equal_transformers(name):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[name]
    hf = transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4,
                                  max_position_embeddings=131072,
                                  rope_parameters={**scaling, "rope_theta": THETA})
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    inv_freq, factor = rope_frequencies(HEAD_DIM, THETA, scaling)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    plain, _ = rope_frequencies(HEAD_DIM, THETA, None)
    assert not torch.allclose(inv_freq, plain)  # every case really scales something


def test_yarn_scales_cos_and_sin():
    scaling = SCALINGS["yarn"]
    cos, sin = rope_cos_sin(16, HEAD_DIM, THETA, torch.device("cpu"), torch.float32, scaling)
    assert float(cos[0, 0]) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert float((cos.square() + sin.square()).sqrt().max()) == pytest.approx(
        0.1 * math.log(4.0) + 1.0)


def test_plain_rope_tables_are_unchanged():
    """Without rope_scaling the tables are the plain formula, bit for bit."""
    cos, sin = rope_cos_sin(40, 16, 10000.0, torch.device("cpu"), torch.float32)
    exponents = torch.arange(0, 16, 2, dtype=torch.float32) / 16
    angles = torch.outer(torch.arange(40, dtype=torch.float32), 10000.0**-exponents)
    angles = torch.cat([angles, angles], dim=-1)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    names = [name for name, _ in build_model(ModelConfig(vocab_size=64, dim=32, n_heads=4))
             .named_parameters()]
    assert not any(name.endswith(("bias", "q_norm.weight", "k_norm.weight")) for name in names)


def test_config_keys_from_toml_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nqkv_bias = true\nqk_norm = true\nhead_width = 16\n'
                    '[model.rope_scaling]\nrope_type = "llama3"\nfactor = 8.0\n'
                    'low_freq_factor = 1.0\nhigh_freq_factor = 4.0\n'
                    'original_max_position_embeddings = 64\n')
    config = load_config(path, ["model.rope_scaling.factor=16"])
    validate_config(config)
    assert config.model.rope_scaling["factor"] == 16 and config.model.rope_type == "llama3"
    assert (config.model.qkv_bias, config.model.qk_norm, config.model.head_dim) == (True, True, 16)
    inline = load_config(None, ['model.rope_scaling={type = "linear", factor = 2.0}'])
    assert inline.model.rope_type == "linear"
    assert load_config(None, ["model.rope_scaling=none"]).model.rope_scaling == {}


@pytest.mark.parametrize("override, named", [
    ("model.rope_scaling.rope_type=dynamic", "model.rope_scaling.rope_type"),
    ("model.rope_scaling={rope_type = \"llama3\", factor = 8.0}", "low_freq_factor"),
    ("model.rope_scaling={rope_type = \"linear\", factor = 2.0, beta_fast = 3}",
     "model.rope_scaling.beta_fast"),
    ("model.rope_scaling={rope_type = \"linear\", factor = -1.0}", "model.rope_scaling.factor"),
    ("model.rope_scaling=7", "model.rope_scaling"),
    ("model.qk_norm=maybe", "model.qk_norm"),
    ("model.head_width=7", "model.head_width"),
])
def test_invalid_options_exit_2_naming_the_field(override, named):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", "--set", override]) == 2
    assert named in err.getvalue() and "Traceback" not in err.getvalue()


@pytest.mark.parametrize("options", [
    dict(qkv_bias=True), dict(qkv_bias=True, wo_bias=True), dict(qk_norm=True),
    dict(qk_norm=True, head_width=16, n_kv_heads=2), dict(qkv_bias=True, tie_embeddings=True)])
def test_parameter_counts_match_the_built_model(options):
    config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, **options)
    model = build_model(config)
    assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())
    layout = Layout()
    on_one_rank = stage_params(config, list(range(config.n_layers)), layout, True, True)
    assert on_one_rank.dense == count_parameters(config)["total"]
    # biases and norms do no matmul: the FLOPs are those of the same shapes without them
    bare = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48,
                       head_width=config.head_width, n_kv_heads=config.n_kv_heads,
                       tie_embeddings=config.tie_embeddings)
    assert flops_per_token(config, 16) == flops_per_token(bare, 16)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_match_the_published_parameter_counts(name):
    config = preset_config(name)
    assert count_parameters(config.model)["total"] == pytest.approx(PUBLISHED[name], rel=5e-3)
    assert "config.json" in PRESETS[name][3]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", "--model", name, "--hardware", "h100-80g", "--gpus", "64",
                     "--set", "parallel.tp=4", "--set", "parallel.zero=1",
                     "--set", "parallel.microbatches=8"]) == 0
    billions = count_parameters(config.model)["total"] / 1e9
    assert out.getvalue().startswith(f"{billions:.2f}B parameters"), out.getvalue()[:80]


def test_estimate_refuses_both_model_and_config(tmp_path):
    (tmp_path / "c.toml").write_text("")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["estimate", "--model", "qwen3-8b", "--config", str(tmp_path / "c.toml"),
                     "--hardware", "h100-80g"]) == 2
    assert "--model" in err.getvalue()


def test_config_error_for_a_bad_rope_table_type():
    with pytest.raises(ConfigError, match="must be a table"):
        load_config(None, ["model.rope_scaling=[1, 2]"])
