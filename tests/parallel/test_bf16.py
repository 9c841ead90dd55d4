"""bf16 as a GPU user runs it, against the fp32 one-process reference.

Every layout runs in bf16 (bf16 parameters and activations, fp32 master weights, gradients
accumulated over micro-batches and reduced in fp32) and is compared with the *fp32* one-process
run by :func:`meshtrain.commands.verify.compare` at the bf16 tolerances of
:mod:`meshtrain.commands.verify`
(5e-2 on the loss, 5e-2 relative on the gradient norm): bf16 rounding alone moves these tiny
models' losses by up to ~1.5e-2 and their gradient norms by ~3 % in five steps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtrain.commands.verify import (
    GRAD_NORM_RTOL_BF16,
    LOSS_TOLERANCE_BF16,
    compare,
    reference_config,
    run_layout,
)
from tests.distributed import run_distributed
from tests.helpers import tiny_config, train_many

STEPS = 5
BF16 = ("train.precision=bf16",)
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_dim=32")
PIPE = ("parallel.pp=2", "parallel.microbatches=4", "model.n_layers=4")
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]

LAYOUTS = {
    "dp": [tiny_config(*BF16, f"parallel.zero={z}", "parallel.microbatches=2", nproc=2)
           for z in range(4)]
    + [tiny_config(*BF16, "parallel.zero=1", "parallel.grad_reduce_dtype=bf16", nproc=2)],
    "tp-sp": [tiny_config(*BF16, "parallel.tp=2", "parallel.sequence_parallel=true", nproc=2)],
    "pp": [tiny_config(*BF16, *PIPE, f"parallel.pp_schedule={name}",
                       f"parallel.virtual_stages={v}", nproc=2) for name, v in SCHEDULES],
    "ep": [tiny_config(*BF16, *MOE, "parallel.ep=2", nproc=2)],
}


@pytest.mark.parametrize("axis", list(LAYOUTS))
def test_bf16_layouts_match_the_fp32_one_process_reference(axis):
    cases = LAYOUTS[axis]
    results = run_distributed(2, train_many, [c.to_dict() for c in cases], STEPS,
                              timeout=900)[0]
    for config, records in zip(cases, results, strict=True):
        reference = run_layout(reference_config(config), 1, STEPS)
        report = compare(records, reference, LOSS_TOLERANCE_BF16, GRAD_NORM_RTOL_BF16)
        assert report["ok"], (config.parallel, report)


def _engine_dtypes(*overrides: str) -> tuple[set, set, dict]:
    from meshtrain.parallel import data_parallel_engine
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.trainer import Trainer

    trainer = Trainer(tiny_config(*overrides, "parallel.microbatches=2"), ParallelMesh())
    trainer.train_step()
    engine = data_parallel_engine(trainer.model)
    params = {p.dtype for p in trainer.model.parameters()}
    grads = {(b.grad_buffer if engine.stage < 2 else b.grad_shard).dtype for b in engine.buckets}
    return params, grads, trainer._memory()


def test_bf16_gradient_buffers_are_fp32_unless_asked_for_bf16():
    params, grads, mem = _engine_dtypes(*BF16)
    assert torch.bfloat16 in params and grads == {torch.float32}
    # fp32 gradients cost 4 bytes per parameter (what the planner prices)
    p_bytes = mem["param_bytes"]
    assert mem["grad_bytes"] == 2 * p_bytes
    params, grads, mem = _engine_dtypes(*BF16, "parallel.grad_reduce_dtype=bf16")
    assert grads == {torch.bfloat16} and mem["grad_bytes"] == mem["param_bytes"]


def test_bf16_accumulates_micro_batches_in_fp32():
    """Eight micro-batches' gradients summed into the fp32 buffer equal their fp32 sum of the
    bf16 per-micro-batch gradients; a bf16 buffer rounds after every addition."""
    from meshtrain.parallel import data_parallel_engine
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.trainer import Trainer

    def buffer_after_backward(*overrides):
        trainer = Trainer(tiny_config(*BF16, "parallel.microbatches=8", *overrides),
                          ParallelMesh())
        trainer.compute_gradients(trainer.data.next_step())
        engine = data_parallel_engine(trainer.model)
        return torch.cat([b.grad_buffer.float() for b in engine.buckets])

    fp32 = buffer_after_backward()
    bf16 = buffer_after_backward("parallel.grad_reduce_dtype=bf16")
    assert fp32.dtype == torch.float32
    # the two differ by bf16 accumulation rounding: visible, and far below the gradients
    diff = (fp32 - bf16).abs().max()
    assert 0 < diff < 0.05 * fp32.abs().max()


def test_grad_reduce_dtype_bf16_needs_bf16_precision():
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match="needs train.precision = bf16"):
        tiny_config("parallel.grad_reduce_dtype=bf16")
    with pytest.raises(ConfigError, match="grad_reduce_dtype"):
        tiny_config(*BF16, "parallel.grad_reduce_dtype=fp16")


def test_planner_prices_fp32_gradients_of_bf16_runs():
    from meshtrain.planner.cost.memory import rank_memory
    from meshtrain.planner.cost.workload import Workload

    config = tiny_config(*BF16)
    default = Workload.from_config(config)
    halved = Workload.from_config(dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, grad_reduce_dtype="bf16")))
    layout = config.parallel.layout()
    layers = list(range(config.model.n_layers))
    a = rank_memory(default, layout, 0, layers, 1.0)
    b = rank_memory(halved, layout, 0, layers, 1.0)
    assert a.grad_bytes == pytest.approx(2 * b.grad_bytes) and a.grad_bytes == pytest.approx(
        2 * a.param_bytes)
