"""Config loading, overrides and every refusal (exit status 2 paths)."""

from __future__ import annotations

import pytest

from meshtrain.config import Config, ConfigError, config_from_dict, load_config, set_key
from meshtrain.validation.run_config import validate_config


def _validated(*overrides: str, nproc: int | None = None) -> Config:
    config = load_config(None, overrides)
    validate_config(config, nproc)
    return config


def test_defaults_validate():
    config = _validated()
    assert config.parallel.dp == 1
    assert config.model.kv_heads == config.model.n_heads


def test_toml_then_overrides_typed(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\ndim = 64\nn_heads = 4\n[train]\nlr = 1e-3\nprecision = "bf16"\n')
    config = load_config(path, ["model.dim=128", "train.steps=7", "model.tie_embeddings=true",
                                "train.lr=2e-3"])
    assert config.model.dim == 128 and isinstance(config.model.dim, int)
    assert config.model.n_heads == 4
    assert config.train.steps == 7
    assert config.model.tie_embeddings is True
    assert config.train.lr == pytest.approx(2e-3)
    assert config.train.precision == "bf16"


@pytest.mark.parametrize("override, fragment", [
    ("parallel.bogus=1", "parallel.bogus"),
    ("parallel.tpp=2", 'Did you mean "tp"'),
    ("modle.dim=4", 'Did you mean "model"'),
    ("model.dim=abc", "not a valid int"),
    ("model.tie_embeddings=maybe", "boolean"),
    ("dim=4", "section.key"),
])
def test_unknown_keys_and_bad_types_refused(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, fragment", [
    (["model.dim=64", "model.n_heads=3"], "valid n_heads for dim 64"),
    (["model.n_kv_heads=3"], "n_kv_heads"),
    (["model.mlp=relu"], "swiglu, gelu"),
    (["model.vocab_size=100"], "smaller than the tokenizer"),
    (["model.moe_experts=4", "model.moe_top_k=5"], "moe_top_k"),
    (["model.moe_experts=4", "model.moe_balance=magic"], "aux-loss, bias, none"),
    (["parallel.zero=4"], "valid: 0, 1, 2, 3"),
    (["parallel.pp_schedule=zigzag"], "1f1b"),
    (["parallel.activation_checkpointing=some"], "selective"),
    (["train.global_batch=10", "parallel.microbatches=4"], "not divisible"),
    (["train.lr_schedule=linear"], "cosine"),
    (["train.precision=fp16"], "bf16"),
    (["train.min_lr=1", "train.lr=0.1"], "min_lr"),
    (["train.steps=0"], "at least 1"),
    (["train.straggler_factor=1"], "must be above 1"),
    (["train.straggler_steps=0"], "train.straggler_steps = 0 is too small"),
    (["data.source=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "no such file"),
    (["checkpoint.resume=/nonexistent/ckpt"], "no such checkpoint"),
])
def test_impossible_values_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _validated(*overrides)


def test_world_size_resolution():
    assert _validated(nproc=4).parallel.dp == 4
    with pytest.raises(ConfigError, match="does not equal --nproc"):
        _validated("parallel.dp=2", nproc=3)
    with pytest.raises(ConfigError, match="not divisible"):
        _validated("train.global_batch=6", nproc=4)


def test_padded_vocab_allowed():
    assert _validated("model.vocab_size=512").model.vocab_size == 512


def test_missing_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndim = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[trian]\nsteps = 3\n")
    with pytest.raises(ConfigError, match='Did you mean "train"'):
        load_config(unknown)


def test_round_trip_dict():
    config = load_config(None, ["model.dim=96", "model.n_heads=6"])
    again = config_from_dict(config.to_dict())
    assert again == config
    set_key(again, "train.seed", "5")
    assert again.train.seed == 5


def test_the_default_config_is_the_shipped_demo():
    """``meshtrain train`` without ``--config`` runs ``configs/demo.toml``: the path is found
    from the package's own location, wherever that module sits in the tree."""
    from pathlib import Path

    from meshtrain.config import default_config_path

    demo = Path(__file__).resolve().parents[3] / "configs" / "demo.toml"
    assert demo.is_file() and default_config_path() == demo
