"""Saving and restoring a :class:`~meshtrain.training.trainer.Trainer`'s whole state.

What a checkpoint holds: every parameter's fp32 master value and Adam moments (layout-free, see
:mod:`meshtrain.checkpoint.dcp`), persistent buffers (MoE expert biases), the optimizer step,
the data sampler position, the torch RNG state, the step, the run's ``train.steps`` and where
its learning-rate schedule was last re-spanned (``lr_anchor``), and under expert parallelism the
expert placement (:meth:`~meshtrain.parallel.expert.placement.ExpertPlacer.state_dict`). The
learning-rate schedule is otherwise a function of the step, and the mesh's random streams are
functions of (seed, stream, coordinates), so neither needs state of its own.

With DiLoCo replica groups (``parallel.replicas > 1``) the groups' inner states differ between
rounds, so each group's masters, moments and buffers are saved under its own prefix
(``replica<r>.model.<param>``, ...), and the outer state, the same in every group, once
(``outer.start.<param>``, ``outer.momentum.<param>``, still ZeRO- and tp-sharded like the
masters). Such a checkpoint resumes at the same number of replica groups (any inner layout).
Pseudo-gradient means still in flight (``parallel.sync_overlap``) are finished and saved as
``outer.pending.<param>``, with their fragments and steps in the metadata.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshtrain.checkpoint import manager
from meshtrain.checkpoint.atomic import fsync_dir
from meshtrain.checkpoint.dcp import (
    Chunk,
    ChunkLoadPlanner,
    ChunkSavePlanner,
    buffer_chunks,
    optimizer_chunks,
    shard_chunks,
)
from meshtrain.checkpoint.safe_reader import SafeFileSystemReader

META = "meta"


def _layout(trainer) -> dict:
    par = trainer.config.parallel
    return {"world_size": trainer.mesh.world_size, "dp": par.dp, "tp": par.tp, "pp": par.pp,
            "ep": par.ep, "cp": par.cp, "zero": par.zero, "virtual_stages": par.virtual_stages,
            "precision": trainer.config.train.precision, "replicas": par.replicas}


def _chunks(trainer, pending: list | None = None) -> list[Chunk]:
    """Every tensor chunk this rank saves and loads (see the module docstring); ``pending``:
    DiLoCo's in-flight means, laid out like the masters (None = none)."""
    outer = getattr(trainer, "outer", None)
    if outer is None:
        return optimizer_chunks(trainer.optimizer) + buffer_chunks(trainer.model)
    prefix = f"replica{trainer.mesh.replica_rank}."
    buffers = [Chunk(prefix + c.fqn, c.global_size, c.offsets, c.tensor)
               for c in buffer_chunks(trainer.model)]
    sources = {"outer.start": outer.start, "outer.momentum": outer.momentum_buf}
    if pending is not None:
        sources["outer.pending"] = pending
    outer_state = shard_chunks(trainer.engine, trainer.optimizer.shards, sources)
    return optimizer_chunks(trainer.optimizer, prefix) + buffers + outer_state


def _saved_pending(directory: Path) -> bool:
    """Whether the checkpoint in ``directory`` holds DiLoCo means in flight."""
    names = SafeFileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return any(name.startswith("outer.pending.") for name in names)


def _group():
    return dist.group.WORLD if dist.is_initialized() else None


def save(trainer) -> Path:
    """Write a checkpoint of ``trainer`` after its current step (a collective: every rank); see
    :mod:`meshtrain.checkpoint.manager` for the order of writes, syncs and renames."""
    root = manager.checkpoint_root(trainer.config)
    final = manager.step_dir(root, trainer.step)
    temp = manager.temp_dir(root, trainer.step)
    mesh = trainer.mesh
    exists = final.exists()
    if mesh.is_logging_rank and not exists:
        shutil.rmtree(temp, ignore_errors=True)  # leftovers of an interrupted save
        new_root = not root.is_dir()
        temp.mkdir(parents=True, exist_ok=True)
        if new_root:  # the root's own entry survives a power loss too
            fsync_dir(root.parent)
    mesh.barrier()
    if exists:  # never overwrite a finished checkpoint
        return final
    outer = getattr(trainer, "outer", None)
    meta = {"step": trainer.step, "optimizer_step": trainer.optimizer.step_count,
            "replicas": trainer.mesh.replicas, "outer_rounds": outer.rounds if outer else 0,
            "data": trainer.data.state_dict(), "rng": manager.encode_rng(),
            "config": trainer.config.to_dict(), "total_steps": trainer.config.train.steps,
            "lr_anchor": getattr(trainer, "lr_anchor", None)}
    placer = getattr(trainer, "expert_placer", None)
    if placer is not None:  # which expert sits where; the tensors are in canonical order
        meta["expert_placement"] = placer.state_dict()
    pending = None
    if outer is not None and outer.in_flight:  # the same steps on every rank
        pending = outer.pending_buffers()
        meta["outer_pending"] = [[p.fragment, p.apply_at] for p in outer.in_flight]
    chunks = _chunks(trainer, pending)
    offload = getattr(trainer.engine, "offload", None)  # its chunks' pages go once written
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(temp)),
             planner=ChunkSavePlanner(chunks, {META: json.dumps(meta).encode()},
                                      offload.release if offload is not None else None),
             process_group=_group())
    if offload is not None:
        offload.release_all()
    mesh.barrier()
    delay = os.environ.get("MESHTRAIN_TEST_SAVE_DELAY_S")  # test-only: widen the crash window
    if delay:
        time.sleep(float(delay))
    if mesh.is_logging_rank:
        manager.write_manifest(temp, trainer.step, trainer.config, _layout(trainer),
                               manager.read_run_id(trainer.config.train.run_dir),
                               {"total_steps": trainer.config.train.steps})
        fsync_dir(temp)  # every file's entry, before the directory becomes visible
        temp.rename(final)
        fsync_dir(root)  # the rename is durable before any older checkpoint is removed
        manager.prune(root, trainer.config.checkpoint.keep)
    mesh.barrier()
    return final


def load(trainer, directory: Path) -> dict:
    """Restore ``trainer`` from ``directory`` (saved at any layout with as many replica groups);
    returns the metadata."""
    outer = getattr(trainer, "outer", None)
    pending = None
    if outer is not None and _saved_pending(directory):
        pending = [torch.zeros_like(shard.master) for shard in trainer.optimizer.shards]
    chunks = _chunks(trainer, pending)
    offload = getattr(trainer.engine, "offload", None)
    planner = ChunkLoadPlanner(chunks, [META], offload.release if offload is not None else None)
    dcp.load({}, storage_reader=SafeFileSystemReader(str(directory)), planner=planner,
             process_group=_group())
    meta = json.loads(planner.blobs[META])
    trainer.step = meta["step"]
    trainer.optimizer.step_count = meta["optimizer_step"]
    if outer is not None:
        outer.rounds = meta.get("outer_rounds", 0)
        outer.restore_pending(meta.get("outer_pending", []), pending)
    trainer.data.load_state_dict(meta["data"])
    manager.decode_rng(meta["rng"])
    trainer.engine.after_step(trainer.optimizer.shards)  # parameters from the loaded masters
    placer = getattr(trainer, "expert_placer", None)
    if placer is not None:  # back to the saved expert placement (same ep), else identity
        placer.load_state_dict(meta.get("expert_placement"))
    return meta


def weights_step(path: str) -> int | None:
    """The training step a meshtrain weights dir (or a run dir's ``final/``) was saved at, from
    its safetensors metadata; None for weights that do not record one (Hugging Face dirs)."""
    from safetensors import safe_open

    from meshtrain.checkpoint.safetensors_io import current_weights_dir

    for directory in (Path(path), Path(path) / "final"):
        files = sorted(current_weights_dir(directory).glob("*.safetensors"))
        if files:
            try:
                with safe_open(str(files[0]), framework="pt") as handle:
                    step = (handle.metadata() or {}).get("step")
                return int(step) if step is not None else None
            except (OSError, ValueError):
                return None
    return None


def init_from_weights(trainer, path: str) -> None:
    """Start from full weights (a meshtrain weights dir, sharded or one file, or a Hugging Face
    dir) at any layout: each rank reads them tensor by tensor and copies just the boxes it owns
    into its fp32 masters, and persistent buffers (MoE expert biases) whole; the logging rank
    says on stderr what it loaded."""
    from meshtrain.checkpoint.hf.io import iter_weights

    chunks: dict[str, list] = {}
    for chunk in optimizer_chunks(trainer.optimizer) + buffer_chunks(trainer.model):
        for prefix in ("model.", "buffers."):
            if chunk.fqn.startswith(prefix):
                chunks.setdefault(chunk.fqn[len(prefix):], []).append(chunk)
    seen = set()
    for name, full in iter_weights(path):
        for chunk in chunks.get(name, []):
            box = full
            for dim, (start, size) in enumerate(zip(chunk.offsets, chunk.tensor.shape,
                                                    strict=True)):
                box = box.narrow(dim, start, size)
            chunk.tensor.copy_(box)
        seen.add(name)
    missing = sorted(set(chunks) - seen)
    if missing:
        from meshtrain.config import ConfigError

        raise ConfigError(f"checkpoint.init_from = {path} lacks {len(missing)} tensor(s) of "
                          f"this model, e.g. {', '.join(missing[:3])}.")
    trainer.engine.after_step(trainer.optimizer.shards)
    if getattr(trainer, "outer", None) is not None:
        trainer.outer.restart_round()  # the first round starts from these weights
    if getattr(trainer.engine, "offload", None) is not None:
        trainer.engine.offload.release_all()
    if trainer.mesh.is_logging_rank:
        step = weights_step(path)
        saved = f", saved at step {step}" if step is not None else ""
        print(f"meshtrain: started from the weights in {path} ({len(seen)} tensors{saved})",
              file=sys.stderr, flush=True)
