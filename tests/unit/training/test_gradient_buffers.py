"""The data-parallel engine's flat gradient buffers across steps (one process, ZeRO 0 and 1).

``zero_grad`` does not clear the buffers: each step's first gradient of a parameter is copied
over its slice, and a parameter that gets no gradient is zeroed before its bucket's reduction.
A pipelined step instead zeroes and binds every slice first and runs without hooks. These tests
check the gradients against plain autograd on a copy of the model, after an earlier step left
other values in the buffers.
"""

from __future__ import annotations

import copy

import pytest
import torch

from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.training.trainer import Trainer
from tests.helpers import tiny_config


def _reference_gradients(trainer: Trainer, microbatches) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the step's loss by plain autograd on a copy of the model."""
    model = copy.deepcopy(trainer.model)
    model.zero_grad(set_to_none=True)
    tokens = sum(int(targets.numel()) for _, targets in microbatches)
    for inputs, targets in microbatches:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 reduction="sum") / tokens
        loss.backward()
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p))
            for name, p in model.named_parameters()}


def _skip_layer(trainer: Trainer, key: str) -> None:
    """Make block ``key`` an identity on this instance: its parameters get no gradient."""
    trainer.model.layers[key].forward = lambda x, layout=None: x


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("zero", [0, 1])
def test_stale_buffer_values_never_reach_a_gradient(zero, microbatches):
    trainer = Trainer(tiny_config(f"parallel.zero={zero}",
                                  f"parallel.microbatches={microbatches}"), ParallelMesh())
    trainer.compute_gradients(trainer.data.next_step())  # fills every slice
    trainer.optimizer.step(1e-2)
    trainer.optimizer.zero_grad()
    assert all(p.grad is None for p in trainer.model.parameters())

    _skip_layer(trainer, "1")  # its slices keep the first step's values unless zeroed
    batch = trainer.data.next_step()
    expected = _reference_gradients(trainer, batch)
    trainer.compute_gradients(batch)
    for name, param in trainer.model.named_parameters():
        got = trainer.engine.gradient_of(param)
        torch.testing.assert_close(got, expected[name], rtol=1e-5, atol=1e-7, msg=name)
        assert param.grad.data_ptr() == got.data_ptr(), name  # bound to the buffer again
        if name.startswith("layers.1."):
            assert not got.any(), name


@pytest.mark.parametrize("zero", [0, 1])
def test_pipelined_steps_accumulate_in_bound_buffers_without_hooks(zero):
    """A pipeline's step (``begin_accumulation`` ... ``sync_all``) binds every ``.grad`` to its
    zeroed slice and removes the per-parameter hooks: micro-batches and deferred weight
    gradients (``W``) add in place. The result must still be plain autograd's, after an earlier
    step left other values in the buffers; a later step that is not pipelined gets its hooks
    back."""
    from meshtrain.model.weight_grad import WeightGradQueue, deferring, make_deferrable

    trainer = Trainer(tiny_config(f"parallel.zero={zero}", "parallel.microbatches=2"),
                      ParallelMesh())
    engine = trainer.engine
    trainer.compute_gradients(trainer.data.next_step())  # fills every slice
    trainer.optimizer.zero_grad()
    _skip_layer(trainer, "1")
    batch = trainer.data.next_step()
    expected = _reference_gradients(trainer, batch)
    make_deferrable(trainer.model)
    tokens = sum(int(targets.numel()) for _, targets in batch)

    engine.begin_accumulation()
    assert engine._grad_hooks is None
    for index, (inputs, targets) in enumerate(batch):
        loss = torch.nn.functional.cross_entropy(
            trainer.model(inputs).flatten(0, 1), targets.flatten(), reduction="sum") / tokens
        if index == 0:  # as a zero-bubble I pass, its linear weights' gradients deferred to W
            queue = WeightGradQueue()
            with deferring(queue):
                loss.backward()
            queue.run()
        else:
            loss.backward()
    engine.sync_all()
    for name, param in trainer.model.named_parameters():
        got = engine.gradient_of(param)
        torch.testing.assert_close(got, expected[name], rtol=1e-5, atol=1e-7, msg=name)
        assert param.grad.data_ptr() == got.data_ptr(), name
        if name.startswith("layers.1."):
            assert not got.any(), name
    engine.start_microbatch(is_last=True)
    assert engine._grad_hooks is not None and len(engine._grad_hooks) == len(
        list(trainer.model.parameters()))
