"""Single-process trainer: loss normalisation, micro-batching, checkpointing modes, precision."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain.model import moe_layers
from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.training.trainer import Trainer
from tests.helpers import tiny_config

# fp32 on CPU: summing the same per-token terms in a different grouping (1 vs 4 micro-batches)
# changes results only by float rounding, ~1e-7 relative; 1e-5 leaves room and still catches
# any normalisation error (which would be a factor of 4).
TOL = 1e-5


def _grads_after_one_step(*overrides: str) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    trainer = Trainer(tiny_config(*overrides), ParallelMesh())
    result = trainer.compute_gradients(trainer.data.next_step())
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return float(result["lm"]), grads


def _assert_same(a, b, tol=TOL):
    loss_a, grads_a = a
    loss_b, grads_b = b
    assert loss_a == pytest.approx(loss_b, abs=tol)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], atol=tol, rtol=tol, msg=name)


def test_microbatching_gives_same_loss_and_gradients():
    one = _grads_after_one_step("parallel.microbatches=1")
    four = _grads_after_one_step("parallel.microbatches=4")
    _assert_same(one, four)


def test_loss_is_global_token_mean():
    trainer = Trainer(tiny_config("parallel.microbatches=2"), ParallelMesh())
    microbatches = trainer.data.next_step()
    result = trainer.compute_gradients(microbatches)
    inputs = torch.cat([x for x, _ in microbatches])
    targets = torch.cat([y for _, y in microbatches])
    with torch.no_grad():
        logits = trainer.model(inputs)
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert float(result["lm"]) == pytest.approx(float(expected), abs=TOL)
    assert result["global_tokens"] == targets.numel()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_nothing(mode):
    _assert_same(_grads_after_one_step(), _grads_after_one_step(
        f"parallel.activation_checkpointing={mode}"))


def test_moe_model_trains_and_reports(tmp_path):
    config = tiny_config("model.moe_experts=4", "model.moe_top_k=2", "model.moe_balance=bias",
                         "train.steps=3", run_dir=str(tmp_path))
    trainer = Trainer(config, ParallelMesh())
    history = trainer.fit()
    assert all("moe" in r for r in history)
    biases = [layer.expert_bias for layer in moe_layers(trainer.model)]
    assert any(float(b.abs().sum()) > 0 for b in biases)  # bias balancing moved


def test_bf16_trains_stably(tmp_path):
    config = tiny_config("train.precision=bf16", "train.steps=12", run_dir=str(tmp_path))
    trainer = Trainer(config, ParallelMesh())
    assert trainer.model.tok_embeddings.weight.dtype == torch.bfloat16
    history = trainer.fit()
    losses = [r["loss"] for r in history]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    # fp32 master + two fp32 moments per parameter, bf16 parameters
    n = sum(p.numel() for p in trainer.model.parameters())
    assert history[-1]["mem"]["optim_bytes"] == 12 * n
    assert history[-1]["mem"]["param_bytes"] == 2 * n


def test_fit_writes_metrics_and_final_weights(tmp_path):
    config = tiny_config("train.steps=3", run_dir=str(tmp_path))
    Trainer(config, ParallelMesh()).fit()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    for record in lines:
        for key in ("step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s",
                    "mfu", "comm_bytes", "mem"):
            assert key in record
        assert record["mfu"] is None  # CPU peak unknown: never guessed
        assert record["tokens"] == record["tokens_processed"] == 8 * 16  # text: every target
        assert set(record["mem"]) == {"param_bytes", "grad_bytes", "optim_bytes", "peak_bytes"}
        assert record["mem"]["param_bytes"] > 0 and record["mem"]["peak_bytes"] > 0
    assert (tmp_path / "final" / "model.safetensors.index.json").is_file()


def test_grad_clip_bounds_update():
    trainer = Trainer(tiny_config("train.grad_clip=1e-3"), ParallelMesh())
    trainer.compute_gradients(trainer.data.next_step())
    norm = trainer.optimizer.clip_grad_norm(1e-3)
    after = trainer.optimizer.clip_grad_norm(0)
    grads = [p.grad for p in trainer.model.parameters()]
    direct = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(norm) > 1e-3
    assert float(after) == pytest.approx(1e-3, rel=1e-3)
    assert float(direct) == pytest.approx(float(after), rel=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_flat_adamw_matches_torch_adamw(precision, fused):
    """The flat-shard AdamW, by the fused kernel or the eager formula, takes the same step as
    torch.optim.AdamW on separate tensors."""
    config = tiny_config(f"train.precision={precision}", "train.weight_decay=0.1")
    trainer = Trainer(config, ParallelMesh())
    if fused and not trainer.optimizer.fused:
        pytest.skip("this torch has no fused AdamW kernel")
    trainer.optimizer.fused = fused
    named = list(trainer.model.named_parameters())
    reference = [p.detach().float().clone().requires_grad_(True) for _, p in named]
    groups = [{"params": [r for r, (_, p) in zip(reference, named, strict=True) if p.ndim >= 2],
               "weight_decay": 0.1},
              {"params": [r for r, (_, p) in zip(reference, named, strict=True) if p.ndim < 2],
               "weight_decay": 0.0}]
    torch_adamw = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        trainer.compute_gradients(trainer.data.next_step())
        for r, (_, p) in zip(reference, named, strict=True):
            r.grad = trainer.engine.gradient_of(p).float().clone()
        trainer.optimizer.step(1e-2)
        torch_adamw.step()
        trainer.optimizer.zero_grad()
    tol = 1e-6 if precision == "fp32" else 1e-2
    for r, (name, p) in zip(reference, named, strict=True):
        torch.testing.assert_close(p.float(), r.detach(), atol=tol, rtol=tol, msg=name)
