"""The zero-bubble I/W split in one process: a backward with weight gradients deferred, then
the deferred queue, gives the plain backward's gradients (fp32; 1e-5 relative, since the
weight-grad matmuls sum the same products in a different order)."""

from __future__ import annotations

import torch

from meshtrain.model import build_model
from meshtrain.model.weight_grad import WeightGradQueue, deferring, make_deferrable
from tests.helpers import tiny_config


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(*overrides: str) -> set[str]:
    config = tiny_config("model.vocab_size=264", *overrides)
    model = build_model(config.model)
    make_deferrable(model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, (2, 16), generator=gen)
    model(tokens).float().square().mean().backward()
    plain = _grads(model)
    model.zero_grad(set_to_none=True)
    queue = WeightGradQueue()
    with deferring(queue):
        model(tokens).float().square().mean().backward()
    deferred = {n for n, p in model.named_parameters() if p.grad is None}
    assert any(n.endswith("wq.weight") for n in deferred)  # matmul weights wait for W
    assert queue.entries
    queue.run()
    split = _grads(model)
    assert plain.keys() == split.keys()
    for name, g in plain.items():
        torch.testing.assert_close(split[name], g, rtol=1e-5, atol=1e-6, msg=name)
    return deferred


def test_dense_split_matches_plain_backward():
    _check()


def test_moe_split_matches_plain_backward():
    deferred = _check("model.moe_experts=4", "model.moe_top_k=2")
    assert any("experts.w1" in n for n in deferred)


def test_plain_matmuls_runs_linear_without_the_deferrable_function():
    import torch

    from meshtrain.model.weight_grad import WeightGradQueue, deferring, linear, plain_matmuls

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    assert type(linear(x, w).grad_fn).__name__ == "_LinearBackward"
    with plain_matmuls():
        y = linear(x, w)
        assert type(linear(x, w).grad_fn).__name__ != "_LinearBackward"
    assert type(linear(x, w).grad_fn).__name__ == "_LinearBackward"  # left when the block ends
    queue = WeightGradQueue()
    with deferring(queue):  # a plain forward's weight gradient cannot be deferred: it flows
        y.sum().backward()
    assert not queue.entries and torch.allclose(w.grad, torch.ones(3, 5).t() @ x.detach())


def test_schedules_with_w_passes_make_the_stages_deferrable():
    import torch

    from meshtrain.config import ModelConfig
    from meshtrain.model import build_model
    from meshtrain.model.weight_grad import DeferrableLinear
    from meshtrain.parallel.pipeline import build_schedule
    from meshtrain.parallel.pipeline.stage import split_model
    from meshtrain.parallel.tensor.layers import ColumnParallelLinear

    deferring = {name: build_schedule(name, 2, 4, 2 if name in ("zb-v", "interleaved-1f1b")
                                      else 1).defers_weight_grads
                 for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")}
    # 1F1B splits its cool-down backwards on every rank but the first (early gradient sends)
    assert deferring == {"gpipe": False, "1f1b": True, "interleaved-1f1b": False,
                         "zb-h1": True, "zb-v": True}
    assert not build_schedule("1f1b", 2, 4, early_grad_sends=False).defers_weight_grads
    assert not build_schedule("1f1b", 1, 4).defers_weight_grads
    config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64)
    for defer in (False, True):
        model = build_model(config)
        model.layers["0"].feed_forward.w1 = ColumnParallelLinear(
            model.layers["0"].feed_forward.w1, 0, 2)
        split_model(model, [0, 1], [[0], [1]], defer)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(isinstance(m, DeferrableLinear) == defer for m in linears)
        assert model.layers["0"].feed_forward.w1.defer_weight_grads == defer
