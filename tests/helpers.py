"""Small configs shared by tests: tiny shapes so every test runs in seconds on 2 cores."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from meshtrain.config import Config, config_from_dict, load_config
from meshtrain.validation.run_config import validate_config


@contextlib.contextmanager
def peer_memory_hidden_on_rank(rank: int):
    """Inside the block, distributed rank ``rank`` acts as if it ran on another host: it cannot
    read the other ranks' memory, so :mod:`meshtrain.parallel.shared_memory`'s probe fails there
    (restored afterwards: a pooled worker serves later tests)."""
    import torch.distributed as dist

    import meshtrain.parallel.shared_memory as shm

    original = shm._read_token
    if dist.get_rank() == rank:
        shm._read_token = lambda pid, fd: None
    try:
        yield
    finally:
        shm._read_token = original


def tiny_config(*overrides: str, nproc: int | None = None, run_dir: str | None = None) -> Config:
    """A validated 2-layer dim-32 config on a 200 kB slice of the built-in corpus."""
    base = [
        "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=64", "train.seq_len=16", "train.global_batch=8", "train.steps=4",
        "train.warmup_steps=0", "data.max_bytes=200000", "train.lr=1e-2",
    ]
    if run_dir is not None:
        base.append(f"train.run_dir={run_dir}")
    config = load_config(None, base + list(overrides))
    validate_config(config, nproc)
    return config


def train_many(config_dicts: list[dict], steps: int) -> list[list[dict]]:
    """Run several configs one after another in one spawned world (saves start-up time);
    returns each config's metric records (rank 0's; other ranks return empty lists)."""
    from meshtrain.commands.verify import train_steps

    return [train_steps(c, steps) for c in config_dicts]


def train_many_with_gradients(config_dicts: list[dict], steps: int) -> list[tuple]:
    """:func:`train_many` that also gathers each config's first-step gradients: per config
    ``(records on rank 0 or [], the gradients this rank gathered)``."""
    from meshtrain.commands.verify import train_steps_and_gradients

    return [train_steps_and_gradients(c, steps) for c in config_dicts]


def assert_gradients_match(gradients: list, reference: list, label: object = "") -> dict:
    """Assert every gathered gradient copy matches the one-process gradient of its parameter
    within meshtrain.commands.verify_grads's fp32 per-tensor tolerance; returns the report."""
    from meshtrain.commands.verify_grads import (
        GRAD_ATOL_FP32,
        GRAD_RTOL_FP32,
        compare_gradients,
        describe_failures,
    )

    report = compare_gradients(gradients, reference, GRAD_RTOL_FP32, GRAD_ATOL_FP32)
    assert report["ok"], f"{label}\n{describe_failures(report)}"
    return report


def assert_matches_one_process(records: list[dict], config: Config, steps: int,
                               gradients: list | None = None, reference: Config | None = None,
                               ) -> None:
    """Assert a layout's per-step records (losses, gradient norms) match ``config``'s
    one-process reference run (or ``reference``) within meshtrain.commands.verify's fp32
    tolerances, and, given the layout's first-step ``gradients``, every parameter's gradient
    within the per-tensor tolerance (each failure names the parameter)."""
    from meshtrain.commands.verify import (
        GRAD_NORM_RTOL_FP32,
        LOSS_TOLERANCE_FP32,
        compare,
        reference_config,
        run_layout_with_gradients,
    )

    expected, expected_grads = run_layout_with_gradients(reference or reference_config(config),
                                                         1, steps)
    report = compare(records, expected, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
    assert report["ok"], (config.parallel, report)
    if gradients is not None:
        assert_gradients_match(gradients, expected_grads, config.parallel)


def run_with_gradients(world: int, cases: list[Config], steps: int,
                       timeout: float = 900) -> list[tuple[list[dict], list]]:
    """Train each config on ``world`` processes (one launch); per config ``(rank 0's records,
    the first-step gradients gathered on every rank)``."""
    from meshtrain.commands.verify_grads import merge_gradients
    from tests.distributed import run_distributed

    by_rank = run_distributed(world, train_many_with_gradients, [c.to_dict() for c in cases],
                              steps, timeout=timeout)
    return [(by_rank[0][i][0], merge_gradients([rank[i][1] for rank in by_rank]))
            for i in range(len(cases))]


def assert_layouts_match_one_process(world: int, cases: list[Config], steps: int,
                                     timeout: float = 900) -> list[list[dict]]:
    """Train each config on ``world`` processes and assert its losses and gradient norms match
    its one-process reference within meshtrain.commands.verify's fp32 tolerances, and its
    first-step gradients parameter by parameter; returns the records."""
    results = run_with_gradients(world, cases, steps, timeout)
    for config, (records, gradients) in zip(cases, results, strict=True):
        assert_matches_one_process(records, config, steps, gradients)
    return [records for records, _ in results]


def adjacent_communication(compute: list, stage_to_rank: list[int]) -> list:
    """Pipeline lists with each recv right before the compute that consumes it and each send
    right after the compute that produces it: correct where messages are tagged and sends
    buffered (gloo), not under NCCL's semantics. Shows what the checker and the NCCL test mode
    catch."""
    from meshtrain.parallel.pipeline.schedule import Action
    from meshtrain.parallel.pipeline.schedule import ActionKind as K

    last = len(stage_to_rank) - 1
    lists = []
    for rank, order in enumerate(compute):
        acts = []
        for a in order:
            mb, s = a.microbatch, a.stage
            before = after = None
            if a.kind is K.F:
                if s > 0 and stage_to_rank[s - 1] != rank:
                    before = Action(K.RECV_ACT, mb, s, stage_to_rank[s - 1])
                if s < last and stage_to_rank[s + 1] != rank:
                    after = Action(K.SEND_ACT, mb, s, stage_to_rank[s + 1])
            elif a.kind in (K.B, K.I):
                if s < last and stage_to_rank[s + 1] != rank:
                    before = Action(K.RECV_GRAD, mb, s, stage_to_rank[s + 1])
                if s > 0 and stage_to_rank[s - 1] != rank:
                    after = Action(K.SEND_GRAD, mb, s, stage_to_rank[s - 1])
            acts += [x for x in (before, a, after) if x is not None]
        lists.append(acts)
    return lists


def build_trainer(config_dict: dict):
    """A :class:`~meshtrain.training.trainer.Trainer` of ``config_dict`` on this process's mesh
    (call inside a worker of :func:`tests.distributed.run_distributed`, or alone)."""
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    return Trainer(config, build_mesh(config))


def train_and_save(config_dict: dict, steps: int, final: bool = False) -> list[float]:
    """Resume if a checkpoint is there, train ``steps`` steps, checkpoint (and with ``final``
    write the final weights); the losses."""
    trainer = build_trainer(config_dict)
    trainer.restore()
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    trainer.save_checkpoint()
    if final:
        trainer.save_final()
    return losses


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """The standalone measurement script ``benchmarks/<name>.py``, imported as a module."""
    key = f"meshtrain_benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
