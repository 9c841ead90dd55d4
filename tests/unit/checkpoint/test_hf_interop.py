"""Hugging Face interop: load_hf / save_hf, `meshtrain convert` both ways, refusals.

Tiny random Llama (GQA untied, MHA tied) and Mixtral models are built with transformers in the
test (nothing is downloaded); every parameter, norms included, is redrawn so that a wrong
mapping cannot hide behind an all-ones weight.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from meshtrain.checkpoint import (  # noqa: E402
    convert_from_hf,
    iter_weights,
    load_hf,
    save_hf,
    weights_config,
)
from meshtrain.checkpoint.hf.config import check_exportable, hf_to_model_config  # noqa: E402
from meshtrain.checkpoint.safetensors_io import ShardedWriter, TensorReader  # noqa: E402
from meshtrain.cli import main  # noqa: E402
from meshtrain.config import ConfigError, ModelConfig  # noqa: E402
from meshtrain.model import build_model, moe_layers  # noqa: E402

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
MODELS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(intermediate_size=48, num_key_value_heads=2, rope_theta=500.0)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(intermediate_size=48, num_key_value_heads=4, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=40, num_key_value_heads=2, num_local_experts=4,
                     num_experts_per_tok=2)),
}


def _hf_model(kind: str, dtype: torch.dtype = torch.float32):
    config_cls, model_cls, extra = MODELS[kind]
    config = getattr(transformers, config_cls)(**SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.to(dtype)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """kind -> (directory, tokens, reference logits)."""
    root = tmp_path_factory.mktemp("hf")
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    out = {}
    for kind in MODELS:
        model = _hf_model(kind)
        model.save_pretrained(root / kind)
        with torch.no_grad():
            out[kind] = (root / kind, tokens, model(tokens).logits)
    return out


def _hf_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(tokens).logits


def _tensors(path) -> dict[str, torch.Tensor]:
    with TensorReader(path) as reader:
        return {name: reader.get(name) for name in reader.keys()}


@pytest.mark.parametrize("kind", list(MODELS))
def test_load_hf_matches_transformers_logits(hf_dirs, kind):
    path, tokens, reference = hf_dirs[kind]
    model = load_hf(path)
    assert model.config.tie_embeddings == (kind == "llama-tied")
    assert model.config.moe_experts == (4 if kind == "mixtral" else 0)
    with torch.no_grad():
        logits = model(tokens)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(MODELS))
def test_cli_round_trip_is_exact(hf_dirs, tmp_path, kind):
    path, tokens, reference = hf_dirs[kind]
    mesh_dir, back = tmp_path / "mesh", tmp_path / "back"
    assert main(["convert", "--from-hf", str(path), "--out", str(mesh_dir)]) == 0
    saved = json.loads((mesh_dir / "config.json").read_text())
    assert saved["data"]["tokenizer"] == "bytes"
    assert saved["model"]["vocab_size"] == VOCAB
    assert main(["convert", "--to-hf", str(mesh_dir), "--out", str(back)]) == 0
    original, restored = _tensors(path), _tensors(back)
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype, name
        assert torch.equal(restored[name], tensor), name
    torch.testing.assert_close(_hf_logits(back, tokens), reference, atol=0, rtol=0)


def test_round_trip_keeps_bf16_tokenizer_and_run_dir_is_accepted(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    model = _hf_model("llama-gqa", torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"</s>": VOCAB - 1}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")).save(
        str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    run_dir = tmp_path / "run"
    convert_from_hf(tmp_path / "hf", run_dir / "final")
    saved = json.loads((run_dir / "final" / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps(saved))  # a run dir's own (weightless) copy
    assert saved["data"]["tokenizer"] == str((tmp_path / "hf" / "tokenizer.json").resolve())
    with safe_open(str(run_dir / "final" / "model.safetensors"), "pt") as f:
        assert f.get_slice("tok_embeddings.weight").get_dtype() == "F32"
    assert main(["convert", "--to-hf", str(run_dir), "--out", str(tmp_path / "back")]) == 0
    original, restored = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert all(torch.equal(restored[n], t) and restored[n].dtype == torch.bfloat16
               for n, t in original.items())
    for name in ("tokenizer.json", "chat_template.jinja"):  # the chat template travels too
        assert (tmp_path / "back" / name).read_text() == (tmp_path / "hf" / name).read_text()


def test_converted_dir_is_a_meshtrain_weights_dir(hf_dirs, tmp_path):
    from meshtrain.commands.generate import load_for_generation

    path, tokens, reference = hf_dirs["mixtral"]
    convert_from_hf(path, tmp_path / "mesh")
    model, _, config = load_for_generation(tmp_path / "mesh")
    assert config.model == weights_config(path) == weights_config(tmp_path / "mesh")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference, atol=1e-5, rtol=1e-5)
    from_hf = dict(iter_weights(path))
    from_mesh = dict(iter_weights(tmp_path / "mesh"))
    assert from_hf.keys() == from_mesh.keys() == model.state_dict().keys()
    assert all(torch.equal(from_hf[name], from_mesh[name]) for name in from_hf)


def test_fused_mixtral_checkpoint_loads(hf_dirs, tmp_path):
    """transformers 5.x's in-memory layout (gate_up_proj / down_proj) saved as-is."""
    path, tokens, reference = hf_dirs["mixtral"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with torch.no_grad():
        logits = load_hf(tmp_path)(tokens)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("moe", [False, True])
def test_save_hf_of_a_meshtrain_model_sharded(tmp_path, moe):
    extra = dict(moe_experts=4, moe_top_k=2, moe_ffn_dim=24) if moe else {}
    config = ModelConfig(vocab_size=80, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         ffn_dim=48, rope_theta=1e4, **extra)
    model = build_model(config, seed=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 80, (2, 9), generator=torch.Generator().manual_seed(2))
    save_hf(model, tmp_path / "hf", max_shard_bytes=16_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        expected = model(tokens)
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", tokens), expected,
                               atol=1e-5, rtol=1e-5)
    reloaded = load_hf(tmp_path / "hf")  # from the shards
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 reloaded.state_dict().values(), strict=True))


def test_save_hf_refuses_a_selection_bias(tmp_path):
    config = ModelConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, ffn_dim=16,
                         moe_experts=2, moe_top_k=2, moe_balance="bias")
    model = build_model(config)
    moe_layers(model)[0].expert_bias += 0.5
    with pytest.raises(ConfigError, match="expert_bias"):
        save_hf(model, tmp_path / "out")
    assert not any((tmp_path / "out").glob("*.safetensors*"))


LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, vocab_size=VOCAB)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "low_freq_factor"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type = 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0, "extra": 1}}, "rope_scaling.extra"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 7}, "head_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16},
     "use_sliding_window = true with sliding_window = 16"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]},
     "sliding_attention"),
    ({"model_type": "mistral"}, "not supported"),
    ({"model_type": "mixtral", "sliding_window": 4096}, "sliding_window"),
    ({"model_type": "mixtral", "num_experts_per_tok": 1}, "num_experts_per_tok"),
])
def test_unsupported_hf_configs_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        hf_to_model_config({**LLAMA, **change})


def test_mixtral_config_mapping_round_trips():
    from meshtrain.checkpoint.hf.config import model_config_to_hf

    hf = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
          "router_aux_loss_coef": 0.02, "rope_theta": 1e6, "num_key_value_heads": 2}
    config = hf_to_model_config(hf)
    assert (config.moe_experts, config.moe_top_k, config.moe_every) == (8, 2, 1)
    assert (config.moe_score, config.moe_capacity_factor, config.moe_balance) == \
        ("softmax", 0.0, "aux-loss")
    assert config.moe_aux_coef == pytest.approx(0.02 * 2 / 2)
    back = model_config_to_hf(config)
    assert back["router_aux_loss_coef"] == 0.02 and back["rope_parameters"]["rope_theta"] == 1e6
    assert hf_to_model_config(back) == config


@pytest.mark.parametrize("change", [dict(mlp="gelu"), dict(moe_shared_experts=1),
                                    dict(moe_score="sigmoid"), dict(moe_every=2),
                                    dict(moe_top_k=1), dict(moe_first_dense=1),
                                    dict(moe_groups=2, moe_max_groups=1)])
def test_unexportable_models_are_refused(change):
    base = dict(vocab_size=64, dim=32, n_heads=4, moe_experts=4, moe_top_k=2)
    with pytest.raises(ConfigError, match="cannot export"):
        check_exportable(ModelConfig(**{**base, **change}))


def test_convert_bad_input_exits_2(tmp_path, capsys):
    assert main(["convert", "--from-hf", str(tmp_path / "missing"), "--out",
                 str(tmp_path / "o")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["convert", "--to-hf", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    (scaled / "config.json").write_text(json.dumps(
        {**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}))
    assert main(["convert", "--from-hf", str(scaled), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "dynamic" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_sharded_writer_accepts_any_order_and_aborts_cleanly(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
               "b": torch.randn(5), "c": torch.tensor(7, dtype=torch.int64)}
    plan = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    writer = ShardedWriter(tmp_path / "w", plan, max_shard_bytes=16)
    for name in ("c", "a", "b"):
        writer.write(name, tensors[name])
    writer.close()
    assert (tmp_path / "w" / "model.safetensors.index.json").is_file()
    read = _tensors(tmp_path / "w")
    assert all(torch.equal(read[n], t) and read[n].dtype == t.dtype for n, t in tensors.items())
    writer = ShardedWriter(tmp_path / "x", plan)
    writer.write("a", tensors["a"])
    with pytest.raises(ValueError, match="never written"):
        writer.close()
    assert list((tmp_path / "x").iterdir()) == []
