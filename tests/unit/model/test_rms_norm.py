"""The hand-written CPU RMSNorm backward against ``F.rms_norm`` through autograd."""

import pytest
import torch
import torch.nn.functional as F

from meshtrain.model.rms_norm import RMSNormFunction


@pytest.mark.parametrize("shape", [(7, 64), (2, 33, 256), (2, 16, 4, 32)])
def test_output_and_both_gradients_match_f_rms_norm(shape):
    # fp32; the row sums run in another order (vecdot), and dw sums up to 128 rows:
    # 1e-5 relative is a few ulps over those sums.
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).requires_grad_()
    grad = torch.randn(shape, generator=gen)
    ours = RMSNormFunction.apply(x, w, 1e-5)
    dx, dw = torch.autograd.grad(ours, (x, w), grad)
    ref = F.rms_norm(x, (shape[-1],), w, 1e-5)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), grad)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does():
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.ones(16)
    RMSNormFunction.apply(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is None
    ref = torch.autograd.grad(F.rms_norm(x, (16,), w, 1e-6).sum(), x)[0]
    torch.testing.assert_close(x.grad, ref, rtol=1e-5, atol=1e-6)


def test_the_input_is_not_modified():
    x = torch.randn(3, 8, requires_grad=True)
    before = x.detach().clone()
    w = torch.randn(8, requires_grad=True)
    RMSNormFunction.apply(x, w, 1e-5).pow(2).sum().backward()
    assert torch.equal(x.detach(), before)
