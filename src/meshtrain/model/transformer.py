"""Llama-style decoder-only transformer, plain single-device PyTorch.

The module tree (and therefore every parameter name) follows Llama / torchtitan::

    tok_embeddings.weight
    layers.<i>.attention_norm.weight
    layers.<i>.attention.{wq,wk,wv,wo}.weight      (+ parameter-free ``attention.core``)
    layers.<i>.attention.{wq,wk,wv}.bias            (``qkv_bias``; ``wo.bias`` with ``wo_bias``)
    layers.<i>.attention.{q_norm,k_norm}.weight     (``qk_norm``)
    layers.<i>.ffn_norm.weight
    layers.<i>.feed_forward.{w1,w2,w3}.weight      (dense block; + parameter-free ``act``)
    layers.<i>.moe.{router.weight, experts.w1, ...} (MoE block, see :mod:`meshtrain.model.moe`)
    norm.weight output.weight                                  (absent with ``tie_embeddings``)

Parallelism is applied from outside by wrapping or replacing these submodules, so every
piece that a strategy touches is its own small, named module, and the forwards infer head counts
and sequence lengths from the tensors they get rather than from the config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.config.model import MLP_KINDS, ModelConfig
from meshtrain.model.causal_attention import causal_attention
from meshtrain.model.feed_forward import FeedForward
from meshtrain.model.init import init_weights
from meshtrain.model.moe import MoE
from meshtrain.model.rms_norm import rms_norm
from meshtrain.model.rope import rope_frequencies


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; computes in fp32 and returns the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x`` and scale it by ``weight``."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # A few whole-tensor passes each way instead of autograd's chain of element-wise
            # ops (meshtrain.model.rms_norm); the same formula, fp32 throughout.
            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
    scaling: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary-embedding tables ``cos, sin`` of shape [seq_len, head_dim] for positions 0..S-1.

    Uses the half-split ("rotate_half") layout of Hugging Face Llama: dimension ``j`` and
    ``j + head_dim/2`` form one rotating pair, with frequency ``theta ** (-2j / head_dim)``,
    or the scaled frequency of ``scaling`` (``model.rope_scaling``, see
    :mod:`meshtrain.model.rope`). Computed in fp32 and then cast to ``dtype``.
    """
    inv_freq, multiplier = rope_frequencies(head_dim, theta, scaling, device)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if multiplier != 1.0:
        cos, sin = cos * multiplier, sin * multiplier
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, S, H, D] by the tables ``cos``/``sin`` [S, D] (half-split layout), or
    [B, S, D] when every sequence has its own positions (document masking).

    With ``x = [x0, x1]`` split at ``D / 2``: ``[x0 cos0 - x1 sin0, x1 cos1 + x0 sin1]``, the
    Hugging Face ``x * cos + rotate_half(x) * sin``. :class:`_Rotation` writes each half of the
    result with one product and one ``addcmul``, and its backward (the transposed rotation) the
    same way: two passes over ``x`` each way, where the autograd form takes four
    (two products, the ``rotate_half`` copy and the sum). That runs for fp32 (and fp64) on a
    CPU, where it was measured (docs/performance.md); elsewhere, and under ``torch.compile``
    (which fuses the plain form itself), the plain form runs.
    """
    if (x.device.type == "cpu" and x.dtype == cos.dtype
            and x.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling()):
        return _Rotation.apply(x, cos, sin)
    half = x.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    if cos.dim() == 2:
        cos, signed_sin = cos[None], signed_sin[None]
    return x * cos[:, :, None, :] + torch.roll(x, half, dims=-1) * signed_sin[:, :, None, :]


def _halves(t: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    return t[..., :half], t[..., half:]


class _Rotation(torch.autograd.Function):
    """RoPE's rotation of ``x`` [B, S, H, D] by constant tables, forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B or 1, S, 1, D]: over the heads
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, transpose=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, transpose=True), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            transpose: bool) -> torch.Tensor:
    """``[x0 c0 - x1 s0, x1 c1 + x0 s1]``, or with ``transpose`` its transpose
    ``[x0 c0 + x1 s1, x1 c1 - x0 s0]``, into a new tensor shaped like ``x``."""
    half = x.shape[-1] // 2
    x0, x1 = _halves(x, half)
    (c0, c1), (s0, s1) = _halves(cos, half), _halves(sin, half)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out0, out1 = _halves(out, half)
    torch.mul(x0, c0, out=out0)
    out0.addcmul_(x1, s1 if transpose else s0, value=1 if transpose else -1)
    torch.mul(x1, c1, out=out1)
    out1.addcmul_(x0, s0 if transpose else s1, value=-1 if transpose else 1)
    return out


class AttentionCore(nn.Module):
    """Causal scaled-dot-product attention on q [B, Hq, S, D], k/v [B, Hkv, S, D].

    Parameter-free and RoPE-free, so a strategy can wrap or replace it (e.g. for context
    parallelism or selective checkpointing); causal attention runs through
    :func:`~meshtrain.model.causal_attention.causal_attention`, which skips the masked half on
    CPU. Grouped-query attention uses SDPA's ``enable_gqa``
    (query head ``h`` reads kv head ``h // (Hq / Hkv)``); the head counts come from the tensors,
    so tensor-parallel shards work unchanged.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Return the attention output [B, Hq, S, D]; ``mask`` [B, 1, S, S] (True = may
        attend) replaces the causal mask (document masking)."""
        # enable_gqa reads kv head h // (Hq / Hkv) without materialising repeated heads
        # (the repeat_interleave copy and its backward sum cost ~15% of attention on CPU).
        if mask is None:
            return causal_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with rotary position embeddings.

    Options of the config: ``qkv_bias`` / ``wo_bias`` give the projections biases,
    ``qk_norm`` adds ``q_norm`` / ``k_norm`` (:class:`RMSNorm` over each head, one weight of
    ``head_dim`` shared by all heads, before RoPE), ``rope_scaling`` scales the RoPE frequencies.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.rope_scaling = dict(config.rope_scaling)
        q_width = config.n_heads * config.head_dim
        kv_width = config.kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, q_width, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, kv_width, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, kv_width, bias=config.qkv_bias)
        self.wo = nn.Linear(q_width, config.dim, bias=config.wo_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.core = AttentionCore()
        # (seq_len, device, dtype) -> (cos, sin); a plain dict, never a parameter or buffer.
        # The Transformer hands every layer the same dict: one table per length, not one per
        # layer (at 128K positions a table pair is 64 MiB in bf16 for head_dim 128).
        self.rope_cache: dict[tuple[int, torch.device, torch.dtype], tuple] = {}

    def rope(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple:
        """The cached ``(cos, sin)`` tables for ``seq_len`` positions."""
        key = (seq_len, device, dtype)
        if key not in self.rope_cache:
            self.rope_cache[key] = rope_cos_sin(
                seq_len, self.head_dim, self.rope_theta, device, dtype, self.rope_scaling
            )
        return self.rope_cache[key]

    def reset_buffers(self) -> None:
        """Forget the RoPE tables (e.g. after the module moved device)."""
        self.rope_cache.clear()

    def forward(self, x: torch.Tensor, layout=None) -> torch.Tensor:
        """Attend over ``x`` [B, S, dim] causally; ``layout``, a
        :class:`~meshtrain.model.sequence_layout.SequenceLayout`, gives other positions and
        mask (document masking, context parallelism). Returns [B, S, dim]."""
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Shapes come from the projections, not from x, so a sequence-parallel wrapper that
        # gathers the sequence inside wq/wk/wv still works.
        batch, seq_len = q.shape[0], q.shape[1]
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = v.view(batch, seq_len, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        mask = None
        if layout is None:
            cos, sin = self.rope(seq_len, q.device, q.dtype)
        else:
            cos, sin = self.rope(layout.seq_len, q.device, q.dtype)
            cos, sin, mask = cos[layout.positions], sin[layout.positions], layout.mask
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + mlp(norm(h))``.

    The MLP is ``feed_forward`` (:class:`FeedForward`) or, when ``config.is_moe_layer(layer_id)``,
    ``moe`` (:class:`meshtrain.model.moe.MoE`); only one of the two attributes exists.
    """

    def __init__(self, layer_id: int, config: ModelConfig):
        super().__init__()
        self.layer_id = layer_id
        self.is_moe = config.is_moe_layer(layer_id)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        if self.is_moe:
            self.moe = MoE(config)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_dim, config.mlp)

    def forward(self, x: torch.Tensor, layout=None) -> torch.Tensor:
        """Run the block on ``x`` [B, S, dim] (``layout``: see :meth:`Attention.forward`)."""
        h = x + self.attention(self.attention_norm(x), layout)
        mlp = self.moe if self.is_moe else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole decoder: embedding, ``config.n_layers`` blocks, final norm and LM head.

    ``layers`` is an ``nn.ModuleDict`` keyed ``"0"``..``"n-1"`` so a pipeline stage can delete
    the blocks it does not own and keep every parameter name. Likewise a stage may set
    ``tok_embeddings``, ``norm`` or ``output`` to ``None``: the forward then takes hidden states
    instead of tokens, or returns hidden states instead of logits (the tied head of
    ``tie_embeddings`` always runs; it needs ``tok_embeddings``).

    Constructed on a real device, the weights get the name-seeded init (seed 0) of
    :func:`meshtrain.model.init.init_weights`; under ``torch.device("meta")`` nothing is
    initialised (use :func:`meshtrain.model.build_model`).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size <= 0:
            raise ValueError(
                f"ModelConfig.vocab_size must be > 0 to build a model (got {config.vocab_size}); "
                "resolve 0 to the tokenizer's vocabulary size first."
            )
        if config.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {config.mlp!r}; valid: {', '.join(MLP_KINDS)}")
        self.config = config
        self.tie_embeddings = config.tie_embeddings
        # No default init (``nn.Embedding``'s normal_ on the meta device costs seconds of
        # torch._dynamo import); init_weights sets every value.
        self.tok_embeddings = nn.Embedding.from_pretrained(
            torch.empty(config.vocab_size, config.dim), freeze=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, config) for i in range(config.n_layers)}
        )
        rope_tables: dict = {}  # same head_dim and theta in every layer: share the tables
        for block in self.layers.values():
            block.attention.rope_cache = rope_tables
        self.norm = RMSNorm(config.dim, config.norm_eps)
        if not config.tie_embeddings:
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        else:
            self.output = None
        if not any(p.is_meta for p in self.parameters()):
            init_weights(self, seed=0)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Project hidden states [B, S, dim] to logits [B, S, vocab] (tied or separate weight)."""
        if self.tie_embeddings:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def forward(self, tokens: torch.Tensor, layout=None) -> torch.Tensor:
        """Logits [B, S, vocab_size] (in the parameters' dtype) for ``tokens`` [B, S];
        ``layout``: a :class:`~meshtrain.model.sequence_layout.SequenceLayout` (attend within
        documents; this rank's part of a context-parallel sequence)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, layout)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None and not self.tie_embeddings:
            return h
        return self.head(h)
