"""The chunked token cross-entropy against ``F.cross_entropy`` on fp32 logits
(:mod:`meshtrain.training.cross_entropy`). With 37 rows, chunks of 1 and 4 rows run the chunked
function; chunks of 37 and 1,000 rows take fp32 logits to ``F.cross_entropy`` itself (one chunk)
and bf16 logits through the chunked function in one chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import runtime_facts
from meshtrain.training.cross_entropy import token_cross_entropy_sum

IGNORE = -100


def _case(dtype: torch.dtype, rows: int = 37, vocab: int = 301):
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::5] = IGNORE
    return logits, targets


@pytest.mark.parametrize("chunk_rows", [1, 4, 37, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradient_equal_fp32_cross_entropy(monkeypatch, dtype, chunk_rows):
    monkeypatch.setattr(runtime_facts, "LOSS_CHUNK_ELEMENTS", chunk_rows * 301)
    logits, targets = _case(dtype)
    ours = logits.clone().requires_grad_()
    ref = logits.clone().requires_grad_()
    loss = token_cross_entropy_sum(ours, targets, IGNORE)
    expected = F.cross_entropy(ref.float(), targets, reduction="sum", ignore_index=IGNORE)
    assert loss.dtype == torch.float32
    # The same fp32 quantities, rows summed in another order.
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    (loss * 0.25).backward()
    (expected * 0.25).backward()
    assert ours.grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # bf16 rounds the gradient once
    assert torch.allclose(ours.grad.float(), ref.grad.float(), atol=tolerance, rtol=0)
    assert torch.all(ours.grad[::5] == 0)  # ignored rows get no gradient


def test_all_rows_ignored_give_zero_loss_and_gradient():
    logits, targets = _case(torch.float32)
    targets[:] = IGNORE
    ours = logits.clone().requires_grad_()
    loss = token_cross_entropy_sum(ours, targets, IGNORE)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(ours.grad) == 0
