"""The registered bench suites: which meshtrain layout is compared with which PyTorch peer.

To add a suite (say ``zero3``: meshtrain ZeRO-3 vs FSDP2 ``fully_shard``):

1. write the peer as a module-level ``worker(config_dict, warmup, steps) -> dict`` in
   :mod:`meshtrain.commands.bench.peers` (build the model, then hand a step function to
   :func:`meshtrain.commands.bench.workers.timed_run`;
   :func:`meshtrain.commands.bench.peers.make_step` is the plain
   loop most peers need);
2. write a ``configure(config)`` that sets the meshtrain side's layout (``parallel.zero = 3``) and
   raises :class:`~meshtrain.config.ConfigError` for a shape the peer cannot run;
3. ``register_suite(Suite(name=..., world_size=..., peer=..., description=..., configure=...,
   meshtrain_worker=meshtrain_worker, peer_worker=...))`` below.

The runner then validates, alternates, summarises and prints it like every other suite. A suite
that is not one meshtrain/peer pair passes ``run`` and ``check`` instead (see ``scaling``). Peers
start with meshtrain's ``malloc`` settings (unless ``--no-same-allocator``); ``allocator``
measures what those settings gain, meshtrain against itself under glibc's defaults
(``peer_allocator=False``).
"""

from __future__ import annotations

from meshtrain.commands.bench.base import Suite, register_suite
from meshtrain.commands.bench.diloco_convergence import check_diloco, run_diloco
from meshtrain.commands.bench.moe_peers import (
    configure_moe,
    configure_moe_ep,
    hf_mixtral_worker,
    meshtrain_dp_worker,
)
from meshtrain.commands.bench.parallel_peers import (
    dtensor_tp_worker,
    fsdp2_worker,
    pipelining_worker,
)
from meshtrain.commands.bench.peers import ddp_hf_llama_worker, ddp_worker, hf_llama_worker
from meshtrain.commands.bench.scaling import check_scaling, run_scaling
from meshtrain.commands.bench.workers import meshtrain_worker
from meshtrain.config import Config, ConfigError

HF_DEVICES = ("cpu", "cuda")
"""Where the one-process Hugging Face suites (single, moe) run: one process needs no gloo."""
HF_PRECISIONS = ("fp32", "bf16")
"""What they compare: fp32 (the same numbers on both sides), or each side's bf16 training."""


def _only_dp(config: Config, dp: int) -> None:
    """Pure data parallelism of degree ``dp`` (0 = the world), nothing else."""
    par = config.parallel
    par.dp, par.tp, par.pp, par.ep, par.zero = dp, 1, 1, 1, 0
    par.sequence_parallel = False


def configure_single(config: Config) -> None:
    """One process; the peer is a Hugging Face Llama, which has SwiGLU MLPs only."""
    _only_dp(config, 1)
    _require_swiglu(config, "single")


def _require_swiglu(config: Config, suite: str) -> None:
    """Refuse a model whose MLP ``LlamaForCausalLM`` cannot hold."""
    if config.model.mlp != "swiglu":
        raise ConfigError(f'model.mlp = "{config.model.mlp}": the {suite} suite\'s peer '
                          '(LlamaForCausalLM) has SwiGLU MLPs only; valid: model.mlp = "swiglu".')


def configure_dp(config: Config) -> None:
    """Data parallelism over every process of the suite."""
    _only_dp(config, 0)


def configure_dp_hf(config: Config) -> None:
    """Data parallelism over every process; the peer is a Hugging Face Llama (SwiGLU only)."""
    _only_dp(config, 0)
    _require_swiglu(config, "dp-hf")


def configure_zero3(config: Config) -> None:
    """Data parallelism with ZeRO-3 (parameters, gradients and optimizer state sharded)."""
    _only_dp(config, 0)
    config.parallel.zero = 3


TP_DEGREE = 2
PP_DEGREE = 2


def configure_tp(config: Config) -> None:
    """tp = 2 alone (no sequence parallelism). The DTensor peer splits q, k and v by columns, so
    both head counts must divide by tp (meshtrain would also replicate too few kv heads)."""
    _only_dp(config, 1)
    config.parallel.tp = TP_DEGREE
    m = config.model
    if m.n_heads % TP_DEGREE or m.kv_heads % TP_DEGREE:
        raise ConfigError(f"model.n_heads = {m.n_heads}, model.n_kv_heads = {m.kv_heads}: the tp "
                          f"suite's DTensor peer splits both head counts over tp = {TP_DEGREE}; "
                          f"valid: head counts divisible by {TP_DEGREE}.")


def configure_pp(config: Config) -> None:
    """pp = 2 with the 1F1B schedule over ``parallel.microbatches`` micro-batches (when left at
    1: ``2 × pp`` = 4), so both sides run the same micro-batches."""
    _only_dp(config, 1)
    par = config.parallel
    par.pp, par.pp_schedule, par.virtual_stages = PP_DEGREE, "1f1b", 1
    if par.microbatches == 1:
        par.microbatches = 2 * PP_DEGREE


def configure_allocator(config: Config) -> None:
    """One process, as the ``single`` suite; both sides are meshtrain."""
    _only_dp(config, 1)


register_suite(Suite(
    name="single", world_size=1,
    peer="transformers LlamaForCausalLM (sdpa) + torch.optim.AdamW(fused=True)",
    description="one process: Trainer.train_step() vs a plain PyTorch loop over HF Llama",
    configure=configure_single, meshtrain_worker=meshtrain_worker, peer_worker=hf_llama_worker,
    requires=("transformers",),
    devices=HF_DEVICES, precisions=HF_PRECISIONS))

register_suite(Suite(
    name="dp", world_size=2,
    peer="torch DistributedDataParallel + torch.optim.AdamW(fused=True)",
    description="2 processes: meshtrain dp=2 vs DDP around the same meshtrain model",
    configure=configure_dp, meshtrain_worker=meshtrain_worker, peer_worker=ddp_worker))

register_suite(Suite(
    name="dp-hf", world_size=2,
    peer="torch DistributedDataParallel around transformers LlamaForCausalLM (sdpa) + "
         "torch.optim.AdamW(fused=True)",
    description="2 processes: meshtrain dp=2 vs DDP around the Hugging Face Llama a DDP user "
                "trains (same initial weights)",
    configure=configure_dp_hf, meshtrain_worker=meshtrain_worker,
    peer_worker=ddp_hf_llama_worker, requires=("transformers",)))

register_suite(Suite(
    name="zero3", world_size=2,
    peer="torch FSDP2 fully_shard (per block + root) + torch.optim.AdamW(fused=True)",
    description="2 processes: meshtrain dp=2 ZeRO-3 vs FSDP2 on the same meshtrain model, fp32",
    configure=configure_zero3, meshtrain_worker=meshtrain_worker, peer_worker=fsdp2_worker))

register_suite(Suite(
    name="tp", world_size=TP_DEGREE,
    peer="DTensor parallelize_module (Colwise/Rowwise, vocab-split embedding/head, "
         "loss_parallel) + torch.optim.AdamW(fused=True)",
    description="2 processes: meshtrain tp=2 vs DTensor tensor parallel on the same model",
    configure=configure_tp, meshtrain_worker=meshtrain_worker, peer_worker=dtensor_tp_worker))

register_suite(Suite(
    name="pp", world_size=PP_DEGREE,
    peer="torch.distributed.pipelining PipelineStage + Schedule1F1B + "
         "torch.optim.AdamW(fused=True)",
    description="2 processes: meshtrain pp=2 1F1B vs torch pipelining 1F1B, same split and "
                "micro-batches",
    configure=configure_pp, meshtrain_worker=meshtrain_worker, peer_worker=pipelining_worker))

register_suite(Suite(
    name="allocator", world_size=1,
    peer="meshtrain itself with glibc's default malloc settings",
    description="one process: meshtrain with the malloc settings its launcher gives every "
                "training process vs the same run without them (what the settings gain)",
    configure=configure_allocator, meshtrain_worker=meshtrain_worker,
    peer_worker=meshtrain_worker, peer_allocator=False))

register_suite(Suite(
    name="moe", world_size=1,
    peer="transformers MixtralForCausalLM (sdpa; experts grouped_mm, eager under bf16 "
         "autocast) + torch.optim.AdamW(fused=True)",
    description="one process: meshtrain's MoE model (8 experts top-2 in every block) vs HF "
                "Mixtral holding the same weights",
    configure=configure_moe, meshtrain_worker=meshtrain_worker, peer_worker=hf_mixtral_worker,
    requires=("transformers",),
    devices=HF_DEVICES, precisions=HF_PRECISIONS))

register_suite(Suite(
    name="moe-ep", world_size=2,
    peer="meshtrain dp 2 with every expert on every rank",
    description="2 processes: meshtrain dp 2 × ep 2 (experts split, all-to-all dispatch) vs "
                "dp 2 of the same MoE model",
    configure=configure_moe_ep, meshtrain_worker=meshtrain_worker,
    peer_worker=meshtrain_dp_worker))

register_suite(Suite(
    name="scaling", world_size=4,
    peer="ideal linear scaling of meshtrain's own one-process run",
    description="meshtrain alone at 1, 2, 4 processes of the same global batch on dp, tp and pp",
    meshtrain_worker=meshtrain_worker, peer_worker=None, run=run_scaling, check=check_scaling))

register_suite(Suite(
    name="diloco", world_size=4,
    peer="synchronous data parallelism over as many ranks (meshtrain dp)",
    description="loss and bytes moved: DiLoCo replica groups (4 × dp 1, H = 20) vs dp 4 on the "
                "same tokens, 800 steps of a small model each, both from the same 200 dp steps "
                "(about 4 minutes)",
    meshtrain_worker=meshtrain_worker, peer_worker=None, run=run_diloco, check=check_diloco))
