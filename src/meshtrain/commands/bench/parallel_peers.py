"""The PyTorch-native peers of the model-parallel suites: FSDP2, DTensor TP, ``pipelining``.

Like :mod:`meshtrain.commands.bench.peers`, each trains the bench shape on meshtrain's data, from
meshtrain's name-seeded initial weights (``meshtrain.model.build_model`` on every rank, identical
everywhere, then handed to the PyTorch API, which keeps each rank's piece), with fused
``torch.optim.AdamW`` (:func:`meshtrain.commands.bench.peers.adamw`), meshtrain's LR schedule,
global-norm clipping and loss.

- :func:`fsdp2_worker` (``zero3``): ``fully_shard`` on every block, then on the root.
- :func:`dtensor_tp_worker` (``tp``): ``parallelize_module`` with the standard Megatron plan:
  ``ColwiseParallel`` on q/k/v and gate/up, ``RowwiseParallel`` on o/down, the vocab-split
  embedding (``RowwiseParallel(input_layouts=Replicate())``) and head (``ColwiseParallel`` with
  logits left split over the vocabulary, the loss under ``loss_parallel()``) — the layout
  meshtrain uses (vocab-parallel embedding and cross-entropy; logits never gathered). The norms
  stay plain, replicated modules.
- :func:`pipelining_worker` (``pp``): the same model cut into ``pp`` stages at meshtrain's layer
  split, each a :class:`~torch.distributed.pipelining.PipelineStage`, run by
  :class:`~torch.distributed.pipelining.Schedule1F1B` over the same micro-batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.commands.bench.peers import (
    adamw,
    local_value,
    make_step,
    no_phase,
    train_data,
)
from meshtrain.commands.bench.workers import load_bench_config, preload_tokens, timed_run
from meshtrain.config import Config
from meshtrain.training.lr_schedule import learning_rate
from meshtrain.training.metrics import peak_memory_bytes

CPU = torch.device("cpu")


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def clip_global_norm(params: list[torch.Tensor], max_norm: float, sum_over_world: bool = False,
                     ) -> torch.Tensor:
    """Clip ``params``' gradients by their global L2 norm; returns the norm.

    DTensor gradients (sharded or replicated) and plain ones are normed apart (torch's foreach
    kernels refuse a mixed list) and combined; a plain gradient is a whole, replicated one.
    ``sum_over_world``: the ranks hold *different* parameters (pipeline stages), so the squared
    norms are summed over the world first.
    """
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    grads = [p.grad for p in params if p.grad is not None]
    groups = [[g for g in grads if _is_dtensor(g)], [g for g in grads if not _is_dtensor(g)]]
    square = torch.zeros((), dtype=torch.float32)
    for group in groups:
        if group:
            square += local_value(get_total_norm(group, foreach=True)).float() ** 2
    if sum_over_world:
        dist.all_reduce(square)
    total = square.sqrt()
    for kind in (True, False):
        chosen = [p for p in params if p.grad is not None and _is_dtensor(p.grad) == kind]
        if chosen:
            clip_grads_with_norm_(chosen, max_norm, total, foreach=True)
    return total


def _run(config: Config, model_step, base: int, warmup: int, steps: int) -> dict:
    tokens = config.train.global_batch * config.train.seq_len
    return timed_run(model_step, warmup, steps, tokens, base)


def _start(config_dict: dict):
    """Rebuild the config and tokenize the corpus, then take the memory baseline."""
    config = load_bench_config(config_dict)
    preload_tokens(config)
    return config, peak_memory_bytes(CPU)


def fsdp2_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The ``zero3`` suite's peer: FSDP2 (``fully_shard`` per block + root), fp32, N ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshtrain.model import build_model

    config, base = _start(config_dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = train_data(config, rank, world)
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(config.model, seed=config.train.seed)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    step = make_step(model, lambda mod, inputs: mod(inputs), data, config.train,
                     loss_scale=world)
    return _run(config, step, base, warmup, steps)


def tp_plan(n_layers: int) -> dict:
    """The DTensor tensor-parallel plan of a meshtrain model (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(n_layers):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                     "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def dtensor_tp_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The ``tp`` suite's peer: ``parallelize_module`` on a meshtrain model (local head counts
    come from the split projections' shapes), vocab-parallel loss, N ranks, same data on all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from meshtrain.model import build_model

    config, base = _start(config_dict)
    data = train_data(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(config.model, seed=config.train.seed)
    parallelize_module(model, mesh, tp_plan(config.model.n_layers))
    step = make_step(model, lambda mod, inputs: mod(inputs), data, config.train,
                     clip=lambda mod, max_norm: clip_global_norm(list(mod.parameters()),
                                                                 max_norm),
                     loss_context=loss_parallel)
    return _run(config, step, base, warmup, steps)


def pipeline_stage_model(config: Config, stage: int, num_stages: int) -> torch.nn.Module:
    """Stage ``stage`` of the meshtrain model: its blocks (meshtrain's split: balanced by cost,
    or ``parallel.pp_split``), the embedding on the first, the final norm and head on the last.

    A :class:`~meshtrain.model.Transformer` with the other modules deleted: its forward then
    takes hidden states and/or returns them (untied embeddings only, as for meshtrain's pp).
    """
    from meshtrain.model import build_model
    from meshtrain.parallel.pipeline.stage_split import stage_layers

    model = build_model(config.model, seed=config.train.seed)
    owned = stage_layers(config.model, config.model.vocab_size, num_stages,
                         config.parallel.pp_split)[stage]
    for key in list(model.layers.keys()):
        if int(key) not in owned:
            del model.layers[key]
    if stage > 0:
        model.tok_embeddings = None
    if stage < num_stages - 1:
        model.norm = None
        model.output = None
    return model


def pipelining_worker(config_dict: dict, warmup: int, steps: int) -> dict:
    """The ``pp`` suite's peer: ``PipelineStage`` + ``Schedule1F1B``, one stage per rank."""
    config, base = _start(config_dict)
    step, _ = pipelining_step(config)
    return _run(config, step, base, warmup, steps)


def pipelining_step(config: Config, phase=no_phase):
    """This rank's step of the ``pp`` peer and its ``PipelineStage`` (whose
    ``forward_one_chunk`` / ``backward_one_chunk`` :mod:`.side_by_side` times). ``phase(name)``
    is entered around the schedule, the clipping, the AdamW step and ``zero_grad``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    train = config.train
    rank, world = dist.get_rank(), dist.get_world_size()
    data = train_data(config)  # meshtrain's micro-batches; the schedule re-cuts their concatenation
    model = pipeline_stage_model(config, rank, world)
    tokens = train.global_batch * train.seq_len

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                               reduction="sum") / tokens

    stage = PipelineStage(model, rank, world, CPU)
    # scale_grads=False: each micro-batch's loss is already its share of the step's mean.
    schedule = Schedule1F1B(stage, config.parallel.microbatches, loss_fn=loss_fn,
                            scale_grads=False)
    optimizer = adamw(model, train)
    params = [p for p in model.parameters() if p.requires_grad]
    first, last = rank == 0, rank == world - 1

    def step(index: int) -> float:
        micro = data.next_step()
        inputs = torch.cat([x for x, _ in micro])
        targets = torch.cat([t for _, t in micro])
        losses: list[torch.Tensor] = []
        with phase("schedule"):
            if first:
                schedule.step(inputs, return_outputs=False)
            elif last:
                schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
        if train.grad_clip > 0:
            with phase("clipping"):
                clip_global_norm(params, train.grad_clip, sum_over_world=True)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(index, train)
        with phase("AdamW"):
            optimizer.step()
        with phase("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        total = torch.stack([loss.detach() for loss in losses]).sum() if losses \
            else torch.zeros(())
        dist.all_reduce(total)  # the loss lives on the last stage
        return float(total)

    return step, stage
