"""Unit tests of the single-device model: shapes, causality, names, init, counts and MoE."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.model import (
    Transformer,
    build_model,
    count_parameters,
    flops_per_token,
    init_tensor,
    init_weights,
    moe_layers,
)
from meshtrain.model.feed_forward import FeedForward
from meshtrain.model.moe import MoE
from meshtrain.model.transformer import apply_rope, rope_cos_sin

torch.set_num_threads(1)

TINY = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48)
MOE = dataclasses.replace(TINY, moe_experts=4, moe_top_k=2, moe_ffn_dim=16)

VARIANTS = {
    "mha": TINY,
    "gqa": dataclasses.replace(TINY, n_kv_heads=2),
    "gelu": dataclasses.replace(TINY, mlp="gelu"),
    "tied": dataclasses.replace(TINY, tie_embeddings=True),
    "moe": MOE,
    "moe-sigmoid-shared": dataclasses.replace(
        MOE, moe_score="sigmoid", moe_shared_experts=1, moe_every=2, moe_balance="bias"
    ),
    "moe-gelu-capacity": dataclasses.replace(MOE, mlp="gelu", moe_capacity_factor=1.0),
}


def tokens(batch: int = 2, seq_len: int = 8, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (batch, seq_len), generator=generator)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_forward_backward(name: str) -> None:
    config = VARIANTS[name]
    model = build_model(config)
    logits = model(tokens())
    assert logits.shape == (2, 8, config.vocab_size)
    assert logits.dtype == torch.float32
    logits.float().logsumexp(-1).mean().backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name


def test_bf16_logits_dtype_and_fp32_bias() -> None:
    model = build_model(MOE, dtype=torch.bfloat16)
    assert model(tokens()).dtype == torch.bfloat16
    assert all(m.expert_bias.dtype == torch.float32 for m in moe_layers(model))


def test_vocab_size_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(dataclasses.replace(TINY, vocab_size=0))


@pytest.mark.parametrize("name", ["gqa", "moe"])
def test_causality(name: str) -> None:
    model = build_model(VARIANTS[name])
    x = tokens(batch=1, seq_len=10)
    changed = x.clone()
    changed[0, 6] = (changed[0, 6] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_parameter_names() -> None:
    names = {n for n, _ in build_model(dataclasses.replace(MOE, moe_every=2)).named_parameters()}
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + "attention_norm.weight", p + "ffn_norm.weight"}
        expected |= {p + f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
    expected |= {f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    expected |= {"layers.1.moe.router.weight"}
    expected |= {f"layers.1.moe.experts.{w}" for w in ("w1", "w2", "w3")}
    assert names == expected

    model = build_model(VARIANTS["tied"])
    assert "output.weight" not in dict(model.named_parameters())
    gelu = build_model(VARIANTS["gelu"]).layers["0"].feed_forward
    assert not hasattr(gelu, "w3")
    gqa = build_model(VARIANTS["gqa"]).layers["0"].attention
    assert gqa.wq.weight.shape == (32, 32) and gqa.wk.weight.shape == (16, 32)
    assert list(model.layers.keys()) == ["0", "1"]
    moe = build_model(MOE).layers["0"].moe
    assert moe.experts.w1.shape == (4, 32, 16) and moe.experts.w2.shape == (4, 16, 32)
    assert "layers.0.moe.expert_bias" in build_model(MOE).state_dict()


def test_init_is_name_seeded() -> None:
    model = build_model(MOE, seed=3)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), init_tensor(name, param.shape, 3, MOE))

    # A different construction order (layers built in reverse, then initialised) gives the
    # same weights: init depends on names only.
    reordered = Transformer.__new__(Transformer)
    torch.nn.Module.__init__(reordered)
    with torch.device("meta"):
        reference = Transformer(MOE)
        blocks = {k: reference.layers[k] for k in reversed(list(reference.layers.keys()))}
    reordered.config = MOE
    reordered.tie_embeddings = False
    reordered.output = reference.output
    reordered.norm = reference.norm
    reordered.layers = torch.nn.ModuleDict({k: blocks[k] for k in sorted(blocks)})
    reordered.tok_embeddings = reference.tok_embeddings
    assert [n for n, _ in reordered.named_parameters()][0] == "output.weight"
    reordered.to_empty(device="cpu")
    init_weights(reordered, seed=3)
    other = dict(reordered.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, other[name])

    different = build_model(MOE, seed=4)
    wq = model.layers["0"].attention.wq.weight
    assert not torch.equal(wq, different.layers["0"].attention.wq.weight)
    assert not torch.equal(wq, model.layers["1"].attention.wq.weight)

    # Building directly on a real device uses the same init with seed 0.
    direct, built = Transformer(MOE), build_model(MOE)
    torch.testing.assert_close(direct.state_dict(), built.state_dict())


def test_rope_is_a_relative_rotation() -> None:
    q = torch.randn(1, 1, 1, 8).expand(1, 6, 1, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 6, 1, 8)
    cos, sin = rope_cos_sin(6, 8, 10000.0, torch.device("cpu"), torch.float32)
    rq, rk = apply_rope(q, cos, sin)[0, :, 0], apply_rope(k, cos, sin)[0, :, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q[0, :, 0].norm(dim=-1))
    # <q at position m, k at position n> depends on m - n only.
    torch.testing.assert_close(rq[3] @ rk[1], rq[4] @ rk[2])
    torch.testing.assert_close(rq[2] @ rk[2], q[0, 0, 0] @ k[0, 0, 0])


def _rotate_half_reference(x, cos, sin):
    """Hugging Face Llama's form: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


@pytest.mark.parametrize("per_sequence", [False, True])
def test_rope_equals_the_rotate_half_form_in_value_and_gradient(per_sequence) -> None:
    # Tables whose halves differ (the real ones repeat), so a swapped half or sign shows; float64
    # so gradcheck's finite differences are exact enough to check the hand-written backward.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    shape = (2, 5, 8) if per_sequence else (5, 8)
    cos = torch.randn(shape, dtype=torch.float64, generator=gen)
    sin = torch.randn(shape, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(apply_rope(x, cos, sin), _rotate_half_reference(x, cos, sin))
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))
    grad = torch.randn(x.shape, dtype=torch.float64, generator=gen)
    got, = torch.autograd.grad(apply_rope(x, cos, sin), x, grad)
    want, = torch.autograd.grad(_rotate_half_reference(x, cos, sin), x, grad)
    torch.testing.assert_close(got, want)


def test_rope_in_fp32_on_a_cpu_runs_the_hand_written_rotation() -> None:
    cos, sin = rope_cos_sin(16, 8, 10000.0, torch.device("cpu"), torch.float32)
    x = torch.randn(2, 16, 3, 8, requires_grad=True)
    out = apply_rope(x, cos, sin)
    assert type(out.grad_fn).__name__ == "_RotationBackward"
    torch.testing.assert_close(out, _rotate_half_reference(x, cos, sin))


def test_init_rules() -> None:
    config = dataclasses.replace(TINY, dim=64, ffn_dim=256, vocab_size=512, n_layers=8)
    std = lambda name, shape: init_tensor(name, shape, 0, config).std().item()  # noqa: E731
    assert torch.equal(init_tensor("norm.weight", (64,), 0, config), torch.ones(64))
    assert std("tok_embeddings.weight", (512, 64)) == pytest.approx(0.02, rel=0.05)
    assert std("layers.0.attention.wo.weight", (64, 64)) == pytest.approx(0.005, rel=0.05)
    assert std("layers.0.moe.experts.w2", (4, 256, 64)) == pytest.approx(0.005, rel=0.05)
    assert std("output.weight", (512, 64)) == pytest.approx(0.125, rel=0.05)
    with pytest.raises(ValueError, match="no init rule"):
        init_tensor("layers.0.mystery.weight", (2, 2), 0, config)


@pytest.mark.parametrize("name", ["mha", "gqa", "gelu", "tied", "moe", "moe-sigmoid-shared"])
def test_count_parameters_matches_model(name: str) -> None:
    config = VARIANTS[name]
    counts = count_parameters(config)
    model = build_model(config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == config.vocab_size * config.dim
    assert counts["non_embedding"] == counts["total"] - counts["embedding"]
    inactive = sum(
        (m.num_experts - m.top_k) * m.experts.w1[0].numel() * (3 if config.mlp == "swiglu" else 2)
        for m in moe_layers(model)
    )
    assert counts["active"] == counts["total"] - inactive


def test_flops_per_token() -> None:
    dense = count_parameters(TINY)
    matmul = dense["total"] - TINY.dim * (2 * TINY.n_layers + 1) - dense["embedding"]
    assert flops_per_token(TINY, 8) == 6 * matmul + 12 * 2 * 32 * 8
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    assert flops_per_token(tied, 8) == flops_per_token(TINY, 8)
    assert flops_per_token(MOE, 8) < flops_per_token(dataclasses.replace(MOE, moe_top_k=4), 8)


def moe_input(tokens: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, tokens // 2, MOE.dim, generator=torch.Generator().manual_seed(seed))


def test_moe_stats_capacity_and_aux_loss() -> None:
    moe = build_model(MOE).layers["0"].moe
    x = moe_input().requires_grad_()
    moe(x).sum().backward()
    stats = moe.last_stats
    assert stats["tokens_per_expert"].dtype == torch.long
    assert stats["tokens_per_expert"].sum().item() == 24 * MOE.moe_top_k
    assert stats["dropped"].item() == 0
    assert stats["aux_loss"].item() > 0 and stats["aux_loss"].requires_grad
    assert x.grad is not None and moe.router.weight.grad is not None

    tight = build_model(dataclasses.replace(MOE, moe_capacity_factor=0.25)).layers["0"].moe
    x = moe_input()
    out = tight(x)
    assert tight.capacity(12) == 2  # per sequence of 12 tokens: ceil(0.25 * 12 * 2 / 4)
    kept = sum(torch.bincount(tight.route(seq)[0].flatten(), minlength=4).clamp(max=2).sum()
               for seq in x)
    assert tight.last_stats["dropped"].item() == 24 * 2 - kept.item() > 0
    assert torch.isfinite(out).all()

    plain = build_model(dataclasses.replace(MOE, moe_balance="none")).layers["0"].moe
    plain(moe_input())
    assert plain.last_stats["aux_loss"].item() == 0.0


def test_capacity_drops_later_tokens() -> None:
    config = dataclasses.replace(MOE, moe_top_k=1, moe_capacity_factor=0.5)
    moe = build_model(config).layers["0"].moe
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # everything goes to expert 0
        x = moe_input(8)  # two sequences of 4 tokens: each a routing group of capacity 1
        out = moe(x)
    assert moe.capacity(4) == 1 and moe.last_stats["dropped"].item() == 6
    assert (out[:, 0].abs().sum(-1) > 0).all() and out[:, 1:].abs().sum() == 0


def test_capacity_is_decided_per_sequence_whatever_the_batching() -> None:
    """Drops depend only on each sequence (or group of consecutive positions): a batch gives the
    same outputs as its sequences one at a time, in any order."""
    for group in (0, 3):
        config = dataclasses.replace(MOE, moe_capacity_factor=1.0, moe_capacity_group=group)
        moe = build_model(config).layers["0"].moe
        x = torch.randn(4, 6, MOE.dim, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            whole = moe(x)
            dropped = moe.last_stats["dropped"].item()
            alone, alone_dropped = [], 0
            for seq in x:
                alone.append(moe(seq[None]))
                alone_dropped += moe.last_stats["dropped"].item()
            reversed_ = moe(x.flip(0)).flip(0)
        assert dropped > 0 and dropped == alone_dropped
        torch.testing.assert_close(whole, torch.cat(alone), rtol=0, atol=1e-6)
        torch.testing.assert_close(whole, reversed_, rtol=0, atol=1e-6)


def test_capacity_groups_keep_the_first_positions() -> None:
    """Groups of 2 positions, one expert for all (top-1), capacity 1: the first position of every
    group is kept, the second dropped; a shorter forward's last group has its own capacity."""
    config = dataclasses.replace(MOE, moe_top_k=1, moe_capacity_factor=2.0, moe_capacity_group=2)
    moe = build_model(config).layers["0"].moe
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
        assert moe.capacity(2) == 1
        out = moe(torch.randn(2, 5, MOE.dim))  # groups {0,1} {2,3} {4}
    assert moe.last_stats["dropped"].item() == 4
    kept = out.abs().sum(-1) > 0
    assert kept.tolist() == [[True, False, True, False, True]] * 2


def test_update_bias_favours_underloaded_experts() -> None:
    config = dataclasses.replace(MOE, moe_balance="bias", moe_bias_rate=0.1)
    moe = build_model(config).layers["0"].moe
    moe.update_bias(torch.tensor([10, 2, 4, 4]))
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    assert moe.expert_bias.grad is None
    # Selection follows the bias: a large bias on expert 3 makes it everyone's first choice.
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
        moe(moe_input())
    assert moe.last_stats["tokens_per_expert"][3].item() == 24


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_single_expert_moe_equals_dense_feed_forward(mlp: str) -> None:
    config = dataclasses.replace(MOE, mlp=mlp, moe_experts=1, moe_top_k=1, moe_score="softmax")
    moe = MoE(config)
    init_weights_for(moe, config)
    dense = FeedForward(config.dim, config.expert_ffn_dim, mlp)
    with torch.no_grad():
        dense.w1.weight.copy_(moe.experts.w1[0].T)
        dense.w2.weight.copy_(moe.experts.w2[0].T)
        if mlp == "swiglu":
            dense.w3.weight.copy_(moe.experts.w3[0].T)
    x = moe_input()
    torch.testing.assert_close(moe(x), dense(x))


def init_weights_for(moe: MoE, config: ModelConfig) -> None:
    with torch.no_grad():
        for name, param in moe.named_parameters():
            param.copy_(init_tensor(f"layers.0.moe.{name}", param.shape, 0, config) * 10)


def test_init_is_block_seeded_so_any_range_is_generated_alone() -> None:
    """A range of a parameter (across block boundaries) or of a dim-0 / dim-1 piece equals the
    same elements of the full tensor, bit for bit."""
    from meshtrain.model.init import INIT_BLOCK, init_range
    from meshtrain.parallel.initial_values import initial_value
    from meshtrain.parallel.sharding import ParamSharding

    config = ModelConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=264)
    name, shape = "layers.0.feed_forward.w1.weight", (3, INIT_BLOCK // 2 + 5)
    full = init_tensor(name, shape, 7, config).reshape(-1)
    for start, stop in ((0, 10), (INIT_BLOCK - 3, INIT_BLOCK + 4), (17, full.numel())):
        assert torch.equal(init_range(name, shape, start, stop, 7, config), full[start:stop])
    rows = ParamSharding.piece(shape, (2, shape[1]), (1, 0), tp_dim=0)
    piece = torch.empty(2, shape[1])
    want = full.view(shape)[1:].reshape(-1)
    got = initial_value(name, piece, 7, config, rows, (5, INIT_BLOCK + 9))
    assert torch.equal(got, want[5:INIT_BLOCK + 9])
    cols = ParamSharding.piece(shape, (3, 100), (0, 50), tp_dim=1)
    got = initial_value(name, torch.empty(3, 100), 7, config, cols, (90, 210))
    assert torch.equal(got, full.view(shape)[:, 50:150].reshape(-1)[90:210])


@pytest.mark.parametrize("full, offset, size", [
    ((6, 10), (0, 4), (6, 3)),        # a row-parallel piece: columns of every row
    ((4, 5, 6), (1, 0, 2), (2, 5, 3)),  # an expert-parallel piece cut along two dims
    ((3, 700_000), (1, 100), (2, 650_000)),  # spanning several 2^20-element blocks
])
def test_a_box_is_the_same_cut_of_the_whole_tensor(full, offset, size):
    from meshtrain.config import ModelConfig
    from meshtrain.model.init import init_box, init_tensor

    config = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, ffn_dim=64)
    name = "layers.0.attention.wo.weight"
    whole = init_tensor(name, full, 0, config)
    box = whole[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
    assert torch.equal(init_box(name, full, offset, size, 0, config), box)
