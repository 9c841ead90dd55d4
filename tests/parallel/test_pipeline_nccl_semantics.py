"""Pipeline parallelism under NCCL's point-to-point semantics, emulated on gloo.

gloo matches messages by tag and buffers sends; NCCL matches them per pair of ranks in issue
order and may hold a send until its receive is posted. Here tags are stripped by patching
``torch.distributed`` itself (not through meshtrain's switch), and the suite's default
``MESHTRAIN_P2P_SEMANTICS=nccl-rendezvous`` makes sends wait for their receives. Pipelines on one
host move their messages through shared memory by default
(:mod:`meshtrain.parallel.pipeline.shared_memory_p2p`), which matches them per pair in order as
NCCL does; the rendezvous emulation applies there too. Parity is
meshtrain.commands.verify's fp32 tolerance (2e-4 on the loss, 1e-3 relative on the gradient norm).
"""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.distributed import DistributedTestError, run_distributed
from tests.helpers import adjacent_communication, tiny_config, train_many

STEPS = 3
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]


@contextlib.contextmanager
def _untagged_torch_distributed():
    """Replace torch.distributed's point-to-point functions by ones that drop the tag."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    saved = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv")}

    def untagged(fn):
        def call(tensor, *args, **kwargs):
            kwargs["tag"] = 0
            if len(args) >= 3:  # (peer, group, tag)
                args = args[:2]
            return fn(tensor, *args, **kwargs)
        return call

    try:
        for name, fn in saved.items():
            setattr(c10d, name, untagged(fn))
            setattr(dist, name, getattr(c10d, name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


@contextlib.contextmanager
def _semantics(value: str):
    old = os.environ.get("MESHTRAIN_P2P_SEMANTICS")
    os.environ["MESHTRAIN_P2P_SEMANTICS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MESHTRAIN_P2P_SEMANTICS", None)
        else:
            os.environ["MESHTRAIN_P2P_SEMANTICS"] = old


@contextlib.contextmanager
def _gloo_only_placement():
    """Build schedules with communication placed as gloo tolerates (tests.helpers), skip the
    static checks that reject them, and keep every exchange in flight until the step ends: what
    the runtime did before NCCL's rules were kept."""
    import meshtrain.parallel.pipeline as pipeline
    from meshtrain.parallel.pipeline import schedules
    from meshtrain.parallel.pipeline.executor import PipelineExecutor

    saved = (schedules.add_communication, pipeline.check_schedule,
             PipelineExecutor.__dict__["_finish_previous_exchanges"])
    schedules.add_communication = adjacent_communication
    pipeline.check_schedule = lambda schedule: None
    PipelineExecutor._finish_previous_exchanges = lambda self, in_flight: in_flight
    try:
        yield
    finally:
        (schedules.add_communication, pipeline.check_schedule,
         PipelineExecutor._finish_previous_exchanges) = saved


def train_untagged(config_dicts: list[dict], steps: int, semantics: str = "tagged"):
    """Worker: train each config with tags stripped inside torch.distributed."""
    with _untagged_torch_distributed(), _semantics(semantics):
        return train_many(config_dicts, steps)


def train_gloo_only_placement(config_dicts: list[dict], steps: int, semantics: str):
    """Worker: train with the gloo-only communication placement under ``semantics``."""
    with _gloo_only_placement(), _semantics(semantics):
        return train_many(config_dicts, steps)


def _assert_match(cases, results) -> None:
    from meshtrain.commands.verify import (
        GRAD_NORM_RTOL_FP32,
        LOSS_TOLERANCE_FP32,
        compare,
        reference_config,
        run_layout,
    )

    for config, records in zip(cases, results, strict=True):
        reference = run_layout(reference_config(config), 1, STEPS)
        report = compare(records, reference, LOSS_TOLERANCE_FP32, GRAD_NORM_RTOL_FP32)
        assert report["ok"], (config.parallel, report)


def _cases(pp: int, *extra: str, nproc: int | None = None):
    base = (f"parallel.pp={pp}", f"parallel.microbatches={2 * pp}", f"model.n_layers={2 * pp}")
    return [tiny_config(*base, *extra, f"parallel.pp_schedule={name}",
                        f"parallel.virtual_stages={v}", nproc=nproc or pp)
            for name, v in SCHEDULES]


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "gloo"])
@pytest.mark.parametrize("pp", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: make bench
def test_every_schedule_matches_one_process_without_tags(pp, shared):
    # shared memory (the default on one host) matches each pair's messages in order, as NCCL
    # does; gloo does with its tags stripped
    cases = _cases(pp, f"parallel.pp_shared_memory={str(shared).lower()}")
    results = run_distributed(pp, train_untagged, [c.to_dict() for c in cases], STEPS,
                              "nccl-rendezvous", timeout=900)[0]
    _assert_match(cases, results)


def test_gloo_only_placement_of_zb_v_swaps_messages_under_nccl_order():
    """Receives placed right before their consumers: with tags gloo delivers the right
    tensors; matched as NCCL matches (untagged, per pair in order) rank 1 gets ACT2 where it
    expects GRAD0 (same shape) and trains a different model."""
    from meshtrain.commands.verify import reference_config, run_layout

    # gloo's own transport: its tags are what this test is about (shared memory matches in order)
    (case,) = [c for c in _cases(2, "train.lr=3e-2", "parallel.pp_shared_memory=false")
               if c.parallel.pp_schedule == "zb-v"]
    reference = [r["loss"] for r in run_layout(reference_config(case), 1, STEPS)]
    tagged = run_distributed(2, train_gloo_only_placement, [case.to_dict()], STEPS, "tagged",
                             timeout=600)[0][0]
    untagged = run_distributed(2, train_gloo_only_placement, [case.to_dict()], STEPS, "nccl",
                               timeout=600)[0][0]
    assert max(abs(r["loss"] - x) for r, x in zip(tagged, reference, strict=True)) < 2e-4
    assert max(abs(r["loss"] - x) for r, x in zip(untagged, reference, strict=True)) > 1e-2


def test_sends_waiting_for_receives_deadlock_is_reported(monkeypatch):
    """Interleaved 1F1B with unbatched sends: both neighbours send first. gloo's buffered sends
    hide it; the rendezvous emulation stops with a message naming the send."""
    monkeypatch.delenv("MESHTRAIN_REUSE_WORKERS", raising=False)  # fresh workers: left hanging
    monkeypatch.setenv("MESHTRAIN_P2P_RENDEZVOUS_TIMEOUT_S", "5")
    (case,) = [c for c in _cases(2) if c.parallel.pp_schedule == "interleaved-1f1b"]
    with pytest.raises(DistributedTestError) as info:
        run_distributed(2, train_gloo_only_placement, [case.to_dict()], 1, "nccl-rendezvous",
                        timeout=300)
    assert "was not matched by a posted receive" in str(info.value)
