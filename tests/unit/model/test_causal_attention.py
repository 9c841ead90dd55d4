"""The CPU query-block causal attention against one ``scaled_dot_product_attention`` call."""

import pytest
import torch
import torch.nn.functional as F

from meshtrain.model.causal_attention import causal_attention, splits_queries


def _inputs(seq, heads, kv_heads, dtype=torch.float32, batch=2, head_dim=16):
    gen = torch.Generator().manual_seed(seq * 31 + heads)
    shapes = [(batch, heads, seq, head_dim), (batch, kv_heads, seq, head_dim),
              (batch, kv_heads, seq, head_dim)]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _reference(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("seq", [256, 301, 1000])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_query_blocks_match_one_call_in_output_and_every_gradient(seq, heads, kv_heads):
    # fp32 on CPU in the split range: the blocks skip the masked keys, so the softmax sums run
    # over different (fewer) terms; 1e-5 is fp32 rounding over a few hundred keys.
    q, k, v = _inputs(seq, heads, kv_heads)
    assert splits_queries(q)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    out = causal_attention(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = _reference(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_split_output_reshapes_to_the_projection_input_without_a_copy():
    q, k, v = _inputs(256, 4, 2)
    out = causal_attention(q, k, v)
    assert out.shape == q.shape
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("seq,dtype", [(128, torch.float32), (1024, torch.float32),
                                       (256, torch.bfloat16)])
def test_outside_the_split_range_it_is_the_single_call(seq, dtype):
    q, k, v = _inputs(seq, 4, 2, dtype=dtype)
    assert not splits_queries(q)
    assert torch.equal(causal_attention(q, k, v), _reference(q, k, v))


def _saved_bytes_of_attention_and_output_projection(attention, q, k, v, weight):
    """Bytes of the distinct storages autograd keeps for backward through ``attention`` and the
    output projection that reads its result (as ``Attention`` does)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention(q, k, v)
        batch, heads, seq, head_dim = out.shape
        F.linear(out.transpose(1, 2).reshape(batch, seq, heads * head_dim), weight)
    return sum(storages.values())


def test_the_output_projection_and_the_backward_keep_one_copy_of_the_output():
    # The blocks write into one tensor that the backward and the projection both keep; one
    # output more (the blocks' own outputs beside their joined copy) is what the plain
    # per-block calls keep.
    q, k, v = _inputs(256, 4, 2)
    weight = torch.randn(64, 64, requires_grad=True)
    kept = _saved_bytes_of_attention_and_output_projection(causal_attention, q, k, v, weight)
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, weight))
    output = q.numel() * q.element_size()
    logsumexp = q[..., 0].numel() * q.element_size()
    assert kept <= inputs + output + logsumexp + 4096
