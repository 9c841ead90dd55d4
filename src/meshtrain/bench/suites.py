"""The registered bench suites: which meshtrain layout is compared with which PyTorch peer.

To add a suite (say ``zero3``: meshtrain ZeRO-3 vs FSDP2 ``fully_shard``):

1. write the peer as a module-level ``worker(config_dict, warmup, steps) -> dict`` in
   :mod:`meshtrain.bench.peers` (build the model, then hand a step function to
   :func:`meshtrain.bench.workers.timed_run`; :func:`meshtrain.bench.peers.make_step` is the plain
   loop most peers need);
2. write a ``configure(config)`` that sets the meshtrain side's layout (``parallel.zero = 3``) and
   raises :class:`~meshtrain.config.ConfigError` for a shape the peer cannot run;
3. ``register_suite(Suite(name=..., world_size=..., peer=..., description=..., configure=...,
   meshtrain_worker=meshtrain_worker, peer_worker=...))`` below.

The runner then validates, alternates, summarises and prints it like every other suite.
"""

from __future__ import annotations

from meshtrain.bench.peers import ddp_worker, hf_llama_worker
from meshtrain.bench.runner import Suite, register_suite
from meshtrain.bench.workers import meshtrain_worker
from meshtrain.config import Config, ConfigError


def _only_dp(config: Config, dp: int) -> None:
    """Pure data parallelism of degree ``dp`` (0 = the world), nothing else."""
    par = config.parallel
    par.dp, par.tp, par.pp, par.ep, par.zero = dp, 1, 1, 1, 0
    par.sequence_parallel = False


def configure_single(config: Config) -> None:
    """One process; the peer is a Hugging Face Llama, which has SwiGLU MLPs only."""
    _only_dp(config, 1)
    if config.model.mlp != "swiglu":
        raise ConfigError(f'model.mlp = "{config.model.mlp}": the single suite\'s peer '
                          '(LlamaForCausalLM) has SwiGLU MLPs only; valid: model.mlp = "swiglu".')


def configure_dp(config: Config) -> None:
    """Data parallelism over every process of the suite."""
    _only_dp(config, 0)


register_suite(Suite(
    name="single", world_size=1,
    peer="transformers LlamaForCausalLM (sdpa) + torch.optim.AdamW",
    description="one process: Trainer.train_step() vs a plain PyTorch loop over HF Llama",
    configure=configure_single, meshtrain_worker=meshtrain_worker, peer_worker=hf_llama_worker,
    requires=("transformers",)))

register_suite(Suite(
    name="dp", world_size=2,
    peer="torch DistributedDataParallel + torch.optim.AdamW",
    description="2 processes: meshtrain dp=2 vs DDP around the same meshtrain model",
    configure=configure_dp, meshtrain_worker=meshtrain_worker, peer_worker=ddp_worker))
