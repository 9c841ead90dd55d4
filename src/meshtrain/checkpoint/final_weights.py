"""A run's final weights: sharded safetensors, streamed tensor by tensor by several writers.

Layout (the Hugging Face sharded layout, with meshtrain tensor names, float32)::

    RUN_DIR/final/
        model-00001-of-0000K.safetensors ... model-0000K-of-0000K.safetensors
        model.safetensors.index.json   {"metadata": {"total_size": ...}, "weight_map": {name: file}}
        config.json                    the run's full Config

**Writers.** Each pipeline stage's tensors are written by that stage's dp-rank-0 ranks (one per
tp rank), all stages at once. A tensor that tp splits goes to the stage's writer with the fewest
bytes so far (after the gather every tp rank holds it); any other tensor to tp rank 0, whose copy
is the reference. Each writer packs its tensors, in the stage's order, into files of at most
``max_file_bytes`` (a larger tensor gets a file of its own). Files are numbered by (stage, tp
rank, order), so their names depend only on the model and the layout.

**Streaming.** Tensors come one at a time from :class:`~meshtrain.parallel.gather.StageTensors`
(gathered over ZeRO-3 shards, ep and tp), are written at their planned offsets
(:class:`~meshtrain.checkpoint.safetensors_io.ShardedWriter`: every header is fixed up front)
and are dropped before the next is gathered. No rank holds more than about one full tensor
beyond its own share.

**Completeness and crash safety.** The new set is written into ``RUN_DIR/final.tmp-<token>``
beside ``final/`` (rank 0 first removes the leftovers of an interrupted earlier save, see
:func:`~meshtrain.checkpoint.atomic.cleanup`, and shares the name). Each file is written under a
``.tmp`` name, fsynced and renamed once complete. A rank whose writing fails stops writing but
keeps taking part in the gathers, so no rank is left waiting; after the last tensor every rank
learns every rank's outcome. Only if all files were written does rank 0 write ``config.json``
and then, last, the index (each fsynced and renamed into place), fsync the directory and swap it
in for ``final/`` (:func:`~meshtrain.checkpoint.atomic.swap_in`: one atomic exchange where the
filesystem supports it, else the old ``final/`` renamed aside to ``final.old-<token>`` and the
new one renamed into place), fsync ``RUN_DIR`` and remove the old set. So ``final/`` is at every
instant the complete previous set or the complete new one; where the swap takes two renames and
a crash falls between them, ``final/`` is missing and ``final.old-<token>`` is the complete
previous set, which the readers use
(:func:`~meshtrain.checkpoint.safetensors_io.current_weights_dir`) and the next save renames
back.
If anything failed, every rank raises :class:`FinalWeightsError`, rank 0 removes the temporary
directory, and ``final/`` keeps the previous set. A directory without the index is incomplete,
and the readers refuse it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.checkpoint import atomic
from meshtrain.checkpoint.safetensors_io import INDEX_NAME, ShardedWriter, complete_weights_dir
from meshtrain.errors import RunFailure
from meshtrain.parallel.comm import gather_json
from meshtrain.parallel.gather import StageTensors, TensorSpec

MAX_FILE_BYTES = 2 * 2**30
"""Largest file a writer packs several tensors into (a larger tensor gets a file of its own)."""

FileSpec = tuple[int, list[tuple[str, tuple[int, ...]]]]
"""One file of a stage: the tp rank that writes it and its ``(name, full shape)`` tensors."""


class FinalWeightsError(RunFailure):
    """Some rank could not write its final-weights files; no index was written."""


def plan_stage_files(specs: list[TensorSpec], tp: int, max_file_bytes: int) -> list[FileSpec]:
    """Assign a stage's tensors (in order) to its ``tp`` writers and pack each writer's tensors
    into files of at most ``max_file_bytes``; returns the files, writer by writer, in order."""
    loads = [0] * tp
    owned: list[list[TensorSpec]] = [[] for _ in range(tp)]
    for spec in specs:
        candidates = range(tp) if spec.tp_split else (0,)
        writer = min(candidates, key=lambda t: (loads[t], t))
        loads[writer] += spec.nbytes_fp32
        owned[writer].append(spec)
    files: list[FileSpec] = []
    for writer, mine in enumerate(owned):
        current: list[tuple[str, tuple[int, ...]]] = []
        size = 0
        for spec in mine:
            if current and size + spec.nbytes_fp32 > max_file_bytes:
                files.append((writer, current))
                current, size = [], 0
            current.append((spec.name, spec.shape))
            size += spec.nbytes_fp32
        if current:
            files.append((writer, current))
    return files


def file_names(layout: list[list[FileSpec]]) -> list[list[str]]:
    """``model-0000i-of-0000K.safetensors`` for every file of every stage, numbered in stage
    order (``layout[stage]`` = that stage's files)."""
    total = sum(len(files) for files in layout)
    names, number = [], 0
    for files in layout:
        names.append([f"model-{number + i + 1:05d}-of-{total:05d}.safetensors"
                      for i in range(len(files))])
        number += len(files)
    return names


class _Writer:
    """This rank's files (none unless it is a writer), written one after another as their
    tensors arrive; a failure is kept, and later tensors are ignored."""

    def __init__(self, out: Path, files: list[tuple[str, FileSpec]], metadata: dict[str, str]):
        self.out, self.files, self.metadata = out, files, metadata
        self.file_of = {name: i for i, (_, (_, tensors)) in enumerate(files)
                        for name, _ in tensors}
        self.current: ShardedWriter | None = None
        self.current_index = -1
        self.error: BaseException | None = None
        self.error_file = ""

    def _open(self, index: int) -> None:
        self._close()
        file, (_, tensors) = self.files[index]
        plan = [(name, shape, torch.float32) for name, shape in tensors]
        self.current_index = index
        self.current = ShardedWriter(self.out, plan, None, basename=file.removesuffix(
            ".safetensors"), metadata=self.metadata)

    def _close(self) -> None:
        if self.current is not None:
            try:
                self.current.close()
            except BaseException:
                self.current.abort()  # no .tmp file left behind
                raise
            finally:
                self.current = None

    def add(self, name: str, value: torch.Tensor | None) -> None:
        """Write tensor ``name`` if this rank writes it (and nothing failed yet)."""
        index = self.file_of.get(name)
        if index is None or self.error is not None:
            return
        try:
            if index != self.current_index:
                self._open(index)
            self.current.write(name, value.detach().float())
        except Exception as error:  # noqa: BLE001 - every rank must learn of it (see finish)
            self._fail(error)

    def finish(self) -> None:
        """Complete the last file (checks that each planned tensor was written)."""
        if self.error is not None:
            return
        try:
            self._close()
        except Exception as error:  # noqa: BLE001
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.error_file = self.files[self.current_index][0] if self.current_index >= 0 else "?"
        if self.current is not None:
            self.current.abort()  # delete the partial .tmp file
            self.current = None


def _gather(mesh, value) -> list:
    """Every rank's ``value`` (JSON-able: tuples come back as lists), on every rank (a
    collective over the whole job, sent as JSON, never pickled)."""
    if dist.is_initialized() and mesh.world_size > 1:
        return gather_json(value, None, mesh.world_size)
    return [value]


def _agree(mesh, problem: str | None) -> list[str]:
    """Every rank's problem (None = fine), on every rank (a collective over the whole job)."""
    return [p for p in _gather(mesh, problem) if p]


def _prepare(out: Path) -> tuple[str | None, str | None]:
    """Rank 0: recover or remove what an interrupted earlier save left, and make the empty
    directory the new set is written into; ``(problem, its path)``."""
    try:
        atomic.cleanup(out, complete_weights_dir)
        return None, str(atomic.staging_dir(out))
    except OSError as error:
        return f"rank 0 could not prepare a directory beside {out}: {error}", None


def _publish(staging: Path, out: Path, config_json: str, index: dict) -> None:
    """Rank 0, once every file is written: ``config.json``, then the index, then the swap."""
    atomic.write_atomically(staging / "config.json", config_json)
    atomic.write_atomically(staging / INDEX_NAME, json.dumps(index, indent=2))
    atomic.swap_in(staging, out)


def save_final_weights(model: nn.Module, engine, mesh, out: str | Path, config_json: str,
                       step: int, max_file_bytes: int | None = None) -> Path | None:
    """Write the full model to ``out`` as sharded safetensors plus an index and ``config.json``
    (a collective: every rank of the job calls it). ``config_json`` is the text of
    ``config.json`` (the run's Config); ``step`` is recorded in each file's metadata. Returns
    ``out`` on rank 0, None elsewhere; raises :class:`FinalWeightsError` on every rank if any
    rank failed to write its files."""
    out = Path(out)
    tensors = StageTensors(model, engine, mesh)
    stage_files = plan_stage_files(tensors.specs, mesh.tp, max_file_bytes or MAX_FILE_BYTES)
    layout = mesh.comm("pp").all_gather_json(stage_files)  # names and shapes, as JSON lists
    names = file_names(layout)
    entries = [(name, shape, file) for stage, files in zip(names, layout, strict=True)
               for file, (_, tensors_of_file) in zip(stage, files, strict=True)
               for name, shape in tensors_of_file]
    weight_map = {name: file for name, _, file in entries}
    if len(weight_map) != len(entries):  # the same on every rank: every rank raises
        raise ValueError("a tensor is held by more than one pipeline stage")
    prepared = _gather(mesh, _prepare(out) if mesh.is_logging_rank else (None, None))
    problems = [problem for problem, _ in prepared if problem]
    if problems:
        raise FinalWeightsError(f"final weights not saved: {problems[0]}.")
    staging = Path(next(path for _, path in prepared if path))
    mine = [(file, spec) for file, spec in zip(names[mesh.pp_rank], stage_files, strict=True)
            if mesh.dp_cp_rank == 0 and spec[0] == mesh.tp_rank
            # replica groups hold the same (synced) weights; a group that is a job of its
            # own (fault tolerance) writes its own run's copy
            and (getattr(mesh, "replica_rank", 0) == 0 or getattr(mesh, "group_alone", False))]
    writer = _Writer(staging, mine, {"format": "pt", "step": str(step)})
    for spec, value in tensors:
        writer.add(spec.name, value)
        del value  # before the next tensor is gathered
    writer.finish()
    problem = None
    if writer.error is not None:
        problem = (f"rank {mesh.rank} (pp {mesh.pp_rank}, tp {mesh.tp_rank}) could not write "
                   f"{writer.error_file}: {type(writer.error).__name__}: {writer.error}")
    problems = _agree(mesh, problem)  # every write has ended: the barrier before the swap
    cause = writer.error
    if not problems and mesh.is_logging_rank:
        total = sum(4 * math.prod(shape) for _, shape, _ in entries)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        try:
            _publish(staging, out, config_json, index)
        except OSError as error:
            cause, problem = error, (f"rank 0 could not write {INDEX_NAME} or config.json or "
                                     f"move the new set into place: {error}")
        problems = _agree(mesh, problem)
    elif not problems:
        problems = _agree(mesh, None)  # waits for rank 0's swap
    if problems:
        if mesh.is_logging_rank:
            shutil.rmtree(staging, ignore_errors=True)
        raise FinalWeightsError(
            f"final weights not saved to {out}: {'; '.join(problems)}. {out} keeps the "
            "previous final weights, if there were any.") from cause
    return out if mesh.is_logging_rank else None
