"""Llama 3.1, Qwen2.5 and Qwen3 checkpoints: in, trained at tp2 x pp2, and out again; the MoE
families Qwen3-MoE and Qwen2-MoE in and out (their training: ``test_hf_moe_families``).

For each family a tiny random ``transformers`` model (:mod:`tests.hf_families`) goes through
``meshtrain convert --from-hf``; then

- meshtrain's logits equal ``transformers``' own to 1e-5 relative (fp32) over twice the
  original context, where RoPE scaling changes the answer (a control without the scaling differs
  by far more there). The same computation in another order of fp32 operations (fused attention,
  grouped expert GEMMs against per-expert loops) differs by ~1e-6; the MoE families' routing
  picks the same experts, since no token's k-th and (k+1)-th probabilities are within rounding of
  each other for these random weights, and a flipped choice would move a logit by far more;
- ``convert --to-hf`` gives back every tensor bit for bit, and the same config;
- training from the converted weights at tp2 x pp2 (Qwen2.5 also with sequence parallelism)
  gives the one-process losses and gradient norms within meshtrain.commands.verify's fp32 tolerances
  (2e-4 on the loss, 1e-3 relative on the norm: tensor parallelism sums the matmuls' partial
  products in another order, so the results differ by fp32 rounding, not more);
- under tp2 each rank holds exactly its columns' slice of every bias, and the QK-norm weight
  whole, recorded as a partial gradient summed over tp;
- sliding-window attention is still refused, exit status 2, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from meshtrain.checkpoint import iter_weights, weights_config  # noqa: E402
from meshtrain.checkpoint.hf.config import hf_to_model_config  # noqa: E402
from meshtrain.checkpoint.safetensors_io import TensorReader  # noqa: E402
from meshtrain.cli import main  # noqa: E402
from meshtrain.commands.verify import (  # noqa: E402
    GRAD_NORM_RTOL_FP32,
    LOSS_TOLERANCE_FP32,
    compare,
    reference_config,
)
from meshtrain.config import CheckpointConfig, Config, config_from_dict, load_config  # noqa: E402
from meshtrain.model import build_model  # noqa: E402
from meshtrain.validation.run_config import validate_config  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.hf_families import (  # noqa: E402
    CONTEXT,
    FAMILIES,
    TRAINED,
    VOCAB,
    hf_logits,
    make_hf_model,
)

TOKENS = torch.randint(0, VOCAB, (2, 2 * CONTEXT), generator=torch.Generator().manual_seed(3))
LOGITS_RTOL = 1e-5
STEPS = 3
OPTIONS = {"llama3.1": ("llama3", False, False, False), "qwen2.5": ("yarn", True, False, False),
           "qwen3": ("linear", False, False, True), "llama-bias": ("default", True, True, False),
           "qwen3-moe": ("default", False, False, True), "qwen2-moe": ("yarn", True, False, False)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (Hugging Face dir, meshtrain weights dir from ``convert --from-hf``)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        hf_dir = make_hf_model(family, root / f"{family}-hf")
        mesh_dir = root / f"{family}-meshtrain"
        assert main(["convert", "--from-hf", str(hf_dir), "--out", str(mesh_dir)]) == 0
        out[family] = (hf_dir, mesh_dir)
    return out


def _meshtrain_logits(mesh_dir, **change) -> torch.Tensor:
    config = dataclasses.replace(weights_config(mesh_dir), **change)
    model = build_model(config)
    model.load_state_dict(dict(iter_weights(mesh_dir)))
    with torch.no_grad():
        return model(TOKENS)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _tensors(path) -> dict[str, torch.Tensor]:
    with TensorReader(path) as reader:
        return {name: reader.get(name) for name in reader.keys()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_at_twice_the_context(converted, family):
    hf_dir, mesh_dir = converted[family]
    config = weights_config(mesh_dir)
    expected = OPTIONS[family]  # (rope_type, qkv_bias, wo_bias, qk_norm)
    assert (config.rope_type, config.qkv_bias, config.wo_bias, config.qk_norm) == expected
    reference = hf_logits(hf_dir, TOKENS)
    logits = _meshtrain_logits(mesh_dir)
    assert _relative(logits, reference) <= LOGITS_RTOL
    beyond = slice(CONTEXT, None)  # the positions past the original context
    assert _relative(logits[:, beyond], reference[:, beyond]) <= LOGITS_RTOL
    if config.rope_scaling:  # control: plain RoPE is far off there, so the test can fail
        plain = _meshtrain_logits(mesh_dir, rope_scaling={})
        assert _relative(plain[:, beyond], reference[:, beyond]) > 100 * LOGITS_RTOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bit_exact(converted, family, tmp_path):
    hf_dir, mesh_dir = converted[family]
    back = tmp_path / "back"
    assert main(["convert", "--to-hf", str(mesh_dir), "--out", str(back)]) == 0
    original, restored = _tensors(hf_dir), _tensors(back)
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    source = json.loads((hf_dir / "config.json").read_text())
    written = json.loads((back / "config.json").read_text())
    assert written["architectures"] == source["architectures"]
    assert hf_to_model_config(written) == hf_to_model_config(source)
    assert torch.equal(hf_logits(back, TOKENS), hf_logits(hf_dir, TOKENS))


def _train_config(mesh_dir, run_dir, *overrides: str) -> Config:
    config = load_config(mesh_dir / "config.json", [
        f"checkpoint.init_from={mesh_dir}", f"train.run_dir={run_dir}",
        f"train.seq_len={2 * CONTEXT}", "train.global_batch=4", f"train.steps={STEPS}",
        "train.warmup_steps=0", "train.lr=1e-3", "data.max_bytes=100000", *overrides])
    validate_config(config, None)
    return config


def _restored_trainer(config_dict: dict):
    """This rank's trainer for ``config_dict``, started from its ``checkpoint.init_from``
    weights as ``meshtrain train`` starts."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    trainer = Trainer(config, build_mesh(config))
    trainer.restore()
    return trainer


def train_from_weights(config_dicts: list[dict], steps: int) -> list[list[dict]]:
    """Each config's first ``steps`` metric records (logging rank; [] elsewhere), starting from
    its ``checkpoint.init_from`` weights."""
    out = []
    for config_dict in config_dicts:
        trainer = _restored_trainer(config_dict)
        records = [trainer.train_step() for _ in range(steps)]
        out.append(records if trainer.mesh.is_logging_rank else [])
    return out


def test_tp2_pp2_from_converted_checkpoints_trains_like_one_process(converted, tmp_path):
    layout = ("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2")
    cases = [_train_config(converted[family][1], tmp_path / family, *layout,
                           *(("parallel.sequence_parallel=true",) if family == "qwen2.5" else ()))
             for family in TRAINED]
    results = run_distributed(4, train_from_weights, [c.to_dict() for c in cases], STEPS,
                              timeout=900)[0]
    references = train_from_weights([reference_config(c).to_dict() for c in cases], STEPS)
    fresh = train_from_weights([dataclasses.replace(reference_config(cases[0]), checkpoint=
                                                    CheckpointConfig()).to_dict()], 1)[0]
    assert abs(fresh[0]["loss"] - references[0][0]["loss"]) > 0.1  # the weights were loaded
    for family, records, reference in zip(TRAINED, results, references, strict=True):
        report = compare(records, reference, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
        print(f"{family}: max |loss diff| {report['max_abs_loss_diff']:.2e}, max |grad-norm "
              f"diff| {report['max_abs_grad_norm_diff']:.2e}")
        assert report["ok"], (family, report)


def local_attention_tensors(config_dicts: list[dict]) -> list[dict]:
    """Build each config's trainer on this rank; its attention tensors of layer 0, whole
    names -> (local value, sharding record fields)."""
    from meshtrain.parallel import parallel_state

    out = []
    for config_dict in config_dicts:
        trainer = _restored_trainer(config_dict)
        shardings = parallel_state(trainer.model).shardings
        found = {}
        for name, param in trainer.model.named_parameters():
            if name.startswith("layers.0.attention."):
                record = shardings[name]
                found[name] = (param.detach().clone(), record.full_shape, record.offset,
                               record.tp_dim, record.tp_replicated, record.tp_partial_grad)
        out.append({"tp_rank": trainer.mesh.tp_rank, "params": found})
    return out


def test_tp2_shards_biases_with_their_columns_and_replicates_qk_norm(converted, tmp_path):
    cases = [_train_config(converted[family][1], tmp_path / family, "parallel.tp=2")
             for family in ("llama-bias", "qwen3")]
    ranks = run_distributed(2, local_attention_tensors, [c.to_dict() for c in cases])
    for index, family in enumerate(("llama-bias", "qwen3")):
        full = {name: tensor for name, tensor in iter_weights(converted[family][1])
                if name.startswith("layers.0.attention.")}
        for rank in ranks:
            tp_rank, params = rank[index]["tp_rank"], rank[index]["params"]
            assert params.keys() == full.keys()
            for name, (local, full_shape, offset, tp_dim, replicated, partial) in params.items():
                whole = full[name]
                if name.endswith(("wq.bias", "wk.bias", "wv.bias")):  # column-split with wq/wk/wv
                    rows = whole.shape[0] // 2
                    assert (tp_dim, full_shape, offset) == (0, tuple(whole.shape),
                                                            (tp_rank * rows,)), name
                    assert torch.equal(local, whole[tp_rank * rows:(tp_rank + 1) * rows]), name
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    assert replicated and partial and tp_dim is None, name
                    assert torch.equal(local, whole), name
                elif name.endswith("wo.bias"):  # added once after the row-parallel reduction
                    assert replicated and not partial and torch.equal(local, whole), name


def test_sliding_window_is_still_refused_naming_the_field(converted, tmp_path, capsys):
    hf_dir = tmp_path / "windowed"
    shutil.copytree(converted["qwen2.5"][0], hf_dir)
    doc = json.loads((hf_dir / "config.json").read_text())
    doc.update(use_sliding_window=True, sliding_window=32)
    (hf_dir / "config.json").write_text(json.dumps(doc))
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "sliding_window = 32" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
