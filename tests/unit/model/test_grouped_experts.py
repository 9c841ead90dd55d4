"""Grouped expert GEMMs: the same numbers as one matmul per expert, deferrable weight gradients,
and no read of the routing counts to the host where the grouped kernel runs."""

from __future__ import annotations

import pytest
import torch

import meshtrain.model.grouped_gemm as grouped_gemm
from meshtrain.model.grouped_gemm import ExpertGroups, grouped_mm_available
from meshtrain.model.weight_grad import WeightGradQueue, deferring, grouped_expert_matmul
from meshtrain.parallel.comm import CommLog, CountedComm
from meshtrain.parallel.expert.apply import ExpertParallelExperts
from tests.unit.model.test_moe_routing import _moe, _tokens

COUNTS = [3, 0, 6, 1]  # an expert without rows among them


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS), 16, generator=g, requires_grad=True)
    w = torch.randn(len(COUNTS), 16, 8, generator=g, requires_grad=True)
    return x, w, torch.randn(sum(COUNTS), 8, generator=g)


def _per_expert_reference(x, w, go):
    """One plain matmul per expert, through autograd."""
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = torch.cat([part @ wr[e] for e, part in enumerate(torch.split(xr, COUNTS))])
    out.backward(go)
    return out.detach(), xr.grad, wr.grad


@pytest.mark.parametrize("force_per_expert", [False, True])
def test_grouped_matmul_equals_one_matmul_per_expert(monkeypatch, force_per_expert):
    monkeypatch.setattr(grouped_gemm, "FORCE_PER_EXPERT", force_per_expert)
    x, w, go = _operands()
    out = grouped_expert_matmul(x, w, ExpertGroups(torch.tensor(COUNTS)))
    out.backward(go)
    ref_out, ref_gx, ref_gw = _per_expert_reference(x, w, go)
    # Each expert's product is the same matmul over the same rows: equal to fp32 rounding.
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_gx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_gw, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(w.grad[1]) == 0  # the empty expert: a zero gradient


def test_grouped_weight_gradient_is_deferred_to_the_w_pass():
    x, w, go = _operands(1)
    queue = WeightGradQueue()
    with deferring(queue):
        grouped_expert_matmul(x, w, ExpertGroups(torch.tensor(COUNTS))).backward(go)
    assert w.grad is None and x.grad is not None and len(queue.entries) == 1
    queue.run()
    _, _, ref_gw = _per_expert_reference(x, w, go)
    torch.testing.assert_close(w.grad, ref_gw, rtol=1e-6, atol=1e-6)


def test_cpu_build_has_the_grouped_kernel():
    # The CPU torch this project pins runs torch._grouped_mm in fp32 (forward and backward);
    # if a build loses it, the per-expert path takes over (tested above) and this says so.
    assert grouped_mm_available("cpu", torch.float32)


class _HostReads:
    """Counts ``Tensor.tolist`` / ``Tensor.item`` calls: reads of device values to the host."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in ("tolist", "item"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name):
                self.calls.append(_name)
                return _original(tensor, *args)
            monkeypatch.setattr(torch.Tensor, name, counted)


def test_moe_layer_reads_nothing_to_the_host_with_the_grouped_kernel(monkeypatch):
    moe = _moe()
    x = _tokens(16).view(2, 8, -1).requires_grad_()
    reads = _HostReads(monkeypatch)
    moe(x).sum().backward()
    assert reads.calls == []


def test_per_expert_path_reads_the_counts_once_per_layer(monkeypatch):
    monkeypatch.setattr(grouped_gemm, "FORCE_PER_EXPERT", True)
    moe = _moe()
    x = _tokens(16).view(2, 8, -1).requires_grad_()
    reads = _HostReads(monkeypatch)
    moe(x).sum().backward()  # forward and backward: three products each, one read
    assert reads.calls == ["tolist"]


def test_expert_parallel_dispatch_reads_the_splits_once(monkeypatch):
    moe = _moe()
    local = ExpertParallelExperts(moe.experts, CountedComm("ep", None, 1, CommLog()), 0, 1)
    x = _tokens(10).requires_grad_()
    reads = _HostReads(monkeypatch)
    local(x, torch.tensor([3, 0, 5, 2])).sum().backward()
    assert reads.calls == ["tolist"]
