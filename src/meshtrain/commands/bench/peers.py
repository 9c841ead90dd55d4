"""The PyTorch-native peers meshtrain is measured against, each a plain training loop.

Every peer trains the bench shape on the same data as meshtrain (the same
:class:`~meshtrain.data.train_data.TrainData` sequences at every step, the same micro-batching),
from the same initial weights, with ``torch.optim.AdamW(fused=True)`` (the fastest AdamW torch
has on the device; ``foreach=True`` where torch has no fused kernel for it) using meshtrain's
hyper-parameters, weight-decay grouping (matrices only), learning-rate schedule and global-norm
clipping, and the same loss (summed token cross-entropy over the step's token count). So the
first-step losses of both sides agree, which the bench reports as a sanity check.

- :func:`hf_llama_worker`: one process, ``transformers``' ``LlamaForCausalLM`` (SDPA attention).
- :func:`ddp_worker`: N processes, ``DistributedDataParallel`` around the meshtrain model.
- :func:`ddp_hf_llama_worker`: N processes, ``DistributedDataParallel`` around
  ``LlamaForCausalLM`` (the ``dp-hf`` suite).

The model-parallel peers (FSDP2, DTensor TP, ``torch.distributed.pipelining``) are in
:mod:`meshtrain.commands.bench.parallel_peers`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from meshtrain.commands.bench.workers import (
    bench_device,
    load_bench_config,
    preload_tokens,
    timed_run,
)
from meshtrain.config import Config, TrainConfig
from meshtrain.training.lr_schedule import learning_rate
from meshtrain.training.metrics import peak_memory_bytes

HF_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
"""meshtrain block submodule -> Hugging Face Llama decoder-layer submodule."""


def hf_llama_name(name: str) -> str:
    """The ``LlamaForCausalLM`` parameter name of meshtrain parameter ``name``."""
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"model.layers.{layer}.{HF_LAYER_NAMES[module]}.{leaf}"


def build_hf_llama(config: Config) -> torch.nn.Module:
    """``LlamaForCausalLM`` of the bench shape, holding meshtrain's name-seeded initial weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshtrain.model import build_model

    m = config.model
    hf_config = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
        num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads, hidden_act="silu",
        max_position_embeddings=config.train.seq_len, rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False,
        use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(hf_config).float()
    source = build_model(m, seed=config.train.seed)
    state = {hf_llama_name(k): v for k, v in source.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied lm_head is the embedding itself; anything else left over is a naming bug.
    if unexpected or [k for k in missing if k != "lm_head.weight" or not m.tie_embeddings]:
        raise RuntimeError(f"weight mapping to LlamaForCausalLM failed: missing {missing}, "
                           f"unexpected {unexpected}")
    return model.train()


def has_fused_adamw(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has a fused AdamW kernel for parameters of ``device`` and ``dtype``
    (tried on a one-element parameter: torch checks only at the first step)."""
    probe = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        torch.optim.AdamW([probe], fused=True).step()
    except RuntimeError:
        return False
    return True


def adamw(model: torch.nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with meshtrain's hyper-parameters and decay groups, fused.

    The fused kernel (one pass over each group, what a user tuning for speed picks, and the
    kernel meshtrain's own optimizer runs) where torch has it for the parameters' device and
    dtype (CPU and CUDA in torch 2.13, DTensor shards included); ``foreach=True`` otherwise.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    fused = all(has_fused_adamw(device, dtype)
                for device, dtype in {(p.device, p.dtype) for p in params})
    kernel = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=train.lr,
                             betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                             **kernel)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor (a replicated DTensor's full value)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def default_clip(model: torch.nn.Module, max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_`` over every parameter (the plain, DDP and FSDP2 peers)."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)


def no_phase(name: str) -> contextlib.AbstractContextManager:
    """The ``phase`` of an untimed step: enters nothing."""
    return contextlib.nullcontext()


def make_step(model: torch.nn.Module, logits_of, data, train: TrainConfig, loss_scale: int = 1,
              clip=default_clip, loss_context=contextlib.nullcontext,
              device: torch.device | None = None, phase=no_phase):
    """A plain training step over ``data``'s micro-batches: forward, loss, backward, clip, AdamW.

    ``logits_of(model, inputs)`` returns the logits; each micro-batch's summed loss is divided by
    the step's local token count (and DDP / FSDP average over ranks: the global mean).
    ``clip(model, max_norm)`` clips the gradients by their global norm; loss and backward run
    inside ``loss_context()`` (``torch.distributed.tensor.parallel.loss_parallel`` for the
    DTensor peer, whose logits stay split over the vocabulary). ``device``: where the
    micro-batches go (the model's device; default: where the data is). With
    ``train.precision = "bf16"`` the forward runs under ``torch.autocast`` to bf16 (weights,
    gradients and Adam state stay fp32), as a PyTorch or Hugging Face user's mixed precision
    does; the loss is taken in fp32. ``phase(name)`` is entered around each part of the step
    (``forward``, ``backward``, ``clipping``, ``AdamW``, ``zero_grad``):
    :mod:`meshtrain.commands.bench.side_by_side` times them; by default it does nothing.
    """
    optimizer = adamw(model, train)
    autocast = train.precision == "bf16"

    def step(index: int) -> float:
        microbatches = [(inputs.to(device), targets.to(device)) if device is not None
                        else (inputs, targets) for inputs, targets in data.next_step()]
        tokens = sum(targets.numel() for _, targets in microbatches)
        total = torch.zeros((), device=device)
        for inputs, targets in microbatches:
            with phase("forward"), (torch.autocast(inputs.device.type, dtype=torch.bfloat16)
                                    if autocast else contextlib.nullcontext()):
                logits = logits_of(model, inputs)
            with loss_context():
                with phase("forward"):  # the loss: the forward's last part
                    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                           reduction="sum") / tokens
                with phase("backward"):
                    loss.backward()
            total += local_value(loss.detach())
        if train.grad_clip > 0:
            with phase("clipping"):
                clip(model, train.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(index, train)
        with phase("AdamW"):
            optimizer.step()
        with phase("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        if loss_scale > 1:  # report the global mean loss, as meshtrain does
            torch.distributed.all_reduce(total)
            total /= loss_scale
        return float(total)

    return step


def train_data(config: Config, rank: int = 0, world: int = 1):
    """The :class:`~meshtrain.data.train_data.TrainData` that meshtrain's data-parallel rank
    ``rank`` of ``world`` reads (micro-batches as ``parallel.microbatches`` says)."""
    from meshtrain.data.tokenizer import load_tokenizer
    from meshtrain.data.train_data import TrainData

    return TrainData(config.data, config.train, load_tokenizer(config.data.tokenizer),
                     dp_rank=rank, dp_size=world, microbatches=config.parallel.microbatches)


def hf_llama_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The ``single`` suite's peer: plain PyTorch training of ``transformers.LlamaForCausalLM``."""
    return hf_causal_lm_worker(config_dict, warmup, steps, build_hf_llama)


def hf_logits(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The logits of a ``transformers`` causal LM for ``inputs`` (no KV cache)."""
    return model(input_ids=inputs, use_cache=False).logits


def hf_causal_lm_worker(config_dict: dict, warmup: int, steps: int, build) -> dict:
    """One process training the ``transformers`` model ``build(config)`` returns, in the plain
    loop of :func:`make_step`, on the suite's device (``train.device``)."""
    import transformers  # noqa: F401 - imported before the memory baseline, like torch

    config = load_bench_config(config_dict)
    device = bench_device(config)
    preload_tokens(config)
    data = train_data(config)
    base = peak_memory_bytes(device)
    model = build(config).to(device)
    step = make_step(model, hf_logits, data, config.train, device=device)
    tokens = config.train.global_batch * config.train.seq_len
    return timed_run(step, warmup, steps, tokens, base, device)


def ddp_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The ``dp`` suite's peer: ``DistributedDataParallel`` around the meshtrain model, with
    ``gradient_as_bucket_view=True`` (PyTorch's advice for speed and memory: gradients are views
    into the reduction buckets, not copied into them)."""
    return _ddp_run(config_dict, warmup, steps, meshtrain_model, model_logits)


def model_logits(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The logits of meshtrain's model (or a wrapper around it) for ``inputs``."""
    return model(inputs)


def ddp_hf_llama_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The ``dp-hf`` suite's peer: ``DistributedDataParallel`` (as :func:`ddp_worker`) around
    ``transformers``' ``LlamaForCausalLM`` holding the same initial weights: what a DDP user who
    trains the Hugging Face model runs."""
    import transformers  # noqa: F401 - imported before the memory baseline, like torch

    return _ddp_run(config_dict, warmup, steps, build_hf_llama, hf_logits)


def _ddp_run(config_dict: dict, warmup: int, steps: int, build, logits_of) -> dict:
    """One rank of DDP around ``build(config)`` (:func:`ddp_step`), timed."""
    config = load_bench_config(config_dict)
    preload_tokens(config)
    base = peak_memory_bytes(torch.device("cpu"))
    step = ddp_step(config, build, logits_of)
    tokens = config.train.global_batch * config.train.seq_len
    return timed_run(step, warmup, steps, tokens, base)


def ddp_step(config: Config, build, logits_of, phase=no_phase):
    """This rank's step of DDP (``gradient_as_bucket_view``, the suite's bucket size) around
    ``build(config)``, trained in the plain loop of :func:`make_step` (``phase``: see there)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    data = train_data(config, rank, world)
    model = DistributedDataParallel(build(config), bucket_cap_mb=config.parallel.dp_bucket_mb,
                                    gradient_as_bucket_view=True)
    return make_step(model, logits_of, data, config.train, loss_scale=world, phase=phase)


def meshtrain_model(config: Config) -> torch.nn.Module:
    """meshtrain's model of the bench shape with its name-seeded initial weights (what the DDP
    peer of the ``dp`` suite trains)."""
    from meshtrain.model import build_model

    return build_model(config.model, seed=config.train.seed)
