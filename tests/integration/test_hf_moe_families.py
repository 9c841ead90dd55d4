"""Qwen3-MoE and Qwen2-MoE checkpoints: their routing, trained at dp2 x ep2, and exported from the
training checkpoint.

:mod:`tests.integration.test_hf_families` already checks, for these two families as for the
dense ones, that meshtrain's logits equal ``transformers``' to 1e-5 relative (fp32) and that
``convert --to-hf`` gives back every tensor bit for bit. Here:

- the imported configs are the families' MoE (dense first layer, expert and shared-expert
  widths, raw or renormalised gates, the sigmoid shared-expert gate), and the options matter: the
  other ``moe_norm_topk``, or the shared expert without its gate, moves the logits by far more
  than the tolerance;
- training from the converted weights at dp2 x ep2 (ZeRO-1; each rank holds 2 of the 4 experts)
  gives the one-process losses and gradient norms within meshtrain.commands.verify's fp32
  tolerances, the gradient reaches the shared-expert gate, and the training checkpoint converts to
  a Hugging Face model whose ``transformers`` logits equal meshtrain's on the checkpoint's weights
  (1e-5 relative: the same computation in another order of fp32 operations), every expert in its
  place;
- under tp2 with sequence parallelism and ep2 (4 ranks) Qwen2-MoE trains like one process too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from meshtrain.checkpoint import iter_weights, read_checkpoint_tensors, weights_config  # noqa: E402
from meshtrain.cli import main  # noqa: E402
from meshtrain.commands.verify import (  # noqa: E402
    GRAD_NORM_RTOL_FP32,
    LOSS_TOLERANCE_FP32,
    compare,
    reference_config,
)
from meshtrain.model import build_model  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.hf_families import CONTEXT, MOE_FAMILIES, VOCAB, hf_logits, make_hf_model  # noqa: E402
from tests.integration.test_hf_families import (  # noqa: E402
    _restored_trainer,
    _train_config,
    train_from_weights,
)

TOKENS = torch.randint(0, VOCAB, (2, 2 * CONTEXT), generator=torch.Generator().manual_seed(5))
LOGITS_RTOL = 1e-5
STEPS = 2
GATE = "layers.1.moe.shared_gate.weight"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (Hugging Face dir, meshtrain weights dir from ``convert --from-hf``)."""
    root = tmp_path_factory.mktemp("moe-families")
    out = {}
    for family in MOE_FAMILIES:
        hf_dir = make_hf_model(family, root / f"{family}-hf")
        mesh_dir = root / f"{family}-meshtrain"
        assert main(["convert", "--from-hf", str(hf_dir), "--out", str(mesh_dir)]) == 0
        out[family] = (hf_dir, mesh_dir)
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _logits(config, state) -> torch.Tensor:
    model = build_model(config)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(TOKENS)


def test_imported_configs_are_the_families_moe(converted):
    qwen3 = weights_config(converted["qwen3-moe"][1])
    assert (qwen3.moe_experts, qwen3.moe_top_k, qwen3.moe_norm_topk) == (4, 2, True)
    assert (qwen3.moe_every, qwen3.moe_first_dense, qwen3.ffn_dim, qwen3.moe_ffn_dim) == (
        1, 1, 96, 48)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.moe_shared_experts) == (True, 32, 0)
    qwen2 = weights_config(converted["qwen2-moe"][1])
    assert (qwen2.moe_experts, qwen2.moe_top_k, qwen2.moe_norm_topk) == (4, 2, False)
    assert (qwen2.moe_shared_experts, qwen2.shared_ffn_dim, qwen2.moe_shared_gate) == (1, 80, True)
    assert (qwen2.qkv_bias, qwen2.wo_bias, qwen2.moe_first_dense) == (True, False, 0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_options_decide_the_logits(converted, family):
    hf_dir, mesh_dir = converted[family]
    config, state = weights_config(mesh_dir), dict(iter_weights(mesh_dir))
    reference = hf_logits(hf_dir, TOKENS)
    assert _relative(_logits(config, state), reference) <= LOGITS_RTOL
    flipped = dataclasses.replace(config, moe_norm_topk=not config.moe_norm_topk)
    assert _relative(_logits(flipped, state), reference) > 100 * LOGITS_RTOL
    if config.moe_shared_gate:  # the same shared expert, ungated
        ungated = dataclasses.replace(config, moe_shared_gate=False)
        state = {name: tensor for name, tensor in state.items() if "shared_gate" not in name}
        assert _relative(_logits(ungated, state), reference) > 100 * LOGITS_RTOL


def train_and_checkpoint(config_dicts: list[dict], steps: int) -> list[list[dict]]:
    """Train each config ``steps`` steps from its init_from weights, then save a checkpoint."""
    out = []
    for config_dict in config_dicts:
        trainer = _restored_trainer(config_dict)
        records = [trainer.train_step() for _ in range(steps)]
        trainer.save_checkpoint()
        out.append(records if trainer.mesh.is_logging_rank else [])
    return out


def _expert_weights(state: dict, prefix: str, experts: int) -> dict[str, torch.Tensor]:
    """HF per-expert names of layer 1 -> the tensors meshtrain's stacked experts hold."""
    leaves = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    return {f"model.layers.1.mlp.experts.{j}.{hf}.weight": state[f"{prefix}.{ours}"][j].t()
            for ours, hf in leaves.items() for j in range(experts)}


def test_dp2_ep2_trains_like_one_process_and_its_checkpoint_exports(converted, tmp_path):
    from meshtrain.checkpoint.safetensors_io import TensorReader

    layout = ("parallel.dp=2", "parallel.ep=2", "parallel.zero=1")
    cases = [_train_config(converted[family][1], tmp_path / family, *layout)
             for family in MOE_FAMILIES]
    results = run_distributed(2, train_and_checkpoint, [c.to_dict() for c in cases], STEPS,
                              timeout=900)[0]
    references = train_from_weights([reference_config(c).to_dict() for c in cases], STEPS)
    for family, records, reference in zip(MOE_FAMILIES, results, references, strict=True):
        report = compare(records, reference, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
        assert report["ok"], (family, report)

    for family in MOE_FAMILIES:
        ckpt, out = tmp_path / family / "checkpoints", tmp_path / f"{family}-exported"
        saved, tensors = read_checkpoint_tensors(ckpt)
        assert saved.parallel.ep == 2
        state = dict(tensors)
        assert main(["convert", "--to-hf", str(ckpt), "--out", str(out)]) == 0
        logits = _logits(saved.model, state)
        assert _relative(hf_logits(out, TOKENS), logits) <= LOGITS_RTOL, family
        with TensorReader(out) as reader:
            for name, tensor in _expert_weights(state, "layers.1.moe.experts", 4).items():
                assert torch.equal(reader.get(name), tensor), (family, name)
            if family == "qwen2-moe":
                gate = reader.get("model.layers.1.mlp.shared_expert_gate.weight")
                assert torch.equal(gate, state[GATE])
                initial = dict(iter_weights(converted[family][1]))[GATE]
                assert not torch.equal(gate, initial)  # trained: its gradient arrived


def test_tp2_sp_ep2_qwen2_moe_trains_like_one_process(converted, tmp_path):
    config = _train_config(converted["qwen2-moe"][1], tmp_path / "run", "parallel.tp=2",
                           "parallel.sequence_parallel=true", "parallel.dp=2",
                           "parallel.ep=2")
    records = run_distributed(4, train_from_weights, [config.to_dict()], STEPS,
                              timeout=900)[0][0]
    reference = train_from_weights([reference_config(config).to_dict()], STEPS)[0]
    report = compare(records, reference, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
    assert report["ok"], report
