"""Config fuzzing (Hypothesis): bad input is always a ConfigError, never a crash or a hang.

- Any keys (known or not) with any values, through ``--set`` strings and through mappings (as a
  TOML or config.json file gives them): validation either accepts the config or raises
  :class:`ConfigError` with a message, and then the CLI exits 2 with no traceback.
- Configs built valid by construction (shapes that divide, batches that split) always validate.
- A few of those, tiny, train for one step in this process.
- Known-invalid values for each key are always refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.cli import main
from meshtrain.config import (
    LR_SCHEDULES,
    Config,
    ConfigError,
    config_from_dict,
    default_config_path,
    load_config,
)
from meshtrain.config.layout import ACTIVATION_CHECKPOINTING_KINDS, PP_SCHEDULES
from meshtrain.config.model import MLP_KINDS
from meshtrain.parallel.pipeline.schedules import default_virtual_stages
from meshtrain.validation.run_config import validate_config

FIELDS = {f"{section.name}.{f.name}": typing.get_type_hints(type(getattr(Config(),
                                                                         section.name)))[f.name]
          for section in dataclasses.fields(Config)
          for f in dataclasses.fields(getattr(Config(), section.name))}
# Paths are fuzzed with a few safe shapes: random text there could glob the whole filesystem.
PATH_KEYS = {"data.source", "data.tokenizer", "train.run_dir", "checkpoint.dir",
             "checkpoint.resume", "checkpoint.init_from"}
SAFE_PATHS = ["builtin", "bytes", "auto", "none", "", "/nonexistent/x.txt", "/nonexistent/"]
CHOICES = ["swiglu", "gelu", "cosine", "wsd", "1f1b", "zb-v", "gpipe", "full", "bf16", "fp32",
           "skip", "stop", "cpu", "auto", "aux-loss", "bias", "softmax", "sigmoid", "3,3,2", "1,"]
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def _scalars():
    return st.one_of(
        st.integers(-10, 10**9), st.sampled_from([0, 1, 2, 3, 4, 8, 16, -1, 2**31, 10**12]),
        st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
        st.sampled_from(CHOICES), st.text(max_size=12))


def _value_for(key: str):
    if key in PATH_KEYS:
        return st.sampled_from(SAFE_PATHS)
    return _scalars()


@st.composite
def _overrides(draw):
    keys = draw(st.lists(st.one_of(st.sampled_from(sorted(FIELDS)),
                                   st.sampled_from(["model.bogus", "nosection.dim", "dim",
                                                    "model.", ".x", "train.lr.x"])),
                         min_size=1, max_size=5))
    return [(key, draw(_value_for(key))) for key in keys]


def _validate_or_config_error(config_source) -> Config | None:
    try:
        config = config_source()
        validate_config(config, None)
        return config
    except ConfigError as error:
        assert str(error).strip(), "a ConfigError needs a message"
        return None


@FUZZ
@given(_overrides(), st.sampled_from([None, 1, 2, 3, 4, 8]))
def test_any_set_overrides_validate_or_raise_config_error(overrides, nproc):
    texts = [f"{key}={value}" for key, value in overrides]
    try:  # the config `meshtrain train` without --config starts from: the demo's
        validate_config(load_config(default_config_path(), texts), nproc)
    except ConfigError as error:
        assert str(error).strip()
    else:
        return
    # Refused: the command line must exit 2 with one message and no traceback.
    args = ["train"] + [a for text in texts for a in ("--set", text)]
    if nproc is not None:
        args += ["--nproc", str(nproc)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(args) == 2
    assert err.getvalue().startswith("meshtrain train:") and "Traceback" not in err.getvalue()


@FUZZ
@given(_overrides())
def test_any_mapping_validates_or_raises_config_error(overrides):
    data: dict = {}
    for key, value in overrides:
        section, _, name = key.partition(".")
        data.setdefault(section, {})
        if isinstance(data[section], dict):
            data[section][name] = value
    _validate_or_config_error(lambda: config_from_dict(data))


@FUZZ
@given(st.sampled_from([["a"], {"x": 1}, None, [1, 2], 3, "text"]))
def test_non_table_sections_and_odd_value_types_raise_config_error(value):
    for data in ({"model": value}, {"model": {"dim": value}}, {"train": {"lr": value}}):
        if data == {"model": {"dim": 3}}:
            continue  # a valid int that merely fails validation below
        _validate_or_config_error(lambda data=data: config_from_dict(data))


@st.composite
def valid_configs(draw):
    """Configs valid by construction (tiny enough to train one step on a CPU)."""
    head_dim = draw(st.sampled_from([2, 4, 8]))
    n_heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([d for d in (0, 1, 2, 4) if d == 0 or n_heads % d == 0]))
    dp = draw(st.sampled_from([1, 2]))
    microbatches = draw(st.sampled_from([1, 2]))
    lr = draw(st.floats(1e-5, 1e-1))
    schedule = draw(st.sampled_from(PP_SCHEDULES))
    return [
        f"model.dim={head_dim * n_heads}", f"model.n_heads={n_heads}", f"model.n_kv_heads={kv}",
        f"model.n_layers={draw(st.integers(1, 3))}", f"model.ffn_dim={draw(st.integers(4, 48))}",
        f"model.mlp={draw(st.sampled_from(MLP_KINDS))}",
        f"model.tie_embeddings={draw(st.booleans())}",
        f"parallel.dp={dp}", f"parallel.microbatches={microbatches}",
        f"parallel.zero={draw(st.integers(0, 3))}",
        f"parallel.activation_checkpointing={draw(st.sampled_from(ACTIVATION_CHECKPOINTING_KINDS))}",
        f"parallel.pp_schedule={schedule}",
        f"parallel.virtual_stages={default_virtual_stages(schedule)}",
        f"train.global_batch={dp * microbatches * draw(st.integers(1, 3))}",
        f"train.seq_len={draw(st.integers(4, 24))}", f"train.lr={lr}",
        f"train.min_lr={lr * draw(st.floats(0, 1))}",
        f"train.lr_schedule={draw(st.sampled_from(LR_SCHEDULES))}",
        f"train.warmup_steps={draw(st.integers(0, 3))}",
        f"train.on_nonfinite={draw(st.sampled_from(['skip', 'stop']))}",
        f"train.collective_timeout_s={draw(st.floats(0.5, 1e4))}",
        "data.max_bytes=20000", "train.steps=1",
    ]


@FUZZ
@given(valid_configs())
def test_valid_configs_validate(overrides):
    config = load_config(None, overrides)
    assert validate_config(config, max(config.parallel.dp, 1)) == max(config.parallel.dp, 1)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(valid_configs())
def test_a_few_valid_configs_train_one_step(tmp_path_factory, overrides):
    run_dir = tmp_path_factory.mktemp("run")
    single = [o for o in overrides if not o.startswith("parallel.dp=")] + ["parallel.dp=1"]
    args = ["train", "--run-dir", str(run_dir)] + [a for o in single for a in ("--set", o)]
    assert main(args) == 0
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1


INVALID = {
    "model.dim": ["0", "-8", "abc", "1.5", "nan"], "model.n_heads": ["0", "3", "-1"],
    "model.n_kv_heads": ["3", "-1"], "model.n_layers": ["0"], "model.mlp": ["relu"],
    "model.rope_theta": ["0", "-1", "inf", "nan"], "model.norm_eps": ["0", "nan"],
    "model.vocab_size": ["-1", "100"], "parallel.tp": ["0", "3"], "parallel.pp": ["0", "9"],
    "parallel.zero": ["4", "-1"], "parallel.pp_schedule": ["zigzag", ""],
    "parallel.microbatches": ["0", "5", "100000000"], "parallel.dp_bucket_mb": ["0", "nan"],
    "parallel.zero3_prefetch": ["-1", "1.5", "two"],
    "parallel.pp_split": ["1,2", "x"], "train.lr": ["-1", "0", "nan", "inf"],
    "train.min_lr": ["-1", "1"], "train.steps": ["0"], "train.global_batch": ["0", "-4"],
    "train.lr_schedule": ["linear"], "train.decay_fraction": ["0", "2", "nan"],
    "train.adam_beta1": ["1", "-0.1", "nan"], "train.grad_clip": ["-1", "nan"],
    "train.precision": ["fp8"], "train.device": ["tpu"], "train.collective_timeout_s": ["0", "-5",
                                                                                        "inf"],
    "train.on_nonfinite": ["ignore"], "train.max_nonfinite_skips": ["0"],
    "train.max_restarts": ["-1"], "train.debug_collectives": ["maybe"],
    "data.source": ["/nonexistent/x.txt"], "data.tokenizer": ["/nonexistent/tokenizer.json"],
    "checkpoint.every": ["-1"], "checkpoint.resume": ["/nonexistent/ckpt"],
}


@pytest.mark.parametrize("key, value", [(k, v) for k, vs in INVALID.items() for v in vs])
def test_known_invalid_values_exit_2_without_traceback(key, value, capsys):
    base = ["model.dim=32", "model.n_heads=4", "model.ffn_dim=64", "model.n_layers=4",
            "train.global_batch=8"]
    with pytest.raises(ConfigError):
        validate_config(load_config(None, [*base, f"{key}={value}"]), None)
    args = ["train"] + [a for o in (*base, f"{key}={value}") for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain train:") and "Traceback" not in err


def test_nonfinite_floats_are_refused_everywhere():
    for key, kind in FIELDS.items():
        if kind is float:
            with pytest.raises(ConfigError, match="finite"):
                load_config(None, [f"{key}=nan"])
            assert not math.isnan(getattr(getattr(Config(), key.split(".")[0]),
                                          key.split(".")[1]))
