"""Data parallelism and ZeRO 1/2/3 on several CPU processes against one process (fp32).

Tolerance: 2e-4 absolute on the loss, 1e-3 relative on the gradient norm (see
:mod:`meshtrain.commands.verify` for why); measured differences are ~1e-6.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.commands.verify import LOSS_TOLERANCE_FP32, run_layout
from meshtrain.parallel.data.checks import check_replicas_in_sync
from tests.distributed import run_distributed
from tests.helpers import assert_layouts_match_one_process, tiny_config, train_many

STEPS = 5  # the "five steps of losses and gradient norms"


def _dp_bytes(records: list[dict]) -> int:
    return records[0]["comm_bytes"]["dp"]


def test_dp2_every_zero_stage_matches_one_process():
    cases = [tiny_config(f"parallel.zero={z}", nproc=2) for z in range(4)]
    cases += [tiny_config("parallel.zero=0", "parallel.microbatches=2", nproc=2),
              tiny_config("parallel.zero=3", "parallel.microbatches=2", nproc=2),
              tiny_config("parallel.zero=1", "parallel.dp_bucket_mb=0.005",
                          "parallel.check_replicas_every=1", nproc=2),
              # ZeRO-3 units smaller than a block (single projections), also recomputed.
              tiny_config("parallel.zero=3", "parallel.dp_bucket_mb=0.005",
                          "parallel.microbatches=2", nproc=2),
              tiny_config("parallel.zero=3", "parallel.dp_bucket_mb=0.005",
                          "parallel.activation_checkpointing=full", nproc=2),
              # ZeRO-3 gathering no unit ahead, and three units ahead.
              tiny_config("parallel.zero=3", "parallel.dp_bucket_mb=0.005",
                          "parallel.microbatches=2", "parallel.zero3_prefetch=0", nproc=2),
              tiny_config("parallel.zero=3", "parallel.dp_bucket_mb=0.005",
                          "parallel.microbatches=2", "parallel.zero3_prefetch=3", nproc=2)]
    results = assert_layouts_match_one_process(2, cases, STEPS)
    # Prefetching changes when a unit is gathered, never what is sent.
    assert _dp_bytes(results[10]) == _dp_bytes(results[9]) == _dp_bytes(results[7])

    plain, z1, z2, z3 = (_dp_bytes(r) for r in results[:4])
    assert z1 / plain == pytest.approx(1.0, rel=0.05)
    assert z2 / plain == pytest.approx(1.0, rel=0.05)
    # ZeRO-3: an all-gather for forward and one for backward, and a reduce-scatter: 1.5x, less
    # the last block's second gather (it stays gathered for its backward, which runs next).
    # The tiny model: 2 blocks of 9,280 parameters, 16,928 in embedding, head and final norm.
    block, total = 9280, 2 * 9280 + 16928
    assert z3 / plain == pytest.approx(1.5 - block / (2 * total), rel=0.01)

    mem = [r[0]["mem"] for r in results[:4]]
    assert mem[1]["optim_bytes"] == pytest.approx(mem[0]["optim_bytes"] / 2, rel=0.02)
    assert mem[2]["grad_bytes"] == pytest.approx(mem[0]["grad_bytes"] / 2, rel=0.02)
    assert mem[3]["param_bytes"] == pytest.approx(mem[0]["param_bytes"] / 2, rel=0.02)
    assert mem[1]["param_bytes"] == mem[0]["param_bytes"]


def test_dp4_zero3_and_microbatch_combinations():
    cases = [tiny_config("parallel.zero=3", nproc=4),
             tiny_config("parallel.zero=2", "parallel.microbatches=2", nproc=4)]
    results = assert_layouts_match_one_process(4, cases, STEPS)
    # Same global batch, different (dp, microbatches) split: identical losses.
    one_proc = run_layout(tiny_config("parallel.microbatches=8"), 1, STEPS)
    assert [r["loss"] for r in results[1]] == pytest.approx(
        [r["loss"] for r in one_proc], abs=LOSS_TOLERANCE_FP32)


def test_bf16_trains_stably_and_model_states_follow_zero():
    """bf16 + fp32 Adam, N = 2, bf16 gradients (``parallel.grad_reduce_dtype = bf16``): model
    states per rank are the ZeRO paper's 16P (DP), 4P + 12P/N (stage 1), 2P + 14P/N (stage 2)
    and 16P/N (stage 3), 5, read from the runtime's buffers."""
    cases = [tiny_config("train.precision=bf16", "parallel.grad_reduce_dtype=bf16",
                         f"parallel.zero={z}", "train.steps=10", nproc=2) for z in range(4)]
    results = run_distributed(2, train_many, [c.to_dict() for c in cases], 10, timeout=600)[0]
    for records in results:
        losses = torch.tensor([r["loss"] for r in records])
        assert torch.isfinite(losses).all()
        assert losses[-3:].mean() < losses[:3].mean()
    import dataclasses

    from meshtrain.data.tokenizer import ByteTokenizer
    from meshtrain.model import count_parameters

    model_config = dataclasses.replace(cases[0].model, vocab_size=ByteTokenizer().vocab_size)
    p = count_parameters(model_config)["total"]
    n = 2
    expected = [16 * p, 4 * p + 12 * p / n, 2 * p + 14 * p / n, 16 * p / n]
    for stage, (records, want) in enumerate(zip(results, expected, strict=True)):
        mem = records[-1]["mem"]
        states = mem["param_bytes"] + mem["grad_bytes"] + mem["optim_bytes"]
        assert states == pytest.approx(want, rel=0.01), (stage, mem)


def check_replica_divergence_detected() -> str:
    from meshtrain.parallel import data_parallel_engine
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = tiny_config("parallel.zero=1", nproc=2)
    mesh = build_mesh(config)
    trainer = Trainer(config, mesh)
    trainer.train_step()
    engine = data_parallel_engine(trainer.model)
    if mesh.dp_rank == 1:
        with torch.no_grad():
            next(trainer.model.parameters()).add_(1e-3)
    try:
        check_replicas_in_sync(engine)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_replica_check_detects_divergence():
    messages = run_distributed(2, check_replica_divergence_detected)
    assert all("diverged" in m for m in messages)


def _units_ahead(config_dicts: list[dict], steps: int) -> list[dict]:
    """Per config: at every ZeRO-3 unit's forward and backward of the last step, how many
    other units were gathered (or being gathered) while it ran."""
    from tests.helpers import build_trainer

    out = []
    for config_dict in config_dicts:
        trainer = build_trainer(config_dict)
        gatherer = trainer.engine.gatherer
        seen: dict[str, list[int]] = {"forward": [], "backward": []}
        unit_of = {b.index: i for i, bs in enumerate(gatherer.unit_buckets) for b in bs}

        def record(original, kind, gatherer=gatherer, seen=seen, unit_of=unit_of):
            def run(unit, *args):
                result = original(unit, *args)
                held = {unit_of[b] for b in gatherer._gathered | set(gatherer._handles)
                        if b in unit_of}
                seen[kind].append(len(held - {unit}))
                return result
            return run

        for _ in range(steps - 1):
            trainer.train_step()
        gatherer._pre_forward = record(gatherer._pre_forward, "forward")
        gatherer._pre_backward = record(gatherer._pre_backward, "backward")
        trainer.train_step()
        seen["units"] = len(gatherer.units)
        out.append(seen)
    return out


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_zero3_prefetch_gathers_that_many_units_ahead(depth):
    """``parallel.zero3_prefetch``: while a unit's forward runs, exactly the next ``depth``
    units (fewer at the end) are gathered beside it; in backward at least the previous
    ``depth`` are (units whose gradients are still being reduced may be held too)."""
    config = tiny_config("parallel.zero=3", "parallel.dp_bucket_mb=0.005",
                         f"parallel.zero3_prefetch={depth}", nproc=2).to_dict()
    seen = run_distributed(2, _units_ahead, [config], 2)[0][0]
    n = seen["units"]
    assert n > 4  # single projections: enough units for every depth
    assert seen["forward"] == [min(depth, n - 1 - k) for k in range(n)]
    backward = seen["backward"]
    assert len(backward) == n
    assert all(held >= min(depth, n - 1 - k) for k, held in enumerate(backward)), backward
