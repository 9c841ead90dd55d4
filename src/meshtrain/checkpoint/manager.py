"""Checkpoint directories: atomic saves, manifests with checksums, retention, resume discovery.

Layout of ``checkpoint.dir`` (default ``RUN_DIR/checkpoints``)::

    step_00000040/            a complete checkpoint (DCP files + manifest.json)
    step_00000080/
    .tmp-step_00000120/       being written; never read, removed by the next save

A save writes into ``.tmp-step_N`` (every DCP file fsynced), then rank 0 writes
``manifest.json`` (every file with its size and SHA-256, the step, the model config and the
layout; fsynced), fsyncs the directory, renames it to ``step_N`` and fsyncs ``checkpoint.dir``:
a checkpoint is visible only once complete, it stays visible after a power loss, and an
interrupted save never touches a finished one. Only after that does :func:`prune` remove the
leftovers of interrupted saves (every other ``.tmp-step_*``: the ranks saving are one job, so
no other save is running) and the good checkpoints beyond the newest ``checkpoint.keep`` good
ones. A checkpoint is *good* when its manifest verifies (:func:`verify`); a bad one (no
manifest, a missing, truncated or altered file) neither counts toward ``keep`` nor is removed,
so a good checkpoint is never removed to make room for a bad one. An existing ``step_N`` is
never overwritten.

On resume, ``auto`` takes the newest checkpoint whose manifest verifies; a truncated or garbled
one, or one whose DCP ``.metadata`` names anything but DCP's metadata classes (it is never
unpickled with a general unpickler, :mod:`meshtrain.checkpoint.safe_reader`), is skipped with a
warning naming the problem.

A run directory belongs to one run: ``RUN_DIR/run.json`` holds its run id (written before the
workers start, :func:`write_run_id`), and every checkpoint's manifest repeats it (``run_id``).
``auto`` refuses a checkpoint directory holding checkpoints of two runs, or checkpoints of a run
other than the run directory's; a checkpoint written before run ids existed has none and counts
as the directory's run.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import uuid
import warnings
from pathlib import Path

import torch

from meshtrain.config import Config, ConfigError, ModelConfig

PREFIX = "step_"
TMP_PREFIX = ".tmp-" + PREFIX
"""``.tmp-step_N``: a save being written (or the leftover of an interrupted one)."""
MANIFEST = "manifest.json"
RUN_FILE = "run.json"
"""``RUN_DIR/run.json``: the id of the run this directory belongs to."""
# Model settings that change the shape of some tensor: a checkpoint must agree on all of them.
SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "mlp",
              "tie_embeddings", "moe_experts", "moe_shared_experts", "moe_every",
              "moe_first_dense", "expert_ffn_dim", "shared_ffn_dim", "moe_shared_gate")


def checkpoint_root(config: Config) -> Path:
    """``checkpoint.dir``, or ``RUN_DIR/checkpoints`` when empty."""
    return Path(config.checkpoint.dir or Path(config.train.run_dir) / "checkpoints")


def step_dir(root: Path, step: int) -> Path:
    """Directory of the checkpoint taken after ``step`` optimizer steps."""
    return root / f"{PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def new_run_id() -> str:
    """A fresh run id: 12 hex digits."""
    return uuid.uuid4().hex[:12]


def read_run_id(run_dir: str | Path) -> str | None:
    """The run id recorded in ``RUN_DIR/run.json``, or None (no file, or unreadable)."""
    try:
        run_id = json.loads((Path(run_dir) / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def write_run_id(run_dir: str | Path, run_id: str) -> None:
    """Record ``run_id`` as the run of ``RUN_DIR`` (rank 0, before the workers start)."""
    path = Path(run_dir) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id}) + "\n")
    tmp.replace(path)


def checkpoint_run_ids(root: Path) -> dict[str | None, int]:
    """Each run id found in the manifests of ``root``'s checkpoints, with its newest step
    (None: checkpoints written before run ids, or whose manifest is unreadable)."""
    found: dict[str | None, int] = {}
    for directory in list_checkpoints(root):
        step = int(directory.name[len(PREFIX):])
        try:
            run_id = read_manifest(directory).get("run_id") or None
        except (OSError, ValueError, AttributeError):
            run_id = None
        found[run_id] = max(found.get(run_id, 0), step)
    return found


def check_one_run(root: Path, run_id: str | None) -> str | None:
    """Refuse (ConfigError) resuming from ``root`` when it holds checkpoints of two runs, or of
    a run other than ``run_id`` (the run directory's, None = not recorded); return the run id of
    its checkpoints (None when they have none)."""
    ids = sorted(i for i in checkpoint_run_ids(root) if i)
    if len(ids) > 1:
        raise ConfigError(
            f"checkpoint directory {root} holds checkpoints of {len(ids)} runs "
            f"({', '.join(ids)}); resume=auto resumes only one run's. Remove the other run's "
            f"step_* directories, or point checkpoint.resume at one checkpoint.")
    if ids and run_id and ids[0] != run_id:
        raise ConfigError(
            f"checkpoint directory {root} holds checkpoints of run {ids[0]}, but this run "
            f"directory belongs to run {run_id}; resume=auto resumes only the directory's own "
            f"run. Point checkpoint.resume at a checkpoint to continue from it, or choose "
            f"another --run-dir.")
    return ids[0] if ids else None


def write_manifest(directory: Path, step: int, config: Config, layout: dict,
                   run_id: str | None = None, extra: dict | None = None) -> None:
    """List and checksum every file of ``directory`` into its manifest (rank 0, after DCP);
    ``run_id``: the run it belongs to; ``extra``: more fields to record."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": "meshtrain-dcp-1", "step": step, "files": files,
                "model": dataclasses.asdict(config.model), "layout": layout}
    if run_id:
        manifest["run_id"] = run_id
    manifest.update(extra or {})
    path = directory / MANIFEST
    with path.open("w") as handle:
        json.dump(manifest, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())


def verify(directory: Path) -> str | None:
    """``None`` when ``directory`` is a complete, intact checkpoint, else what is wrong.

    Intact: every file the manifest lists has its size and SHA-256, and the DCP ``.metadata``
    names only DCP's metadata classes (:mod:`meshtrain.checkpoint.safe_reader`: read without
    running anything). The checksums find corruption, not tampering: they have no key."""
    from meshtrain.checkpoint.safe_reader import metadata_problem

    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (incomplete save)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "manifest.json is unreadable"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return metadata_problem(directory)


def read_manifest(directory: Path) -> dict:
    """The parsed manifest of a checkpoint directory."""
    return json.loads((directory / MANIFEST).read_text())


def list_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoint directories under ``root``, newest first (not verified)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def newest_valid(root: Path, warn: bool = True) -> Path | None:
    """The newest checkpoint that verifies; skipped broken ones are reported as warnings."""
    for candidate in list_checkpoints(root):
        problem = verify(candidate)
        if problem is None:
            return candidate
        if warn:
            warnings.warn(f"skipping checkpoint {candidate}: {problem}; falling back to an "
                          f"older one", stacklevel=2)
            print(f"meshtrain: warning: skipping checkpoint {candidate}: {problem}",
                  file=sys.stderr)
    return None


def resolve_resume(config: Config, warn: bool = True) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for (``none``, ``auto`` or a path)."""
    resume = config.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        root = checkpoint_root(config)
        check_one_run(root, read_run_id(config.train.run_dir))
        return newest_valid(root, warn)
    path = Path(resume)
    problem = verify(path)
    if problem is not None:
        raise ConfigError(f"checkpoint.resume = {path}: not a usable checkpoint ({problem}).")
    return path


def _shape_signature(model: ModelConfig) -> dict:
    return {key: getattr(model, key) for key in SHAPE_KEYS}


def check_compatible(config: Config, directory: Path, vocab_size: int) -> None:
    """Refuse (ConfigError, exit 2) a checkpoint whose model shape or number of replica groups
    differs from ``config``'s."""
    manifest = read_manifest(directory)
    saved_replicas = manifest.get("layout", {}).get("replicas", 1)
    if saved_replicas != config.parallel.replicas:
        raise ConfigError(
            f"checkpoint {directory} was saved with parallel.replicas = {saved_replicas}; it "
            f"resumes only at parallel.replicas = {saved_replicas} (each replica group's inner "
            f"state is its own), not {config.parallel.replicas}. Set it back, or start from its "
            "final weights with checkpoint.init_from.")
    saved = ModelConfig(**manifest["model"])
    current = dataclasses.replace(config.model, vocab_size=config.model.vocab_size or vocab_size)
    want, have = _shape_signature(current), _shape_signature(saved)
    diffs = [f"{k}: checkpoint {have[k]} vs config {want[k]}" for k in SHAPE_KEYS
             if want[k] != have[k]]
    if diffs:
        raise ConfigError(f"checkpoint {directory} was saved from a different model shape ("
                          + "; ".join(diffs) + "). Resume with the same [model] settings, or "
                          "set checkpoint.resume = none.")


def preflight(config: Config) -> Path | None:
    """Before any worker starts: find the checkpoint to resume (if any) and refuse one from a
    different model shape (exit 2). Returns it, or None for a fresh start."""
    from meshtrain.data.tokenizer import tokenizer_vocab_size

    directory = resolve_resume(config, warn=True)
    if directory is not None:
        check_compatible(config, directory, tokenizer_vocab_size(config.data.tokenizer))
    return directory


def temp_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written until it is complete."""
    return root / f".tmp-{step_dir(root, step).name}"


def remove_stale_temps(root: Path) -> list[Path]:
    """Remove every ``.tmp-step_*`` under ``root`` (call only when no save is writing one);
    returns what was removed."""
    stale = sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)) \
        if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def prune(root: Path, keep: int) -> None:
    """After a save's rename (no save is writing): remove the leftovers of interrupted saves, and
    the good checkpoints beyond the newest ``keep`` good ones (a checkpoint is good when its
    manifest verifies; a bad one neither counts nor is removed)."""
    remove_stale_temps(root)
    good = [p for p in list_checkpoints(root) if verify(p) is None]
    for old in good[max(keep, 1):]:
        shutil.rmtree(old, ignore_errors=True)


def encode_rng() -> str:
    """This process's torch RNG state, as text for the checkpoint metadata."""
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def decode_rng(text: str) -> None:
    """Restore a torch RNG state written by :func:`encode_rng`."""
    import numpy as np

    state = np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(state))
